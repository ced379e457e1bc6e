"""A reasoning-gym task on a tiny random-init byte-level decoder: a plumbing check, not a learner.

The task is reasoning-gym's `chain_sum` with its own generator and scorer; its curriculum levels
0-2 are the clusters (`chain_sum_L0` .. `chain_sum_L2`). The model reads and writes UTF-8 bytes (the
task's ByteTokenizer), so prompts are about 150 tokens. A short supervised warm start on
"Answer: <n>" targets, then EBPO. Any reasoning-gym dataset works: `--config.task.name=
reasoning_gym:basic_arithmetic`, or several as clusters, `reasoning_gym:chain_sum+basic_arithmetic`.

  python -m ebpo_jax.train --config=configs/rg_tiny.py --workdir=/tmp/rg_tiny
  python -m ebpo_jax.train --config=configs/rg_tiny.py:runlocal --workdir=/tmp/rg_local
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may be "runlocal" (one RL step, seconds on a CPU)."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.task = ml_collections.ConfigDict()
  config.task.name = "reasoning_gym:chain_sum"
  config.task.num_train = 2_000
  config.task.num_eval = 16  # held-out prompts per cluster
  config.task.options = ml_collections.ConfigDict({"levels": 3})

  config.data = ml_collections.ConfigDict()
  config.data.path = ""
  config.data.order = "shuffle"

  config.model = ml_collections.ConfigDict()
  config.model.path = ""  # empty: a random-init decoder of this shape with the task's tokenizer
  config.model.hidden_size = 64
  config.model.intermediate_size = 128
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.num_kv_heads = 1
  config.model.head_dim = 32
  config.model.dtype = "float32"
  config.model.param_dtype = "float32"
  config.model.remat = "none"
  config.model.chat_template = True  # a model directory's chat template wraps the prompts

  config.sft = ml_collections.ConfigDict()
  config.sft.num_steps = 20
  config.sft.batch_size = 16
  config.sft.learning_rate = 1e-3

  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 20
  config.train.batch_size = 8
  config.train.mini_batch_size = 8
  config.train.micro_batch_size = 0
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 0
  config.train.schedule = "constant"
  config.train.weight_decay = 0.0
  config.train.grad_clip = 1.0
  config.train.max_bad_steps = 5
  config.train.log_every = 1

  config.rl = ml_collections.ConfigDict()
  config.rl.group_size = 4
  config.rl.advantage = "ebpo"
  config.rl.num_iterations = 1
  config.rl.dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal, refill
  config.rl.max_refill_rounds = 0  # extra rollout rounds per step to refill dropped groups
  config.rl.overlong_buffer = 0  # DAPO soft overlong penalty over the last N tokens; 0: off
  config.rl.overlong_penalty = 1.0  # the penalty at max_new_tokens
  config.rl.ebpo = ml_collections.ConfigDict()
  config.rl.ebpo.mode = "running"
  config.rl.ebpo.decay = 1.0
  config.rl.ebpo.per_cluster = True  # one prior per cluster; False: one global prior
  config.rl.ebpo.normalize = "batch"
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
  config.sampling.max_new_tokens = 16  # "Answer: " and a few digits, then EOS
  config.sampling.prompts_per_call = 0  # prompts per sampler call (0: all)
  config.sampling.prompt_buckets = (160, 192, 256, 384, 512, 1024)

  config.rewards = ml_collections.ConfigDict()
  config.rewards.workers = 0  # reasoning-gym scorers are fast: score in this process
  config.rewards.timeout_s = 5.0

  config.eval = ml_collections.ConfigDict()
  config.eval.every_steps = 10
  config.eval.greedy = True
  config.eval.num_samples = 1  # k samples per problem for `python -m ebpo_jax.evaluate`
  config.eval.path = ""  # rows file for `ebpo_jax.evaluate`; empty: the task's eval split

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 10
  config.checkpoint.max_to_keep = 2

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1
  config.mesh.fsdp = -1
  config.mesh.tensor = 1

  if arg == "runlocal":
    config.task.num_train = 64
    config.task.num_eval = 8
    config.sft.num_steps = 2
    config.sft.batch_size = 8
    config.train.num_steps = 1
    config.eval.every_steps = 1
    config.checkpoint.every_steps = 1
  elif arg:
    raise ValueError(f"configs/rg_tiny.py: unknown argument {arg!r} (known: runlocal)")
  return config
