"""Small file-level promises: JSONL our writers produce reads back in `data.prepare` (U+2028 in a
string is not a line break there), every file we write has the usual mode (0666 less the umask)
and no writer changes the process umask (other threads would create files under umask 0 for that
moment), and a resume restores without orbax's "could not be restored" warnings."""

import json
import logging
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import checkpoint, files
from ebpo_jax.data import load_rows_and_clusters, prepare
from ebpo_jax.models import hf_io


def test_prepare_reads_jsonl_holding_line_separators(tmp_path):
  """U+2028 and U+2029 are line breaks to str.splitlines, not to JSON Lines: a prompt holding one
  (as prepare itself writes it, ensure_ascii=False) was cut into two malformed lines."""
  records = [
    {"problem": "a\u2028b", "answer": "1", "unique_id": "u0", "subject": "Algebra", "level": 1},
    {"problem": "c\u2029d", "answer": "2", "unique_id": "u1", "subject": "Algebra", "level": 2},
  ]
  source = tmp_path / "math500.jsonl"
  source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
  out = tmp_path / "out.jsonl"
  prepare.prepare("math500", str(source), str(out))
  again = tmp_path / "again.jsonl"
  prepare.prepare("math500", str(out), str(again))  # its own output, read back by itself
  rows, _ = load_rows_and_clusters(again)
  assert [row["prompt"] for row in rows] == ["a\u2028b", "c\u2029d"]


@pytest.fixture
def no_umask_changes(monkeypatch):
  """os.umask fails the test if called: reading it by setting it is a race with other threads."""

  def forbidden(mask):
    raise AssertionError(f"os.umask({mask:o}) called")

  monkeypatch.setattr(os, "umask", forbidden)


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def test_default_file_mode_is_read_without_changing_the_umask(no_umask_changes, tmp_path):
  (tmp_path / "plain").write_bytes(b"x")  # open() applies the umask: the reference mode
  assert files.default_file_mode() == _mode(tmp_path / "plain")


def test_safetensors_export_has_the_usual_mode(no_umask_changes, tmp_path):
  (tmp_path / "plain").write_bytes(b"x")
  path = tmp_path / "model.safetensors"
  hf_io.save_readable({"w": np.zeros(3, np.float32)}, str(path), {"format": "np"})
  assert _mode(path) == _mode(tmp_path / "plain")


def test_mirrored_remote_file_has_the_usual_mode(gcs_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("EBPO_JAX_CACHE", str(tmp_path / "cache"))
  (tmp_path / "plain").write_bytes(b"x")
  remote = files.join(gcs_dir, "rows.jsonl")
  files.write_atomic(remote, b'{"prompt": "1+1=", "answer": "2"}\n')
  local = files.local_copy(remote)
  assert _mode(local) == _mode(tmp_path / "plain")


def test_restore_logs_no_could_not_be_restored_warning(tmp_path):
  """Each resume logged six orbax warnings ("Item 'state' was found in the checkpoint, but could
  not be restored"), from asking orbax which items a checkpoint holds."""
  state = {"w": jnp.arange(4.0), "step": jnp.zeros((), jnp.int32)}
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
    ckpt.save(0, state, config={"seed": 0}, force=True)
  records = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  logging.getLogger("absl").addHandler(handler)
  try:
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as ckpt:
      restored, saved_config = ckpt.restore(0, abstract)
  finally:
    logging.getLogger("absl").removeHandler(handler)
  assert restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and saved_config == {"seed": 0}
  assert not [r.getMessage() for r in records], [r.getMessage() for r in records]
