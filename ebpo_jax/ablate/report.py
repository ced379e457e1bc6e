"""The ablation report: every run's summary -> per-variant tables, paired differences, plots."""

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ebpo_jax import files
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.ablate import advantage_mass, stats


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
  """Rows per (variant, G) over seeds: final and per-cluster accuracy (mean, population std); the
  overall gain over step 0 with a 95% Student t interval; minutes per run (mean and range, of the
  runs that recorded `wall_s`); the hardest cluster's gain over its step-0 value with a 95% t
  interval; each variant minus GRPO paired by seed (hard-cluster gain and final accuracy, 95% t
  intervals); the training diagnostics (all-equal groups, zero-advantage share, grad norm, final
  entropy, EBPO shrinkage); how many steps the hardest cluster took to gain `target_gain` (median
  over the seeds that did); and the advantages of the logged completions by cluster and group
  outcome pooled over the seeds (`advantage_mass`, with `advantage_mass_seeds` the seeds that
  logged them). A cell of one seed has no interval (None)."""
  if not results:
    raise ValueError("no results to report")
  hard = _hardest_cluster(results)
  groups: dict[tuple[str, int], list[dict]] = {}
  for r in sorted(results, key=lambda r: (r["group_size"], r["variant"], r["seed"])):
    groups.setdefault((r["variant"], r["group_size"]), []).append(r)
  rows = [_row(variant, g, runs, hard, target_gain) for (variant, g), runs in groups.items()]
  for row in rows:
    row.update(_versus_reference(groups, row["variant"], row["G"], hard))
  return {
    "rows": rows,
    "runs": list(results),
    "hard_cluster": hard,
    "target_gain": target_gain,
    "ci_level": stats.LEVEL,
    "reference": REFERENCE,
    "summary": summary_lines(rows, hard, target_gain),
  }


def _row(variant: str, g: int, runs: Sequence[dict], hard: str | None, target_gain: float) -> dict:
  """One (variant, G) row over its seeds' runs (see build_report)."""
  final = [_final_accuracy(r) for r in runs]
  gains = [_gain(r, "all") for r in runs]
  walls = [r["wall_s"] / 60 for r in runs if r.get("wall_s") is not None]
  row = {
    "variant": variant,
    "G": g,
    "seeds": len(runs),
    "acc_mean": float(np.mean(final)),
    "acc_std": float(np.std(final)),  # population std (ddof=0): the spread, not an interval
    "acc_before": float(np.mean([r["curve"]["all"][0] for r in runs])),
    **dict(zip(("gain_mean", "gain_low", "gain_high"), stats.mean_ci(gains), strict=True)),
    "wall_min_mean": _mean(walls),
    "wall_min_range": (min(walls), max(walls)) if walls else None,
    "per_cluster": {
      c: float(np.mean([r["curve"][c][-1] for r in runs])) for c in runs[0]["clusters"]
    },
    "all_equal_frac": _mean([r["all_equal_frac"] for r in runs]),
    "zero_frac": _mean([r["zero_frac"] for r in runs]),
    "grad_norm": _mean([r["grad_norm"] for r in runs]),
    "entropy": _mean([r["entropy_final"] for r in runs]),
    "shrinkage": _mean([r["shrinkage"] for r in runs]),
  }
  row[advantage_mass.KEY], row["advantage_mass_seeds"] = advantage_mass.pool(runs)
  if hard is not None:
    gains = [_gain(r, hard) for r in runs]
    _, low, high = stats.mean_ci(gains)
    reached = [_steps_to(r["curve"], hard, r["curve"][hard][0] + target_gain) for r in runs]
    reached = [s for s in reached if s is not None]
    row.update(
      hard_gain_mean=float(np.mean(gains)),
      hard_gain_std=float(np.std(gains)),  # population std, as acc_std
      hard_gain_low=low,
      hard_gain_high=high,
      hard_gains=[round(x, 3) for x in gains],
      reached=len(reached),
      steps_to_target=float(np.median(reached)) if reached else None,
    )
  return row


