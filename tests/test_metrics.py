"""Tests for ebpo_jax.metrics: metric names, JSONL format, TensorBoard events, truncation, plots,
table."""

import glob
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from ebpo_jax import losses, metrics


def _read_tb_scalars(logdir):
  """{(tag, step): value} from tensorboardX event files (TFRecord framing, read by hand)."""
  scalars = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
      pos += 12 + length + 4
      for value in event.summary.value:
        scalars[(value.tag, event.step)] = value.simple_value
  return scalars


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
  scalars = _read_tb_scalars(tmp_path / "tensorboard")
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


def test_plot_metrics_writes_pngs_and_skips_absent_keys_and_flat_panels(tmp_path):
  with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(1, 6):
      writer.write(
        step,
        {
          "reward/mean": step / 10,
          "reward/mean/add": step / 20,
          "entropy": 1.0 / step,
          "kl": 0.0,  # flat (no KL term): its panel is skipped
          "adv/zero_frac": 0.5 + step / 100,
          "ebpo/shrinkage_mean": 0.3,  # flat
          "grad_norm": float("nan") if step == 3 else 1.0 + step,
          "reward/errors": 0.0,  # flat
          "time/step_s": 2.0,  # flat, but the panel's other series are not
          "time/sample_s": 1.0 + step / 100,
          "time/update_s": 1.0,
        },
      )
      if step % 2 == 0:
        writer.write(
          step, {"eval/accuracy": 0.5, "eval/accuracy/add": step / 10, "eval/accuracy/mul": 0.4}
        )
  paths = metrics.plot_metrics(tmp_path)
  names = sorted(os.path.basename(p) for p in paths)
  assert names == [
    "accuracy.png",
    "adv_zero_frac.png",
    "entropy.png",
    "grad_norm.png",
    "reward.png",
    "step_time.png",
  ]
  for path in paths:
    assert os.path.dirname(path) == str(tmp_path / "plots")
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 1000
  # Asked for by name, a flat key is drawn.
  chosen = metrics.plot_metrics(tmp_path, keys=["kl", "eval/accuracy/", "missing"])
  assert sorted(os.path.basename(p) for p in chosen) == ["eval_accuracy.png", "kl.png"]


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
  timing = ("time/step_s", "time/tokens_per_s", "time/sample_s", "time/update_s")
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
  patterns = [p for _, panel in metrics.DEFAULT_PANELS for p in panel]
  assert [p for p in patterns if p not in metrics.KEYS | prefixes] == []
  names = [name for name, _ in metrics.DEFAULT_PANELS]
  assert len(names) == len(set(names))  # one PNG per panel


def test_policy_loss_metrics_are_named_here():
  logps = jnp.log(jnp.full((2, 3), 0.5))
  _, aux = losses.policy_loss(
    logps,
    logps - 0.1,
    jnp.array([1.0, -1.0]),
    jnp.ones((2, 3), bool),
    ref_logps_bt=logps + 0.1,
    kl_coef=0.1,
    entropy_bt=jnp.ones((2, 3)),
    entropy_coef=0.01,
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
