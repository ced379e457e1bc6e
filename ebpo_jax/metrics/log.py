"""WORKDIR/metrics.jsonl, samples.jsonl, TensorBoard events and wandb: writing (MetricsWriter),
reading, truncating."""

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ebpo_jax import files
from ebpo_jax.metrics import wandb_log
from ebpo_jax.metrics.names import (
  EVAL_ACCURACY,
  METRICS_FILE,
  REMOTE_FLUSH_S,
  REWARD_MEAN,
  SAMPLES_FILE,
  STEP,
  TENSORBOARD_DIR,
)


class MetricsWriter:
  """Appends metrics to WORKDIR/metrics.jsonl, TensorBoard (WORKDIR/tensorboard/) and wandb, and
  tables of sample completions to WORKDIR/samples.jsonl, TensorBoard text and a wandb Table.

  `enabled=False` (processes other than 0) makes every method a no-op that touches no file.
  `resume_step`: when resuming from a checkpoint at that step, lines of metrics.jsonl and
  samples.jsonl (and TensorBoard events) with a larger step, written after the checkpoint by the
  run that died, are dropped first; FRESH_START (a run that restored nothing) drops them all.
  None: appends to what is there. `hparams`: the run's resolved config (nested, JSON values), for
  TensorBoard (the HPARAMS tab and a `config` text) and as wandb's config. `wandb`: log to wandb
  too (`wandb_log.WandbRun`: the workdir's one run, continued on resume).
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
    hparams: Mapping[str, Any] | None = None,
    wandb: wandb_log.WandbOptions | None = None,
  ):
    self.enabled = enabled
    self.path = files.join(workdir, METRICS_FILE)
    self.samples_path = files.join(workdir, SAMPLES_FILE)
    if flush_every_s is None:
      flush_every_s = REMOTE_FLUSH_S if files.is_remote(workdir) else 0.0
    self.flush_every_s = flush_every_s
    self._file = self._samples = self._tb = self._wandb = None
    if not enabled:
      return
    files.makedirs(workdir)
    if resume_step is not None:
      truncate_after(self.path, resume_step)
      truncate_after(self.samples_path, resume_step)
    self._file = files.Appender(self.path)
    if tensorboard:
      purge_step = None if resume_step is None else resume_step + 1
      self._tb = _summary_writer(files.join(workdir, TENSORBOARD_DIR), purge_step)
      if hparams is not None:
        _write_hparams(self._tb, hparams)
    if wandb is not None:
      self._wandb = wandb_log.WandbRun(wandb, workdir, hparams)
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
    if self._wandb is not None:
      self._wandb.log(int(step), values)
    if time.monotonic() - self._flushed_at >= self.flush_every_s:
      self.flush()

  def write_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes a table of sample completions at `step`: each row (a dict of the same columns,
    string or number values) as one line {"step": step, **row} of samples.jsonl, the table as
    TensorBoard text `samples` (markdown) and as the wandb Table `samples`."""
    if not self.enabled or not rows:
      return
    if self._file is None:
      raise ValueError(f"MetricsWriter for {self.path} is closed")
    step = int(step)
    columns = list(rows[0])
    table = [[_json_value(row[c]) for c in columns] for row in rows]
    if self._samples is None:
      self._samples = files.Appender(self.samples_path)
    for values in table:
      record = {STEP: step, **dict(zip(columns, values, strict=True))}
      self._samples.write(json.dumps(record, allow_nan=False) + "\n")
    header, cells = [STEP, *columns], [[step, *values] for values in table]
    if self._tb is not None:
      self._tb.add_text(wandb_log.SAMPLES_KEY, markdown_table(header, cells), step)
    if self._wandb is not None:
      self._wandb.log_table(step, header, cells)
    if time.monotonic() - self._flushed_at >= self.flush_every_s:
      self.flush()

  def flush(self) -> None:
    """Makes every line written so far durable (remote: uploads metrics.jsonl and the events)."""
    for appender in (self._file, self._samples):
      if appender is not None:
        appender.flush()
    if self._tb is not None:
      self._tb.flush()
    self._flushed_at = time.monotonic()

  def sync(self) -> None:
    """metrics.jsonl and samples.jsonl durable (fsync'ed locally, uploaded remotely): the trainer
    calls it before each checkpoint save, so that no checkpoint commits ahead of its lines."""
    for appender in (self._file, self._samples):
      if appender is not None:
        appender.sync()

  def close(self) -> None:
    """Flushes and closes every output (a remote writer uploads what it holds; wandb finishes)."""
    for appender in (self._file, self._samples):
      if appender is not None:
        appender.close()
    self._file = self._samples = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _summary_writer(logdir: str, purge_step: int | None):
  """A tensorboardX SummaryWriter on `logdir`; a remote logdir's event file goes through
  `ebpo_jax.files` (`_RemoteEventFile`). `purge_step`: TensorBoard drops the events of earlier
  files from that step on (the steps a resumed run writes again)."""
  _load_tensorboardx_without_torch()
  from tensorboardX import SummaryWriter, record_writer

  if files.is_remote(logdir):
    scheme = logdir.split("://", 1)[0]
    record_writer.register_writer_factory(scheme, _RemoteEventFileFactory())
  return SummaryWriter(logdir, purge_step=purge_step)


def _load_tensorboardx_without_torch() -> None:
  """Imports tensorboardX without torch: its writer module imports torch when it is installed
  (only to recognise torch tensors, which this writer never passes), 2-4 s of every trainer's
  start. `import torch` fails while the module loads (a None entry in sys.modules) and works again
  after; a process that has already imported torch imports tensorboardX as it is."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    return
  sys.modules["torch"] = None
  try:
    import tensorboardX  # noqa: F401
  finally:
    del sys.modules["torch"]


def _write_hparams(tb, hparams: Mapping[str, Any]) -> None:
  """The config into TensorBoard's own event file (not add_hparams' extra run directory): the
  HPARAMS tab's session (flattened scalar values; lists as JSON) with reward/mean and
  eval/accuracy as its metric columns, and the whole config as JSON in the TEXT tab (`config`)."""
  from tensorboardX.summary import hparams as hparams_summary

  flat = {
    k: v if isinstance(v, str | bool | int | float) else json.dumps(v)
    for k, v in flatten(hparams).items()
    if v is not None
  }
  experiment, session_start, _ = hparams_summary(flat, {REWARD_MEAN: 0.0, EVAL_ACCURACY: 0.0})
  writer = tb._get_file_writer()  # add_hparams would write to a run directory of its own
  writer.add_summary(experiment)
  writer.add_summary(session_start)
  text = json.dumps(hparams, indent=1, sort_keys=True)
  tb.add_text("config", "    " + text.replace("\n", "\n    "))  # indented: a code block


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested mapping as one level with dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A markdown table (TensorBoard's text tab renders it); `|` and newlines in cells escaped."""
  cell = lambda v: str(v).replace("|", "\\|").replace("\n", "\\n")
  lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
  return "\n".join(lines)


def _json_value(value: Any) -> Any:
  """A table cell as JSON: strings stay, numbers become Python numbers (non-finite: None)."""
  if isinstance(value, str):
    return value
  number = np.asarray(value).item()
  if isinstance(number, float) and not math.isfinite(number):
    return None
  return number


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
