"""Integer arithmetic, the tiny built-in task: "12+34=" -> "46", a character tokenizer.

Clusters are (operation, digit count) pairs named like `add_2`: both operands have exactly that many
digits (1 digit: 0-9). Subtraction puts the larger operand first, so answers are never negative.
Difficulty is a rough rank for the curriculum order: the digit count, +0.5 for `sub` (borrows), x2
for `mul`.
"""

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ebpo_jax.tasks.base import Task, check_fraction, generated_rows
from ebpo_jax.tasks.tokenizers import CharTokenizer

OPS = {"add": "+", "sub": "-", "mul": "*"}
_DIFFICULTY = {"add": lambda d: float(d), "sub": lambda d: d + 0.5, "mul": lambda d: 2.0 * d}
MAX_DIGITS = 9


def score_arithmetic(response: str, row: dict[str, Any]) -> float:
  """1.0 when the response up to its first newline is the answer (surrounding spaces ignored)."""
  return float(response.split("\n", 1)[0].strip() == row["answer"])


class ArithmeticTask(Task):
  """Integer arithmetic with clusters by operation and digit count."""

  score = staticmethod(score_arithmetic)

  def __init__(
    self,
    ops: Sequence[str] = ("add",),
    digits: Sequence[int] = (1, 2, 3),
    clusters: Sequence[str] | None = None,
    eval_fraction: float = 0.2,
  ):
    """Clusters are all (op, digits) pairs, or the given names like ("add_1", "mul_2")."""
    names = list(clusters) if clusters else [f"{o}_{d}" for o, d in itertools.product(ops, digits)]
    self.clusters = [_parse_cluster(name) for name in names]
    if len(set(names)) != len(names) or not names:
      raise ValueError(f"arithmetic clusters must be distinct and non-empty, got {names}")
    check_fraction(eval_fraction)
    self.name = "arithmetic"
    self.cluster_names = names
    self.eval_fraction = eval_fraction
    self.tokenizer = CharTokenizer()

  def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    candidates = lambda k: self._candidates(k, seed)
    return generated_rows(
      candidates, self.cluster_names, split, n, eval_fraction=self.eval_fraction, where="arithmetic"
    )

  def _candidates(self, k: int, seed: int) -> Iterator[dict[str, Any]]:
    """An endless stream of problems of cluster k, the same for both splits."""
    op, digits = self.clusters[k]
    rng = np.random.default_rng(np.random.SeedSequence([seed, k]))
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
    while True:
      a, b = (int(x) for x in rng.integers(low, high, size=2))
      if op == "sub" and a < b:
        a, b = b, a
      answer = {"add": a + b, "sub": a - b, "mul": a * b}[op]
      yield {
        "prompt": f"{a}{OPS[op]}{b}=",
        "answer": str(answer),
        "cluster": k,
        "difficulty": _DIFFICULTY[op](digits),
      }


def _parse_cluster(name: str) -> tuple[str, int]:
  op, _, digits = name.partition("_")
  if op not in OPS or not digits.isdigit() or not 1 <= int(digits) <= MAX_DIGITS:
    raise ValueError(
      f"arithmetic cluster {name!r} must be <op>_<digits> with op in {tuple(OPS)} and digits "
      f"1-{MAX_DIGITS}"
    )
  return op, int(digits)
