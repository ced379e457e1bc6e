"""Ablations: one config under several advantage estimators, group sizes and seeds.

  python -m ebpo_jax.ablate --config=configs/arith_ebpo.py --workdir=/tmp/ablation \
      [--variants=grpo,ebpo_running,...] [--group_sizes=2,4,8,16] [--seeds=3] [--workers=2] \
      [--config.train.num_steps=100 ...] [--report_only]

Every run is `python -m ebpo_jax.train` in its own process (one device each on a CPU), with the
variant's config overrides. The supervised warm start runs once per seed (a run with
`train.num_steps=0`); each variant of that seed starts from its params (`model.init_from`, no warm
start of its own) with a fresh state of its own estimator, so all variants of a seed share the
warm-started policy, the initial evaluation and the data order (they follow `seed`). A run that
finished is skipped when the ablation is started again, unless its resolved config changed (the
config file, the overrides, or its seed's warm start): then it runs again from scratch; one that was
interrupted resumes from its latest checkpoint.

Writes WORKDIR/ablation.md (per variant and group size over the seeds: final accuracy mean and
spread, per cluster; the hardest cluster's gain with a 95% Student t interval; each variant minus
GRPO paired by seed, of that gain and of the final accuracy, with 95% t intervals; the share of
all-equal groups, zero-advantage share, grad norm, entropy; steps to a target gain; where the
advantages go: mean |advantage| and mean advantage of the logged completions (samples.jsonl) by
cluster and group outcome, all-fail / mixed / all-success, pooled over the seeds), ablation.json
(those rows and every run's summary) and plots in WORKDIR/plots/ (held-out accuracy; the training
diagnostics: reward, groups without signal, EBPO's shrinkage and prior, gradient norm, entropy),
then prints the report, its summary last. `--report_only` runs nothing: it reports the runs of the
plan that have finished (a long ablation's results so far) and names the others.

WORKDIR may be `gs://bucket/...`: the runs are trainer workdirs under it, and every file goes
through `ebpo_jax.files`. A run's log.txt grows as the run goes on a local WORKDIR; on a bucket
(which cannot append) the run writes it to a local temporary file, uploaded when the run ends.
"""

import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import numpy as np
import tqdm

from ebpo_jax import files, process
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.ablate import advantage_mass
from ebpo_jax.ablate.diagnostics import (  # noqa: F401  (panel_curves: for notebooks)
  panel_curves,
  plot_diagnostics,
  run_workdir,
)
from ebpo_jax.ablate.report import (  # noqa: F401  (for notebooks: ablation_figure, mean_curve, seed_band)
  ablation_figure,
  build_report,
  mean_curve,
  plot_ablation,
  render_markdown,
  seed_band,
)
from ebpo_jax.trainer import workdir as workdir_lib

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
WALL_FILE = "wall_s"  # a run's seconds of training so far, over the invocations that ended


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


# Each run's own end-of-run plots (about 4 s a run): off; the report draws the ablation's.
NO_RUN_PLOTS = "--config.logging.plots=False"


def _override_args(overrides: Mapping[str, Any]) -> list[str]:
  args = []
  for key, value in overrides.items():
    text = repr(value) if isinstance(value, tuple) else str(value)
    args.append(f"--config.{key}={text}")
  return args


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
  """The environment of a run: one CPU device (the mesh spans all devices a process sees)."""
  return process.fake_cpu_devices_env(1, base)


@contextlib.contextmanager
def _log_file(path: str) -> Iterator[tuple[str, TextIO]]:
  """(local path, file open for appending) of a run's log `path`: `path` itself when local; for a
  remote `path` a local temporary file, appended to `path` (one upload) when the block ends."""
  if not files.is_remote(path):
    with open(path, "a", encoding="utf-8") as log:
      yield path, log
    return
  with tempfile.NamedTemporaryFile("a+", encoding="utf-8", suffix=".log") as log:
    try:
      yield log.name, log
    finally:
      log.flush()
      appender = files.Appender(path)
      appender.write(files.read_text(log.name))
      appender.close()


def _train(config: str, workdir: str, args: Sequence[str], env: Mapping[str, str]) -> None:
  """Runs the trainer on `workdir`, output to workdir/log.txt; raises AblationError on failure."""
  files.makedirs(workdir)
  cmd = [
    sys.executable,
    "-m",
    "ebpo_jax.train",
    f"--config={config}",
    f"--workdir={workdir}",
    *args,
  ]
  log_path = files.join(workdir, "log.txt")
  with _log_file(log_path) as (local_log, log):
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), check=False)
    log.flush()
    tail = files.read_text(local_log).splitlines()[-5:]
  if proc.returncode != 0:
    raise AblationError(
      f"run {_basename(workdir)} failed (exit {proc.returncode}); log: {log_path}\n"
      + "\n".join(tail)
    )


