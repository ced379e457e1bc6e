"""EBPO on integer arithmetic with a tiny random-init decoder: the default main job.

A short supervised warm start teaches the answer format (and some of the easy clusters), then RL
with the EBPO advantage improves the held-out accuracy per cluster. Runs on a laptop CPU.

  python -m ebpo_jax.train --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo
  python -m ebpo_jax.train --config=configs/arith_ebpo.py:runlocal --workdir=/tmp/arith_local

Any key can be overridden, e.g. `--config.rl.advantage=grpo --config.rl.group_size=4`.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may be "runlocal" (a few steps, seconds on a CPU)."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.task = ml_collections.ConfigDict()
  config.task.name = "arithmetic"
  config.task.num_train = 20_000
  config.task.num_eval = 64  # held-out prompts per cluster
  config.task.options = ml_collections.ConfigDict({"ops": ("add",), "digits": (1, 2, 3)})

  config.data = ml_collections.ConfigDict()
  config.data.path = (
    ""  # a JSONL/Parquet file of {"prompt", "answer", "cluster"?, "difficulty"?} rows
  )
  config.data.order = "shuffle"  # shuffle | clustered | curriculum

  config.model = ml_collections.ConfigDict()
  config.model.path = ""  # a Hugging Face directory; empty: a random-init decoder of this shape
  config.model.hidden_size = 128
  config.model.intermediate_size = 384
  config.model.num_layers = 3
  config.model.num_heads = 4
  config.model.num_kv_heads = 4
  config.model.head_dim = 32
  config.model.dtype = "float32"
  config.model.param_dtype = "float32"
  config.model.remat = "none"

  config.sft = ml_collections.ConfigDict()  # supervised warm start before RL (0 steps: none)
  config.sft.num_steps = 400
  config.sft.batch_size = 128
  config.sft.learning_rate = 1e-3

  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 200
  config.train.batch_size = 32  # prompts per RL step
  config.train.mini_batch_size = 32  # prompts per optimizer update
  config.train.micro_batch_size = 0  # rows (responses) per gradient-accumulation chunk; 0: whole
  config.train.learning_rate = 3e-4
  config.train.warmup_steps = 0
  config.train.schedule = "constant"  # constant | cosine
  config.train.weight_decay = 0.0
  config.train.grad_clip = 1.0
  config.train.max_bad_steps = 5
  config.train.log_every = 1

  config.rl = ml_collections.ConfigDict()
  config.rl.group_size = 8
  config.rl.advantage = "ebpo"  # grpo | dr_grpo | rloo | js_shrinkage | ebpo
  config.rl.num_iterations = 1
  config.rl.ebpo = ml_collections.ConfigDict()
  config.rl.ebpo.mode = "running"  # running (paper, Algorithm 1) | batch (authors' released code)
  config.rl.ebpo.decay = 1.0
  config.rl.ebpo.normalize = "batch"  # batch (paper) | none | group | cluster
  config.rl.loss = ml_collections.ConfigDict()
  config.rl.loss.clip_low = 0.2
  config.rl.loss.clip_high = 0.2
  config.rl.loss.dual_clip = 3.0
  config.rl.loss.aggregation = "token-mean"
  config.rl.loss.kl_coef = 0.0
  config.rl.loss.kl_kind = "k3"
  config.rl.loss.entropy_coef = 0.0

  config.sampling = ml_collections.ConfigDict()
  config.sampling.temperature = 1.0
  config.sampling.top_p = 1.0
  config.sampling.top_k = 0
  config.sampling.max_new_tokens = 6
  config.sampling.prompt_buckets = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

  config.rewards = ml_collections.ConfigDict()
  config.rewards.workers = 0  # 0: score in this process (the arithmetic verifier is trivial)
  config.rewards.timeout_s = 5.0

  config.eval = ml_collections.ConfigDict()
  config.eval.every_steps = 50
  config.eval.greedy = True

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 50
  config.checkpoint.max_to_keep = 2

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1
  config.mesh.fsdp = -1  # -1: all remaining devices
  config.mesh.tensor = 1

  if arg == "runlocal":
    config.task.num_train = 512
    config.task.num_eval = 8
    config.sft.num_steps = 5
    config.sft.batch_size = 16
    config.train.num_steps = 3
    config.train.batch_size = 8
    config.train.mini_batch_size = 4
    config.rl.group_size = 4
    config.eval.every_steps = 2
    config.checkpoint.every_steps = 2
  elif arg:
    raise ValueError(f"configs/arith_ebpo.py: unknown argument {arg!r} (known: runlocal)")
  return config
