"""Ablations: one config under several advantage estimators, group sizes and seeds.

  python -m ebpo_jax.ablate --config=configs/arith_ebpo.py --workdir=/tmp/ablation \
      [--variants=grpo,ebpo_running,...] [--group_sizes=2,4,8,16] [--seeds=3] [--workers=2] \
      [--config.train.num_steps=100 ...]

Every run is `python -m ebpo_jax.train` in its own process (one device each on a CPU), with the
variant's config overrides. The supervised warm start runs once per seed (a run with
`train.num_steps=0`); each variant of that seed starts from a copy of its step-0 checkpoint, so all
variants of a seed share the warm-started policy, the initial evaluation and the data order (the
data order and the rollout keys follow `seed`). A run that finished is skipped when the ablation is
started again; one that was interrupted resumes from its latest checkpoint.

Writes WORKDIR/ablation.md (final accuracy mean and spread per variant and group size, per cluster,
gain of the hardest cluster, zero-advantage share, entropy, steps to a target gain), ablation.json
(every run's summary) and plots in WORKDIR/plots/, then prints a short summary.
"""

import concurrent.futures
import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tqdm
from absl import app, flags
from ml_collections import config_flags

from ebpo_jax import metrics as metrics_lib

# Each variant sets every estimator key, so the base config's choice does not leak into it.
_EBPO = {"rl.advantage": "ebpo", "rl.ebpo.decay": 1.0, "rl.ebpo.per_cluster": True}
VARIANTS: dict[str, dict[str, Any]] = {
  "grpo": {"rl.advantage": "grpo"},
  "dr_grpo": {"rl.advantage": "dr_grpo"},
  "rloo": {"rl.advantage": "rloo"},
  "js_shrinkage": {"rl.advantage": "js_shrinkage"},
  # The authors' released code: one global prior from the current batch only, batch normalisation.
  "ebpo_batch": {
    **_EBPO,
    "rl.ebpo.mode": "batch",
    "rl.ebpo.normalize": "batch",
    "rl.ebpo.per_cluster": False,
  },
  # The paper's Algorithm 1 with a prior per cluster (running), batch normalisation.
  "ebpo_running": {**_EBPO, "rl.ebpo.mode": "running", "rl.ebpo.normalize": "batch"},
  # The same with one global running prior (paper claim: per-cluster priors help).
  "ebpo_global": {
    **_EBPO,
    "rl.ebpo.mode": "running",
    "rl.ebpo.normalize": "batch",
    "rl.ebpo.per_cluster": False,
  },
  "ebpo_decay": {
    **_EBPO,
    "rl.ebpo.mode": "running",
    "rl.ebpo.normalize": "batch",
    "rl.ebpo.decay": 0.9,
  },
  # Running per-cluster prior, other scalings of r - V (see advantages.ebpo).
  "ebpo_group": {**_EBPO, "rl.ebpo.mode": "running", "rl.ebpo.normalize": "group"},
  "ebpo_cluster": {**_EBPO, "rl.ebpo.mode": "running", "rl.ebpo.normalize": "cluster"},
  "ebpo_none": {**_EBPO, "rl.ebpo.mode": "running", "rl.ebpo.normalize": "none"},
}
DEFAULT_VARIANTS = ("grpo", "dr_grpo", "rloo", "js_shrinkage", "ebpo_batch", "ebpo_running",
                    "ebpo_global", "ebpo_decay", "ebpo_group")  # fmt: skip
RESULT_FILE = "result.json"  # written in a run's directory when the run finished


class AblationError(RuntimeError):
  """A run failed; the message names the run and its log file."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: a variant at a group size and seed."""

  variant: str
  group_size: int
  seed: int

  @property
  def name(self) -> str:
    return f"{self.variant}_G{self.group_size}_s{self.seed}"


