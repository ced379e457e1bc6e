"""A reward function of `config.rewards` in the trainer (a process): logged beside math-verify."""

import pytest

from ebpo_jax import metrics
from tests.helpers.processes import on_pythonpath, run_trainer

# ------------------------------------------------------------------------------ in the trainer

REWARD_MODULE = '''
def short(completions, rows, **extras):
  """1.0 for a completion of at most 2 characters (a 1- or 2-digit sum), else 0.0."""
  return [float(len(c) <= 2) for c in completions]
'''


def test_trainer_logs_a_reward_function_beside_math_verify(tmp_path, monkeypatch):
  # A reward module that only the trainer's PYTHONPATH finds, weight 0.5 beside the built-in
  # math_verify (in worker processes: it times out with signals).
  on_pythonpath(monkeypatch, tmp_path, my_rewards=REWARD_MODULE)
  result = run_trainer(
    tmp_path / "run",
    "--config.rewards.fns=math_verify, 0.5*my_rewards:short",
    "--config.rewards.workers=1",
    "--config.train.num_steps=1",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  train = [m for m in metrics.read_metrics(tmp_path / "run") if "reward/mean" in m]
  assert len(train) == 1
  line = train[0]
  assert line["reward/errors"] == 0
  # The weighted total: 1 x math_verify + 0.5 x short, averaged (no None, no overlong penalty).
  expected = line["reward/math_verify"] + 0.5 * line["reward/short"]
  assert line["reward/mean"] == pytest.approx(expected, abs=1e-6)
  assert 0 < line["reward/short"] <= 1


BROKEN_MODULE = """
def broken(completions, rows, **extras):
  return [len(c) / 0 for c in completions]
"""


def test_a_run_whose_reward_calls_all_fail_stops_with_one_line(tmp_path, monkeypatch):
  """Before rewards.max_error_frac the run trained on the zeros the failed calls scored and
  exited 0 after one warning line."""
  on_pythonpath(monkeypatch, tmp_path, broken_rewards=BROKEN_MODULE)
  result = run_trainer(
    tmp_path / "run",
    "--config.rewards.fns=broken_rewards:broken",
    "--config.sft.num_steps=0",
    "--config.train.num_steps=2",
  )
  assert result.returncode == 2, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  expected = "error: rewards.max_error_frac=0.5: 32 of 32 calls of reward 'broken' failed"
  assert last.startswith(expected), last
  assert "broken: ZeroDivisionError: division by zero" in last
  assert [m["step"] for m in metrics.read_metrics(tmp_path / "run")] == [0]  # no step trained
