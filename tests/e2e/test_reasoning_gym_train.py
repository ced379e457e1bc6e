"""One trainer step on a reasoning-gym task (chain_sum) with a tiny random-init byte-level model."""

import json

from tests.helpers.configs import RG_TINY
from tests.helpers.processes import run_trainer


def test_one_rl_step_on_chain_sum(tmp_path):
  result = run_trainer(tmp_path, config=f"{RG_TINY}:runlocal")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_lines = [m for m in lines if "reward/mean" in m]
  assert [m["step"] for m in train_lines] == [1]
  step = train_lines[0]
  assert 0.0 <= step["reward/mean"] <= 1.0
  assert step["reward/errors"] == 0  # every response went through chain_sum's own scorer
  assert step["compiles/train_step"] == 1
  for key in ("loss", "grad_norm", "entropy", "ebpo/shrinkage_mean"):
    assert step[key] is not None, key
  # The clusters are the dataset's curriculum levels, evaluated before and after the step.
  evals = [m for m in lines if "eval/accuracy" in m]
  assert [m["step"] for m in evals] == [0, 1]
  for level in range(3):
    assert f"eval/accuracy/chain_sum_L{level}" in evals[-1]
    name = f"chain_sum_L{level}"
    assert f"reward/mean/{name}" in step or f"ebpo/prior_mean/{name}" in step
  assert set(evals[-1]) >= {"eval/accuracy", "eval/accuracy/chain_sum_L0"}
  assert "held-out accuracy" in result.stdout
  assert (tmp_path / "checkpoints").is_dir()
