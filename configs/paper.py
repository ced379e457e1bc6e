"""The EBPO paper's runs (arXiv 2602.05165): three models x six methods x four group sizes.

  --config=configs/paper.py:MODEL,METHOD[,gN][,loraR][,runlocal]

  MODEL   qwen3_8b | qwen3_14b | llama31_8b
  METHOD  ebpo_topic  EBPO, a prior per topic cluster, batches in clustered sequences
          ebpo_naive  EBPO, one global prior, shuffled data (paper: "EBPO-naive")
          ebpo_diff   EBPO, one global running prior, one epoch ordered easy -> hard (curriculum)
          grpo | dr_grpo | dapo   the paper's baselines
  gN      group size G in {4, 8, 16, 32}; default 4 (the paper's default)
  loraR   LoRA at rank R (not the paper's: it trains all weights), e.g. lora32: adapters on all
          seven projections, alpha 32, lr 1e-5, the frozen base in bfloat16 (see LORA below)
  runlocal  the same method on a 2-layer random-init model of the same architecture (head layout,
            qk-norm, untied head, MLP ratio): one RL step on integer arithmetic, seconds on a CPU
            (the paper's mesh splits tensor over 2 devices: on one CPU device add
            --config.mesh.tensor=1, or give the CPU 8 devices with
            XLA_FLAGS=--xla_force_host_platform_device_count=8)

All hyperparameters are the paper's as restated in the project's EBPO.md ("The rest of the recipe"),
cited per key below; keys marked "assumed" are not given there.

Data pipeline (rows files of {"prompt", "answer", "cluster", "difficulty", "source", "id"}):

  # 1. DAPO-Math-17K (a local copy) and the evaluation sets -> the project's row format
  python -m ebpo_jax.data.prepare --source=dapo_math_17k --path=/data/raw/dapo-math-17k \
      --out=/data/ebpo/dapo_math_17k.jsonl
  python -m ebpo_jax.data.prepare --source=math500,aime24,aime25,amc23,olympiadbench \
      --path=/data/raw --out=/data/ebpo/math_eval.jsonl
  # 2a. topic clusters (ebpo_topic; the authors: all-MiniLM-L6-v2 sentence embeddings, KMeans)
  python -m ebpo_jax.data.cluster --input=/data/ebpo/dapo_math_17k.jsonl \
      --output=/data/ebpo/dapo_math_17k.topic.jsonl --num_clusters=10
  # 2b. difficulty = the base model's pass rate over 16 rollouts at temperature 1.0 (ebpo_diff)
  python -m ebpo_jax.difficulty --config=configs/paper.py:qwen3_8b,ebpo_diff \
      --input=/data/ebpo/dapo_math_17k.jsonl \
      --output=/data/ebpo/dapo_math_17k.diff.qwen3_8b.jsonl --k=16
  # 3. train (the same command on every host of the slice; see launch/)
  python -m ebpo_jax.train --config=configs/paper.py:qwen3_8b,ebpo_topic,g4 --workdir=gs://.../run
  # 4. evaluate: Pass@1 averaged over eval.num_samples samples per problem, per benchmark
  python -m ebpo_jax.evaluate --config=configs/paper.py:qwen3_8b,ebpo_topic,g4 --workdir=...

Model weights: `model.path` is a local Hugging Face directory (config.json, safetensors, tokenizer),
e.g. `huggingface-cli download Qwen/Qwen3-8B --local-dir /data/models/Qwen3-8B` beforehand;
override with `--config.model.path=...`. The paper says "LLaMA-3.1-8B"; we assume the Instruct
model (a chat template for the math prompts; the base model has none).

Why the mesh, dtypes, remat and micro-batch (sized for a v5p-64-class slice, 32 chips):
results/memory.md, "configs/paper.py: mesh and memory", beside the compiled numbers.

Runlocal: 8 fake CPU devices as fsdp x tensor = 4 x 2.

LORA (`loraR`; docs/lora.md): everything else is the paper's recipe. alpha is fixed at 32 as in
"LoRA Without Regret" (Schulman et al., Thinking Machines 2025), whose 1/r-scaled adapters then
want about the same learning rate at every rank, about 10x full fine-tuning's: 1e-5 for the
paper's 1e-6. It found ranks 1-64 match full fine-tuning in policy-gradient RL (little information
per episode); 32 is a safe middle. The base is frozen, so it needs no float32 master copy: it is
stored in bfloat16, the compute dtype, and the KL reference is that same base with the adapters
off (no copy). Per-chip memory with LoRA: results/memory.md, "LoRA".
"""

