"""EBPO on integer addition with a tiny random-init decoder: the default main job.

A supervised warm start (450 steps) teaches the answer format, 1-digit addition and part of 2-digit
addition; then 200 RL steps with the paper's EBPO advantage (running per-cluster prior, batch
normalisation) raise the held-out greedy accuracy of the hard cluster, add_2. About 1 minute on 2
idle CPU cores (2-3.5 with other jobs running); the trainer ends with the per-cluster before/after
table and WORKDIR/plots/.

  python -m ebpo_jax.train --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo
  python -m ebpo_jax.train --config=configs/arith_ebpo.py:runlocal --workdir=/tmp/arith_local

Any key can be overridden, e.g. `--config.rl.advantage=grpo --config.rl.group_size=4`.

Why these settings, and this config's results: bench/RESULTS.md, "configs/arith_ebpo.py".
"""

import importlib.util
import pathlib

import ml_collections

# configs/ is not a package and the loaders import a config by path: load its sibling by path too.
_spec = importlib.util.spec_from_file_location(
  "common", pathlib.Path(__file__).with_name("common.py")
)
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may be "runlocal" (a few steps, seconds on a CPU)."""
  arg = common.parse_arg(arg, runlocal=False)
  config = common.get_config()  # the base config holds this job's values
  if arg.runlocal:
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
  return config
