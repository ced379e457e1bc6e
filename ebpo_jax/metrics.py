"""Run metrics: their names, WORKDIR/metrics.jsonl, TensorBoard events, plots, summary table.

metrics.jsonl holds one JSON object per line, each with an integer "step" and float values.
Non-finite values (NaN, inf) are written as JSON `null`: strict JSON has no NaN, and readers
(`json`, pandas, jq) all accept null. Lines are flushed as written, so after a crash the file
ends at most with one partial line, which the readers here ignore.

WORKDIR may be `gs://bucket/...` (everything goes through `ebpo_jax.files`, TensorBoard's event
file included). An object store cannot append: each flush there uploads metrics.jsonl and the
TensorBoard event file whole, so a remote writer flushes at most every REMOTE_FLUSH_S seconds (and
on `flush()`, which the trainer calls whenever it starts a checkpoint, so that the bucket's lines
always reach the latest checkpoint).
"""

import io
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ebpo_jax import files

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"
# MetricsWriter's resume_step when nothing was restored: every line of an earlier start is dropped.
FRESH_START = -1
# How often a writer on an object store uploads (each upload sends the whole files again).
REMOTE_FLUSH_S = 60.0

# ----------------------------------------------------------------------------- metric names
# The one copy of every key the trainer writes to metrics.jsonl (contracts: see DESIGN.md).

STEP = "step"  # the integer step of every line; not a metric (MetricsWriter.write's argument)

# Rollouts: rewards, advantages, responses (the train step and the host).
REWARD_MEAN = "reward/mean"  # mean total reward over the batch's responses (weighted sum of fns)
REWARD_ERRORS = "reward/errors"  # verifier calls that raised or timed out
REWARD_OVERLONG_PENALTY = "reward/overlong_penalty"  # DAPO's soft overlong punishment, mean
ADV_ZERO_FRAC = "adv/zero_frac"  # share of valid responses whose advantage is exactly 0
ADV_ABS_MEAN = "adv/abs_mean"
EBPO_SHRINKAGE_MEAN = "ebpo/shrinkage_mean"  # mean shrinkage S over the batch's prompts (EBPO)
EBPO_PRIOR_MEAN = "ebpo/prior_mean"  # per cluster only: per_cluster(EBPO_PRIOR_MEAN, name)
RESPONSE_LEN_MEAN = "response_len/mean"
TRUNCATED_FRAC = "truncated_frac"  # responses cut at the generation length
ROLLOUT_TOKENS = "rollout/tokens"  # tokens sampled this step (all refill rounds)
DAPO_KEPT_FRAC = "dapo/kept_frac"  # dynamic sampling: first-round groups with varied rewards
DAPO_ROUNDS = "dapo/rounds"
DAPO_FILLED_GROUPS = "dapo/filled_groups"  # groups without signal that filled a short batch

# The update: losses.policy_loss's metrics, averaged over the step's updates, and the optimizer's.
LOSS = "loss"
PG_LOSS = "pg_loss"
KL = "kl"  # to the reference policy; 0 without one (rl.loss.kl_coef == 0)
ENTROPY = "entropy"
CLIPFRAC = "clipfrac"
CLIPFRAC_LOW = "clipfrac_low"
CLIPFRAC_HIGH = "clipfrac_high"
DUAL_CLIPFRAC = "dual_clipfrac"
RATIO_MEAN = "ratio_mean"
APPROX_KL = "approx_kl"  # k3 of the old policy from the new one: how far the update moved
GRAD_NORM = "grad_norm"
BAD_UPDATES = "bad_updates"  # updates skipped for a non-finite loss or grad norm

# Bookkeeping and wall-clock time.
COMPILES_TRAIN_STEP = "compiles/train_step"  # times the train step was traced (1 = no retrace)
TIME_STEP_S = "time/step_s"
TIME_SAMPLE_S = "time/sample_s"
TIME_UPDATE_S = "time/update_s"
TIME_TOKENS_PER_S = "time/tokens_per_s"  # ROLLOUT_TOKENS / TIME_STEP_S