def _basename(path: str) -> str:
  return os.path.basename(os.fspath(path).rstrip("/"))


def _warm_dir(workdir: str, seed: int) -> str:
  return files.join(workdir, "warm_start", f"s{seed}")


def _ensure_warm_start(config, workdir, seed, base_args, env) -> str:
  """The step-0 checkpoint (warm start + first evaluation) of `seed`, trained once per config: a
  warm start of another config is trained again, and the runs of its seed, which started from the
  old one, are deleted first. One kept without its checkpoint (a committed ablation keeps a run's
  config, summary and metrics only) is trained again, the same config: its seed's runs stay."""
  warm = _warm_dir(workdir, seed)
  args = [*base_args, f"--config.seed={seed}", "--config.train.num_steps=0"]
  if _ran_with(warm, config, args):
    if files.exists(files.join(warm, RESULT_FILE)):
      if files.isdir(files.join(warm, workdir_lib.CHECKPOINTS_DIR)):
        return warm
      files.remove_tree(warm)
  else:
    for run_dir in _seed_runs(workdir, seed):
      files.remove_tree(run_dir)
    files.remove_tree(warm)
  _train(config, warm, args, env)
  files.write_atomic(files.join(warm, RESULT_FILE), "{}\n")
  return warm


def _ran_with(run_dir: str, config: str, args: Sequence[str]) -> bool:
  """Whether `run_dir` holds a run (config.json) of the config that `config` and `args` resolve
  to; any changed key counts, steps included (the result would differ)."""
  saved = workdir_lib.saved_config(run_dir)
  return saved is not None and not workdir_lib.changed_keys(
    saved, workdir_lib.resolved_config(config, args)
  )


def _seed_runs(workdir: str, seed: int) -> list[str]:
  runs = files.join(workdir, "runs")
  names = files.listdir(runs) if files.isdir(runs) else []
  return [files.join(runs, name) for name in names if name.endswith(f"_s{seed}")]


def _variant_args(warm: str, run: Run, base_args: Sequence[str]) -> list[str]:
  """The trainer flags of `run`, started from the warm start in `warm`."""
  overrides = {**VARIANTS[run.variant], "rl.group_size": run.group_size, "seed": run.seed}
  overrides.update({"model.init_from": warm, "sft.num_steps": 0})
  return [*base_args, *_override_args(overrides)]


def _finished_result(config, workdir, run: Run, base_args) -> dict | None:
  """`run`'s summary if it finished under the config it would run with now, else None."""
  run_dir = run_workdir(workdir, run.name)
  args = _variant_args(_warm_dir(workdir, run.seed), run, base_args)
  if files.exists(files.join(run_dir, RESULT_FILE)) and _ran_with(run_dir, config, args):
    return read_result(run_dir)
  return None


def _run_one(config, workdir, run: Run, base_args, env, warm_locks) -> dict:
  """Trains `run` (or resumes it), unless it finished under the same config; returns its result.
  A run of another config (changed overrides, config file or warm start) starts afresh."""
  run_dir = run_workdir(workdir, run.name)
  with warm_locks[run.seed]:
    warm = _ensure_warm_start(config, workdir, run.seed, base_args, env)
  # The variant starts from the warm start's params (its own state: the estimator's prior may have
  # another shape); the same seed gives it the same step-0 evaluation and data order.
  finished = _finished_result(config, workdir, run, base_args)
  if finished is not None:
    return finished
  args = _variant_args(warm, run, base_args)
  if not _ran_with(run_dir, config, args):  # interrupted under this config: resumes, else afresh
    files.remove_tree(run_dir)
  wall_s = _timed_train(config, run_dir, args, env)
  result = summarize_run(run_dir, run)
  result["wall_s"] = wall_s
  files.write_atomic(files.join(run_dir, RESULT_FILE), json.dumps(result, indent=1) + "\n")
  return result


