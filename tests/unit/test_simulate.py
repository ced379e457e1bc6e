"""Tests for `python -m ebpo_jax.simulate`: the tables' claims on small sizes, and the CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ebpo_jax import simulate

SMALL = ["--num_prompts=256", "--num_clusters=4", "--steps=3", "--seed=1"]


@pytest.fixture(scope="module")
def bernoulli_results(tmp_path_factory):
  path = tmp_path_factory.mktemp("simulate") / "results.json"
  results = simulate.main([*SMALL, "--group_sizes=2,4,8", f"--json={path}"])
  return results, path


def test_eb_baseline_beats_the_group_mean_and_a_global_prior(bernoulli_results):
  results, _ = bernoulli_results
  for g, rows in results.items():
    mse = {name: row["baseline_mse"] for name, row in rows.items()}
    assert mse["ebpo"] < mse["grpo"], (g, mse)  # paper Theorem 3.3
    assert mse["ebpo"] < mse["ebpo/global"], (g, mse)  # per-cluster priors (EBPO.md claim 4)
    assert mse["js_shrinkage"] < mse["rloo"], (g, mse)  # both leave r_i out
    assert mse["grpo"] == mse["dr_grpo"]  # same group-mean baseline


def test_saturated_groups_and_gradient_signal(bernoulli_results):
  results, _ = bernoulli_results
  for rows in results.values():
    assert rows["ebpo"]["zero_adv"] == 0.0 < rows["grpo"]["zero_adv"]
    assert rows["ebpo"]["signal"] == 1.0 > rows["grpo"]["signal"]
    assert rows["grpo"]["zero_adv"] + rows["grpo"]["signal"] == pytest.approx(1.0)
    assert np.isnan(rows["grpo"]["shrinkage"]) and 0 < rows["ebpo"]["shrinkage"] < 1
  shrinkage = [results[g]["ebpo"]["shrinkage"] for g in (2, 4, 8)]
  zeros = [results[g]["grpo"]["zero_adv"] for g in (2, 4, 8)]
  assert shrinkage == sorted(shrinkage, reverse=True)  # S falls as G grows
  assert zeros == sorted(zeros, reverse=True)


def test_grpo_zero_share_matches_the_model(bernoulli_results):
  # A Bernoulli group of size G is saturated with probability theta^G + (1 - theta)^G.
  results, _ = bernoulli_results
  args = simulate.parse_args(SMALL)
  theta = np.concatenate(
    [simulate.sample_batch(np.random.default_rng(s), args, 2)[2] for s in range(20)]
  )
  for g in (2, 4, 8):
    expected = np.mean(theta**g + (1 - theta) ** g)
    assert results[g]["grpo"]["zero_adv"] == pytest.approx(expected, abs=0.05), g


def test_json_output(bernoulli_results):
  results, path = bernoulli_results
  saved = json.loads(path.read_text())
  assert saved["args"]["num_prompts"] == 256
  assert saved["results"]["4"]["ebpo"]["baseline_mse"] == results[4]["ebpo"]["baseline_mse"]


def test_gaussian_rewards():
  results = simulate.main([*SMALL, "--group_sizes=2", "--rewards=gaussian", "--normalize=group"])
  rows = results[2]
  assert rows["grpo"]["zero_adv"] == 0.0  # continuous rewards never tie
  assert rows["ebpo"]["baseline_mse"] < rows["grpo"]["baseline_mse"]
  # Group mean MSE is noise^2 / G = 0.125 in expectation.
  assert rows["grpo"]["baseline_mse"] == pytest.approx(0.125, rel=0.15)


def test_cli_runs_and_rejects_bad_flags():
  cmd = [sys.executable, "-m", "ebpo_jax.simulate"]
  ok = subprocess.run(
    [*cmd, "--num_prompts=32", "--group_sizes=2", "--steps=1"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert ok.returncode == 0, ok.stderr
  assert "G = 2" in ok.stdout and "ebpo/global" in ok.stdout
  bad = subprocess.run([*cmd, "--group_sizes=1,4"], capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2
  assert "--group_sizes=1,4: must be comma-separated integers >= 2, got '1,4'" in bad.stderr
  with pytest.raises(SystemExit):
    simulate.parse_args(["--decay=0"])
