"""The ablation report: every run's summary -> per-variant tables, paired differences, plots."""

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ebpo_jax import files
from ebpo_jax import metrics as metrics_lib


def _hardest_cluster(results: Sequence[dict]) -> str | None:
  """The cluster with the lowest mean accuracy at step 0 over all runs (ties: the later one)."""
  clusters = results[0]["clusters"]
  if not clusters:
    return None
  before = [_mean([r["curve"][c][0] for r in results]) for c in clusters]
  before = [np.inf if b is None else b for b in before]
  return clusters[len(clusters) - 1 - int(np.argmin(before[::-1]))]


def _steps_to(curve: dict, key: str, target: float) -> int | None:
  for step, value in zip(curve["step"], curve[key], strict=True):
    if value is not None and value >= target - 1e-9:  # 0.2 + 0.1 > 0.3 in floats
      return step
  return None


def build_report(results: Sequence[dict], *, target_gain: float = 0.10) -> dict:
  """Rows per (variant, G): mean and spread over seeds of the final and per-cluster accuracy,
  the hardest cluster's gain over its step-0 value, zero-advantage share, final entropy, and how
  many steps the hardest cluster took to gain `target_gain` (median over the seeds that did)."""
  if not results:
    raise ValueError("no results to report")
  hard = _hardest_cluster(results)
  groups: dict[tuple[str, int], list[dict]] = {}
  for r in sorted(results, key=lambda r: (r["group_size"], r["variant"], r["seed"])):
    groups.setdefault((r["variant"], r["group_size"]), []).append(r)
  rows = []
  for (variant, g), runs in groups.items():
    final = [r["curve"]["all"][-1] for r in runs]
    row = {
      "variant": variant,
      "G": g,
      "seeds": len(runs),
      "acc_mean": float(np.mean(final)),
      "acc_std": float(np.std(final)),
      "acc_before": float(np.mean([r["curve"]["all"][0] for r in runs])),
      "per_cluster": {
        c: float(np.mean([r["curve"][c][-1] for r in runs])) for c in runs[0]["clusters"]
      },
      "zero_frac": _mean([r["zero_frac"] for r in runs]),
      "entropy": _mean([r["entropy_final"] for r in runs]),
      "shrinkage": _mean([r["shrinkage"] for r in runs]),
    }
    if hard is not None:
      gains = [r["curve"][hard][-1] - r["curve"][hard][0] for r in runs]
      reached = [_steps_to(r["curve"], hard, r["curve"][hard][0] + target_gain) for r in runs]
      reached = [s for s in reached if s is not None]
      row.update(
        hard_gain_mean=float(np.mean(gains)),
        hard_gain_std=float(np.std(gains)),
        hard_gains=[round(x, 3) for x in gains],
        reached=len(reached),
        steps_to_target=float(np.median(reached)) if reached else None,
      )
    rows.append(row)
  if hard is not None:
    _add_paired_differences(rows, groups, hard)
  return {
    "rows": rows,
    "runs": list(results),
    "hard_cluster": hard,
    "target_gain": target_gain,
    "summary": summary_lines(rows, hard, target_gain),
  }


def _add_paired_differences(rows: list[dict], groups: dict, hard: str) -> None:
  """Each row's hard-cluster gain minus GRPO's at the same G and seed (same warm start and data),
  mean and population std over the shared seeds; None without a GRPO run."""

  def gains(runs: Sequence[dict]) -> dict[int, float]:
    return {r["seed"]: r["curve"][hard][-1] - r["curve"][hard][0] for r in runs}

  for row in rows:
    reference = gains(groups.get(("grpo", row["G"]), []))
    ours = gains(groups[(row["variant"], row["G"])])
    diffs = [ours[s] - reference[s] for s in sorted(ours) if s in reference]
    row["vs_grpo_mean"] = float(np.mean(diffs)) if diffs else None
    row["vs_grpo_std"] = float(np.std(diffs)) if diffs else None


