"""ebpo_jax.ablate: the plan, the report arithmetic, the plots (a real run: e2e/test_ablate.py)."""

import contextlib
import json
import os
import shutil
import types

import numpy as np
import pytest

from ebpo_jax import ablate
from tests.helpers.ablation import run_summary
from tests.helpers.tiny_step import tiny_steps


def fake_result(variant, seed, hard_curve, easy_curve, *, zero_frac=0.5, g=8, wall_s=None):
  steps = [0, 10, 20][: len(hard_curve)]
  overall = [(a + b) / 2 for a, b in zip(hard_curve, easy_curve, strict=True)]
  curve = {"step": steps, "all": overall, "easy": easy_curve, "hard": hard_curve}
  extra = {} if wall_s is None else {"wall_s": wall_s}
  return run_summary(variant, seed, curve, g=g, zero_frac=zero_frac, **extra)


def test_plan_is_seed_major_and_validates_names():
  runs = ablate.plan(["grpo", "ebpo_running"], [4, 8], [0, 1])
  assert [r.name for r in runs[:4]] == [
    "grpo_G4_s0",
    "ebpo_running_G4_s0",
    "grpo_G8_s0",
    "ebpo_running_G8_s0",
  ]
  assert len(runs) == 8 and {r.seed for r in runs[4:]} == {1}
  with pytest.raises(ValueError, match="unknown variant.*'ppo'"):
    ablate.plan(["ppo"], [8], [0])
  with pytest.raises(ValueError, match="group sizes must be >= 2"):
    ablate.plan(["grpo"], [1], [0])


def test_every_variant_sets_a_known_estimator():
  for name, overrides in ablate.VARIANTS.items():
    assert overrides["rl.advantage"] in ("grpo", "dr_grpo", "rloo", "js_shrinkage", "ebpo"), name
    if overrides["rl.advantage"] == "ebpo":
      # Every EBPO variant pins mode, normalisation and decay: the base config cannot leak in.
      pinned = {"rl.ebpo.mode", "rl.ebpo.normalize", "rl.ebpo.decay", "rl.ebpo.per_cluster"}
      assert pinned <= set(overrides), name
  assert ablate.VARIANTS["ebpo_batch"]["rl.ebpo.per_cluster"] is False  # the authors' code


@pytest.mark.parametrize("per_cluster, counts", [(True, [12.0, 20.0]), (False, [32.0])])
def test_global_prior_switch_of_the_trainer(per_cluster, counts):
  # ebpo_batch / ebpo_global set rl.ebpo.per_cluster=False: train_step then reads and updates one
  # prior in slot 0. 8 prompts x G=4, clusters 0,0,0,1,1,1,1,1: per cluster 3*4 = 12 and 5*4 = 20
  # rewards enter the reward accumulator; pooled, all 32 go to slot 0 (any other slot stays empty).
  step = tiny_steps({} if per_cluster else {"rl.ebpo.per_cluster": False})
  assert (step.B, step.G) == (8, 4)
  batch = step.batch()
  batch["cluster_ids"] = np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int32)
  new_state, _, _ = step(batch)  # (state, metrics, aux)
  count = np.asarray(new_state.prior.rewards.count)
  np.testing.assert_array_equal(count[: len(counts)], counts)
  assert count.sum() == 32


def test_child_env_gives_one_device_and_keeps_other_flags():
  env = ablate.child_env(
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1", "A": "b"}
  )
  assert env["XLA_FLAGS"].split() == [
    "--xla_cpu_foo=1",
    "--xla_force_host_platform_device_count=1",
  ]
  assert env["A"] == "b"