# Evaluation lines.
EVAL_ACCURACY = "eval/accuracy"
EVAL_VERIFIER_ERRORS = "eval/verifier_errors"  # evaluation verifier calls that raised or timed out

# Keys that measure wall-clock time: they differ between an interrupted and a straight run.
TIMING_KEYS = (TIME_STEP_S, TIME_TOKENS_PER_S, TIME_SAMPLE_S, TIME_UPDATE_S)
# Keys that are also logged per cluster, as per_cluster(key, name).
PER_CLUSTER_KEYS = (REWARD_MEAN, EVAL_ACCURACY, EBPO_PRIOR_MEAN)
# Every metric name above (not STEP).
KEYS = frozenset(
  {REWARD_MEAN, REWARD_ERRORS, REWARD_OVERLONG_PENALTY, ADV_ZERO_FRAC, ADV_ABS_MEAN}
  | {EBPO_SHRINKAGE_MEAN, EBPO_PRIOR_MEAN, RESPONSE_LEN_MEAN, TRUNCATED_FRAC, ROLLOUT_TOKENS}
  | {DAPO_KEPT_FRAC, DAPO_ROUNDS, DAPO_FILLED_GROUPS}
  | {LOSS, PG_LOSS, KL, ENTROPY, CLIPFRAC, CLIPFRAC_LOW, CLIPFRAC_HIGH, DUAL_CLIPFRAC}
  | {RATIO_MEAN, APPROX_KL, GRAD_NORM, BAD_UPDATES, COMPILES_TRAIN_STEP, *TIMING_KEYS}
  | {EVAL_ACCURACY, EVAL_VERIFIER_ERRORS}
)


def cluster_prefix(key: str) -> str:
  """The prefix that all per-cluster keys of `key` share: "eval/accuracy" -> "eval/accuracy/"."""
  return f"{key}/"


def per_cluster(key: str, cluster_name: str) -> str:
  """The one rule for per-cluster keys: ("reward/mean", "add_2d") -> "reward/mean/add_2d"."""
  return cluster_prefix(key) + cluster_name


def reward_fn_key(name: str) -> str:
  """The one rule for a reward function's key (config.rewards.fns): "brevity" -> "reward/brevity",
  its mean value over the batch beside REWARD_MEAN. A ValueError for a name whose key is taken
  ("mean", "errors", ...)."""
  key = f"reward/{name}"
  if key in KEYS:
    taken = sorted(k.removeprefix("reward/") for k in KEYS if k.startswith("reward/"))
    raise ValueError(f"reward name {name!r} is taken by a metric; not one of {', '.join(taken)}")
  return key


# Default plots: (file name, patterns); a pattern ending in "/" matches every key with that prefix.
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
  ("reward", (REWARD_MEAN, cluster_prefix(REWARD_MEAN))),
  ("accuracy", (EVAL_ACCURACY, cluster_prefix(EVAL_ACCURACY))),
  ("adv_zero_frac", (ADV_ZERO_FRAC,)),
  ("ebpo_shrinkage", (EBPO_SHRINKAGE_MEAN,)),
  ("ebpo_prior_mean", (cluster_prefix(EBPO_PRIOR_MEAN),)),
  ("entropy", (ENTROPY,)),
  ("kl", (KL,)),
  ("grad_norm", (GRAD_NORM,)),
  ("clipfrac", (CLIPFRAC,)),
  ("loss", (LOSS,)),
  ("response_len", (RESPONSE_LEN_MEAN,)),
  ("reward_errors", (REWARD_ERRORS,)),
  ("tokens_per_sec", (TIME_TOKENS_PER_S,)),
  ("step_time", (TIME_STEP_S, TIME_SAMPLE_S, TIME_UPDATE_S)),
)


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


