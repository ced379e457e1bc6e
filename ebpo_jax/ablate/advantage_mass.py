"""Where an estimator's advantages go: mean advantage and mean |advantage| of the logged completions
(a run's samples.jsonl) by cluster and group outcome, per run and pooled over a variant's seeds.

GRPO gives a group whose rewards are all equal exactly 0; EBPO's shrunk baseline gives it
r - V != 0, and how large that is per cluster (a hard cluster's all-fail groups against an easy
cluster's all-fail or all-success ones) is what a per-cluster prior changes.

A group's outcome, from its G rewards (before DAPO's overlong penalty, as samples.jsonl has them):
  - "all_fail": every reward <= 0 (max <= 0);
  - "all_success": every reward reaches the full reward (min >= tasks.base.FULL_REWARD);
  - "all_equal_other": all rewards equal, strictly between those (the same partial credit);
  - "mixed": any other group (partial credit that differs counts as mixed).

samples.jsonl holds the first `logging.num_samples` completions of every `logging.samples_every`-th
step's batch, prompt-major: a group's G lines are consecutive and share (step, prompt). A trailing
group cut short by `num_samples` is left out (its outcome is unknown).
"""

import itertools
import os
from collections.abc import Sequence

import numpy as np

from ebpo_jax import files
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.tasks import base as tasks_base

KEY = "advantage_mass"  # a run summary's (and a report row's) key: a list of cells, or None
OUTCOMES = ("all_fail", "mixed", "all_equal_other", "all_success")  # the report's column order


def outcome(rewards: Sequence[float]) -> str:
  """The outcome of a group with these rewards (see the module docstring)."""
  low, high = min(rewards), max(rewards)
  if high <= 0.0:
    return "all_fail"
  if low >= tasks_base.FULL_REWARD:
    return "all_success"
  return "all_equal_other" if low == high else "mixed"


def groups(records: Sequence[dict], group_size: int) -> list[list[dict]]:
  """The complete groups of samples.jsonl's records: runs of consecutive lines with the same
  (step, prompt), cut into chunks of `group_size` (a prompt drawn twice in a row gives two groups);
  a shorter remainder is dropped."""
  out = []
  for _, run in itertools.groupby(records, key=lambda r: (r["step"], r["prompt"])):
    run = list(run)
    out += [run[i : i + group_size] for i in range(0, len(run) - group_size + 1, group_size)]
  return out


def cells(groups_: Sequence[Sequence[dict]], clusters: Sequence[str] = ()) -> list[dict]:
  """Per (cluster, outcome) present: {"cluster", "outcome", "groups", "count" (completions),
  "adv_mean", "abs_mean"}, ordered by `clusters` (others after, by name), then by OUTCOMES."""
  advantages: dict[tuple[str, str], list[float]] = {}
  group_counts: dict[tuple[str, str], int] = {}
  for group in groups_:
    key = (group[0]["cluster"], outcome([r["reward"] for r in group]))
    advantages.setdefault(key, []).extend(r["advantage"] for r in group)
    group_counts[key] = group_counts.get(key, 0) + 1
  return [
    _cell(key, group_counts[key], np.asarray(advantages[key], dtype=np.float64))
    for key in sorted(advantages, key=lambda key: sort_key(key, clusters))
  ]


def _cell(key: tuple[str, str], groups_: int, adv: np.ndarray) -> dict:
  """One (cluster, outcome) cell from its groups' count and its completions' advantages."""
  cluster, kind = key
  return {
    "cluster": cluster,
    "outcome": kind,
    "groups": groups_,
    "count": int(adv.size),
    "adv_mean": float(adv.mean()),
    "abs_mean": float(np.abs(adv).mean()),
  }


def sort_key(key: tuple[str, str], clusters: Sequence[str]) -> tuple:
  """Orders (cluster, outcome) pairs: by `clusters` (others after, by name), then by OUTCOMES."""
  cluster, kind = key
  known = list(clusters)
  at = known.index(cluster) if cluster in known else len(known)
  return at, cluster, OUTCOMES.index(kind)


def summarize(run_dir: str | os.PathLike, group_size: int, clusters: Sequence[str] = ()):
  """`cells` of the run's samples.jsonl; None when the run logged no samples (no file, or
  `logging.samples_every` 0) or no complete group."""
  path = files.join(run_dir, metrics_lib.SAMPLES_FILE)
  if not files.exists(path):
    return None
  records = metrics_lib.read_metrics(path)  # JSON lines with an integer step, as metrics.jsonl
  return cells(groups(records, group_size), clusters) or None


def pool(runs: Sequence[dict]) -> tuple[list[dict] | None, int]:
  """(cells pooled over the runs' summaries, how many runs had cells): counts add up and the means
  are over all the completions together (weighted by count, not a mean of the runs' means). None
  and 0 when no run has cells (none logged samples, or all were summarized before this existed)."""
  per_run = [r[KEY] for r in runs if r.get(KEY)]
  if not per_run:
    return None, 0
  totals: dict[tuple[str, str], dict] = {}
  for run_cells in per_run:
    for cell in run_cells:
      total = totals.setdefault(
        (cell["cluster"], cell["outcome"]), {"groups": 0, "count": 0, "adv": 0.0, "abs": 0.0}
      )
      total["groups"] += cell["groups"]
      total["count"] += cell["count"]
      total["adv"] += cell["adv_mean"] * cell["count"]
      total["abs"] += cell["abs_mean"] * cell["count"]
  clusters = runs[0].get("clusters", ())
  pooled = [
    {
      "cluster": cluster,
      "outcome": kind,
      "groups": t["groups"],
      "count": t["count"],
      "adv_mean": t["adv"] / t["count"],
      "abs_mean": t["abs"] / t["count"],
    }
    for (cluster, kind), t in sorted(totals.items(), key=lambda kv: sort_key(kv[0], clusters))
  ]
  return pooled, len(per_run)
