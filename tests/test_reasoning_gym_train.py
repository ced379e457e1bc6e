"""One trainer step on a reasoning-gym task (chain_sum) with a tiny random-init byte-level model."""

import importlib.util
import json
import pathlib

import pytest

from ebpo_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def rg_config(arg: str | None = "runlocal"):
  spec = importlib.util.spec_from_file_location("rg_tiny", ROOT / "configs" / "rg_tiny.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_both_variants_of_the_config_pass_the_trainer_checks():
  for arg in (None, "runlocal"):
    train.check_config(rg_config(arg), num_devices=8)
  with pytest.raises(ValueError, match="unknown argument 'big'"):
    rg_config("big")


def test_one_rl_step_on_chain_sum(tmp_path, capsys):
  config = rg_config()
  last_eval = train.run(config, str(tmp_path))
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
    assert f"reward/chain_sum_L{level}" in step or f"ebpo/prior_mean/chain_sum_L{level}" in step
  assert set(last_eval) >= {"eval/accuracy", "eval/accuracy/chain_sum_L0"}
  assert "held-out accuracy" in capsys.readouterr().out
  assert (tmp_path / "checkpoints").is_dir()