def _matching_keys(patterns: Iterable[str], available: Sequence[str]) -> list[str]:
  keys = []
  for pattern in patterns:
    if pattern.endswith("/"):
      keys += sorted(k for k in available if k.startswith(pattern) and k not in keys)
    elif pattern in available and pattern not in keys:
      keys.append(pattern)
  return keys


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  points = [(r[STEP], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in points], [v for _, v in points]


def plot_metrics(workdir: str | os.PathLike, keys: Sequence[str] | None = None) -> list[str]:
  """Writes PNG plots of metrics.jsonl to WORKDIR/plots/ and returns their paths.

  `keys=None` draws DEFAULT_PANELS (reward and accuracy, overall and per cluster, adv/zero_frac,
  shrinkage, entropy, kl, grad_norm, clipfrac, timing, ...), skipping a panel whose every series
  is constant: a flat line (kl with no KL term, reward/errors at 0) says only its value, which
  metrics.jsonl holds. Otherwise one plot per key, drawn even when flat (a key ending in "/" is a
  prefix: all matching keys on one plot). Keys absent from the file are skipped.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_metrics(workdir)
  available = sorted({k for r in records for k in r if k != STEP})
  if keys is None:
    panels = DEFAULT_PANELS
  else:
    panels = tuple((key.rstrip("/").replace("/", "_"), (key,)) for key in keys)
  out_dir = files.join(workdir, PLOTS_DIR)
  files.makedirs(out_dir)
  paths = []
  for name, patterns in panels:
    series = {key: _series(records, key) for key in _matching_keys(patterns, available)}
    if not series or (keys is None and all(len(set(v)) <= 1 for _, v in series.values())):
      continue
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, (steps, values) in series.items():
      ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_xlabel(STEP)
    ax.set_title(name)
    ax.grid(alpha=0.3)
    if len(series) > 1:
      ax.legend(fontsize="small")
    path = files.join(out_dir, f"{name}.png")
    files.write_atomic(path, png_bytes(fig))
    paths.append(path)
  return paths


def png_bytes(fig, dpi: int = 100) -> bytes:
  """A matplotlib figure as PNG bytes, for `files.write_atomic` (local or remote alike)."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
  return buffer.getvalue()


def missing_panels(records: Iterable[Mapping[str, Any]]) -> list[str]:
  """The DEFAULT_PANELS patterns that match no key of `records`, as "PANEL: PATTERN".

  Checked per pattern, not per panel, so a per-cluster prefix that matches nothing shows even
  when its panel draws the overall key. A check that the default plots read what a run logs.
  """
  available = sorted({k for r in records for k in r if k != STEP})
  return [
    f"{name}: {pattern}"
    for name, patterns in DEFAULT_PANELS
    for pattern in patterns
    if not _matching_keys([pattern], available)
  ]


def summary_table(
  rows: Mapping[str, Mapping[str, float]],
  *,
  columns: Sequence[str] | None = None,
  row_header: str = "cluster",
  digits: int = 3,
) -> str:
  """A plain-text table, e.g. final accuracy per cluster: {"add_2d": {"accuracy": 0.9, "n": 64}}.

  Columns default to all value keys in first-seen order; a missing value prints as "-".
  """
  if columns is None:
    columns = list(dict.fromkeys(k for values in rows.values() for k in values))

  def fmt(value: Any) -> str:
    if value is None:
      return "-"
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
      return str(value)
    return f"{float(value):.{digits}f}"

  header = [row_header, *columns]
  body = [[str(name), *(fmt(values.get(c)) for c in columns)] for name, values in rows.items()]
  widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

  def line(cells: list[str]) -> str:
    first = cells[0].ljust(widths[0])
    rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
    return "  ".join([first, *rest]).rstrip()

  rule = "  ".join("-" * w for w in widths)
  return "\n".join([line(header), rule, *(line(row) for row in body)])