def test_report_arithmetic():
  # Two seeds per variant. 'hard' starts lowest (0.1 and 0.2 at step 0), so it is the hardest.
  results = [
    fake_result("grpo", 0, [0.1, 0.15, 0.3], [0.9, 0.9, 0.9], wall_s=600),
    fake_result("grpo", 1, [0.2, 0.2, 0.2], [0.8, 0.9, 1.0], wall_s=840),
    fake_result("ebpo_running", 0, [0.1, 0.25, 0.5], [0.9, 1.0, 1.0], zero_frac=0.0),
    fake_result("ebpo_running", 1, [0.2, 0.3, 0.4], [0.8, 0.8, 0.8], zero_frac=0.0),
  ]
  report = ablate.build_report(results, target_gain=0.10)
  assert report["hard_cluster"] == "hard"
  rows = {r["variant"]: r for r in report["rows"]}
  grpo, ebpo = rows["grpo"], rows["ebpo_running"]
  # grpo final overall: (0.3+0.9)/2 = 0.6 and (0.2+1.0)/2 = 0.6 -> mean 0.6, std 0.
  assert grpo["acc_mean"] == pytest.approx(0.6) and grpo["acc_std"] == pytest.approx(0.0)
  # grpo hard gains: 0.3-0.1 = 0.2 and 0.2-0.2 = 0 -> mean 0.1, population std 0.1.
  assert grpo["hard_gain_mean"] == pytest.approx(0.1)
  assert grpo["hard_gain_std"] == pytest.approx(0.1)
  # Overall gains (the mean of the two clusters, last minus step 0): grpo 0.6 - 0.5 on both seeds;
  # ebpo 0.75 - 0.5 = 0.25 and 0.6 - 0.5 = 0.1: mean 0.175, sd 0.1061, half-width 12.706 * 0.075.
  assert grpo["gain_mean"] == pytest.approx(0.1) and grpo["gain_low"] == pytest.approx(0.1)
  assert (ebpo["gain_low"], ebpo["gain_high"]) == pytest.approx((-0.778, 1.128), abs=1e-3)
  # Wall time per run in minutes: grpo's 10 and 14 (mean 12); ebpo's runs did not record one.
  assert (grpo["wall_min_mean"], *grpo["wall_min_range"]) == pytest.approx((12.0, 10.0, 14.0))
  assert ebpo["wall_min_mean"] is None
  # Steps to +0.10: seed 0 reaches 0.2 at step 20 (0.15 at step 10 is short); seed 1 never.
  assert grpo["reached"] == 1 and grpo["steps_to_target"] == 20
  # ebpo: gains 0.4 and 0.2 (mean 0.3); +0.10 reached at step 10 by both -> median 10.
  assert ebpo["hard_gain_mean"] == pytest.approx(0.3)
  assert ebpo["reached"] == 2 and ebpo["steps_to_target"] == 10
  # Per-cluster final means: ebpo easy (1.0 + 0.8) / 2 = 0.9.
  assert ebpo["per_cluster"]["easy"] == pytest.approx(0.9)
  assert ebpo["zero_frac"] == 0.0 and grpo["zero_frac"] == 0.5
  # Paired by seed: ebpo minus grpo gains, seed 0: 0.4 - 0.2 = 0.2, seed 1: 0.2 - 0 = 0.2.
  assert ebpo["vs_grpo_mean"] == pytest.approx(0.2)
  assert ebpo["vs_grpo_gain_diffs"] == pytest.approx([0.2, 0.2])  # their spread: 0
  assert any("ebpo_running +0.200 [+0.200, +0.200] (n=2)" in x for x in report["summary"])
  markdown = ablate.render_markdown(report, {"config": "c.py", "date": "2026-11-30"})
  assert "| ebpo_running | 8 | 2 |" in markdown
  assert "| gain (all), mean [95% CI] |" in markdown and "+0.175 [-0.778, +1.128] (n=2)" in markdown
  assert "| 12.0 (10.0-14.0) |" in markdown  # grpo's minutes per run
  # Gains 0.4, 0.2: half-width t_{0.975,1} * sd / sqrt(2) = 12.706 * 0.1414 / 1.414 = 1.271.
  assert (
    "+0.300 [-0.971, +1.571] (n=2); per seed +0.40, +0.20 | +0.200 [+0.200, +0.200]" in markdown
  )


