"""Held-out accuracy against wall time for one or more trainer runs (seeds), with standard errors.

  python bench/learning_curve.py /tmp/smol_cpu_s0 /tmp/smol_cpu_s1 --out results/smollm2_cpu.png

Reads each workdir's metrics.jsonl: the evaluation lines' `eval/accuracy` (avg@k over the held-out
problems when `eval.num_samples` = k > 1) against `time/elapsed_s`, the wall time since the run
started (model load, compiles and the evaluations included). The band is +-1 binomial standard
error over the N held-out problems, sqrt(p (1 - p) / N): for avg@k an upper bound of the standard
error over problems (each problem's c/k has variance at most p (1 - p)). Prints per run the first
and last evaluation, the gain in points with its standard error (the two evaluations are of the
same problems with independent samples), and the wall time; the figure goes to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ebpo_jax import metrics as metrics_lib  # noqa: E402


def eval_points(workdir: str) -> tuple[list[float], list[float], int]:
  """(minutes, accuracies, N problems) of a run's evaluation lines."""
  records = metrics_lib.read_metrics(workdir)
  evals = [r for r in records if metrics_lib.EVAL_ACCURACY in r]
  if not evals:
    raise SystemExit(f"{workdir}: no evaluation lines in metrics.jsonl")
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  clusters = [k for k in evals[0] if k.startswith(metrics_lib.EVAL_ACCURACY + "/")]
  problems = config["task"]["num_eval"] * max(len(clusters), 1)
  minutes = [r.get(metrics_lib.TIME_ELAPSED_S, math.nan) / 60 for r in evals]
  return minutes, [r[metrics_lib.EVAL_ACCURACY] for r in evals], problems


def binomial_se(p: float, n: int) -> float:
  return math.sqrt(max(p * (1 - p), 0.0) / n)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--out", default="learning_curve.png")
  parser.add_argument("--title", default="held-out accuracy against wall time")
  args = parser.parse_args()
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  print("| run | N | first | last | gain (points) +- SE | minutes |")
  print("|---|---:|---:|---:|---:|---:|")
  for workdir in args.workdirs:
    minutes, acc, n = eval_points(workdir)
    se = [binomial_se(p, n) for p in acc]
    name = os.path.basename(os.path.normpath(workdir))
    ax.plot(minutes, acc, marker="o", label=name)
    lo = [p - s for p, s in zip(acc, se, strict=True)]
    hi = [p + s for p, s in zip(acc, se, strict=True)]
    ax.fill_between(minutes, lo, hi, alpha=0.2)
    gain_se = math.hypot(se[0], se[-1])
    print(
      f"| {name} | {n} | {acc[0]:.3f} | {acc[-1]:.3f} | "
      f"{100 * (acc[-1] - acc[0]):+.1f} +- {100 * gain_se:.1f} | {minutes[-1]:.1f} |"
    )
  ax.set_xlabel("wall time, minutes (2 CPU cores)")
  ax.set_ylabel(metrics_lib.EVAL_ACCURACY)
  ax.set_title(args.title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.out, dpi=100)
  print(f"figure: {args.out}")


if __name__ == "__main__":
  main()
