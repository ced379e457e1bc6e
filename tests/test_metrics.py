"""Tests for ebpo_jax.metrics: JSONL format, TensorBoard events, truncation, plots, table."""

import glob
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from ebpo_jax import metrics


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


def test_plot_metrics_writes_pngs_and_skips_absent_keys(tmp_path):
  with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(1, 6):
      writer.write(
        step,
        {
          "reward/mean": step / 10,
          "entropy": 1.0 / step,
          "kl": 0.01 * step,
          "adv/zero_frac": 0.5,
          "ebpo/shrinkage_mean": 0.3,
          "grad_norm": float("nan") if step == 3 else 1.0,
        },
      )
      if step % 2 == 0:
        writer.write(
          step, {"eval/accuracy": 0.5, "eval/accuracy/add": 0.6, "eval/accuracy/mul": 0.4}
        )
  paths = metrics.plot_metrics(tmp_path)
  names = sorted(os.path.basename(p) for p in paths)
  assert names == [
    "accuracy.png",
    "adv_zero_frac.png",
    "ebpo_shrinkage.png",
    "entropy.png",
    "grad_norm.png",
    "kl.png",
    "reward.png",
  ]
  for path in paths:
    assert os.path.dirname(path) == str(tmp_path / "plots")
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 1000
  chosen = metrics.plot_metrics(tmp_path, keys=["kl", "eval/accuracy/", "missing"])
  assert sorted(os.path.basename(p) for p in chosen) == ["eval_accuracy.png", "kl.png"]


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


def test_progress_bar_shows_postfix_and_is_silent_when_disabled(capsys):
  bar = metrics.progress_bar(10, initial=3)
  bar.set_postfix(reward=0.5)
  bar.update()
  bar.close()
  assert bar.n == 4
  err = capsys.readouterr().err
  assert "4/10" in err and "reward=0.5" in err
  quiet = metrics.progress_bar(10, enabled=False)
  quiet.update()
  quiet.close()
  assert capsys.readouterr().err == ""
