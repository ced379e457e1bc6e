"""PNG plots of metrics.jsonl (WORKDIR/plots/) and the plain-text summary table.

The default plots: `overview.png`, the EBPO story on one page (reward and held-out accuracy per
cluster, the groups without signal, the prior per cluster with its spread, the shrinkage S per
cluster, entropy), then one PNG per panel of DEFAULT_PANELS. Each series is drawn raw and faint
with a light rolling mean over it once it has enough points; per-cluster series
keep one colour per cluster across panels, the all-cluster series is black.
"""

import io
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ebpo_jax import files
from ebpo_jax.metrics.log import read_metrics
from ebpo_jax.metrics.names import (
  ADV_ALL_EQUAL_FRAC,
  ADV_ZERO_FRAC,
  ASYNC_ROLLOUT_WAIT_S,
  ASYNC_TRAINER_WAIT_S,
  ASYNC_TRANSFER_S,
  CLIPFRAC,
  EBPO_PRIOR_MEAN,
  EBPO_PRIOR_STD,
  EBPO_SHRINKAGE,
  EBPO_SHRINKAGE_MEAN,
  ENTROPY,
  EVAL_ACCURACY,
  GRAD_NORM,
  KL,
  LOSS,
  PER_CLUSTER_KEYS,
  PLOTS_DIR,
  RESPONSE_LEN_MEAN,
  REWARD_ERRORS,
  REWARD_MEAN,
  SFT_LOSS,
  STEP,
  TIME_SAMPLE_S,
  TIME_STEP_S,
  TIME_TOKENS_PER_S,
  TIME_UPDATE_S,
  cluster_prefix,
  per_cluster,
)


class Panel(NamedTuple):
  """One plot: the keys it draws, its title and y-axis label.

  A pattern ending in "/" is a per-cluster prefix (every key under it, one line per cluster); any
  other pattern is one exact key. `missing_panels` checks `patterns`; `optional` keys are drawn
  when logged but may be absent (a global prior's bare keys). `band` = (mean base, std base): a
  key under the std base is not a line but the shaded mean ± std around the matching mean key.
  `labels` names exact keys in the legend; `unit` marks shares (y from 0 to 1 when they fit).
  """

  name: str  # the PNG's file name, without ".png"
  title: str
  ylabel: str
  patterns: tuple[str, ...]
  optional: tuple[str, ...] = ()
  band: tuple[str, str] | None = None
  labels: Mapping[str, str] = {}
  unit: bool = False