def _timed_train(config, run_dir, args, env) -> float:
  """Trains (or resumes) the run in `run_dir`; returns the seconds its invocations took, this one
  and those that ended before it (a failed trainer, Ctrl-C: WALL_FILE; a killed ablation process
  records none)."""
  wall_path = files.join(run_dir, WALL_FILE)
  earlier = float(files.read_text(wall_path)) if files.exists(wall_path) else 0.0
  start = time.perf_counter()
  try:
    _train(config, run_dir, args, env)
  finally:
    wall_s = earlier + time.perf_counter() - start
    if files.isdir(run_dir):
      files.write_atomic(wall_path, f"{wall_s}\n")
  return wall_s


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
  report_only: bool = False,
) -> dict:
  """Runs every (variant, G, seed) not finished yet, then writes the report; returns it.
  `report_only`: runs nothing and reports the runs of the plan that finished under this config (a
  long ablation's results so far); the report names the others.

  `config` is a config path with an optional `:arg`; `overrides` are extra trainer flags applied to
  every run, e.g. ["--config.train.num_steps=100"]; the runs draw no plots of their own (the report
  draws the ablation's; `--config.logging.plots=True` in `overrides` asks for them). `seeds` is a
  count (0..n-1) or a list.
  `workers` runs go at once, each in its own process with one device (`env` defaults to this
  process's environment with one CPU device; pass your own for accelerators). Returns the report
  dict (`rows`, `runs`, `markdown`, `summary`, `plots`).
  """
  workdir = files.abspath(workdir)
  seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
  runs = plan(variants, group_sizes, seed_list)
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  for arg in overrides:
    if not arg.startswith("--config."):
      raise ValueError(f"overrides must look like --config.KEY=VALUE, got {arg!r}")
  run_args = [NO_RUN_PLOTS, *overrides]  # a later flag wins: overrides may turn them on
  header = {"config": config, "overrides": list(overrides), "date": str(datetime.date.today())}
  if report_only:
    found = {run.name: _finished_result(config, workdir, run, run_args) for run in runs}
    results = [result for result in found.values() if result is not None]
    if not results:
      raise AblationError(f"no run of this plan finished in {workdir} under this config")
    header["not_finished"] = [name for name, result in found.items() if result is None]
    return _write_report(workdir, results, header, target_gain)
  files.makedirs(workdir)
  env = child_env() if env is None else dict(env)
  warm_locks = {seed: threading.Lock() for seed in seed_list}
  results, failures = [], []
  bar = tqdm.tqdm(total=len(runs), desc="ablation", unit="run", disable=not progress)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = {
      pool.submit(_run_one, config, workdir, run, run_args, env, warm_locks): run for run in runs
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
  return _write_report(workdir, results, header, target_gain)


def _write_report(workdir: str, results: list[dict], header: dict, target_gain: float) -> dict:
  """Builds the report of `results`, draws its plots, writes ablation.md and ablation.json."""
  report = build_report(results, target_gain=target_gain)
  report["plots"] = plot_ablation(workdir, results) + plot_diagnostics(workdir, results)
  report["markdown"] = render_markdown(report, header)
  files.write_atomic(files.join(workdir, "ablation.md"), report["markdown"])
  files.write_atomic(
    files.join(workdir, "ablation.json"), json.dumps({**header, **report}, indent=1) + "\n"
  )
  return report


# ----------------------------------------------------------------------------- summaries


def summarize_run(run_dir: str | os.PathLike, run: Run) -> dict:
  """A run's numbers from its metrics.jsonl: accuracy curves per cluster; means over the RL steps
  of the share of all-equal groups, of zero advantages, of the grad norm and of EBPO's shrinkage;
  the entropy of the last tenth of the steps. From its samples.jsonl: the advantages by cluster and
  group outcome (`advantage_mass.summarize`; None when the run logged no samples)."""
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
    "all_equal_frac": mean_of(metrics_lib.ADV_ALL_EQUAL_FRAC),
    "zero_frac": mean_of(metrics_lib.ADV_ZERO_FRAC),
    "entropy_final": float(np.mean([r["entropy"] for r in train[-max(len(train) // 10, 1) :]])),
    "grad_norm": mean_of(metrics_lib.GRAD_NORM),
    "shrinkage": mean_of(metrics_lib.EBPO_SHRINKAGE_MEAN),
    advantage_mass.KEY: advantage_mass.summarize(run_dir, run.group_size, clusters),
  }


def read_result(run_dir: str | os.PathLike) -> dict:
  """A finished run's summary (its result.json)."""
  return json.loads(files.read_text(files.join(run_dir, RESULT_FILE)))


def load_results(workdir: str | os.PathLike) -> list[dict]:
  """Every finished run's summary under WORKDIR/runs/."""
  runs = files.join(workdir, "runs")
  if not files.isdir(runs):
    return []
  run_dirs = [files.join(runs, name) for name in files.listdir(runs)]
  return [read_result(d) for d in run_dirs if files.exists(files.join(d, RESULT_FILE))]
