"""`ebpo_jax.trainer.run(config, workdir, rewards=[...])`, the trainer as a Python function, from a
script as a notebook would call it: Python reward functions with weights, logged under their names
and recorded in the run's config.json (a lambda's refusal: tests/unit/tasks/test_reward_fns.py)."""

import json
import textwrap

import pytest

from ebpo_jax import metrics
from tests.helpers.processes import on_pythonpath, run_module

REWARDS = '''
def short(completions, rows, **extras):
  """1.0 for a completion of at most 2 characters."""
  return [float(len(c) <= 2) for c in completions]
'''

SCRIPT = """
import sys
from ebpo_jax import cli, trainer
from my_rewards import short

if __name__ == "__main__":  # a script's guard: the scorer processes import __main__
  overrides = {{"train.num_steps": 1, "sft.num_steps": 0}}
  config = cli.load_config("configs/arith_ebpo.py:runlocal", overrides)
  rewards = {rewards}
  result = trainer.run(config, sys.argv[1], rewards=rewards)
  print("accuracy", result["eval/accuracy"])
"""


def _run(tmp_path, monkeypatch, rewards: str):
  """The script with `rewards = REWARDS` on a workdir tmp_path/run; my_rewards.py on its path."""
  on_pythonpath(monkeypatch, tmp_path, my_rewards=REWARDS)
  script = tmp_path / "notebook_cell.py"
  script.write_text(textwrap.dedent(SCRIPT.format(rewards=rewards)))
  return run_module(str(script), str(tmp_path / "run"))  # the session's compilation cache


def test_trainer_run_takes_python_reward_functions_with_weights(tmp_path, monkeypatch):
  result = _run(tmp_path, monkeypatch, '["exact_match", (short, 0.5)]')
  assert result.returncode == 0, result.stderr[-3000:]
  assert "accuracy" in result.stdout
  (line,) = [m for m in metrics.read_metrics(tmp_path / "run") if "reward/mean" in m]
  assert line["reward/short"] > 0  # else its weight would not show in the sum
  assert line["reward/mean"] == pytest.approx(
    line["reward/exact_match"] + 0.5 * line["reward/short"], abs=1e-6
  )
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["rewards"]["fns"] == "exact_match, short=0.5*my_rewards:short"
