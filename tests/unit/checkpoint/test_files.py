"""Tests for ebpo_jax.files: the content, no temporary file left, the old file kept on failure."""

import os

import pytest

from ebpo_jax import files


def test_write_atomic_text_and_bytes_create_parents_and_leave_no_temporary(tmp_path):
  path = tmp_path / "a" / "b" / "out.json"
  files.write_atomic(path, "héllo\n")
  assert path.read_bytes() == "héllo\n".encode()
  files.write_atomic(str(path), b"\x00\xffbytes")
  assert path.read_bytes() == b"\x00\xffbytes"
  assert os.listdir(path.parent) == ["out.json"]


def test_write_atomic_relative_path(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  files.write_atomic("plain.txt", "x")
  assert (tmp_path / "plain.txt").read_text() == "x"
  assert os.listdir(tmp_path) == ["plain.txt"]


def test_write_lines_adds_one_newline_per_line(tmp_path):
  path = tmp_path / "rows.jsonl"
  files.write_lines(path, (f'{{"i": {i}}}' for i in range(3)))
  assert path.read_text() == '{"i": 0}\n{"i": 1}\n{"i": 2}\n'
  files.write_lines(path, [])
  assert path.read_text() == ""


def test_a_failure_mid_write_keeps_the_old_file(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text("old\n")

  def lines():
    yield "new 1"
    raise RuntimeError("row 2 is bad")

  with pytest.raises(RuntimeError, match="row 2 is bad"):
    files.write_lines(path, lines())
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["rows.jsonl"]
  with pytest.raises(TypeError):
    files.write_atomic(path, 3)  # neither str nor bytes: fails inside the write
  assert path.read_text() == "old\n"
  assert os.listdir(tmp_path) == ["rows.jsonl"]


def test_a_failed_rename_keeps_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "out.txt"
  path.write_text("old")

  def refuse(src, dst):
    raise OSError("disk gone")

  monkeypatch.setattr(os, "replace", refuse)
  with pytest.raises(OSError, match="disk gone"):
    files.write_atomic(path, "new")
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["out.txt"]


def test_the_temporary_file_is_in_the_same_directory_and_named_with_the_pid(tmp_path, monkeypatch):
  seen = []
  real_replace = os.replace
  monkeypatch.setattr(os, "replace", lambda src, dst: (seen.append(src), real_replace(src, dst)))
  files.write_atomic(tmp_path / "out.txt", "x")
  assert seen == [os.path.join(str(tmp_path), f".out.txt.{os.getpid()}.tmp")]


def test_a_bucket_round_trip(gcs_dir, tmp_path):
  """Against the storage emulator: atomic writes, reads, listing, appending, copying, mirroring."""
  target = files.join(gcs_dir, "sub", "out.json")
  assert target == f"{gcs_dir}/sub/out.json"
  assert not files.exists(target)
  files.write_atomic(target, "héllo\n")
  assert files.read_text(target) == "héllo\n"
  assert files.isfile(target) and files.isdir(files.join(gcs_dir, "sub"))
  files.write_lines(files.join(gcs_dir, "rows.jsonl"), (f"{i}" for i in range(3)))
  assert files.listdir(gcs_dir) == ["rows.jsonl", "sub"]
  with files.open_file(files.join(gcs_dir, "rows.jsonl")) as f:
    assert f.read().split() == ["0", "1", "2"]

  def failing():
    yield "new"
    raise RuntimeError("row 2 is bad")

  with pytest.raises(RuntimeError, match="row 2 is bad"):
    files.write_lines(target, failing())
  assert files.read_text(target) == "héllo\n"  # nothing uploaded

  log = files.join(gcs_dir, "log.txt")
  appender = files.Appender(log)
  appender.write("a\n")
  appender.flush()
  appender.write("b\n")
  appender.close()
  reopened = files.Appender(log)  # a resumed writer keeps what is there
  reopened.write("c\n")
  reopened.close()
  assert files.read_text(log) == "a\nb\nc\n"

  files.copy_file(target, tmp_path / "copy.json")
  assert (tmp_path / "copy.json").read_text() == "héllo\n"
  mirror = files.local_copy(files.join(gcs_dir, "sub"))
  assert os.listdir(mirror) == ["out.json"]
  files.write_atomic(target, "changed")
  mirror = files.local_copy(files.join(gcs_dir, "sub"))
  assert files.read_text(os.path.join(mirror, "out.json")) == "changed"
  files.remove_tree(files.join(gcs_dir, "sub"))
  assert not files.exists(target)


def test_local_paths_pass_through_unchanged(tmp_path):
  assert files.local_copy(tmp_path) == str(tmp_path)
  assert not files.is_remote(tmp_path) and files.is_remote("gs://b/x")
  with pytest.raises(ValueError, match="reads only"):
    files.open_file(tmp_path / "x", "w")


def test_walk_files_and_staged_dir_locally(tmp_path):
  with files.staged_dir(tmp_path / "out") as staging:
    assert staging == str(tmp_path / "out")
    for name in ("a-b/x", "a/y", "a/x", "top"):
      files.write_atomic(os.path.join(staging, name), name)
  assert files.walk_files(tmp_path / "out") == ["a/x", "a/y", "a-b/x", "top"]


def test_staged_dir_uploads_on_success_only_and_local_copy_excludes(gcs_dir):
  with files.staged_dir(gcs_dir) as staging:
    files.write_atomic(os.path.join(staging, "sub", "w.safetensors"), b"weights")
    files.write_atomic(os.path.join(staging, "config.json"), "{}")
  assert files.walk_files(gcs_dir) == ["config.json", "sub/w.safetensors"]
  assert not os.path.exists(staging)
  with pytest.raises(RuntimeError, match="stop"), files.staged_dir(files.join(gcs_dir, "no")) as s:
    files.write_atomic(os.path.join(s, "config.json"), "{}")
    raise RuntimeError("stop")
  assert not files.exists(files.join(gcs_dir, "no", "config.json"))
  mirror = files.local_copy(gcs_dir, exclude=["*.safetensors"])
  assert files.walk_files(mirror) == ["config.json"]


@pytest.mark.parametrize("remote", [False, True])
def test_move_tree_moves_a_directory_whole(tmp_path, request, remote):
  base = request.getfixturevalue("gcs_dir") if remote else str(tmp_path)
  source, target = files.join(base, "ckpt", "2"), files.join(base, "aside", "2")
  files.write_atomic(files.join(source, "state", "data"), b"\x00\x01")
  files.write_atomic(files.join(source, "config.json"), "{}")
  files.move_tree(source, target)
  assert not files.exists(source)
  assert files.walk_files(target) == ["config.json", "state/data"]
  assert files.read_bytes(files.join(target, "state", "data")) == b"\x00\x01"
