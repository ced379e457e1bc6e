r"""Math problems with answers checked by math-verify.

The model's answer is taken as the paper's evaluation takes it (DAPO's prompt and verifier): the
text after the last `Answer:` on the last line that has one, else the last `\boxed{...}` (or
`\fbox{...}`), else nothing (scores 0). It counts as correct when math-verify finds it equivalent
to the row's answer: `verify(parse(gold), parse(pred))`, both wrapped in `\boxed{}` so that bare
LaTeX such as `\frac{3}{4}` or `(0,1]` parses.

math-verify interrupts slow parsing and comparisons with SIGALRM (the main thread only), so
`math_score` must run in a `RewardPool` with workers > 0, whose per-call timeout also bounds what a
signal cannot interrupt (a long big-integer operation in C).
"""

import itertools
import pathlib
import re
from typing import Any

from math_verify import parse, verify  # at module level: a worker imports it when it unpickles
from math_verify.errors import TimeoutException

from ebpo_jax.data import load_rows_and_clusters
from ebpo_jax.data.prepare import read_source
from ebpo_jax.tasks.base import (
  BOXED,
  Task,
  check_fraction,
  check_split,
  last_boxed,
  shuffled_rows,
  split_of,
)
from ebpo_jax.tasks.tokenizers import ByteTokenizer

# DAPO-Math-17K's prompt, the one the paper trained with; `{prompt}` is the problem.
INSTRUCTION = (
  "Solve the following math problem step by step. The last line of your response should be of "
  "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
  '{prompt}\n\nRemember to put your answer on its own line after "Answer:".'
)
# math-verify's own timeouts (whole seconds, SIGALRM) for parsing one text and for one comparison:
# below the trainer's usual per-call timeout, so that a slow answer usually scores 0 without
# costing a worker.
PARSE_TIMEOUT_S = 2
VERIFY_TIMEOUT_S = 2

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)  # DAPO's pattern
_ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)
_FINAL_PERIOD = re.compile(r"(?<!\.)\.$")  # "5." -> "5", but "1, 2, ..." stays
_MATH_DOLLAR = re.compile(r"(?<!\\)\$")  # a `$` that is not the escaped dollar sign `\$`
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def extract_math_answer(response: str) -> str:
  r"""The response's final answer, normalised (see `normalize_math_answer`); "" when it has none.

  The text after the last `Answer:` on the last line that has one (the marker may also end a line,
  with the answer on the next), else the contents of the last `\boxed{...}` or `\fbox{...}`."""
  lines = _ANSWER_LINE.findall(response)
  if lines:
    return normalize_math_answer(_ANSWER_MARKER.split(lines[-1])[-1])
  boxed = last_boxed(response)
  return "" if boxed is None else normalize_math_answer(boxed)


def normalize_math_answer(answer: str) -> str:
  r"""The answer without surrounding space, `**`, a final period, math delimiters (`$`, `\(`,
  `\[`) or a `\boxed{}` around all of it."""
  previous = None
  while answer != previous:
    previous = answer
    answer = _FINAL_PERIOD.sub("", answer.strip().strip("*").strip()).rstrip()
    for left, right in _DELIMITERS:
      inner = answer[len(left) : -len(right)]
      if answer.startswith(left) and answer.endswith(right) and inner and right not in inner:
        answer = inner
        break
    boxed = BOXED.match(answer)
    if boxed and answer.endswith("}") and last_boxed(answer) == answer[boxed.end() : -1]:
      answer = answer[boxed.end() : -1]
  return answer


class MathVerifyTimeout(Exception):
  """math-verify's own timeout: the call scores 0 and the reward pool counts it as an error
  (math-verify itself would log a warning and return a plain "not equivalent")."""


def _parse(answer: str) -> list[Any]:
  r"""math-verify's parse of an answer: in `\boxed{}`, unless it still holds `$` math itself.
  An answer it cannot parse gives [] (as math-verify does); its timeout raises MathVerifyTimeout."""
  text = answer if _MATH_DOLLAR.search(answer) else f"\\boxed{{{answer}}}"
  try:
    return parse(text, parsing_timeout=PARSE_TIMEOUT_S, raise_on_error=True)
  except TimeoutException:
    raise MathVerifyTimeout(f"math-verify timed out parsing (> {PARSE_TIMEOUT_S} s)") from None
  except Exception:
    return []