def _mean(values: Sequence[float | None]) -> float | None:
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def summary_lines(rows: Sequence[dict], hard: str | None, target_gain: float) -> list[str]:
  """A few plain sentences: the best variant per G, and EBPO variants against GRPO by seed."""
  if hard is None:
    lines = []
    for g in sorted({r["G"] for r in rows}):
      best = max((r for r in rows if r["G"] == g), key=lambda r: r["acc_mean"])
      lines.append(f"G={g}: best final accuracy: {best['variant']} {best['acc_mean']:.3f}")
    return lines
  lines = []
  for g in sorted({r["G"] for r in rows}):
    at_g = [r for r in rows if r["G"] == g]
    best = max(at_g, key=lambda r: r["hard_gain_mean"])
    text = f"G={g}: largest mean gain on {hard}: {best['variant']} {best['hard_gain_mean']:+.3f}"
    paired = [r for r in at_g if r["variant"].startswith("ebpo") and r["vs_grpo_mean"] is not None]
    if paired:
      diffs = ", ".join(
        f"{r['variant']} {r['vs_grpo_mean']:+.3f} (std {r['vs_grpo_std']:.3f})" for r in paired
      )
      text += f"; EBPO minus GRPO, paired by seed: {diffs}"
    reached = sum(r["reached"] for r in at_g)
    text += f"; {reached}/{sum(r['seeds'] for r in at_g)} runs gained >= {target_gain:.2f}"
    lines.append(text)
  seeds = min(r["seeds"] for r in rows)
  spread = float(np.mean([r["hard_gain_std"] for r in rows]))
  lines.append(
    f"{seeds} seed(s) per cell; the gain's seed-to-seed std averages {spread:.3f}, so "
    "differences between variants well below that are not evidence of a difference."
  )
  return lines


def _fmt(value: float | None, digits: int = 3) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict, header: Mapping[str, Any]) -> str:
  """The report as Markdown: settings, the table, per-cluster accuracies, summary, plots."""
  rows, hard = report["rows"], report["hard_cluster"]
  clusters = list(rows[0]["per_cluster"])
  gain_head = f"{hard} gain (seeds)" if hard is not None else "gain"
  target = f"steps to +{report['target_gain']:.2f}"
  head = ["variant", "G", "seeds", "acc before", "acc after (mean ± std)", gain_head,
          "minus grpo, paired", target, "zero-adv share", "entropy (final)",
          "shrinkage"]  # fmt: skip
  lines = [
    "# Ablation",
    "",
    f"- date: {header.get('date')}",
    f"- config: `{header.get('config')}` {' '.join(header.get('overrides', []))}",
    f"- hardest cluster (lowest accuracy at step 0): {hard}",
    "",
    "| " + " | ".join(head) + " |",
    "|" + "---|" * len(head),
  ]
  for r in rows:
    gain, paired = "-", "-"
    if hard is not None:
      gain = f"{r['hard_gain_mean']:+.3f} ({', '.join(f'{x:+.2f}' for x in r['hard_gains'])})"
      if r["vs_grpo_mean"] is not None and r["variant"] != "grpo":
        paired = f"{r['vs_grpo_mean']:+.3f} ± {r['vs_grpo_std']:.3f}"
    steps = (
      "-" if hard is None else f"{_fmt(r['steps_to_target'], 0)} ({r['reached']}/{r['seeds']})"
    )
    cells = [r["variant"], str(r["G"]), str(r["seeds"]), _fmt(r["acc_before"]),
             f"{r['acc_mean']:.3f} ± {r['acc_std']:.3f}", gain, paired, steps, _fmt(r["zero_frac"]),
             _fmt(r["entropy"]), _fmt(r["shrinkage"])]  # fmt: skip
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Final accuracy per cluster (mean over seeds):", ""]
  lines.append("| variant | G | " + " | ".join(clusters) + " |")
  lines.append("|" + "---|" * (len(clusters) + 2))
  for r in rows:
    cells = [r["variant"], str(r["G"]), *(_fmt(r["per_cluster"][c]) for c in clusters)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "## Summary", "", *(f"- {line}" for line in report["summary"])]
  if report.get("plots"):
    lines += ["", "## Plots", ""]
    names = [os.path.basename(p) for p in report["plots"]]
    lines += [f"![{os.path.splitext(name)[0]}](plots/{name})" for name in names]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def plot_ablation(workdir: str | os.PathLike, results: Sequence[dict]) -> list[str]:
  """`ablation_figure` per group size as WORKDIR/plots/ablation_accuracy_G<G>.png; the paths."""
  out_dir = files.join(workdir, metrics_lib.PLOTS_DIR)
  files.makedirs(out_dir)
  paths = []
  for g in sorted({r["group_size"] for r in results}):
    path = files.join(out_dir, f"ablation_accuracy_G{g}.png")
    files.write_atomic(path, metrics_lib.png_bytes(ablation_figure(results, g), dpi=90))
    paths.append(path)
  return paths


