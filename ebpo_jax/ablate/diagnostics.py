"""The training diagnostics of an ablation's runs over RL steps, one figure per group size: the
training reward, the share of groups without signal, EBPO's shrinkage S and prior, the gradient
norm and the entropy, one colour per estimator, the mean over seeds with their range as a band.

Read from each run's metrics.jsonl (WORKDIR/runs/NAME/). A panel is drawn only when some run logs
its keys: GRPO-only ablations have no shrinkage panel.
"""

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from ebpo_jax import files
from ebpo_jax import metrics as metrics_lib

ALL_EQUAL_FRAC = metrics_lib.ADV_ALL_EQUAL_FRAC
PRIOR_STD = metrics_lib.EBPO_PRIOR_STD
SHRINKAGE = metrics_lib.EBPO_SHRINKAGE


@dataclasses.dataclass(frozen=True)
class Curve:
  """One line of a panel: the mean over seeds at the steps they share, and a band around it."""

  label: str
  variant: str
  steps: np.ndarray
  mean: np.ndarray
  low: np.ndarray  # the band: min over seeds, or mean - prior std
  high: np.ndarray
  dashed: bool = False


@dataclasses.dataclass(frozen=True)
class Panel:
  """What a panel reads: keys (a per-cluster prefix expands to one line per cluster)."""

  title: str
  ylabel: str
  keys: tuple[str, ...]  # each a metric name; drawn when logged, per cluster when logged so
  band_key: str | None = None  # a std to draw as mean ± std around the line instead of seeds
  dashed: tuple[str, ...] = ()


PANELS = (
  Panel("training reward", "mean reward of the batch", (metrics_lib.REWARD_MEAN,)),
  Panel(
    "groups without signal (lower: more prompts teach)",
    "share",
    (metrics_lib.ADV_ZERO_FRAC, ALL_EQUAL_FRAC),
    dashed=(ALL_EQUAL_FRAC,),
  ),
  Panel("EBPO shrinkage S (weight on the prior mean)", "S", (SHRINKAGE,)),
  Panel(
    "EBPO prior mean per cluster",
    "prior mean reward",
    (metrics_lib.EBPO_PRIOR_MEAN,),
    band_key=PRIOR_STD,
  ),
  Panel("gradient norm (before clipping)", "global norm", (metrics_lib.GRAD_NORM,)),
  Panel("policy entropy", "nats per token", (metrics_lib.ENTROPY,)),
)
_LABELS = {
  metrics_lib.ADV_ZERO_FRAC: "zero advantages",
  ALL_EQUAL_FRAC: "all-equal groups (GRPO zeroes them)",
}


def run_workdir(workdir: str | os.PathLike, name: str) -> str:
  """The trainer workdir of the ablation's run `name` (WORKDIR/runs/NAME)."""
  return files.join(workdir, "runs", name)


def _training_lines(path: str) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(path) if metrics_lib.REWARD_MEAN in r]


def _series_keys(lines: Sequence[dict], key: str) -> list[tuple[str, str | None]]:
  """(metric, cluster) pairs that `key` reads in `lines`: itself, or its per-cluster keys."""
  logged = dict.fromkeys(k for r in lines for k in r)
  if key in logged:
    return [(key, None)]
  prefix = metrics_lib.cluster_prefix(key)
  return [(k, k.removeprefix(prefix)) for k in logged if k.startswith(prefix)]


def _values(lines: Sequence[dict], key: str) -> dict[int, float]:
  return {r["step"]: float(r[key]) for r in lines if r.get(key) is not None}


def _seed_curve(per_seed: Sequence[dict[int, float]]) -> tuple[np.ndarray, ...] | None:
  """(steps, mean, min, max) over the seeds at the steps all of them logged; None if none."""
  steps = sorted(set.intersection(*(set(v) for v in per_seed)))
  if not steps:
    return None
  values = np.array([[v[s] for s in steps] for v in per_seed])
  return np.array(steps), values.mean(0), values.min(0), values.max(0)