REFERENCE = "grpo"  # the estimator every variant is compared with, seed by seed
_PAIRED_KEYS = ("vs_grpo_seeds", "vs_grpo_mean", "vs_grpo_low", "vs_grpo_high",
                "vs_grpo_gain_diffs", "vs_grpo_acc_mean", "vs_grpo_acc_low", "vs_grpo_acc_high",
                "vs_grpo_acc_diffs")  # fmt: skip


def _versus_reference(groups: dict, variant: str, g: int, hard: str | None) -> dict:
  """The row's paired differences to GRPO at the same G: per seed both ran (the same warm start
  and data order), variant minus GRPO of the hard-cluster gain (`vs_grpo_*`) and of the final
  accuracy (`vs_grpo_acc_*`), their mean and 95% t interval over those seeds. All None for GRPO's
  own row, without a GRPO run at this G, or without a shared seed (`vs_grpo_seeds` says which)."""
  paired = dict.fromkeys(_PAIRED_KEYS)
  reference = groups.get((REFERENCE, g))
  if variant == REFERENCE or reference is None:
    return paired
  ours = groups[(variant, g)]
  acc = stats.paired_differences(
    _by_seed(ours, _final_accuracy), _by_seed(reference, _final_accuracy)
  )
  paired["vs_grpo_seeds"] = list(acc)
  if not acc:
    return paired
  mean, low, high = stats.mean_ci(list(acc.values()))
  paired.update(vs_grpo_acc_mean=mean, vs_grpo_acc_low=low, vs_grpo_acc_high=high)
  paired["vs_grpo_acc_diffs"] = list(acc.values())
  if hard is not None:
    gain = functools.partial(_gain, cluster=hard)
    diffs = list(stats.paired_differences(_by_seed(ours, gain), _by_seed(reference, gain)).values())
    mean, low, high = stats.mean_ci(diffs)
    paired.update(vs_grpo_mean=mean, vs_grpo_low=low, vs_grpo_high=high, vs_grpo_gain_diffs=diffs)
  return paired


def _by_seed(runs: Sequence[dict], value) -> dict[int, float]:
  return {r["seed"]: value(r) for r in runs}


def _final_accuracy(run: dict) -> float:
  return run["curve"]["all"][-1]


def _gain(run: dict, cluster: str) -> float:
  """The run's accuracy on `cluster` at its last evaluation minus at step 0."""
  return run["curve"][cluster][-1] - run["curve"][cluster][0]


def _mean(values: Sequence[float | None]) -> float | None:
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def _paired_text(row: dict, prefix: str) -> str:
  """The row's paired difference `prefix` ('vs_grpo' or 'vs_grpo_acc') as text; '-' for GRPO's own
  row, 'no grpo' without GRPO at this G, 'no shared seed' when the two ran no seed in common."""
  if row["variant"] == REFERENCE:
    return "-"
  if row["vs_grpo_seeds"] is None:
    return f"no {REFERENCE}"
  if row[f"{prefix}_mean"] is None:
    return "no shared seed"
  low, high = row[f"{prefix}_low"], row[f"{prefix}_high"]
  return stats.format_interval(row[f"{prefix}_mean"], low, high, len(row["vs_grpo_seeds"]))


def _gain_text(row: dict) -> str:
  ci = stats.format_interval(
    row["hard_gain_mean"], row["hard_gain_low"], row["hard_gain_high"], row["seeds"]
  )
  return f"{ci}; per seed {', '.join(f'{x:+.2f}' for x in row['hard_gains'])}"


def _missing_reference(rows: Sequence[dict]) -> list[int]:
  """The group sizes without a GRPO row: their variants have no paired differences."""
  sizes = sorted({r["G"] for r in rows})
  return [g for g in sizes if not any(r["G"] == g and r["variant"] == REFERENCE for r in rows)]


