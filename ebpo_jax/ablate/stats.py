"""Seed statistics for the ablation report: Student t intervals, differences paired by seed.

With a handful of seeds the spread of a mean is wide, and a normal (z) interval or a population
standard deviation would make it look narrower than it is; these use the sample standard deviation
(n - 1) and the t quantile with n - 1 degrees of freedom. A single seed has no interval at all.
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.95  # the report's confidence level


def t_quantile(n: int, level: float = LEVEL) -> float:
  """t_{(1 + level) / 2, n - 1}: the two-sided critical value of a mean over `n` >= 2 values."""
  if n < 2:
    raise ValueError(f"a t interval needs at least 2 values, got {n}")
  return float(scipy_stats.t.ppf((1.0 + level) / 2.0, n - 1))


def mean_ci(
  values: Sequence[float], level: float = LEVEL
) -> tuple[float, float | None, float | None]:
  """(mean, low, high) of `values` (one per seed): mean +- t_{(1+level)/2, n-1} * sd / sqrt(n),
  sd with ddof=1. One value has no spread to estimate: (mean, None, None), never a 0-wide interval.
  """
  x = np.asarray(values, dtype=np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"mean_ci needs a non-empty list of numbers, got {values!r}")
  mean = float(x.mean())
  if x.size == 1:
    return mean, None, None
  half = t_quantile(x.size, level) * float(x.std(ddof=1)) / math.sqrt(x.size)
  return mean, mean - half, mean + half


def paired_differences(
  ours: Mapping[int, float], reference: Mapping[int, float]
) -> dict[int, float]:
  """Per seed, ours minus reference, over the seeds both have (sorted): a seed run by only one side
  has no partner and is dropped, since its warm start and data order differ from the others'."""
  return {seed: ours[seed] - reference[seed] for seed in sorted(ours) if seed in reference}


def interval(values: Sequence[float], level: float = LEVEL) -> dict:
  """`mean_ci` as the report stores it: {"mean", "low", "high", "n"} (low and high None for n=1)."""
  mean, low, high = mean_ci(values, level)
  return {"mean": mean, "low": low, "high": high, "n": len(values)}


def format_interval(mean: float, low: float | None, high: float | None, n: int) -> str:
  """'+0.113 [+0.013, +0.212] (n=4)'; one value: '+0.200 (n=1, no CI)'."""
  if low is None or high is None:
    return f"{mean:+.3f} (n={n}, no CI)"
  return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}] (n={n})"