def panel_curves(
  workdir: str | os.PathLike, results: Sequence[dict], group_size: int
) -> dict[str, list[Curve]]:
  """Per panel title, the lines of the runs at `group_size` (summaries from `summarize_run`,
  as in report["runs"]): one per variant and key (and cluster, for per-cluster keys), the mean
  over seeds; panels that no run logs are left out."""
  lines = {r["name"]: _training_lines(run_workdir(workdir, r["name"])) for r in results}
  variants = list(dict.fromkeys(r["variant"] for r in results))
  out: dict[str, list[Curve]] = {}
  for panel in PANELS:
    curves = []
    for variant in variants:
      runs = [r for r in results if r["variant"] == variant and r["group_size"] == group_size]
      if not runs:
        continue
      logs = [lines[r["name"]] for r in runs]
      keys = [k for k in panel.keys if _series_keys(logs[0], k)]
      for key in keys:
        for metric, cluster in _series_keys(logs[0], key):
          curve = _seed_curve([_values(log, metric) for log in logs])
          if curve is None:
            continue
          steps, mean, low, high = curve
          parts = [variant, cluster]
          if panel.band_key is not None:  # mean ± the logged std (its seed mean), else seeds
            std_key = panel.band_key if cluster is None else f"{panel.band_key}/{cluster}"
            std = _seed_curve([_values(log, std_key) for log in logs])
            if std is not None and np.array_equal(std[0], steps):
              low, high = mean - std[1], mean + std[1]
              parts.append("± prior std")
          label = " ".join(p for p in parts if p)
          if len(panel.keys) > 1:
            label += f": {_LABELS[key]}"
          dashed = key in panel.dashed
          curves.append(Curve(label, variant, steps, mean, low, high, dashed))
    if curves:
      out[panel.title] = curves
  return out


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over the last `window` points (fewer at the start)."""
  cumsum = np.cumsum(np.insert(values, 0, 0.0))
  idx = np.arange(1, len(values) + 1)
  start = np.maximum(idx - window, 0)
  return (cumsum[idx] - cumsum[start]) / (idx - start)


def plot_diagnostics(workdir: str | os.PathLike, results: Sequence[dict]) -> list[str]:
  """WORKDIR/plots/ablation_diagnostics_G{g}.png per group size: `panel_curves` drawn with light
  smoothing (the raw mean faint behind it) and the band shaded. Returns the paths."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator

  out_dir = files.join(workdir, metrics_lib.PLOTS_DIR)
  files.makedirs(out_dir)
  colours = {v: f"C{i % 10}" for i, v in enumerate(dict.fromkeys(r["variant"] for r in results))}
  paths = []
  for g in sorted({r["group_size"] for r in results}):
    panels = panel_curves(workdir, results, g)
    if not panels:
      continue
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5.2 * cols, 3.4 * rows))
    FigureCanvasAgg(fig)
    for i, (title, curves) in enumerate(panels.items()):
      ax = fig.add_subplot(rows, cols, i + 1)
      seen: dict[str, int] = {}  # lines per variant so far: a variant's clusters differ in style
      for c in curves:
        seen[c.variant] = seen.get(c.variant, 0) + 1
        style = "--" if c.dashed else ["-", ":", "-.", (0, (5, 1))][(seen[c.variant] - 1) % 4]
        colour = colours[c.variant]
        window = max(1, len(c.steps) // 20)  # light: 200 steps -> a 10-step mean
        if window > 1:
          ax.plot(c.steps, c.mean, color=colour, alpha=0.25, linewidth=0.8, linestyle=style)
        ax.plot(
          c.steps,
          _smooth(c.mean, window),
          color=colour,
          linestyle=style,
          label=c.label,
          marker="o" if len(c.steps) <= 12 else None,
          markersize=3,
        )
        if np.any(c.high > c.low):
          low, high = _smooth(c.low, window), _smooth(c.high, window)
          ax.fill_between(c.steps, low, high, color=colour, alpha=0.12, linewidth=0)
      ax.set_title(f"G={g}: {title}", fontsize="medium")
      ax.set_xlabel("RL step")
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
      ax.set_ylabel(next(p.ylabel for p in PANELS if p.title == title))
      ax.grid(alpha=0.3)
      ax.legend(fontsize="x-small")
    fig.tight_layout()
    path = files.join(out_dir, f"ablation_diagnostics_G{g}.png")
    files.write_atomic(path, metrics_lib.png_bytes(fig, dpi=90))
    paths.append(path)
  return paths