import pathlib
from typing import NamedTuple

import ml_collections

from ebpo_jax import cli

# configs/ is not a package: its sibling common.py is loaded by path, as every config is.
common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))

MODELS = {  # the checkpoints' config.json values
  "qwen3_8b": {
    "path": "/data/models/Qwen3-8B",
    "architecture": "qwen3",
    "vocab_size": 151_936,
    "hidden_size": 4096,
    "intermediate_size": 12_288,
    "num_layers": 36,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
  },
  "qwen3_14b": {
    "path": "/data/models/Qwen3-14B",
    "architecture": "qwen3",
    "vocab_size": 151_936,
    "hidden_size": 5120,
    "intermediate_size": 17_408,
    "num_layers": 40,
    "num_heads": 40,
    "num_kv_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
  },
  "llama31_8b": {
    "path": "/data/models/Llama-3.1-8B-Instruct",
    "architecture": "llama",
    "vocab_size": 128_256,
    "hidden_size": 4096,
    "intermediate_size": 14_336,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_theta": 500_000.0,  # plus HF's llama3 rope scaling, read from config.json
  },
}
# train.micro_batch_size at G = 4 (rows; 4 per prompt). Whole groups of 8 prompts or more (one per
# data x fsdp shard) run each prompt once per group (the shared-prefix layout: 25% fewer tokens
# than 12,288-token rows); with splash attention the largest that fits with 10% headroom, by the
# TPU compiler on v5p-64 (results/memory.md): Qwen3-8B 64 rows 60.9 GB per chip; Llama-3.1-8B 64
# rows 53.6 GB; Qwen3-14B 32 rows 45.8 GB (64, about 84 GB, not compiled). Other G keep one
# 12,288-token row per shard (compiled before the kernels; not redone).
MICRO_ROWS_G4 = {"qwen3_8b": 64, "llama31_8b": 64, "qwen3_14b": 32}
# sampling.prompts_per_call x G: the TPU compiler on v5p-64 gives 67.7 GB per chip for Qwen3-8B at
# 1,024 rows, G = 4 (+ 3.1 GB of train state waiting: 31% headroom); at larger G the same rows hold
# fewer prompts to prefill, so no more. Llama-3.1-8B's cache is smaller (32 layers). Qwen3-14B's
# KV cache at 1,024 rows alone is about 64 GB per chip, so it takes 512 (results/memory.md).
SAMPLER_ROWS = {"qwen3_8b": 1024, "llama31_8b": 1024, "qwen3_14b": 512}
METHODS = ("ebpo_topic", "ebpo_naive", "ebpo_diff", "grpo", "dr_grpo", "dapo")
GROUP_SIZES = (4, 8, 16, 32)
TARGET_DEVICES = 32  # a v5p-64-class slice: 32 chips
LORA_ALPHA = 32.0  # LoRA Without Regret's alpha: the best learning rate is then rank-independent
LORA_LEARNING_RATE = 1e-5  # 10x the paper's 1e-6 (LoRA Without Regret: LoRA wants ~10x full FT)

# DAPO-Math-17K: about 17.4K distinct prompts; one epoch at 512 prompts per step.
PROMPTS_PER_EPOCH = 17_398
BATCH_PROMPTS = 512  # EBPO.md: 512 prompts per step
MAX_RESPONSE = 8192  # EBPO.md: max response 8192 tokens
MAX_PROMPT = 4096  # EBPO.md: max prompt 4096 tokens
# DAPO's overlong buffer: 4,096 of its 20,480-token maximum; the same fifth of ours.
OVERLONG_BUFFER = MAX_RESPONSE * 4096 // 20_480