def plan(variants: Sequence[str], group_sizes: Sequence[int], seeds: Sequence[int]) -> list[Run]:
  """All (variant, G, seed) runs, seed-major so that early results already pair the variants."""
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    raise ValueError(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
  if not group_sizes or any(int(g) < 2 for g in group_sizes):
    raise ValueError(f"group sizes must be >= 2, got {list(group_sizes)}")
  if not seeds:
    raise ValueError("at least one seed is needed")
  return [Run(v, int(g), int(s)) for s in seeds for g in group_sizes for v in variants]


# ----------------------------------------------------------------------------- running


def _override_args(overrides: Mapping[str, Any]) -> list[str]:
  args = []
  for key, value in overrides.items():
    text = repr(value) if isinstance(value, tuple) else str(value)
    args.append(f"--config.{key}={text}")
  return args


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of a run: one CPU device (the mesh spans all devices a process sees)."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
  return env


def _train(config: str, workdir: pathlib.Path, args: Sequence[str], env: Mapping[str, str]) -> None:
  """Runs the trainer on `workdir`, output to workdir/log.txt; raises AblationError on failure."""
  workdir.mkdir(parents=True, exist_ok=True)
  cmd = [
    sys.executable,
    "-m",
    "ebpo_jax.train",
    f"--config={config}",
    f"--workdir={workdir}",
    *args,
  ]
  with open(workdir / "log.txt", "a", encoding="utf-8") as log:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), check=False)
  if proc.returncode != 0:
    tail = (workdir / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
    raise AblationError(
      f"run {workdir.name} failed (exit {proc.returncode}); log: {workdir / 'log.txt'}\n"
      + "\n".join(tail)
    )


def _warm_dir(workdir: pathlib.Path, seed: int) -> pathlib.Path:
  return workdir / "warm_start" / f"s{seed}"


def _ensure_warm_start(config, workdir, seed, base_args, env) -> pathlib.Path:
  """The step-0 checkpoint (warm start + first evaluation) of `seed`, trained once."""
  warm = _warm_dir(workdir, seed)
  if not (warm / RESULT_FILE).exists():
    _train(config, warm, [*base_args, f"--config.seed={seed}", "--config.train.num_steps=0"], env)
    (warm / RESULT_FILE).write_text("{}\n")
  return warm


def _start_from_warm(warm: pathlib.Path, run_dir: pathlib.Path) -> None:
  """Copies the warm start's step-0 checkpoint and metrics into a fresh run directory."""
  if (run_dir / "checkpoints").exists():
    return  # started before: the trainer resumes from its own latest checkpoint
  run_dir.mkdir(parents=True, exist_ok=True)
  shutil.copy(warm / metrics_lib.METRICS_FILE, run_dir / metrics_lib.METRICS_FILE)
  tmp = run_dir / "checkpoints.tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(warm / "checkpoints", tmp)
  tmp.rename(run_dir / "checkpoints")


def _run_one(config, workdir, run: Run, base_args, env, warm_locks) -> dict:
  run_dir = workdir / "runs" / run.name
  if (run_dir / RESULT_FILE).exists():
    return json.loads((run_dir / RESULT_FILE).read_text())
  with warm_locks[run.seed]:
    warm = _ensure_warm_start(config, workdir, run.seed, base_args, env)
  _start_from_warm(warm, run_dir)
  overrides = {**VARIANTS[run.variant], "rl.group_size": run.group_size, "seed": run.seed}
  start = time.perf_counter()
  _train(config, run_dir, [*base_args, *_override_args(overrides)], env)
  result = summarize_run(run_dir, run)
  result["wall_s"] = time.perf_counter() - start
  (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
  return result


def run_ablation(
  config: str,
  workdir: str | os.PathLike,
  *,
  variants: Sequence[str] = DEFAULT_VARIANTS,
  group_sizes: Sequence[int] = (8,),
  seeds: int | Sequence[int] = 3,
  workers: int = 1,
  overrides: Sequence[str] = (),
  target_gain: float = 0.10,
  progress: bool = True,
  env: Mapping[str, str] | None = None,
) -> dict:
  """Runs every (variant, G, seed) not finished yet, then writes the report; returns it.

  `config` is a config path with an optional `:arg`; `overrides` are extra trainer flags applied to
  every run, e.g. ["--config.train.num_steps=100"]. `seeds` is a count (0..n-1) or a list.
  `workers` runs go at once, each in its own process with one device (`env` defaults to this
  process's environment with one CPU device; pass your own for accelerators). Returns the report
  dict (`rows`, `runs`, `markdown`, `summary`, `plots`).
  """
  workdir = pathlib.Path(workdir).resolve()
  seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
  runs = plan(variants, group_sizes, seed_list)
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  for arg in overrides:
    if not arg.startswith("--config."):
      raise ValueError(f"overrides must look like --config.KEY=VALUE, got {arg!r}")
  workdir.mkdir(parents=True, exist_ok=True)
  env = child_env() if env is None else dict(env)
  warm_locks = {seed: threading.Lock() for seed in seed_list}
  results, failures = [], []
  bar = tqdm.tqdm(total=len(runs), desc="ablation", unit="run", disable=not progress)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = {
      pool.submit(_run_one, config, workdir, run, list(overrides), env, warm_locks): run
      for run in runs
    }
    for future in concurrent.futures.as_completed(futures):
      try:
        results.append(future.result())
      except AblationError as e:
        failures.append(str(e))
      bar.update()
      bar.set_postfix(done=len(results), failed=len(failures))
  bar.close()
  if failures:
    raise AblationError(f"{len(failures)} of {len(runs)} runs failed:\n" + "\n".join(failures))
  report = build_report(results, target_gain=target_gain)
  report["plots"] = plot_ablation(workdir, results)
  header = {"config": config, "overrides": list(overrides), "date": str(datetime.date.today())}
  report["markdown"] = render_markdown(report, header)
  (workdir / "ablation.md").write_text(report["markdown"])
  (workdir / "ablation.json").write_text(json.dumps({**header, **report}, indent=1) + "\n")
  return report


# ----------------------------------------------------------------------------- summaries


def summarize_run(run_dir: str | os.PathLike, run: Run) -> dict:
  """A run's numbers from its metrics.jsonl: accuracy curves per cluster, train metric means."""
  records = metrics_lib.read_metrics(run_dir)
  evals = [r for r in records if r.get("eval/accuracy") is not None]
  train = [r for r in records if "reward/mean" in r]
  if not evals or not train:
    raise AblationError(f"run {run.name}: no evaluation or training lines in {run_dir}")
  prefix = "eval/accuracy/"
  clusters = [k.removeprefix(prefix) for k in evals[0] if k.startswith(prefix)]  # trainer's order
  curve = {
    "step": [r["step"] for r in evals],
    "all": [r["eval/accuracy"] for r in evals],
    **{c: [r.get(f"eval/accuracy/{c}") for r in evals] for c in clusters},
  }

  def mean_of(key: str) -> float | None:
    values = [r[key] for r in train if r.get(key) is not None]
    return float(np.mean(values)) if values else None

  return {
    **dataclasses.asdict(run),
    "name": run.name,
    "clusters": clusters,
    "curve": curve,
    "zero_frac": mean_of("adv/zero_frac"),
    "entropy_final": float(np.mean([r["entropy"] for r in train[-max(len(train) // 10, 1) :]])),
    "grad_norm": mean_of("grad_norm"),
    "shrinkage": mean_of("ebpo/shrinkage_mean"),
  }


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
    lines += [f"![{pathlib.Path(p).stem}](plots/{pathlib.Path(p).name})" for p in report["plots"]]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def plot_ablation(workdir: str | os.PathLike, results: Sequence[dict]) -> list[str]:
  """Accuracy over steps per variant (mean over seeds): overall and hardest cluster, one figure
  per group size, in WORKDIR/plots/. Returns the paths."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  out_dir = pathlib.Path(workdir) / metrics_lib.PLOTS_DIR
  out_dir.mkdir(parents=True, exist_ok=True)
  hard = _hardest_cluster(results)
  keys = ["all"] + ([hard] if hard is not None else [])
  paths = []
  for g in sorted({r["group_size"] for r in results}):
    fig = Figure(figsize=(6.0 * len(keys), 4.0))
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
      ax = fig.add_subplot(1, len(keys), i + 1)
      for variant in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["group_size"] == g and r["variant"] == variant]
        if not runs:
          continue
        steps, mean = mean_curve(runs, key)
        ax.plot(steps, mean, marker="o", markersize=3, label=variant)
      ax.set_title(f"G={g}: held-out accuracy, {'all clusters' if key == 'all' else key}")
      ax.set_xlabel("RL step")
      ax.grid(alpha=0.3)
      ax.legend(fontsize="small")
    path = out_dir / f"ablation_accuracy_G{g}.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    paths.append(str(path))
  return paths


def mean_curve(runs: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
  """Mean over runs (summaries from `summarize_run`) of the accuracy curve `key` ("all" or a
  cluster name), at the evaluation steps all of them share."""
  shared = set(runs[0]["curve"]["step"])
  for r in runs[1:]:
    shared &= set(r["curve"]["step"])
  steps = sorted(shared)
  values = []
  for step in steps:
    at = [r["curve"][key][r["curve"]["step"].index(step)] for r in runs]
    values.append(float(np.mean([v for v in at if v is not None])))
  return steps, values


def load_results(workdir: str | os.PathLike) -> list[dict]:
  """Every finished run's summary under WORKDIR/runs/."""
  return [
    json.loads(path.read_text())
    for path in sorted(pathlib.Path(workdir).glob(f"runs/*/{RESULT_FILE}"))
  ]


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  config_flag = f["config"]
  try:
    report = run_ablation(
      config_flags.get_config_filename(config_flag),
      f.workdir,
      variants=[v for v in f.variants.split(",") if v],
      group_sizes=[int(g) for g in f.group_sizes.split(",") if g],
      seeds=f.seeds,
      workers=f.workers,
      overrides=_override_args(config_flags.get_override_values(config_flag)),
      target_gain=f.target_gain,
    )
  except (AblationError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(report["markdown"])
  print(f"report: {pathlib.Path(f.workdir) / 'ablation.md'}")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Experiment config file (path[:arg]).")
  flags.DEFINE_string("workdir", None, "Directory for the runs, ablation.md and plots.")
  flags.DEFINE_string(
    "variants", ",".join(DEFAULT_VARIANTS), f"Comma list of: {', '.join(VARIANTS)}."
  )
  flags.DEFINE_string("group_sizes", "8", "Comma list of group sizes G.")
  flags.DEFINE_integer("seeds", 3, "Number of seeds (0..n-1).")
  flags.DEFINE_integer("workers", 1, "Runs at once (each one process, one device).")
  flags.DEFINE_float("target_gain", 0.10, "Gain of the hardest cluster counted as 'reached'.")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
