"""Evaluation metrics computed the long way, to check ebpo_jax.evaluate's."""

import itertools


def brute_pass_at_k(correct: list[bool], k: int) -> float:
  """Share of the k-subsets of the samples that hold a correct one."""
  subsets = list(itertools.combinations(correct, k))
  return sum(any(s) for s in subsets) / len(subsets)