DEFAULT_PANELS: tuple[Panel, ...] = (
  Panel("reward", "Training reward", "mean reward", (REWARD_MEAN, cluster_prefix(REWARD_MEAN))),
  Panel(
    "accuracy",
    "Held-out accuracy",
    "accuracy",
    (EVAL_ACCURACY, cluster_prefix(EVAL_ACCURACY)),
    unit=True,
  ),
  Panel(
    "zero_signal",
    "Groups without signal",
    "share of the batch",
    (ADV_ALL_EQUAL_FRAC, ADV_ZERO_FRAC),
    labels={
      ADV_ALL_EQUAL_FRAC: "all rewards equal (GRPO gives 0)",
      ADV_ZERO_FRAC: "advantage exactly 0 (this run)",
    },
    unit=True,
  ),
  Panel(
    "ebpo_prior_mean",
    "EBPO prior: mean ± between-prompt std",
    "prior mean reward (band: ± tau)",
    (cluster_prefix(EBPO_PRIOR_MEAN), cluster_prefix(EBPO_PRIOR_STD)),
    optional=(EBPO_PRIOR_MEAN, EBPO_PRIOR_STD),
    band=(EBPO_PRIOR_MEAN, EBPO_PRIOR_STD),
    labels={EBPO_PRIOR_MEAN: "global prior"},
  ),
  Panel(
    "ebpo_shrinkage",
    "EBPO shrinkage S (baseline = S·prior + (1-S)·group mean)",
    "S: weight on the prior mean",
    (EBPO_SHRINKAGE_MEAN, cluster_prefix(EBPO_SHRINKAGE)),
    optional=(EBPO_SHRINKAGE,),
    labels={EBPO_SHRINKAGE_MEAN: "batch mean", EBPO_SHRINKAGE: "global prior"},
    unit=True,
  ),
  Panel("entropy", "Policy entropy", "entropy per token (nats)", (ENTROPY,)),
  Panel("kl", "KL to the reference policy", "KL per token", (KL,)),
  Panel("grad_norm", "Gradient norm", "global gradient norm", (GRAD_NORM,)),
  Panel("clipfrac", "Clipped tokens", "share of tokens clipped", (CLIPFRAC,), unit=True),
  Panel("loss", "Loss", "loss", (LOSS,)),
  Panel(
    "sft_loss", "Warm start loss (steps before RL)", "cross-entropy per answer token", (SFT_LOSS,)
  ),
  Panel("response_len", "Response length", "tokens per response", (RESPONSE_LEN_MEAN,)),
  Panel("reward_errors", "Verifier errors", "calls that raised or timed out", (REWARD_ERRORS,)),
  Panel("tokens_per_sec", "Throughput", "sampled tokens per second", (TIME_TOKENS_PER_S,)),
  Panel(
    "step_time",
    "Wall-clock time per step",
    "seconds",
    (TIME_STEP_S, TIME_SAMPLE_S, TIME_UPDATE_S),
    labels={TIME_STEP_S: "step", TIME_SAMPLE_S: "sampling", TIME_UPDATE_S: "update"},
  ),
  # rl.max_staleness > 0 only (optional keys: a synchronous run does not draw it; the staleness is
  # the schedule's, min(step - 1, k)).
  Panel(
    "async_waits",
    "Asynchronous pipeline: who waits",
    "seconds per step",
    (),
    optional=(ASYNC_TRAINER_WAIT_S, ASYNC_ROLLOUT_WAIT_S, ASYNC_TRANSFER_S),
    labels={
      ASYNC_TRAINER_WAIT_S: "trainer waits for the batch",
      ASYNC_ROLLOUT_WAIT_S: "producer idle",
      ASYNC_TRANSFER_S: "params copy",
    },
  ),
)
# The panels of overview.png, in reading order: outcome, signal, the prior, the policy.
OVERVIEW = ("reward", "accuracy", "zero_signal", "ebpo_prior_mean", "ebpo_shrinkage", "entropy")
OVERVIEW += ("async_waits",)  # drawn for an asynchronous run only
OVERVIEW_FILE = "overview"
# (colour, line style) of a panel's exact keys, in order; per-cluster keys take cluster_colors.
EXACT_STYLES = (("black", "-"), ("dimgray", "--"), ("darkgoldenrod", ":"))
# Legends with more entries than this name only the all-cluster series (the rest is colour).
MAX_LEGEND = 12


# ----------------------------------------------------------------------------- series


