"""The trainer's parts, used by the entry points (train, evaluate, export, ablate, difficulty),
and `run`, the trainer as a Python function: `ebpo_jax.trainer.run(config, workdir, rewards=[...])`.

loop       the run: `run` (checks, the workdir's claim) and `train` (resume or start, the RL loop,
           the end-of-run summary)

config     checking every value of a config before compiling (`check_config`; `cli.load_config`
           loads it, `cli.entry_point` turns a bad value into one line)
state      `TrainState`, a fresh or an abstract state and its shardings
optimizer  AdamW after clipping, its learning-rate schedule, its state's shardings
step       the pure `train_step` over frozen `StepOptions` (advantages, then PPO-clip updates)
           and its one jit; it returns the advantages beside the metrics (`StepAux`)
task_rows  the task, its tokenizer and its rows, each checked before anything compiles
warm_start the supervised warm start before RL (batches: `data.make_batches`, order `sampled`)
workdir    a run's workdir: its lock, its config.json compared on resume, its format number
policy     a policy for evaluate/export/difficulty: a run's checkpoint or a model directory
"""

from collections.abc import Sequence
from typing import Any

import ml_collections


def run(
  config: ml_collections.ConfigDict, workdir: str, *, rewards: Sequence[Any] = (), name: str = ""
) -> dict:
  """Trains (or resumes) under `config` in `workdir`, as `python -m ebpo_jax.train` does; returns
  the last evaluation. `rewards`: Python reward functions (or `(function, weight)` pairs) instead
  of `config.rewards.fns`. See `loop.run`."""
  from ebpo_jax.trainer import loop  # imported when a run starts: the parts import without it

  return loop.run(config, workdir, rewards=rewards, name=name)
