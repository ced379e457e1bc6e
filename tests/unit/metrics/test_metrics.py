"""Tests for ebpo_jax.metrics: metric names, JSONL format, TensorBoard events, truncation, plots,
table."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses, metrics
from tests.helpers.tensorboard import read_event_files


def test_write_jsonl_lines_and_tensorboard(tmp_path):
  with metrics.MetricsWriter(tmp_path) as writer:
    writer.write(1, {"reward/mean": jnp.float32(0.25), "loss": np.float64(1.5), "kl": 2})
    writer.write(
      2,
      {
        "reward/mean": 0.5,
        "grad_norm": jnp.array(float("nan")),
        "entropy": float("inf"),
        "adv/zero_frac": jnp.array([0.75]),
      },
    )
    # Flushed as written: readable before close.
    assert len(metrics.read_metrics(tmp_path)) == 2
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  # Strict JSON: non-finite values are null, never NaN / Infinity tokens.
  assert lines[1] == (
    '{"step": 2, "reward/mean": 0.5, "grad_norm": null, "entropy": null, "adv/zero_frac": 0.75}'
  )
  first = json.loads(lines[0])
  assert first == {"step": 1, "reward/mean": 0.25, "loss": 1.5, "kl": 2.0}
  assert all(type(v) is float for k, v in first.items() if k != "step")
  scalars = {
    (value.tag, event.step): value.simple_value
    for events in read_event_files(tmp_path / "tensorboard")
    for event in events
    for value in event.summary.value
  }
  assert scalars[("reward/mean", 1)] == pytest.approx(0.25)
  assert scalars[("reward/mean", 2)] == pytest.approx(0.5)
  assert scalars[("loss", 1)] == pytest.approx(1.5)


def test_write_appends_across_writers_and_rejects_bad_values(tmp_path):
  with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(1, {"a": 1.0})
  with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(2, {"a": 2.0})
    with pytest.raises(ValueError, match="'b' must be a numeric scalar"):
      writer.write(3, {"b": np.ones(3)})
    with pytest.raises(ValueError, match="'step'"):
      writer.write(3, {"step": 3})
  assert [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
  assert not (tmp_path / "tensorboard").exists()


def test_sync_makes_metrics_jsonl_durable_before_a_checkpoint(tmp_path, monkeypatch):
  # The trainer syncs before each checkpoint save: a checkpoint never commits ahead of its metrics
  # (a flush only handed the lines to the OS; a crash of the machine could lose them).
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real_fsync(fd)))
  with metrics.MetricsWriter(tmp_path, tensorboard=False, flush_every_s=3600) as writer:
    writer.write(1, {"loss": 1.0})
    assert synced == []  # a line alone is not synced (a remote writer does not upload it)
    writer.sync()
    assert synced == [os.stat(tmp_path / metrics.METRICS_FILE).st_ino]
    writer.sync()
    assert len(synced) == 1  # nothing new: no second fsync
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1]


def test_disabled_writer_touches_nothing(tmp_path):
  workdir = tmp_path / "w"
  with metrics.MetricsWriter(workdir, enabled=False) as writer:
    writer.write(1, {"a": 1.0})
  assert not workdir.exists()


def _write_lines(path, steps, tail=""):
  path.write_text("".join(json.dumps({"step": s, "x": float(s)}) + "\n" for s in steps) + tail)


def test_truncate_after_drops_later_steps_and_partial_line(tmp_path):
  # A run that checkpointed at step 4, logged 5 and 6 and died mid-line.
  _write_lines(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6], tail='{"step": 7, "x"')
  assert metrics.truncate_after(tmp_path, 4) == 3
  assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3, 4]
  assert (tmp_path / "metrics.jsonl").read_text().endswith('{"step": 4, "x": 4.0}\n')
  assert metrics.truncate_after(tmp_path, 4) == 0
  assert metrics.truncate_after(tmp_path / "missing", 1) == 0


def test_writer_resume_step_truncates_then_appends(tmp_path):
  _write_lines(tmp_path / "metrics.jsonl", [1, 2, 3, 4])
  with metrics.MetricsWriter(tmp_path, tensorboard=False, resume_step=2) as writer:
    writer.write(3, {"x": 30.0})
  records = metrics.read_metrics(tmp_path)
  assert [(r["step"], r["x"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_read_metrics_names_the_bad_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{oops\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
    metrics.read_metrics(path)
  path.write_text('{"step": 1}\n{"x": 1}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: .*integer 'step'"):
    metrics.read_metrics(path)
  # A complete last line that only lacks its newline is kept.
  path.write_text('{"step": 1}\n{"step": 2}')
  assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]


def _synthetic_run(path, steps=40, clusters=("add_1", "add_2")):
  """A metrics.jsonl as an EBPO run with kl_coef=0 writes it: train lines, eval every 10 steps."""
  rng = np.random.default_rng(0)
  with metrics.MetricsWriter(path, tensorboard=False) as writer:
    for step in range(1, steps + 1):
      line = {
        "reward/mean": step / steps + rng.normal(0, 0.05),
        "entropy": 1.0 / step,
        "kl": 0.0,  # no KL term: a flat panel, skipped
        "adv/all_equal_frac": 0.6 - step / 200,
        "adv/zero_frac": 0.0,  # EBPO: flat, but its panel's other series is not
        "ebpo/shrinkage_mean": 0.5 + rng.normal(0, 0.05),
        "grad_norm": float("nan") if step == 3 else 1.0 + step,
        "reward/errors": 0.0,  # flat
        "time/step_s": 2.0,  # flat, but the panel's other series are not
        "time/sample_s": 1.0 + step / 100,
        "time/update_s": 1.0,
      }
      for k, name in enumerate(clusters):
        line[f"reward/mean/{name}"] = (k + 1) * step / (2 * steps)
        line[f"ebpo/prior_mean/{name}"] = 0.2 * (k + 1) + step / 400
        line[f"ebpo/prior_std/{name}"] = 0.1 / (k + 1)
        line[f"ebpo/shrinkage/{name}"] = 0.4 + 0.2 * k
      writer.write(step, line)
      if step % 10 == 0:
        accuracy = {
          f"eval/accuracy/{name}": step / 100 * (k + 1) for k, name in enumerate(clusters)
        }
        writer.write(step, {"eval/accuracy": step / 80, **accuracy})


def test_plot_metrics_writes_pngs_and_skips_absent_keys_and_flat_panels(tmp_path):
  _synthetic_run(tmp_path)
  paths = metrics.plot_metrics(tmp_path)
  names = [os.path.basename(p) for p in paths]
  assert names == [
    "overview.png",
    "reward.png",
    "accuracy.png",
    "zero_signal.png",
    "ebpo_prior_mean.png",
    "ebpo_shrinkage.png",
    "entropy.png",
    "grad_norm.png",
    "step_time.png",
  ]  # no kl.png (kl_coef=0), reward_errors.png, clipfrac.png (absent)
  for path in paths:
    assert os.path.dirname(path) == str(tmp_path / "plots")
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 1000
  # Asked for by name, a flat key is drawn.
  chosen = metrics.plot_metrics(tmp_path, keys=["kl", "eval/accuracy/", "missing"])
  assert sorted(os.path.basename(p) for p in chosen) == ["eval_accuracy.png", "kl.png"]


def _axes_of(panel_name, records):
  """The drawn axes of a default panel: (lines, collections) as draw_panel leaves them."""
  from matplotlib.figure import Figure

  panel = next(p for p in metrics.DEFAULT_PANELS if p.name == panel_name)
  available = sorted({k for r in records for k in r if k != "step"})
  lines, bands = metrics.plots._panel_series(panel, records, available)
  ax = Figure().add_subplot()
  metrics.plots.draw_panel(ax, panel, lines, bands, metrics.plots.cluster_colors(available))
  return ax


def test_panels_label_y_band_the_prior_and_call_s_the_weight_on_the_prior(tmp_path):
  _synthetic_run(tmp_path)
  records = metrics.read_metrics(tmp_path)
  for panel in metrics.DEFAULT_PANELS:
    assert panel.ylabel and panel.title, panel.name
  ax = _axes_of("ebpo_prior_mean", records)
  assert ax.get_ylabel().startswith("prior mean")
  assert len(ax.collections) == 2  # one shaded band per cluster
  # The std keys are bands, not lines of their own.
  assert {line.get_label() for line in ax.get_lines()} >= {"add_1", "add_2"}
  assert not any("prior_std" in str(line.get_label()) for line in ax.get_lines())
  # The band is mean ± std: 0.2 ± 0.1 and 0.4 ± 0.1 (3 points: drawn raw, not smoothed).
  from matplotlib.figure import Figure

  ax = Figure().add_subplot()
  key = "ebpo/prior_mean/a"
  lines = {key: (np.array([1.0, 2.0, 3.0]), np.array([0.2, 0.3, 0.4]))}
  bands = {key: (np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.1, 0.1]))}
  panel = next(p for p in metrics.DEFAULT_PANELS if p.name == "ebpo_prior_mean")
  metrics.plots.draw_panel(ax, panel, lines, bands, {"a": "red"})
  (band,) = ax.collections
  y = band.get_paths()[0].vertices[:, 1]
  assert (y.min(), y.max()) == pytest.approx((0.1, 0.5))
  ax = _axes_of("ebpo_shrinkage", records)
  assert ax.get_ylabel() == "S: weight on the prior mean"  # EBPO.md: V = (1-S) mean + S mu_glob
  assert ax.get_ylim() == pytest.approx((-0.03, 1.03))
  labels = {line.get_label() for line in ax.get_lines()}
  assert {"add_1", "add_2", "batch mean"} <= labels
  ax = _axes_of("zero_signal", records)
  assert {"all rewards equal (GRPO gives 0)", "advantage exactly 0 (this run)"} <= {
    line.get_label() for line in ax.get_lines()
  }


def test_smoothing_draws_raw_faint_and_handles_short_and_null_series(tmp_path):
  assert metrics.plots.smooth([1.0, 2.0]) is None  # too short: drawn raw
  values = np.r_[np.zeros(20), np.ones(20)]
  smoothed = metrics.plots.smooth(values)
  # Centred, so the step stays at step 20 (an EMA would still be far below 1 at step 22).
  assert smoothed[:18].max() == 0.0 and smoothed[22:].min() == 1.0
  assert smoothed[19] == pytest.approx(0.4) and smoothed[20] == pytest.approx(0.6)
  # 40 steps: every series with 10+ points gets a faint raw line and a solid smoothed one.
  _synthetic_run(tmp_path)
  ax = _axes_of("reward", metrics.read_metrics(tmp_path))
  alphas = sorted(line.get_alpha() or 1.0 for line in ax.get_lines())
  assert alphas == [0.35, 0.35, 0.35, 1.0, 1.0, 1.0]
  # One and two points, nulls, a NaN written as null and a cluster logged only once: no crash.
  short = tmp_path / "short"
  with metrics.MetricsWriter(short, tensorboard=False) as writer:
    writer.write(1, {"reward/mean": 0.1, "ebpo/prior_mean/a": 0.2})
    writer.write(2, {"reward/mean": float("nan"), "reward/mean/a": 0.3, "ebpo/prior_mean/a": 0.4})
  with open(short / "metrics.jsonl", "a") as f:
    line = {"step": 3, "reward/mean": None, "reward/mean/b": 0.5, "ebpo/prior_std/a": None}
    f.write(json.dumps(line) + "\n")
  names = [os.path.basename(p) for p in metrics.plot_metrics(short)]
  assert names == ["overview.png", "ebpo_prior_mean.png"]  # reward/mean: one finite point, flat


def test_overview_of_a_grpo_run_has_no_ebpo_panels_and_many_clusters_fit(tmp_path):
  clusters = tuple(f"topic_{i}" for i in range(14))
  _synthetic_run(tmp_path, steps=20, clusters=clusters)
  records = [
    {k: v for k, v in r.items() if not k.startswith("ebpo/")}
    for r in metrics.read_metrics(tmp_path)
  ]
  fig = metrics.overview_figure(records)
  titles = [ax.get_title() for ax in fig.axes]
  assert titles == [
    "Training reward",
    "Held-out accuracy",
    "Groups without signal",
    "Policy entropy",
  ]
  assert all(ax.get_ylabel() for ax in fig.axes)
  # One figure legend for the clusters (14 of them + all), not one per panel.
  assert [len(legend.get_texts()) for legend in fig.legends] == [15]
  assert metrics.overview_figure([{"step": 1, "kl": 0.0}]) is None


def test_an_asynchronous_run_gets_the_pipeline_panel_and_a_synchronous_one_does_not(tmp_path):
  _synthetic_run(tmp_path, steps=20)
  records = metrics.read_metrics(tmp_path)
  waits = (metrics.ASYNC_TRAINER_WAIT_S, metrics.ASYNC_ROLLOUT_WAIT_S, metrics.ASYNC_TRANSFER_S)
  stale = [
    {**r, **{k: 0.01 * (i % 3 + j) for j, k in enumerate(waits)}} for i, r in enumerate(records)
  ]
  titles = lambda recs: [ax.get_title() for ax in metrics.overview_figure(recs).axes]
  assert "Asynchronous pipeline: who waits" not in titles(records)
  assert titles(stale)[-1] == "Asynchronous pipeline: who waits"


# ----------------------------------------------------------------------------- metric names


def test_metric_names_are_the_logged_contracts():
  # DESIGN.md's contracts and the names in every metrics.jsonl so far: a rename breaks readers.
  contracts = {
    "REWARD_MEAN": "reward/mean",
    "ADV_ZERO_FRAC": "adv/zero_frac",
    "EBPO_SHRINKAGE_MEAN": "ebpo/shrinkage_mean",
    "ENTROPY": "entropy",
    "KL": "kl",
    "LOSS": "loss",
    "GRAD_NORM": "grad_norm",
    "EVAL_ACCURACY": "eval/accuracy",
  }
  assert {name: getattr(metrics, name) for name in contracts} == contracts
  timing = ("time/step_s", "time/tokens_per_s", "time/sample_s", "time/update_s", "time/elapsed_s")
  timing += ("env/time_s", "async/trainer_wait_s", "async/rollout_wait_s", "async/transfer_s")
  assert timing == metrics.TIMING_KEYS
  assert metrics.STEP == "step" and metrics.STEP not in metrics.KEYS
  assert set(metrics.TIMING_KEYS) | set(metrics.PER_CLUSTER_KEYS) <= metrics.KEYS
  constants = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)}
  files_and_dirs = {metrics.METRICS_FILE, metrics.TENSORBOARD_DIR, metrics.PLOTS_DIR, metrics.STEP}
  files_and_dirs |= {metrics.SAMPLES_FILE, metrics.WANDB_RUN_ID_FILE}
  assert constants - files_and_dirs == metrics.KEYS  # KEYS lists every name, and only names


def test_per_cluster_is_the_one_rule_for_cluster_keys():
  assert metrics.per_cluster(metrics.REWARD_MEAN, "add_2d") == "reward/mean/add_2d"
  assert metrics.per_cluster(metrics.EVAL_ACCURACY, "mul") == "eval/accuracy/mul"
  assert metrics.per_cluster(metrics.EBPO_PRIOR_MEAN, "topic_0") == "ebpo/prior_mean/topic_0"
  key = metrics.per_cluster(metrics.EVAL_ACCURACY, "mul")
  assert key.startswith(metrics.cluster_prefix(metrics.EVAL_ACCURACY))
  # A per-cluster key never equals an overall one (the drift this rule replaced: reward/<cluster>).
  for base in metrics.PER_CLUSTER_KEYS:
    assert metrics.per_cluster(base, "mean") not in metrics.KEYS


def test_every_default_panel_pattern_is_a_metric_name_or_a_per_cluster_prefix():
  prefixes = {metrics.cluster_prefix(k) for k in metrics.PER_CLUSTER_KEYS}
  patterns = [p for panel in metrics.DEFAULT_PANELS for p in panel.patterns + panel.optional]
  assert [p for p in patterns if p not in metrics.KEYS | prefixes] == []
  names = [panel.name for panel in metrics.DEFAULT_PANELS]
  assert len(names) == len(set(names)) and "overview" not in names  # one PNG per panel
  assert set(metrics.plots.OVERVIEW) <= set(names)


def test_policy_loss_metrics_are_named_here():
  logps = jnp.log(jnp.full((2, 3), 0.5))
  _, aux = losses.policy_loss(
    logps,
    logps - 0.1,
    jnp.array([1.0, -1.0]),
    jnp.ones((2, 3), bool),
    ref_logps_bt=logps + 0.1,
    options=losses.LossOptions(kl_coef=0.1, entropy_coef=0.01),
    entropy_bt=jnp.ones((2, 3)),
  )
  assert set(aux) <= metrics.KEYS, sorted(set(aux) - metrics.KEYS)


def test_missing_panels_names_each_pattern_that_matches_no_logged_key():
  full = {metrics.STEP: 1, **dict.fromkeys(metrics.KEYS, 0.0)}
  for base in metrics.PER_CLUSTER_KEYS:
    full[metrics.per_cluster(base, "add")] = 0.0
  assert metrics.missing_panels([full]) == []
  # What the trainer logged before the panels were built from the names.
  old = [
    {"step": 1, "reward/mean": 0.1, "reward/add": 0.2, "tokens_per_sec": 9.0, "time/step_s": 1.0},
    {"step": 2, "eval/accuracy": 0.5, "eval/accuracy/add": 0.5},
  ]
  missing = metrics.missing_panels(old)
  assert "reward: reward/mean/" in missing
  assert "tokens_per_sec: time/tokens_per_s" in missing
  assert not any(m.startswith(("accuracy:", "step_time: time/step_s")) for m in missing)
  assert "step_time: time/sample_s" in missing


def test_summary_table_layout():
  table = metrics.summary_table(
    {"add_1d": {"accuracy": 0.9, "n": 64}, "mul_2digit": {"accuracy": 0.125}},
  )
  assert table.splitlines() == [
    "cluster     accuracy   n",
    "----------  --------  --",
    "add_1d         0.900  64",
    "mul_2digit     0.125   -",
  ]


def test_the_end_of_run_table_gives_each_accuracy_its_standard_error():
  # add_2: 0.25 -> 0.5 on n = 16 prompts: se sqrt(0.25 * 0.75 / 16) = 0.108, then sqrt(0.25 / 16)
  # = 0.125.
  first = {
    "step": 0,
    "eval/accuracy": 0.5,
    "eval/accuracy/add_1": 0.75,
    "eval/accuracy/add_2": 0.25,
  }
  last = {"step": 9, "eval/accuracy": 0.75, "eval/accuracy/add_1": 1.0, "eval/accuracy/add_2": 0.5}
  table = metrics.accuracy_table(first, last, {"add_1": 16, "add_2": 16})
  assert table.splitlines() == [
    "cluster  before  se before  after  se after   n",
    "-------  ------  ---------  -----  --------  --",
    "add_1     0.750      0.108  1.000     0.000  16",
    "add_2     0.250      0.108  0.500     0.125  16",
    "all       0.500      0.088  0.750     0.077  32",
  ]
