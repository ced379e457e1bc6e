"""WORKDIR/metrics.jsonl and TensorBoard events: writing (MetricsWriter), reading, truncating."""

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ebpo_jax import files
from ebpo_jax.metrics.names import METRICS_FILE, REMOTE_FLUSH_S, STEP, TENSORBOARD_DIR


class MetricsWriter:
  """Appends metrics to WORKDIR/metrics.jsonl and to TensorBoard (WORKDIR/tensorboard/).

  `enabled=False` (processes other than 0) makes every method a no-op that touches no file.
  `resume_step`: when resuming from a checkpoint at that step, lines (and TensorBoard events)
  with a larger step, written after the checkpoint by the run that died, are dropped first;
  FRESH_START (a run that restored nothing) drops them all. None: appends to what is there.
  `flush_every_s`: `write` flushes when this long has passed since the last flush; default 0
  (every line) for a local WORKDIR, REMOTE_FLUSH_S for a remote one. `flush` and `close` always do.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    enabled: bool = True,
    tensorboard: bool = True,
    resume_step: int | None = None,
    flush_every_s: float | None = None,
  ):
    self.enabled = enabled
    self.path = files.join(workdir, METRICS_FILE)
    if flush_every_s is None:
      flush_every_s = REMOTE_FLUSH_S if files.is_remote(workdir) else 0.0
    self.flush_every_s = flush_every_s
    self._file = None
    self._tb = None
    if not enabled:
      return
    files.makedirs(workdir)
    if resume_step is not None:
      truncate_after(workdir, resume_step)
    self._file = files.Appender(self.path)
    if tensorboard:
      purge_step = None if resume_step is None else resume_step + 1
      self._tb = _summary_writer(files.join(workdir, TENSORBOARD_DIR), purge_step)
    self._flushed_at = time.monotonic()

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Writes one line {"step": step, **metrics}; values are scalars (Python, NumPy or JAX)."""
    if not self.enabled:
      return
    if self._file is None:
      raise ValueError(f"MetricsWriter for {self.path} is closed")
    values = _to_floats(metrics)
    record = {STEP: int(step)}
    record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    if self._tb is not None:
      for key, value in values.items():
        if math.isfinite(value):  # TensorBoard shows a gap; tensorboardX would warn per value
          self._tb.add_scalar(key, value, global_step=int(step))
    if time.monotonic() - self._flushed_at >= self.flush_every_s:
      self.flush()

  def flush(self) -> None:
    """Makes every line written so far durable (remote: uploads metrics.jsonl and the events)."""
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()
    self._flushed_at = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _summary_writer(logdir: str, purge_step: int | None):
  """A tensorboardX SummaryWriter on `logdir`; a remote logdir's event file goes through
  `ebpo_jax.files` (`_RemoteEventFile`). `purge_step`: TensorBoard drops the events of earlier
  files from that step on (the steps a resumed run writes again)."""
  from tensorboardX import SummaryWriter, record_writer

  if files.is_remote(logdir):
    scheme = logdir.split("://", 1)[0]
    record_writer.register_writer_factory(scheme, _RemoteEventFileFactory())
  return SummaryWriter(logdir, purge_step=purge_step)


class _RemoteEventFile:
  """One TensorBoard event file on an object store: the records are kept in memory and the whole
  file is uploaded (`files.write_atomic`) on a flush that has something new. tensorboardX's own
  gs:// writer uploads once more from `__del__` after `close`, at interpreter exit; with the store
  gone by then it retries for minutes."""

  def __init__(self, path: str):
    self._path = path
    self._data = bytearray()
    self._uploaded = -1  # bytes in the last upload

  def write(self, data: bytes) -> None:
    self._data += data

  def flush(self) -> None:
    if len(self._data) != self._uploaded:
      files.write_atomic(self._path, bytes(self._data))
      self._uploaded = len(self._data)

  def close(self) -> None:
    self.flush()


class _RemoteEventFileFactory:
  """tensorboardX's writer factory (`record_writer.register_writer_factory`) for one scheme."""

  def open(self, path: str) -> _RemoteEventFile:
    return _RemoteEventFile(path)

  def directory_check(self, path: str) -> None:
    del path  # an object store has no directories to create


def _to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Python floats from scalars; one device-to-host transfer for all JAX values."""
  if STEP in metrics:
    raise ValueError("metrics must not contain the key 'step' (it is the write() argument)")
  keys = list(metrics)
  host = jax.device_get([metrics[k] for k in keys])  # a list keeps the caller's key order
  values = {}
  for key, value in zip(keys, host, strict=True):
    array = np.asarray(value)
    if array.size != 1 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
      raise ValueError(f"metric {key!r} must be a numeric scalar, got {value!r}")
    values[str(key)] = float(array.reshape(()))
  return values


def _metrics_path(path: str | os.PathLike) -> str:
  path = os.fspath(path)
  return files.join(path, METRICS_FILE) if files.isdir(path) else path


def _parse_lines(path: str, text: str) -> list[tuple[str, dict[str, Any]]]:
  """(raw line, record) pairs of the content `text` of file `path`. A last line without newline
  that is not valid JSON (a process died mid-write) is dropped; any other bad line raises naming
  FILE:LINE."""
  lines = text.split("\n")
  parsed = []
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if lineno == len(lines):
        break
      raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(STEP), int):
      raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step'")
    parsed.append((line, record))
  return parsed


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file (or of WORKDIR/metrics.jsonl given WORKDIR)."""
  path = _metrics_path(path)
  return [record for _, record in _parse_lines(path, files.read_text(path))]


def truncate_after(workdir: str | os.PathLike, step: int) -> int:
  """Drops the lines with "step" > `step` (and a partial last line) from WORKDIR/metrics.jsonl,
  atomically; returns how many lines were dropped. Call when resuming from checkpoint `step`."""
  path = _metrics_path(workdir)
  if not files.exists(path):
    return 0
  text = files.read_text(path)
  total = sum(1 for line in text.split("\n") if line.strip())
  kept = [line for line, record in _parse_lines(path, text) if record[STEP] <= step]
  files.write_lines(path, kept)
  return total - len(kept)