def ablation_figure(results: Sequence[dict], group_size: int):
  """Held-out accuracy over steps per variant at one group size, overall and on the hardest
  cluster: the mean over seeds as a line, their min-max range shaded (a gap between variants
  inside the bands is seed noise). A matplotlib Figure; each variant keeps its colour at every G."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  hard = _hardest_cluster(results)
  keys = ["all"] + ([hard] if hard is not None else [])
  variants = list(dict.fromkeys(r["variant"] for r in results))
  fig = Figure(figsize=(6.0 * len(keys), 4.2), layout="constrained")
  FigureCanvasAgg(fig)
  most_seeds = 1
  for i, key in enumerate(keys):
    ax = fig.add_subplot(1, len(keys), i + 1)
    for v, variant in enumerate(variants):
      runs = [r for r in results if r["group_size"] == group_size and r["variant"] == variant]
      if not runs:
        continue
      most_seeds = max(most_seeds, len(runs))
      steps, mean, low, high = seed_band(runs, key)
      label = f"{variant} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
      ax.plot(steps, mean, marker="o", markersize=3, color=f"C{v % 10}", label=label)
      if len(runs) > 1:
        ax.fill_between(steps, low, high, color=f"C{v % 10}", alpha=0.18, lw=0)
    what = "all clusters" if key == "all" else key
    ax.set_title(f"G={group_size}: held-out accuracy, {what}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("accuracy (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
  if most_seeds > 1:
    fig.suptitle("line: mean over seeds; band: min to max over seeds", fontsize="medium")
  return fig


def _shared_steps(runs: Sequence[dict]) -> list[int]:
  shared = set(runs[0]["curve"]["step"])
  for r in runs[1:]:
    shared &= set(r["curve"]["step"])
  return sorted(shared)


def _at_steps(runs: Sequence[dict], key: str, steps: Sequence[int]) -> list[list[float]]:
  """Per step, the seeds' values of curve `key` that are not None."""
  values = []
  for step in steps:
    at = [r["curve"][key][r["curve"]["step"].index(step)] for r in runs]
    values.append([v for v in at if v is not None])
  return values


def mean_curve(runs: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
  """Mean over runs (summaries from `summarize_run`) of the accuracy curve `key` ("all" or a
  cluster name), at the evaluation steps all of them share."""
  steps = _shared_steps(runs)
  return steps, [_reduce(np.mean, at) for at in _at_steps(runs, key, steps)]


def seed_band(
  runs: Sequence[dict], key: str
) -> tuple[list[int], list[float], list[float], list[float]]:
  """(steps, mean, min, max) over runs (one per seed) of the accuracy curve `key`, at the
  evaluation steps all of them share."""
  steps = _shared_steps(runs)
  at_steps = _at_steps(runs, key, steps)
  mean, low, high = ([_reduce(f, at) for at in at_steps] for f in (np.mean, np.min, np.max))
  return steps, mean, low, high


def _reduce(fn, values: Sequence[float]) -> float:
  return float(fn(values)) if values else float("nan")  # no seed has a value at this step