def _equal(gold: Any, predicted: Any) -> bool:
  """math-verify's comparison of one parsed pair; an error is False (as math-verify's own), its
  timeout raises MathVerifyTimeout."""
  try:
    return bool(verify(gold, predicted, timeout_seconds=VERIFY_TIMEOUT_S, raise_on_error=True))
  except TimeoutException:
    raise MathVerifyTimeout(f"math-verify timed out comparing (> {VERIFY_TIMEOUT_S} s)") from None
  except Exception:
    return False


def math_answers_equivalent(gold: str, predicted: str) -> bool:
  """Whether math-verify finds `predicted` equivalent to `gold` (both answers, not responses):
  `verify(parse(gold), parse(predicted))`, pair by pair as math-verify does, so that its own
  timeouts raise MathVerifyTimeout instead of scoring a silent 0."""
  gold, predicted = normalize_math_answer(gold), normalize_math_answer(predicted)
  if not gold or not predicted:
    return False
  pairs = itertools.product(_parse(gold), _parse(predicted))
  return any(_equal(g, p) for g, p in pairs)


def math_score(response: str, row: dict[str, Any]) -> float:
  """1.0 when the response's final answer (`extract_math_answer`) is equivalent to row["answer"]
  by math-verify, else 0.0. Run it in a RewardPool with workers > 0 (see the module docstring)."""
  return float(math_answers_equivalent(row["answer"], extract_math_answer(response)))


def math_verify_reward(completions: list[str], rows: list[dict], **extras: Any) -> list[float]:
  """`math_score` as a reward function (`reward_fns`, the built-in `math_verify`)."""
  return [math_score(c, row) for c, row in zip(completions, rows, strict=True)]


class MathTask(Task):
  """Math problems from a prepared rows file (`path`) or, without one, from
  `ebpo_jax.data.prepare.read_source(source)`; the eval split is a fixed `eval_fraction` of the
  prompts (by a hash of the prompt). `instruction` is the prompt template, `{prompt}` the
  problem."""

  score = staticmethod(math_score)

  def __init__(
    self,
    path: str = "",
    source: str = "champ",
    eval_fraction: float = 0.2,
    instruction: str = INSTRUCTION,
  ):
    check_fraction(eval_fraction)
    if instruction.count("{prompt}") != 1:
      raise ValueError(
        f"task 'math': instruction must contain '{{prompt}}' once (where the problem goes), got "
        f"{instruction!r}"
      )
    if path:
      rows, self.cluster_names = load_rows_and_clusters(path)
      self.name = f"math:{pathlib.Path(path).name}"
    else:
      rows, self.cluster_names = _source_rows(source)
      self.name = f"math:{source}"
    self._rows = {
      s: [r for r in rows if split_of(r["prompt"], eval_fraction) == s] for s in ("train", "eval")
    }
    self.tokenizer = ByteTokenizer()
    self.instruction = instruction

  def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """At most n rows of the split (all when n <= 0), in an order shuffled by seed."""
    check_split(split, max(n, 0))
    return shuffled_rows(self._rows[split], n, seed)

  def format_prompt(self, row: dict[str, Any]) -> str:
    return self.instruction.replace("{prompt}", row["prompt"])

  def format_target(self, row: dict[str, Any]) -> str:
    return f"Answer: {row['answer']}"

  def extract_answer(self, response: str) -> str:
    """The response's final answer as the scorer reads it (for majority votes)."""
    return extract_math_answer(response)


def _source_rows(source: str) -> tuple[list[dict[str, Any]], list[str]]:
  """The rows of a named source, their cluster names numbered in order of first appearance."""
  rows = read_source(source)
  ids: dict[str, int] = {}
  rows = [{**row, "cluster": ids.setdefault(row["cluster"], len(ids))} for row in rows]
  return rows, list(ids)