def test_ablation_plot_shades_the_seed_range_around_the_mean(tmp_path):
  from matplotlib.collections import PolyCollection

  results = [
    fake_result("grpo", 0, [0.1, 0.3, 0.3], [0.8, 0.9, 1.0]),
    fake_result("grpo", 1, [0.2, 0.2, 0.0], [0.8, 0.8, 0.8]),
    fake_result("ebpo_running", 0, [0.1, 0.5, 0.6], [0.8, 0.9, 1.0]),
  ]
  results[1]["curve"]["hard"][2] = None  # seed 1 has no value at step 20
  # grpo on the hard cluster: mean 0.15, 0.25, 0.3; min-max 0.1-0.2, 0.2-0.3, 0.3-0.3.
  steps, mean, low, high = ablate.seed_band(results[:2], "hard")
  assert steps == [0, 10, 20]
  assert mean == pytest.approx([0.15, 0.25, 0.3])
  assert (low, high) == (pytest.approx([0.1, 0.2, 0.3]), pytest.approx([0.2, 0.3, 0.3]))
  assert ablate.mean_curve(results[:2], "hard") == (steps, pytest.approx(mean))
  (path,) = ablate.plot_ablation(tmp_path, results)
  assert path == str(tmp_path / "plots" / "ablation_accuracy_G8.png")
  assert os.path.getsize(path) > 1000
  fig = ablate.ablation_figure(results, 8)
  for ax in fig.axes:  # one band per axis: grpo has 2 seeds, ebpo_running's single seed none
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1 and ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["grpo (2 seeds)", "ebpo_running (1 seed)"]
  y = bands[0].get_paths()[0].vertices[:, 1]  # the hard cluster's grpo band
  assert (y.min(), y.max()) == pytest.approx((0.1, 0.3))


def test_hardest_cluster_ties_go_to_the_later_cluster():
  results = [fake_result("grpo", 0, [0.0, 0.0], [0.0, 0.0])]
  assert ablate.build_report(results)["hard_cluster"] == "hard"


def test_warm_start_without_its_checkpoint_is_trained_again_and_keeps_the_seeds_runs(
  tmp_path, monkeypatch
):
  """A warm start kept as its summary only (config.json and result.json, as a committed ablation
  keeps it) is trained again before a variant starts from it; the seed's finished runs stay."""
  from ebpo_jax.trainer import workdir as workdir_lib

  trained = []

  def fake_train(config, workdir, args, env):
    trained.append(workdir)
    workdir_lib.save_config(workdir, workdir_lib.resolved_config(config, args))
    os.makedirs(os.path.join(workdir, workdir_lib.CHECKPOINTS_DIR, "0"))

  monkeypatch.setattr(ablate, "_train", fake_train)
  config, seed = "configs/arith_ebpo.py:runlocal", 0
  warm = ablate._ensure_warm_start(config, str(tmp_path), seed, [], {})
  assert trained == [warm]
  assert ablate._ensure_warm_start(config, str(tmp_path), seed, [], {}) == warm
  assert trained == [warm]  # finished, checkpoint there: not trained again

  finished_run = tmp_path / "runs" / f"grpo_G8_s{seed}"
  finished_run.mkdir(parents=True)
  (finished_run / ablate.RESULT_FILE).write_text("{}\n")
  shutil.rmtree(os.path.join(warm, workdir_lib.CHECKPOINTS_DIR))
  assert ablate._ensure_warm_start(config, str(tmp_path), seed, [], {}) == warm
  assert trained == [warm, warm]
  assert os.path.isdir(os.path.join(warm, workdir_lib.CHECKPOINTS_DIR))
  assert (finished_run / ablate.RESULT_FILE).exists()


