"""A reasoning-gym task on a tiny random-init byte-level decoder: a plumbing check, not a learner.

The task is reasoning-gym's `chain_sum` with its own generator and scorer; its curriculum levels
0-2 are the clusters (`chain_sum_L0` .. `chain_sum_L2`). The model reads and writes UTF-8 bytes (the
task's ByteTokenizer), so prompts are about 150 tokens. A short supervised warm start on
"Answer: <n>" targets, then EBPO. Any reasoning-gym dataset works: `--config.task.name=
reasoning_gym:basic_arithmetic`, or several as clusters, `reasoning_gym:chain_sum+basic_arithmetic`.

  python -m ebpo_jax.train --config=configs/rg_tiny.py --workdir=/tmp/rg_tiny
  python -m ebpo_jax.train --config=configs/rg_tiny.py:runlocal --workdir=/tmp/rg_local
"""

import pathlib

import ml_collections

from ebpo_jax import cli

# configs/ is not a package: its sibling common.py is loaded by path, as every config is.
common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may be "runlocal" (one RL step, seconds on a CPU)."""
  arg = common.parse_arg(arg, runlocal=False)
  config = common.get_config()
  config.task.name = "reasoning_gym:chain_sum"
  config.task.num_train = 2_000
  config.task.num_eval = 16
  config.task.options.levels = 3
  # A random-init decoder with the task's byte tokenizer.
  config.model.update(intermediate_size=128, num_layers=2, num_kv_heads=1)
  config.sft.num_steps = 20
  config.sft.batch_size = 16
  config.train.num_steps = 20
  config.train.batch_size = 8
  config.train.mini_batch_size = 8
  config.rl.group_size = 4
  config.sampling.max_new_tokens = 16  # "Answer: " and a few digits, then EOS
  config.sampling.prompt_buckets = (160, 192, 256, 384, 512, 1024)
  config.eval.every_steps = 10
  config.checkpoint.every_steps = 10
  if arg.runlocal:
    common.runlocal(config, num_train=64, num_eval=8, num_steps=1, every_steps=1)
    config.sft.num_steps = 2
    config.sft.batch_size = 8
  return config