_USAGE = "expected MODEL,METHOD[,gN][,loraR][,runlocal], e.g. qwen3_8b,ebpo_topic,g16"


class Variant(NamedTuple):
  """A parsed argument of this file."""

  model: str
  method: str
  group_size: int
  runlocal: bool
  lora_rank: int  # 0: full fine-tuning (the paper)


def parse_arg(arg: str | None) -> Variant:
  """`"MODEL,METHOD[,gN][,loraR][,runlocal]"` -> Variant; errors name the part. (`common.parse_arg`
  also takes the named form, `model=qwen3_8b,method=grpo,g=8,lora=32`.)"""
  parts = common.parse_arg(arg, model="", method="", g=4, lora=0, runlocal=False)  # EBPO.md: G=4
  if not (parts.model and parts.method):
    raise ValueError(f"configs/paper.py: argument {arg!r}: {_USAGE}")
  if parts.model not in MODELS:
    raise ValueError(
      f"configs/paper.py: unknown MODEL {parts.model!r} (known: {', '.join(MODELS)})"
    )
  if parts.method not in METHODS:
    known = ", ".join(METHODS)
    raise ValueError(f"configs/paper.py: unknown METHOD {parts.method!r} (known: {known})")
  if parts.g not in GROUP_SIZES:
    sizes = ", ".join(f"g{g}" for g in GROUP_SIZES)
    raise ValueError(f"configs/paper.py: unknown group size g{parts.g} in {arg!r} (known: {sizes})")
  if parts.lora < 0:
    raise ValueError(f"configs/paper.py: LoRA rank lora{parts.lora} in {arg!r}: must be >= 1")
  return Variant(parts.model, parts.method, parts.g, parts.runlocal, parts.lora)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The config of `arg` = "MODEL,METHOD[,gN][,loraR][,runlocal]" (see the module docstring)."""
  variant = parse_arg(arg)
  config = _paper_recipe(variant.model, variant.group_size)
  _apply_method(config, variant.model, variant.method)
  if variant.lora_rank:
    _apply_lora(config, variant.lora_rank)
  if variant.runlocal:
    _make_local(config, variant.model, variant.method)
  return config


def _apply_lora(config: ml_collections.ConfigDict, rank: int) -> None:
  """LoRA adapters at `rank` on every projection (module docstring, LORA)."""
  lc = config.model.lora
  lc.rank, lc.alpha, lc.targets = rank, LORA_ALPHA, "q,k,v,o,gate,up,down"
  lc.base_dtype = "bfloat16"  # frozen: no float32 master copy needed; the compute dtype
  config.train.learning_rate = LORA_LEARNING_RATE


def _paper_recipe(model: str, group_size: int) -> ml_collections.ConfigDict:
  """The shared recipe: EBPO (topic clusters) on `model` with the paper's hyperparameters. The
  paper's values are restated here even where they equal common.py's, so they cannot drift."""
  spec = MODELS[model]
  config = common.get_config()
  config.task.name = "math"  # math-verify equivalence of the final answer
  config.task.num_train = PROMPTS_PER_EPOCH  # used only when data.path is empty
  config.task.num_eval = 64  # the in-training monitor
  config.task.options.path = "/data/ebpo/dapo_math_17k.jsonl"

  config.data.path = "/data/ebpo/dapo_math_17k.topic.jsonl"  # EBPO.md: data DAPO-Math-17K
  config.data.order = "clustered"  # EBPO.md: EBPO-topic, batches in clustered sequences

  config.model.path = spec["path"]  # a local Hugging Face directory; shape from its config.json
  config.model.architecture = spec["architecture"]
  config.model.tie_word_embeddings = spec["tie_word_embeddings"]
  config.model.rope_theta = spec["rope_theta"]
  for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
    config.model[key] = spec[key]  # the checkpoint's shape (bench/memory.py reads it)
  config.model.head_dim = spec["head_dim"]
  config.model.vocab_size = spec["vocab_size"]  # ebpo_jax.aot: this shape, without the directory
  config.model.dtype = "bfloat16"
  config.model.param_dtype = "float32"  # master weights: see results/memory.md
  config.model.remat = "full"  # see results/memory.md
  config.model.unroll_layers = False  # one rolled layer loop: TPU compile time at 28-40 layers
  config.model.chat_template = True

  config.sft.num_steps = 0  # none: RL starts from the released model
  config.sft.batch_size = 1
  config.sft.learning_rate = 1e-6

  # Assumed: EBPO.md gives one epoch only for EBPO-diff; every method gets the same single pass.
  config.train.num_steps = -(-PROMPTS_PER_EPOCH // BATCH_PROMPTS)  # 34
  config.train.batch_size = BATCH_PROMPTS  # EBPO.md: 512 prompts per step
  config.train.mini_batch_size = 128  # EBPO.md: mini-batches of 128 (4 updates per step)
  # G = 4: whole groups of 8+ prompts (MICRO_ROWS_G4); other G: one row per shard (not redone).
  config.train.micro_batch_size = MICRO_ROWS_G4[model] if group_size == 4 else 8
  config.train.learning_rate = 1e-6  # EBPO.md: lr 1e-6 constant
  config.train.warmup_steps = 0  # EBPO.md: constant
  config.train.schedule = "constant"  # EBPO.md: constant
  config.train.weight_decay = 0.01  # EBPO.md: weight decay 0.01
  config.train.grad_clip = 1.0  # EBPO.md: grad clip 1.0
  config.train.max_bad_steps = 3

  config.rl.group_size = group_size  # EBPO.md: G = 4 by default; 8, 16, 32 in the G study
  config.rl.advantage = "ebpo"
  config.rl.num_iterations = 1  # EBPO.md: one update epoch per batch
  config.rl.ebpo.mode = "running"  # EBPO.md: Algorithm 1, state carried across steps
  config.rl.ebpo.decay = 1.0  # EBPO.md: decay = 1 is the paper
  config.rl.ebpo.per_cluster = True  # a prior per topic cluster (False: the paper's single prior)
  config.rl.ebpo.normalize = "batch"  # EBPO.md: normalisation over the whole batch
  config.rl.loss.clip_low = 0.2  # EBPO.md: clip 0.2 both sides
  config.rl.loss.clip_high = 0.2
  config.rl.loss.dual_clip = 3.0  # EBPO.md: dual-clip 3.0
  config.rl.loss.aggregation = "token-mean"  # EBPO.md: token-level ratio, token-mean aggregation
  config.rl.loss.kl_coef = 0.001  # EBPO.md: KL loss to a frozen reference, coefficient 0.001
  config.rl.loss.kl_kind = "k3"  # EBPO.md: k3 "low-variance" estimator
  config.rl.loss.entropy_coef = 0.0  # EBPO.md: no entropy bonus

  config.sampling.temperature = 1.0  # EBPO.md: rollout temperature 1.0
  config.sampling.top_p = 1.0  # EBPO.md: top-p 1.0
  config.sampling.max_new_tokens = MAX_RESPONSE  # EBPO.md: response 8192 tokens
  config.sampling.compact = True  # long-tailed lengths: decode only the running rows
  # Rows (prompts x G) per sampler call, SAMPLER_ROWS: with the prefill's scores gone (splash),
  # 4x the 256 of before for the 8B models (512 prompts in 2 calls at G = 4, not 8).
  config.sampling.prompts_per_call = SAMPLER_ROWS[model] // group_size
  config.sampling.prompt_buckets = (256, 512, 1024, 2048, MAX_PROMPT)  # EBPO.md: prompt 4096

  config.rewards.workers = 32  # math-verify in a process pool
  config.rewards.timeout_s = 10.0

  config.eval.every_steps = 10
  config.eval.greedy = False  # EBPO.md: Pass@1 over samples, at the rollout temperature
  config.eval.num_samples = 16  # EBPO.md: 16-32 samples per problem (32 for AIME/AMC: override)
  config.eval.path = "/data/ebpo/math_eval.jsonl"  # EBPO.md: MATH-500, AIME24/25, AMC23, OlyBench

  config.checkpoint.every_steps = 10
  config.mesh.tensor = 4  # fsdp -1: 8 on 32 chips
  return config


def _apply_method(config: ml_collections.ConfigDict, model: str, method: str) -> None:
  """The method's changes to the shared recipe."""
  rl = config.rl
  if method == "ebpo_naive":  # EBPO.md: the same estimator on randomly shuffled data
    config.data.order = "shuffle"
    config.data.path = "/data/ebpo/dapo_math_17k.jsonl"
    rl.ebpo.per_cluster = False
  elif method == "ebpo_diff":  # EBPO.md: pass rate over 16 rollouts; easy -> hard, one epoch
    config.data.order = "curriculum"
    config.data.path = f"/data/ebpo/dapo_math_17k.diff.{model}.jsonl"  # this model's pass rates
    rl.ebpo.per_cluster = False  # one running prior that follows the stream
  elif method in ("grpo", "dr_grpo", "dapo"):
    config.data.order = "shuffle"
    config.data.path = "/data/ebpo/dapo_math_17k.jsonl"
    rl.advantage = "dr_grpo" if method == "dr_grpo" else "grpo"
  if method == "dr_grpo":  # Dr.GRPO (Liu et al. 2025): no std, a constant length normaliser
    rl.loss.aggregation = "seq-mean-token-sum-norm"
  if method == "dapo":  # DAPO (Yu et al. 2025)
    rl.loss.clip_high = 0.28  # clip-higher
    rl.loss.kl_coef = 0.0  # DAPO drops the KL term
    rl.dynamic_sampling = True  # drop groups whose rewards are all equal, refill
    rl.max_refill_rounds = 3  # at most 3 extra rollout rounds per step
    rl.overlong_buffer = OVERLONG_BUFFER  # soft overlong penalty over the last 1,638 tokens
    rl.overlong_penalty = 1.0


