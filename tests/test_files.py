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


def test_remote_paths_are_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="gs://bucket/x.json: atomic writes are for local paths"):
    files.write_atomic("gs://bucket/x.json", "x")
  assert os.listdir(tmp_path) == []