def _matching_keys(patterns: Iterable[str], available: Sequence[str]) -> list[str]:
  keys = []
  for pattern in patterns:
    if pattern.endswith("/"):
      keys += sorted(k for k in available if k.startswith(pattern) and k not in keys)
    elif pattern in available and pattern not in keys:
      keys.append(pattern)
  return keys


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of `key`, leaving out lines without it and null (non-finite) values."""
  points = [
    (r[STEP], float(r[key]))
    for r in records
    if isinstance(r.get(key), int | float) and math.isfinite(r[key])
  ]
  return np.array([s for s, _ in points], float), np.array([v for _, v in points], float)


def smooth(values: Sequence[float]) -> np.ndarray | None:
  """A light centred rolling mean (no lag, unlike an EMA: a step change stays where it happened)
  over 2h+1 points, h = n/20 clipped to 1..25 (the edges average the points they have); None for
  fewer than 10 points, which are drawn raw."""
  values = np.asarray(values, float)
  if len(values) < 10:
    return None
  half = min(max(len(values) // 20, 1), 25)
  kernel = np.ones(2 * half + 1)
  sums = np.convolve(values, kernel, mode="same")
  counts = np.convolve(np.ones_like(values), kernel, mode="same")
  return sums / counts


def _cluster_name(key: str) -> str | None:
  for base in PER_CLUSTER_KEYS:
    if key.startswith(cluster_prefix(base)):
      return key.removeprefix(cluster_prefix(base))
  return None


def _natural_order(name: str) -> list:
  """topic_2 before topic_10: digit runs compare as numbers."""
  return [
    (0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)
  ]


def cluster_colors(keys: Iterable[str]) -> dict[str, Any]:
  """One colour per cluster name found in per-cluster `keys`, the same in every panel."""
  from matplotlib import colormaps

  names = sorted(
    {name for key in keys if (name := _cluster_name(key)) is not None}, key=_natural_order
  )
  if len(names) <= 10:
    cmap = colormaps["tab10"]
    return {name: cmap(i) for i, name in enumerate(names)}
  if len(names) <= 20:
    cmap = colormaps["tab20"]
    return {name: cmap(i) for i, name in enumerate(names)}
  cmap = colormaps["viridis"]
  return {name: cmap(i / (len(names) - 1)) for i, name in enumerate(names)}


# ----------------------------------------------------------------------------- drawing


def _panel_series(panel: Panel, records, available) -> tuple[dict, dict]:
  """({line key: (steps, values)}, {line key: (steps, std)}) of a panel; band keys pair by the
  suffix after their base (ebpo/prior_std/add_1 shades ebpo/prior_mean/add_1)."""
  keys = _matching_keys(panel.patterns + panel.optional, available)
  lines, bands = {}, {}
  std_base = panel.band[1] if panel.band else None
  for key in keys:
    if std_base is not None and (key == std_base or key.startswith(std_base + "/")):
      continue
    lines[key] = _series(records, key)
    if std_base is not None and key.startswith(panel.band[0]):
      std_key = std_base + key.removeprefix(panel.band[0])
      if std_key in available:
        bands[key] = _series(records, std_key)
  lines = {k: v for k, v in lines.items() if len(v[0])}
  return lines, bands


def _is_flat(lines: dict, bands: dict) -> bool:
  return all(len(set(v.tolist())) <= 1 for _, v in (*lines.values(), *bands.values()))


def draw_panel(ax, panel: Panel, lines: dict, bands: dict, colors: Mapping[str, Any]) -> list:
  """Draws a panel's series on `ax` (raw faint, smoothed solid, mean ± std shaded); returns the
  handles of its exact (not per-cluster) keys, for a legend."""
  # Exact keys in black and greys, apart from the cluster colours (an entropy line in blue would
  # read as the first cluster's in the overview).
  exact_handles, styles = [], iter(EXACT_STYLES * 4)
  has_clusters = any(_cluster_name(k) is not None for k in lines)
  values_all = []
  for key, (steps, values) in lines.items():
    cluster = _cluster_name(key)
    if cluster is not None:
      color, style, width, label = colors.get(cluster, "grey"), "-", 1.4, cluster
    else:
      color, style = EXACT_STYLES[0] if has_clusters else next(styles)
      width = 2.2 if has_clusters else 1.8
      label = panel.labels.get(key, "all clusters" if has_clusters else key)
    # A few far points (the first step's compile time) are drawn raw, not smeared by the mean.
    kept = ~_far_points(values)
    smooth_steps, smoothed = steps[kept], smooth(values[kept])
    marker = "o" if len(steps) < 30 else None
    if smoothed is None:
      smooth_steps, smoothed = steps, values
      (handle,) = ax.plot(
        steps, values, style, color=color, lw=width, marker=marker, markersize=3, label=label
      )
    else:
      ax.plot(steps, values, color=color, lw=0.8, alpha=0.35)
      (handle,) = ax.plot(smooth_steps, smoothed, style, color=color, lw=width, label=label)
    values_all.append(values)
    if key in bands:
      band_steps, std = bands[key]
      shared, at_mean, at_std = np.intersect1d(smooth_steps, band_steps, return_indices=True)
      mean, spread = smoothed[at_mean], smooth(std[at_std])
      spread = std[at_std] if spread is None else spread
      ax.fill_between(shared, mean - spread, mean + spread, color=color, alpha=0.15, lw=0)
      values_all.append(np.concatenate([mean - spread, mean + spread]))
    if cluster is None:
      exact_handles.append(handle)
  ax.set_title(panel.title, fontsize="medium")
  ax.set_xlabel(STEP)
  ax.set_ylabel(panel.ylabel)
  ax.grid(alpha=0.3)
  every = np.concatenate(values_all) if values_all else np.zeros(0)
  if panel.unit and every.size and every.min() >= 0.0 and every.max() <= 1.0:
    ax.set_ylim(-0.03, 1.03)
  else:
    _clip_outliers(ax, every)
  return exact_handles


def _far_points(values: np.ndarray) -> np.ndarray:
  """Which values lie far out (3 inter-percentile ranges beyond the 2nd-98th percentiles), when
  they are few (at most 2% of 20 or more points); all False otherwise."""
  values = np.asarray(values, float)
  none = np.zeros(values.shape, bool)
  if values.size < 20:
    return none
  low, high = np.percentile(values, [2, 98])
  span = max(high - low, 1e-12)
  far = (values > high + 3 * span) | (values < low - 3 * span)
  return far if far.sum() <= 0.02 * values.size else none


def _clip_outliers(ax, values: np.ndarray) -> None:
  """Keeps a few far points (the first step's compile time, one grad-norm spike) from flattening
  the rest: the y-axis spans the other points and says how many lie beyond."""
  far = _far_points(values)
  if not far.any():
    return
  inliers = values[~far]
  low, high = inliers.min(), inliers.max()
  margin = 0.08 * max(high - low, 1e-12)
  ax.set_ylim(low - margin, high + margin)
  above, below = int((values > high).sum()), int((values < low).sum())
  beyond = ", ".join(
    text for n, text in ((above, f"{above} above"), (below, f"{below} below")) if n
  )
  ax.text(0.99, 0.01, f"off the axis: {beyond}", transform=ax.transAxes, ha="right",
          va="bottom", fontsize="x-small", color="dimgray")  # fmt: skip


def _legend(ax, handles_exact: list, num_lines: int) -> None:
  if num_lines <= 1:
    return
  if num_lines <= MAX_LEGEND:
    outside = num_lines > 4
    kwargs = {"bbox_to_anchor": (1.01, 1.0), "loc": "upper left"} if outside else {}
    ax.legend(fontsize="small", **kwargs)
  elif handles_exact:
    ax.legend(handles=handles_exact, fontsize="small", title=f"{num_lines} series")


def _drawable(panels, records, available, *, skip_flat: bool) -> list[tuple[Panel, dict, dict]]:
  out = []
  for panel in panels:
    lines, bands = _panel_series(panel, records, available)
    if lines and not (skip_flat and _is_flat(lines, bands)):
      out.append((panel, lines, bands))
  return out


def overview_figure(records: Sequence[Mapping[str, Any]]):
  """The EBPO story of a run on one matplotlib Figure (OVERVIEW's panels that were logged and
  are not flat), one cluster legend below; None when none is drawable. For notebooks too."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  available = sorted({k for r in records for k in r if k != STEP})
  by_name = {p.name: p for p in DEFAULT_PANELS}
  drawn = _drawable([by_name[n] for n in OVERVIEW], records, available, skip_flat=True)
  if not drawn:
    return None
  colors = cluster_colors(available)
  cols = 3 if len(drawn) > 4 else min(len(drawn), 2)
  rows = math.ceil(len(drawn) / cols)
  fig = Figure(figsize=(5.2 * cols, 3.8 * rows + 0.6), layout="constrained")
  FigureCanvasAgg(fig)
  for i, (panel, lines, bands) in enumerate(drawn):
    ax = fig.add_subplot(rows, cols, i + 1)
    handles = draw_panel(ax, panel, lines, bands, colors)
    if len(handles) > 1 or (handles and panel.labels and not colors):
      ax.legend(handles=handles, fontsize="small")
  if colors:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="black", lw=2.2, label="all clusters")]
    handles += [Line2D([], [], color=c, lw=1.4, label=n) for n, c in colors.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 8))
  fig.suptitle("Run overview (faint: raw; solid: smoothed)", fontsize="large")
  return fig


