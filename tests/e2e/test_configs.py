"""The paper's runlocal variants train: one method per model runs one real RL step in the trainer's
process (about 35 s each)."""

import json
import math

import pytest

from tests.helpers.configs import config_module
from tests.helpers.processes import run_trainer

# Two run for real (e2e): Qwen3 (q/k norms) with DAPO's dynamic sampling, Llama (an untied head)
# with EBPO and its KL reference. Every other model x method traces its train step above.
E2E_ARGS = ["qwen3_8b,dapo", "llama31_8b,ebpo_topic"]


@pytest.mark.parametrize("arg", E2E_ARGS)
def test_runlocal_variant_runs_one_rl_step(arg, tmp_path):
  method = arg.split(",")[1]
  config = config_module("paper").get_config(f"{arg},runlocal")
  result = run_trainer(tmp_path, config=f"configs/paper.py:{arg},runlocal", devices=8)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [m for m in lines if "reward/mean" in m]
  assert [m["step"] for m in steps] == [1]
  step = steps[0]
  for key in ("loss", "grad_norm", "entropy"):
    assert math.isfinite(step[key]), (key, step[key])
  assert step["bad_updates"] == 0
  assert step["compiles/train_step"] == 1
  assert ("ebpo/shrinkage_mean" in step) == method.startswith("ebpo")
  assert ("dapo/rounds" in step) == (method == "dapo")  # dynamic sampling ran
  if method == "dapo":
    assert 1 <= step["dapo/rounds"] <= 1 + config.rl.max_refill_rounds
  assert [m["step"] for m in lines if "eval/accuracy" in m] == [0, 1]
