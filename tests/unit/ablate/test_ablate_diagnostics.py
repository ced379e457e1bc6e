"""ebpo_jax.ablate.diagnostics: per-estimator training curves from the runs' metrics.jsonl."""

import json

import numpy as np
import pytest

from ebpo_jax import ablate


def write_run(workdir, name, lines):
  """A run directory as the trainer leaves it: an evaluation line, then training lines."""
  run_dir = workdir / "runs" / name
  run_dir.mkdir(parents=True)
  records = [
    {"step": 0, "eval/accuracy": 0.5},
    *({"step": i + 1, **x} for i, x in enumerate(lines)),
  ]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def result(variant, seed, g=4):
  return {"variant": variant, "group_size": g, "seed": seed, "name": f"{variant}_G{g}_s{seed}"}


def common(reward, zero_frac):
  return {"reward/mean": reward, "adv/zero_frac": zero_frac, "grad_norm": 1.0, "entropy": 0.3}


@pytest.fixture
def workdir(tmp_path):
  # GRPO, two seeds: the all-equal share equals the zero-advantage share (GRPO zeroes those groups).
  grpo = [(0.2, 0.5), (0.4, 0.25)], [(0.4, 0.5), (0.6, 0.75)]
  for seed, lines in enumerate(grpo):
    lines = [{**common(r, z), "adv/all_equal_frac": z} for r, z in lines]
    write_run(tmp_path, f"grpo_G4_s{seed}", lines)
  # EBPO with a prior per cluster: the prior's mean, std and shrinkage per cluster.
  ebpo = [
    {**common(0.3, 0.0), "adv/all_equal_frac": 0.5, "ebpo/shrinkage_mean": 0.4,
     "ebpo/prior_mean/add_1": 0.5, "ebpo/prior_std/add_1": 0.1, "ebpo/shrinkage/add_1": 0.3},
    {**common(0.5, 0.0), "adv/all_equal_frac": 0.25, "ebpo/shrinkage_mean": 0.4,
     "ebpo/prior_mean/add_1": 0.6, "ebpo/prior_std/add_1": 0.2, "ebpo/shrinkage/add_1": 0.2},
  ]  # fmt: skip
  write_run(tmp_path, "ebpo_running_G4_s0", ebpo)
  # EBPO with one global prior: its keys bare, without a cluster.
  ebpo_global = {"ebpo/shrinkage_mean": 0.7, "ebpo/prior_mean": 0.2, "ebpo/prior_std": 0.1}
  line = {**common(0.1, 0.0), "adv/all_equal_frac": 0.0, **ebpo_global, "ebpo/shrinkage": 0.7}
  write_run(tmp_path, "ebpo_global_G4_s0", [line] * 2)
  return tmp_path


RESULTS = [
  result("grpo", 0),
  result("grpo", 1),
  result("ebpo_running", 0),
  result("ebpo_global", 0),
]


def by_label(curves):
  return {c.label: c for c in curves}


def test_curves_average_seeds_and_band_their_range(workdir):
  panels = ablate.panel_curves(workdir, RESULTS, 4)
  reward = by_label(panels["training reward"])
  # grpo: seed 0 [0.2, 0.4], seed 1 [0.4, 0.6] -> mean [0.3, 0.5], band min..max.
  np.testing.assert_allclose(reward["grpo"].mean, [0.3, 0.5])
  np.testing.assert_allclose(reward["grpo"].low, [0.2, 0.4])
  np.testing.assert_allclose(reward["grpo"].high, [0.4, 0.6])
  assert list(reward["grpo"].steps) == [1, 2]  # training lines only: the step-0 eval is not one
  np.testing.assert_array_equal(reward["ebpo_running"].low, reward["ebpo_running"].high)  # 1 seed


def test_keys_are_drawn_per_cluster_when_logged_so(workdir):
  panels = ablate.panel_curves(workdir, RESULTS, 4)
  signal = by_label(panels["groups without signal (lower: more prompts teach)"])
  # The all-equal share is dashed, beside the zero-advantage share.
  assert signal["ebpo_running: all-equal groups (GRPO zeroes them)"].dashed
  np.testing.assert_allclose(signal["ebpo_running: zero advantages"].mean, [0.0, 0.0])
  np.testing.assert_allclose(signal["grpo: zero advantages"].mean, [0.5, 0.5])
  assert not signal["grpo: zero advantages"].dashed
  np.testing.assert_allclose(signal["grpo: all-equal groups (GRPO zeroes them)"].mean, [0.5, 0.5])
  shrinkage = by_label(panels["EBPO shrinkage S (weight on the prior mean)"])
  # Per cluster where logged so; the global prior's bare key; GRPO has none.
  assert set(shrinkage) == {"ebpo_running add_1", "ebpo_global"}
  np.testing.assert_allclose(shrinkage["ebpo_running add_1"].mean, [0.3, 0.2])
  np.testing.assert_allclose(shrinkage["ebpo_global"].mean, [0.7, 0.7])
  prior = by_label(panels["EBPO prior mean per cluster"])
  # The band is the prior's std: 0.5 ± 0.1, 0.6 ± 0.2 (a seed band would be empty here).
  np.testing.assert_allclose(prior["ebpo_running add_1 ± prior std"].low, [0.4, 0.4])
  np.testing.assert_allclose(prior["ebpo_running add_1 ± prior std"].high, [0.6, 0.8])
  # The global prior's bare keys: 0.2 ± 0.1.
  np.testing.assert_allclose(prior["ebpo_global ± prior std"].mean, [0.2, 0.2])
  np.testing.assert_allclose(prior["ebpo_global ± prior std"].low, [0.1, 0.1])


def test_grpo_only_ablation_has_no_ebpo_panels_and_plots_one_png_per_g(workdir):
  grpo = [result("grpo", 0), result("grpo", 1)]
  assert not any("EBPO" in title for title in ablate.panel_curves(workdir, grpo, 4))
  paths = ablate.plot_diagnostics(workdir, RESULTS)
  assert [p.rsplit("/", 1)[-1] for p in paths] == ["ablation_diagnostics_G4.png"]
  assert (workdir / "plots" / "ablation_diagnostics_G4.png").read_bytes()[:4] == b"\x89PNG"
