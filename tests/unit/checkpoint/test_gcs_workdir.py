"""A gs:// workdir against the storage emulator (conftest's `gcs_emulator`, `gcs_dir`), nothing
mocked, in process: a remote path kept whole, metrics.jsonl and its flush policy, a missing
checkpoint directory named (every output of processes and runs: e2e/test_gcs_workdir.py)."""

import pytest

from ebpo_jax import checkpoint, files
from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.runs import PNG

# ----------------------------------------------------------------------------- in process


def test_abspath_keeps_a_remote_path_whole(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert files.abspath("gs://bucket/run") == "gs://bucket/run"
  assert files.abspath("run") == str(tmp_path / "run")


def test_metrics_writer_on_a_bucket_flushes_by_time_and_resumes(gcs_dir):
  path = files.join(gcs_dir, metrics_lib.METRICS_FILE)
  with metrics_lib.MetricsWriter(gcs_dir, flush_every_s=3600) as writer:
    writer.write(1, {"loss": 1.0})
    assert not files.isdir(gcs_dir)  # not due yet: neither metrics.jsonl nor events uploaded
    writer.flush()
    assert files.listdir(gcs_dir) == ["metrics.jsonl", "tensorboard"]
    writer.write(2, {"loss": 2.0})
    writer.write_samples(2, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    assert [r["step"] for r in metrics_lib.read_metrics(path)] == [1]
  assert [r["step"] for r in metrics_lib.read_metrics(gcs_dir)] == [1, 2]  # close uploads
  samples = files.join(gcs_dir, metrics_lib.SAMPLES_FILE)
  assert [r["completion"] for r in metrics_lib.read_metrics(samples)] == ["2"]
  assert metrics_lib.MetricsWriter(gcs_dir, enabled=False).flush_every_s == (
    metrics_lib.REMOTE_FLUSH_S
  )
  with metrics_lib.MetricsWriter(gcs_dir, tensorboard=False, resume_step=1) as writer:
    writer.write(2, {"loss": 20.0})
  records = metrics_lib.read_metrics(gcs_dir)
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 20.0)]
  assert metrics_lib.read_metrics(samples) == []  # the samples of step 2 went with its lines
  assert metrics_lib.truncate_after(files.join(gcs_dir, "missing"), 1) == 0
  plots = metrics_lib.plot_metrics(gcs_dir, keys=["loss"])
  assert plots == [files.join(gcs_dir, "plots", "loss.png")]
  assert files.read_bytes(plots[0]).startswith(PNG)
  assert not (ROOT / "gs:").exists()


def test_a_missing_checkpoint_directory_on_a_bucket_names_it(gcs_dir):
  missing = files.join(gcs_dir, "checkpoints")
  with pytest.raises(FileNotFoundError, match=f"^{missing}: no such checkpoint directory"):
    checkpoint.Checkpointer(missing, read_only=True)