def summary_lines(rows: Sequence[dict], hard: str | None, target_gain: float) -> list[str]:
  """A few plain sentences per G: the best variant, every variant minus GRPO paired by seed (with
  95% t intervals), and how to read them."""
  lines = []
  for g in sorted({r["G"] for r in rows}):
    at_g = [r for r in rows if r["G"] == g]
    if hard is None:
      best = max(at_g, key=lambda r: r["acc_mean"])
      text = f"G={g}: best final accuracy: {best['variant']} {best['acc_mean']:.3f}"
    else:
      best = max(at_g, key=lambda r: r["hard_gain_mean"])
      text = f"G={g}: largest mean gain on {hard}: {best['variant']} {_gain_text(best)}"
      reached = sum(r["reached"] for r in at_g)
      text += f"; {reached}/{sum(r['seeds'] for r in at_g)} runs gained >= {target_gain:.2f}"
    lines += [text, f"G={g}: {_paired_summary(at_g, hard)}"]
  lines.append(_reading_note(rows))
  return lines


def _paired_summary(at_g: Sequence[dict], hard: str | None) -> str:
  if all(r["variant"] != REFERENCE for r in at_g):
    return f"no {REFERENCE} run at this G, so no paired differences"
  others = [r for r in at_g if r["variant"] != REFERENCE]
  if not others:
    return f"only {REFERENCE} ran"
  what = f"{hard} gain / final accuracy" if hard is not None else "final accuracy"
  parts = []
  for r in others:
    acc = _paired_text(r, "vs_grpo_acc")
    parts.append(
      f"{r['variant']} {_paired_text(r, 'vs_grpo')} / {acc}"
      if hard is not None
      else f"{r['variant']} {acc}"
    )
  return f"minus {REFERENCE} paired by seed ({what}): " + ", ".join(parts)


def _reading_note(rows: Sequence[dict]) -> str:
  level = f"{stats.LEVEL:.0%}"
  note = (
    f"Intervals: {level} Student t over seeds (mean ± t·sd/√n, sd with n-1); a paired interval "
    f"that contains 0 is no evidence that the variant differs from {REFERENCE}."
  )
  if min(r["seeds"] for r in rows) < 2:
    note += " Cells with 1 seed have no interval: run more seeds (--seeds) before comparing them."
  return note