def plot_metrics(workdir: str | os.PathLike, keys: Sequence[str] | None = None) -> list[str]:
  """Writes PNG plots of metrics.jsonl to WORKDIR/plots/ and returns their paths.

  `keys=None` draws overview.png and DEFAULT_PANELS (reward and accuracy overall and per cluster,
  the groups without signal, EBPO's prior and shrinkage per cluster, entropy, kl, grad_norm,
  clipfrac, timing, ...), skipping a panel whose every series is constant: a flat line (kl with no
  KL term, reward/errors at 0) says only its value, which metrics.jsonl holds. Otherwise one plot
  per key, drawn even when flat (a key ending in "/" is a prefix: all matching keys on one plot).
  Keys absent from the file are skipped.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_metrics(workdir)
  available = sorted({k for r in records for k in r if k != STEP})
  if keys is None:
    panels = DEFAULT_PANELS
  else:
    panels = tuple(
      Panel(key.rstrip("/").replace("/", "_"), key, key.rstrip("/"), (key,)) for key in keys
    )
  out_dir = files.join(workdir, PLOTS_DIR)
  files.makedirs(out_dir)
  paths = []
  if keys is None and (fig := overview_figure(records)) is not None:
    paths.append(files.join(out_dir, f"{OVERVIEW_FILE}.png"))
    files.write_atomic(paths[-1], png_bytes(fig))
  colors = cluster_colors(available)
  for panel, lines, bands in _drawable(panels, records, available, skip_flat=keys is None):
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    handles = draw_panel(ax, panel, lines, bands, colors)
    _legend(ax, handles, len(lines))
    path = files.join(out_dir, f"{panel.name}.png")
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
    f"{panel.name}: {pattern}"
    for panel in DEFAULT_PANELS
    for pattern in panel.patterns
    if not _matching_keys([pattern], available)
  ]


def binomial_se(p: float, n: int) -> float:
  """The standard error sqrt(p (1 - p) / n) of an accuracy p measured on n prompts."""
  return math.sqrt(p * (1.0 - p) / n) if n > 0 else math.nan


def accuracy_table(
  first: Mapping[str, Any], last: Mapping[str, Any], counts: Mapping[str, int]
) -> str:
  """The end of a run's summary: the held-out accuracy per cluster (and all) of two evaluation
  lines of metrics.jsonl, each with its binomial standard error over the cluster's `counts`
  prompts."""
  rows = {}
  for name, n in [*counts.items(), ("all", sum(counts.values()))]:
    key = EVAL_ACCURACY if name == "all" else per_cluster(EVAL_ACCURACY, name)
    before, after = first.get(key), last.get(key)
    rows[name] = {
      "before": before,
      "se before": None if before is None else binomial_se(before, n),
      "after": after,
      "se after": None if after is None else binomial_se(after, n),
      "n": n,
    }
  return summary_table(rows)


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
