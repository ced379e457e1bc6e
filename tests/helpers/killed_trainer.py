"""`python -m ebpo_jax.train`, SIGKILLed at a chosen moment (the kill -9 test of e2e/test_train.py).

    python tests/helpers/killed_trainer.py POINT:STEP --config=... --workdir=... [--config.K=V ...]

POINT is `eval` (the evaluation line of STEP has just reached metrics.jsonl, its checkpoint not
yet started), `save` (the checkpoint of STEP has just started: orbax is writing it in the
background) or `train` (the training line of STEP has just reached metrics.jsonl); `term` sends
SIGTERM instead, right after the training line of STEP (the trainer then saves and exits 143).
Under rl.max_staleness (rollouts.pipeline): `transfer` kills in the STEP-th params copy of this
process (the weights the producer samples with, copied, the train step not yet run), `produce` in
the producer thread as its STEP-th batch of this process is made (before it is in flight).
Nothing in the trainer knows about this: the moments are found by wrapping its checkpoint and
metrics writers, then the trainer runs as `python -m ebpo_jax.train` would run it.
"""

import os
import runpy
import signal
import sys
import time

from ebpo_jax import checkpoint
from ebpo_jax import metrics as metrics_lib


def _kill_in_save(step: int) -> None:
  save = checkpoint.Checkpointer.save

  def killing_save(self, at, *args, **kwargs):
    started = save(self, at, *args, **kwargs)
    if started and at == step and os.path.basename(str(self.directory)) == "checkpoints":
      _wait_for_temporary_directory(str(self.directory), at)
      os.kill(os.getpid(), signal.SIGKILL)
    return started

  checkpoint.Checkpointer.save = killing_save


def _wait_for_temporary_directory(directory: str, step: int, timeout_s: float = 30) -> None:
  """Until orbax's writing thread has created `<step>.orbax-checkpoint-tmp*` (a moment after
  `save` returns): the kill then lands while the checkpoint is being written."""
  deadline = time.monotonic() + timeout_s
  prefix = f"{step}.orbax-checkpoint-tmp"
  written = lambda: any(name.startswith(prefix) for name in os.listdir(directory))
  while time.monotonic() < deadline and not written():
    time.sleep(0.001)


def _kill_after_line(step: int, key: str, signum: int = signal.SIGKILL) -> None:
  write = metrics_lib.MetricsWriter.write

  def killing_write(self, at, values):
    write(self, at, values)
    if at == step and key in values:
      self.flush()
      os.kill(os.getpid(), signum)

  metrics_lib.MetricsWriter.write = killing_write


def _kill_in_call(cls, name: str, nth: int) -> None:
  """SIGKILL after the `nth` call of `cls.name` in this process returns (in whichever thread)."""
  original, calls = getattr(cls, name), []

  def killing(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == nth:
      os.kill(os.getpid(), signal.SIGKILL)
    return out

  setattr(cls, name, killing)


def main() -> None:
  point, step = sys.argv.pop(1).split(":")
  if point in ("transfer", "produce"):
    from ebpo_jax.rollouts import pipeline

    _kill_in_call(
      pipeline.Pipeline, {"transfer": "copy_params", "produce": "_make"}[point], int(step)
    )
  elif point == "save":
    _kill_in_save(int(step))
  elif point == "term":
    _kill_after_line(int(step), "reward/mean", signal.SIGTERM)
  else:
    _kill_after_line(int(step), {"eval": "eval/accuracy", "train": "reward/mean"}[point])
  runpy.run_module("ebpo_jax.train", run_name="__main__", alter_sys=True)  # python -m, wrapped


if __name__ == "__main__":
  main()
