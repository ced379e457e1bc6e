"""Trainer runs the tests share, and what the tests read from a run's workdir."""

from ebpo_jax import metrics as metrics_lib


def logged_steps(workdir) -> list[int]:
  """The step of each line of the run's metrics.jsonl, in order."""
  return [r["step"] for r in metrics_lib.read_metrics(workdir)]


PNG = b"\x89PNG\r\n\x1a\n"  # the first bytes of a plot file
