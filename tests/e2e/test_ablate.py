"""ebpo_jax.ablate end to end: a real two-variant ablation on :runlocal, its report, plots, runs."""

import json
import os
import subprocess
import sys

import pytest

from ebpo_jax import ablate
from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.environment import CACHE_VARIABLE

CONFIG = f"{ROOT / 'configs' / 'arith_ebpo.py'}:runlocal"


@pytest.fixture(scope="module")
def small_ablation(tmp_path_factory):
  """grpo and ebpo_running, G=4, one seed, 2 RL steps each on :runlocal (about 30 s)."""
  workdir = tmp_path_factory.mktemp("ablation")
  env = ablate.child_env()
  # the runs share compiles with each other and with the session's other trainer runs
  env["JAX_COMPILATION_CACHE_DIR"] = os.environ[CACHE_VARIABLE]
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  kwargs = dict(
    variants=["grpo", "ebpo_running"],
    group_sizes=[4],
    seeds=1,
    workers=2,
    overrides=["--config.train.num_steps=2"],
    progress=False,
    env=env,
  )
  report = ablate.run_ablation(CONFIG, workdir, **kwargs)
  return workdir, report, kwargs


def test_ablation_writes_report_plots_and_runs(small_ablation):
  workdir, report, _ = small_ablation
  markdown = (workdir / "ablation.md").read_text()
  assert "| grpo | 4 | 1 |" in markdown and "| ebpo_running | 4 | 1 |" in markdown
  assert "## Summary" in markdown
  assert (workdir / "plots" / "ablation_accuracy_G4.png").stat().st_size > 1000
  saved = json.loads((workdir / "ablation.json").read_text())
  assert {r["variant"] for r in saved["rows"]} == {"grpo", "ebpo_running"}
  assert len(report["runs"]) == 2


def test_variants_share_the_warm_start_and_differ_in_estimator(small_ablation):
  workdir, _, _ = small_ablation
  runs = {name: workdir / "runs" / f"{name}_G4_s0" for name in ("grpo", "ebpo_running")}
  # The warm start ran once, in its own directory; the variants started from its checkpoint.
  assert "warm start:" in (workdir / "warm_start" / "s0" / "log.txt").read_text()
  for run_dir in runs.values():
    assert "warm start:" not in (run_dir / "log.txt").read_text()
  lines = {name: [json.loads(x) for x in (d / "metrics.jsonl").open()] for name, d in runs.items()}
  step0 = {name: next(m for m in ls if m["step"] == 0) for name, ls in lines.items()}
  timing = metrics_lib.TIMING_KEYS
  untimed = {name: {k: v for k, v in m.items() if k not in timing} for name, m in step0.items()}
  assert untimed["grpo"] == untimed["ebpo_running"]
  train = {name: [m for m in ls if "reward/mean" in m] for name, ls in lines.items()}
  assert [m["step"] for m in train["grpo"]] == [1, 2]
  assert "ebpo/shrinkage_mean" in train["ebpo_running"][0]
  assert "ebpo/shrinkage_mean" not in train["grpo"][0]
  # Same seed: the same prompts and rollout keys at step 1, so the same rewards.
  assert train["grpo"][0]["reward/mean"] == train["ebpo_running"][0]["reward/mean"]


def test_a_second_call_skips_finished_runs(small_ablation):
  workdir, report, kwargs = small_ablation
  logs = {p: p.stat().st_mtime_ns for p in workdir.glob("**/log.txt")}
  again = ablate.run_ablation(CONFIG, workdir, **kwargs)
  assert {p: p.stat().st_mtime_ns for p in workdir.glob("**/log.txt")} == logs
  assert again["rows"] == report["rows"]


def test_cli_rejects_an_unknown_variant(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "ebpo_jax.ablate",
      f"--config={CONFIG}",
      f"--workdir={tmp_path}",
      "--variants=grpo,ppo",
    ],
    cwd=ROOT,
    env=dict(os.environ),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode != 0
  assert "unknown variant(s) ['ppo']" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "runs").exists()