def test_report_only_reports_the_finished_runs_of_the_plan_and_names_the_rest(
  tmp_path, monkeypatch
):
  """--report_only trains nothing: the plan's runs that finished under this config are reported,
  the others named; a finished run of another config (here: other overrides) is not reported."""
  from ebpo_jax.trainer import workdir as workdir_lib

  def no_training(*args):
    raise AssertionError("report_only must not train")

  monkeypatch.setattr(ablate, "_train", no_training)
  config, workdir = "configs/arith_ebpo.py:runlocal", str(tmp_path)
  base = [ablate.NO_RUN_PLOTS]
  curves = {0: ([0.1, 0.3], [0.5, 0.7]), 1: ([0.2, 0.2], [0.6, 0.6])}
  other_config = [*base, "--config.train.learning_rate=0.5"]
  for seed, variant, args in [
    (0, "grpo", base),
    (0, "ebpo_running", base),
    (1, "grpo", other_config),
  ]:
    run = ablate.Run(variant, 8, seed)
    run_dir = ablate.run_workdir(workdir, run.name)
    os.makedirs(run_dir)
    warm = ablate._warm_dir(workdir, seed)
    resolved = workdir_lib.resolved_config(config, ablate._variant_args(warm, run, args))
    workdir_lib.save_config(run_dir, resolved)
    result = fake_result(variant, seed, *curves[seed], wall_s=60)
    (tmp_path / "runs" / run.name / ablate.RESULT_FILE).write_text(json.dumps(result))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 1, "reward/mean": 0.5, "entropy": 0.3}) + "\n")

  report = ablate.run_ablation(
    config, workdir, variants=["grpo", "ebpo_running"], seeds=2, report_only=True, progress=False
  )
  assert sorted(r["name"] for r in report["runs"]) == ["ebpo_running_G8_s0", "grpo_G8_s0"]
  markdown = (tmp_path / "ablation.md").read_text()
  assert "- runs: 2 of 4 finished; not in this report: grpo_G8_s1, ebpo_running_G8_s1" in markdown
  assert (tmp_path / "plots" / "ablation_accuracy_G8.png").exists()
  with pytest.raises(ablate.AblationError, match="no run of this plan finished"):
    ablate.run_ablation(config, workdir, variants=["rloo"], seeds=1, report_only=True)


def test_committed_ablation_workdirs_are_readable_by_this_code():
  """results/smollm2.md says to copy a committed ablation to /tmp and extend it: every kept run and
  warm start must hold its format.json, or the tool refuses the copy as an older ebpo-jax's."""
  from ebpo_jax.trainer import workdir as workdir_lib

  results = os.path.join(os.path.dirname(__file__), "..", "..", "..", "results")
  kept = [
    os.path.join(root, group, name)
    for root in (os.path.join(results, d) for d in os.listdir(results) if d.startswith("ablation_"))
    if os.path.isdir(root)
    for group in ("runs", "warm_start")
    for name in sorted(os.listdir(os.path.join(root, group)))
  ]
  assert kept, "no committed ablation found under results/"
  for run_dir in kept:
    assert workdir_lib.saved_config(run_dir) is not None, run_dir


def test_a_resumed_runs_wall_time_counts_every_invocation(tmp_path, monkeypatch):
  """A run interrupted (the trainer failed, Ctrl-C) and resumed reports the time of both
  invocations, not the last one's only."""
  from ebpo_jax.trainer import workdir as workdir_lib

  calls = []

  def failing_then_finishing(config, workdir, args, env):
    if not calls:  # the warm start
      os.makedirs(os.path.join(workdir, workdir_lib.CHECKPOINTS_DIR, "0"))
    workdir_lib.save_config(workdir, workdir_lib.resolved_config(config, args))
    calls.append(workdir)
    if len(calls) == 2:
      raise ablate.AblationError("the trainer stopped")

  clock = iter([0.0, 100.0, 500.0, 530.0])  # the run: 100 s, then resumed for 30 s
  monkeypatch.setattr(ablate, "_train", failing_then_finishing)
  monkeypatch.setattr(ablate, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  monkeypatch.setattr(ablate, "summarize_run", lambda run_dir, run: {"name": run.name})
  config, run = "configs/arith_ebpo.py:runlocal", ablate.Run("grpo", 8, 0)
  locks = {0: contextlib.nullcontext()}
  with pytest.raises(ablate.AblationError, match="stopped"):
    ablate._run_one(config, str(tmp_path), run, [], {}, locks)
  result = ablate._run_one(config, str(tmp_path), run, [], {}, locks)
  assert len(calls) == 3 and result["wall_s"] == pytest.approx(130.0)
