"""The Task interface, the train/eval split, and answer extraction shared by the tasks."""

import abc
import hashlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

SPLITS = ("train", "eval")
FULL_REWARD = 1.0  # a response is correct when its reward reaches this (evaluate, difficulty)


class Task(abc.ABC):
  """Prompts plus a verifier.

  `rows(split, n, seed)` gives rows `{"prompt", "answer", "cluster", "difficulty", ...}`; the train
  and eval splits never share a prompt. `score(response, row) -> float in [0, 1]` is a top-level
  function (picklable, so it runs in a process pool); subclasses set it as
  `score = staticmethod(fn)`. `tokenizer` is the task's own tokenizer for random-init models
  (arithmetic: characters; the others: UTF-8 bytes). `format_prompt(row)` is the text the model
  sees, `format_target(row)` the text a supervised warm start teaches it (the caller appends EOS).
  `name_arg`: the constructor keyword that the `:ARG` part of the task's name sets (see `tasks`).
  """

  name: str
  cluster_names: list[str]
  score: ClassVar[Callable[[str, dict[str, Any]], float]]
  name_arg: ClassVar[str | None] = None
  tokenizer: Any = None
  system_prompt: str | None = None

  @abc.abstractmethod
  def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n rows of `split` ('train' or 'eval'), deterministic in seed."""

  def check_row(self, row: dict[str, Any]) -> str | None:
    """The problem of a row that this task cannot score (a rows file's), or None."""
    del row
    return None

  def format_prompt(self, row: dict[str, Any]) -> str:
    return row["prompt"]

  def format_target(self, row: dict[str, Any]) -> str:
    return row["answer"]

  def target_turns(self, row: dict[str, Any]) -> list[tuple[str, str]]:
    """The warm start's transcript as (role, text) turns: role "model" is trained, any other is
    not ("observation": an environment's text, encoded as the rollouts encode it; "untrained":
    the model's text shown but not taught); a single-turn task's is its target."""
    return [("model", self.format_target(row))]

  def extract_answer(self, response: str) -> str:
    """The response's final answer, normalised: the key of a majority vote (maj@k)."""
    return normalize_answer(extract_final_answer(response))


def check_split(split: str, n: int) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"the number of rows must be an int >= 0, got {n!r}")


def split_of(key: str, eval_fraction: float) -> str:
  """'eval' for a fixed share of keys (by a hash of the text, independent of any seed)."""
  digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
  return "eval" if int.from_bytes(digest, "big") < eval_fraction * 2**64 else "train"


def take_split(
  candidates: Iterator[dict[str, Any]],
  split: str,
  n: int,
  *,
  eval_fraction: float,
  where: str,
  max_misses: int = 100_000,
) -> list[dict[str, Any]]:
  """The first n candidate rows whose prompt falls in `split` (duplicates allowed)."""
  out, misses = [], 0
  for row in candidates:
    if len(out) == n:
      break
    if split_of(row["prompt"], eval_fraction) == split:
      out.append(row)
    else:
      misses += 1
      if misses > max_misses:
        raise ValueError(f"{where}: found only {len(out)} of {n} {split} prompts")
  return out


def generated_rows(
  candidates: Callable[[int], Iterator[dict[str, Any]]],
  cluster_names: Sequence[str],
  split: str,
  n: int,
  *,
  eval_fraction: float,
  where: str,
) -> list[dict[str, Any]]:
  """n rows of a generated task's `split`, spread evenly over its clusters (`candidates(k)`
  yields cluster k's rows) and interleaved; errors name `where` and the cluster."""
  check_split(split, n)
  quotas = cluster_quotas(n, len(cluster_names))
  per_cluster = [
    take_split(
      candidates(k), split, quotas[k], eval_fraction=eval_fraction, where=f"{where} {name}"
    )
    for k, name in enumerate(cluster_names)
  ]
  return interleave(per_cluster)


def shuffled_rows(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
  """At most n of `rows` (all when n <= 0), in an order shuffled by seed (file-backed tasks)."""
  order = np.random.default_rng(np.random.SeedSequence([seed])).permutation(len(rows))
  return [rows[i] for i in (order if n <= 0 else order[:n])]


def cluster_quotas(n: int, num_clusters: int) -> list[int]:
  """n split as evenly as possible over the clusters (the first ones get the remainder)."""
  return [n // num_clusters + (k < n % num_clusters) for k in range(num_clusters)]


def interleave(per_cluster: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
  """Rows of all clusters taken in turn, so that any prefix is balanced."""
  out = []
  for i in range(max(map(len, per_cluster), default=0)):
    out.extend(rows[i] for rows in per_cluster if i < len(rows))
  return out


def check_fraction(eval_fraction: float) -> None:
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")


# ------------------------------------------------------------------------------ answers in text

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_AFTER = re.compile(r"answer\s*(?:is)?\s*[:：]", re.IGNORECASE)


def extract_final_answer(response: str) -> str:
  r"""The model's final answer: the last `<answer>...</answer>`, else all text after the last
  `Answer:` (answers may span lines, e.g. grids), else the last `\boxed{...}`, else the last
  non-empty line. Leading/trailing space, `**` and `$`, and a period after a number are dropped."""
  tags = _ANSWER_TAG.findall(response)
  if tags:
    return _clean(tags[-1])
  markers = list(_ANSWER_AFTER.finditer(response))
  if markers:
    return _clean(response[markers[-1].end() :])
  boxed = last_boxed(response)
  if boxed is not None:
    return _clean(boxed)
  nonempty = [line for line in response.splitlines() if line.strip()]
  return _clean(nonempty[-1]) if nonempty else ""


BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
  r"""The contents of the last `\boxed{...}` or `\fbox{...}` (braces nested), None if there is
  none or it is not closed."""
  starts = list(BOXED.finditer(text))
  if not starts:
    return None
  begin, depth = starts[-1].end(), 0
  for i in range(begin, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth < 0:
      return text[begin:i]
  return None


def _clean(answer: str) -> str:
  answer = answer.strip().strip("*").strip()
  if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
    answer = answer.strip("$").strip()
  return _NUMBER_AND_PERIOD.sub(r"\1", answer)


_NUMBER_AND_PERIOD = re.compile(r"^(-?[\d,]*\.?\d+)\.$")  # "42." -> "42" (a sentence keeps its ".")


def normalize_answer(answer: str) -> str:
  """Lower case, whitespace collapsed, a final period and thousands separators dropped."""
  answer = " ".join(answer.lower().split()).removesuffix(".")
  return re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)


def answers_match(predicted: str, gold: str) -> bool:
  """Equal after `normalize_answer`, or both numbers with the same value."""
  predicted, gold = normalize_answer(predicted), normalize_answer(gold)
  if predicted == gold:
    return True
  try:
    a, b = float(predicted), float(gold)
  except ValueError:
    return False
  return math.isfinite(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
