"""PNG plots of metrics.jsonl (WORKDIR/plots/) and the plain-text summary table."""

import io
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ebpo_jax import files
from ebpo_jax.metrics.log import read_metrics
from ebpo_jax.metrics.names import (
  ADV_ZERO_FRAC,
  CLIPFRAC,
  EBPO_PRIOR_MEAN,
  EBPO_SHRINKAGE_MEAN,
  ENTROPY,
  EVAL_ACCURACY,
  GRAD_NORM,
  KL,
  LOSS,
  PLOTS_DIR,
  RESPONSE_LEN_MEAN,
  REWARD_ERRORS,
  REWARD_MEAN,
  STEP,
  TIME_SAMPLE_S,
  TIME_STEP_S,
  TIME_TOKENS_PER_S,
  TIME_UPDATE_S,
  cluster_prefix,
)

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