def _fmt(value: float | None, digits: int = 3) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict, header: Mapping[str, Any]) -> str:
  """The report as Markdown: settings, the table, per-cluster accuracies, summary, plots."""
  rows, hard = report["rows"], report["hard_cluster"]
  clusters = list(rows[0]["per_cluster"])
  level = f"{stats.LEVEL:.0%}"
  gain_head = f"{hard} gain, mean [{level} CI]" if hard is not None else "gain"
  target = f"steps to +{report['target_gain']:.2f}"
  head = ["variant", "G", "seeds", "acc before", "acc after (mean ± std)",
          f"gain (all), mean [{level} CI]", gain_head,
          f"gain minus {REFERENCE}, paired [{level} CI]",
          f"acc minus {REFERENCE}, paired [{level} CI]", target, "all-equal groups",
          "zero-adv share", "grad norm", "entropy (final)", "shrinkage",
          "minutes per run (range)"]  # fmt: skip
  lines = [
    "# Ablation",
    "",
    f"- date: {header.get('date')}",
    f"- config: `{header.get('config')}` {' '.join(header.get('overrides', []))}",
    f"- hardest cluster (lowest accuracy at step 0): {hard}",
    f"- intervals: {level} Student t over seeds, mean ± t·sd/√n with sd over n-1; n=1: no CI",
    f"- paired: per seed, the variant minus {REFERENCE} at the same G (same warm start and data), "
    "over the seeds both ran",
    *(f"- no {REFERENCE} run at G={g}: no paired differences" for g in _missing_reference(rows)),
    *_not_finished_lines(header.get("not_finished"), len(report["runs"])),
    "",
    "| " + " | ".join(head) + " |",
    "|" + "---|" * len(head),
  ]
  for r in rows:
    gain, steps = "-", "-"
    if hard is not None:
      gain = _gain_text(r)
      steps = f"{_fmt(r['steps_to_target'], 0)} ({r['reached']}/{r['seeds']})"
    cells = [r["variant"], str(r["G"]), str(r["seeds"]), _fmt(r["acc_before"]),
             f"{r['acc_mean']:.3f} ± {r['acc_std']:.3f}",
             stats.format_interval(r["gain_mean"], r["gain_low"], r["gain_high"], r["seeds"]), gain,
             _paired_text(r, "vs_grpo") if hard is not None else "-",
             _paired_text(r, "vs_grpo_acc"), steps, _fmt(r["all_equal_frac"]),
             _fmt(r["zero_frac"]), _fmt(r["grad_norm"]), _fmt(r["entropy"]),
             _fmt(r["shrinkage"]), _minutes_text(r)]  # fmt: skip
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Final accuracy per cluster (mean over seeds):", ""]
  lines.append("| variant | G | " + " | ".join(clusters) + " |")
  lines.append("|" + "---|" * (len(clusters) + 2))
  for r in rows:
    cells = [r["variant"], str(r["G"]), *(_fmt(r["per_cluster"][c]) for c in clusters)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += _advantage_mass_table(rows)
  lines += ["", "## Summary", "", *(f"- {line}" for line in report["summary"])]
  if report.get("plots"):
    lines += ["", "## Plots", ""]
    names = [os.path.basename(p) for p in report["plots"]]
    lines += [f"![{os.path.splitext(name)[0]}](plots/{name})" for name in names]
  return "\n".join(lines) + "\n"


def _not_finished_lines(names: Sequence[str] | None, finished: int) -> list[str]:
  if not names:
    return []
  return [f"- runs: {finished} of {finished + len(names)} finished; not in this report: "
          + ", ".join(names)]  # fmt: skip


def _minutes_text(row: dict) -> str:
  if row["wall_min_mean"] is None:
    return "-"
  low, high = row["wall_min_range"]
  return f"{row['wall_min_mean']:.1f} ({low:.1f}-{high:.1f})"


def _advantage_mass_table(rows: Sequence[dict]) -> list[str]:
  """The Markdown lines of the advantages by cluster and group outcome per (variant, G), pooled
  over the seeds that logged samples: a column per (cluster, outcome) some row has, cells
  'mean |A| (mean A, n=completions)'. No lines when no run logged samples."""
  columns = []
  for r in rows:
    for cell in r.get(advantage_mass.KEY) or ():
      if (cell["cluster"], cell["outcome"]) not in columns:
        columns.append((cell["cluster"], cell["outcome"]))
  if not columns:
    return []
  clusters = list(rows[0]["per_cluster"])  # the trainer's order
  columns.sort(key=lambda column: advantage_mass.sort_key(column, clusters))
  lines = [
    "",
    "Where the advantages go: mean |advantage| (mean advantage) by cluster and group outcome, from "
    "the logged batches (samples.jsonl), pooled over the seeds; all_fail: every reward <= 0, "
    "all_success: every reward full, all_equal_other: equal partial rewards; n: completions.",
    "",
    "| variant | G | seeds with samples | " + " | ".join(f"{c} {o}" for c, o in columns) + " |",
    "|" + "---|" * (len(columns) + 3),
  ]
  for r in rows:
    found = {(c["cluster"], c["outcome"]): c for c in r.get(advantage_mass.KEY) or ()}
    cells = [f"{c['abs_mean']:.2f} ({c['adv_mean']:+.2f}, n={c['count']})" if c else "-"
             for c in (found.get(col) for col in columns)]  # fmt: skip
    seeds = f"{r.get('advantage_mass_seeds', 0)}/{r['seeds']}"
    lines.append("| " + " | ".join([r["variant"], str(r["G"]), seeds, *cells]) + " |")
  return lines


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
