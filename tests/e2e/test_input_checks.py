"""Bad input on the command line, as a process: a typo in a `--config.KEY` override is one line
with the closest key, in each entry point that takes a config; `--print_config` prints and exits."""

import json

import pytest

from tests.helpers.processes import run_module, run_trainer


def test_cli_typo_in_a_config_key_is_one_line_with_the_suggestion(tmp_path):
  result = run_trainer(tmp_path, "--config.train.num_step=3", timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip() == (
    "error: --config.train.num_step=3: no config key train.num_step; did you mean train.num_steps?"
  )


@pytest.mark.parametrize("module", ["ebpo_jax.evaluate", "ebpo_jax.difficulty", "ebpo_jax.ablate"])
def test_every_config_entry_point_reports_a_key_typo_in_one_line(module):
  args = ["--config=configs/arith_ebpo.py:runlocal", "--config.sed=1"]
  result = run_module(module, *args, devices=1, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip() == "error: --config.sed=1: no config key sed; did you mean seed?"


def test_print_config_prints_the_resolved_config_and_exits(tmp_path):
  result = run_trainer(
    tmp_path / "run", "--config.rl.group_size=8", "--config.seed=3", "--print_config", timeout=120
  )
  assert result.returncode == 0, result.stderr[-2000:]
  printed = json.loads(result.stdout)
  assert printed["rl"]["group_size"] == 8 and printed["seed"] == 3
  assert printed["task"]["name"] == "arithmetic" and "checkpoint" in printed
  assert not (tmp_path / "run").exists()  # nothing written, nothing compiled