def _make_local(config: ml_collections.ConfigDict, model: str, method: str) -> None:
  """A tiny random-init model of `model`'s architecture, one RL step on arithmetic, on 8 CPUs."""
  spec = MODELS[model]
  heads = spec["num_heads"] // spec["num_kv_heads"]  # one KV head, the model's GQA ratio
  head_dim = 16
  hidden = heads * head_dim  # hidden = heads x head_dim, as in all three models
  mlp_ratio = spec["intermediate_size"] / spec["hidden_size"]
  config.task.name = "arithmetic"  # clusters add/sub x 1/2 digits; difficulty for the curriculum
  config.task.num_train = 256
  config.task.num_eval = 2
  config.task.options.ops, config.task.options.digits = ("add", "sub"), (1, 2)
  config.data.path = ""
  mc = config.model
  mc.path = ""
  mc.hidden_size, mc.num_layers = hidden, 2
  mc.intermediate_size = int(round(mlp_ratio * hidden / 8)) * 8
  mc.num_heads, mc.num_kv_heads, mc.head_dim = heads, 1, head_dim
  mc.dtype = "float32"
  mc.remat = "full"  # the full config's remat path, on a small graph
  config.train.num_steps = 1
  config.train.batch_size = 8
  config.train.mini_batch_size = 4
  config.train.micro_batch_size = 8  # 2 gradient-accumulation chunks at G = 4
  config.sampling.max_new_tokens = 5
  config.sampling.prompts_per_call = 4  # two sampler calls per step, as in the full config
  config.sampling.prompt_buckets = (8, 16)
  if method == "dapo":
    config.rl.max_refill_rounds = 1
    config.rl.overlong_buffer = 1
  config.rewards.workers = 0
  config.eval.every_steps = 1
  config.eval.num_samples = 2
  config.eval.path = ""
  config.checkpoint.every_steps = 1
  config.mesh.tensor = 2  # fsdp 4 x tensor 2 on the 8 fake CPU devices
