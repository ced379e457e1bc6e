"""Rewards as plain callables: `config.rewards.fns`, the built-in functions, and their weighted sum.

A reward function takes a batch and returns one value per completion:

    def brevity(completions: list[str], rows: list[dict], **extras) -> list[float | None]:
      return [1.0 - len(c) / 100 for c in completions]

`rows` are the completions' data rows (`prompt`, `answer`, `cluster`, ... as the task made them).
Keyword extras (accept `**extras`; more may be added): `lengths` (list[int], completion tokens, the
stop token included), `max_new_tokens` (int), `task_score` (the task's own verifier, `(completion,
row) -> float`), `transcripts` (list[list[dict]]: each completion's whole trajectory after the
prompt as messages `{"role": "assistant" | "observation", "content": text}`; in multi-turn rollouts
the completion is the last model turn, and a term that judges the tool use or the earlier turns
reads them here; a single-turn completion is one assistant message). A value is a finite float, or
None: "not applicable" to that completion. It runs in the verifier process pool
(`tasks.rewards.RewardPool`, `rewards.workers`; one worker when that is 0) one completion per call,
so that each has its own `rewards.timeout_s`: a call that raises, hangs, kills its worker or returns
anything else scores 0 and counts in `reward/errors`. It must be trusted code: `load` imports its
module in the trainer process, and the workers run it with the trainer's user and files (they
isolate crashes and hangs, not a hostile module). A function is found by its path, so it must be a
module's top-level function (the workers import the module; import heavy dependencies at module
level, see `rewards`).

`config.rewards.fns` is one string, a comma-separated weighted sum; each term is
`[NAME=][WEIGHT*]FN`, FN a built-in (`BUILTINS`) or `package.module:function`, WEIGHT 1 when
left out, NAME the function's own name when left out:

    --config.rewards.fns="math_verify, 0.5*my_rewards:brevity"
    --config.rewards.fns="task, -0.1*length_penalty"          # the task's verifier, shorter wins

The training reward of a completion is then sum_f WEIGHT_f * value_f, a None adding 0 (TRL's
`reward_weights` rule); it drives the advantages and is logged as `reward/mean`; each function's
mean value over the batch (its Nones left out) as `reward/<NAME>`. `""` (the default): the task's
verifier alone is the reward, as before reward functions existed. Evaluation (`eval/accuracy`,
`python -m ebpo_jax.evaluate`) always scores with the task's verifier: it measures correctness.

Why a string and not a list of {fn, weight, name} (TRL's `reward_funcs` + `reward_weights`, verl's
`custom_reward_function.path/name`): ml_collections sets only keys that a config file already has,
so neither a list nor a ConfigDict keyed by name could take a new function from the command line;
one string can, and reads as the sum it defines.
"""

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ebpo_jax.tasks import load_object
from ebpo_jax.tasks.base import answers_match, extract_final_answer

# Built-in reward functions by name, as paths (imported when used: math-verify takes seconds).
BUILTINS: dict[str, str] = {
  "task": "ebpo_jax.tasks.reward_fns:task_verifier",
  "exact_match": "ebpo_jax.tasks.reward_fns:exact_match",
  "math_verify": "ebpo_jax.tasks.math_task:math_verify_reward",
  "answer_format": "ebpo_jax.tasks.reward_fns:answer_format",
  "length_penalty": "ebpo_jax.tasks.reward_fns:length_penalty",
}
_NAME = re.compile(r"[A-Za-z_]\w*")
_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True)
class RewardFn:
  """One term of the training reward: `weight * fn(...)`, logged as `reward/<name>`."""

  name: str
  fn: Callable[..., Sequence[float | None]]
  weight: float
  path: str  # "package.module:function"


def parse(spec: str) -> list[tuple[str, float, str]]:
  """(name, weight, path) of each term of `spec` (see the module docstring); a ValueError naming
  the term that does not parse or repeats a name. Imports nothing."""
  terms = []
  for term in (t.strip() for t in spec.split(",")):
    if not term:
      continue
    name, eq, rest = term.partition("=")
    if not eq:
      name, rest = "", term
    weight_text, star, fn = rest.rpartition("*")
    fn = fn.strip()
    try:
      weight = float(weight_text) if star else 1.0
    except ValueError:
      raise ValueError(f"term {term!r}: weight {weight_text.strip()!r} is not a number") from None
    if not math.isfinite(weight):
      raise ValueError(f"term {term!r}: weight must be finite")
    if fn in BUILTINS:
      path = BUILTINS[fn]
    elif _PATH.fullmatch(fn):
      path = fn
    else:
      raise ValueError(
        f"term {term!r}: {fn!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
        "'package.module:function'"
      )
    name = name.strip() or fn.rpartition(":")[2]
    if not _NAME.fullmatch(name):
      raise ValueError(f"term {term!r}: name {name!r} is not an identifier")
    if name in {t[0] for t in terms}:
      raise ValueError(f"term {term!r}: a second term named {name!r} (set NAME=)")
    terms.append((name, weight, path))
  return terms


def load(spec: str) -> list[RewardFn]:
  """The reward functions of `spec`, imported; a ValueError of one line naming the term whose
  module does not import, or whose function is missing or not callable."""
  fns = []
  for name, weight, path in parse(spec):
    try:
      fn = load_object(path)
    except ValueError as e:
      raise ValueError(f"reward {name!r}: {e}") from None
    if not callable(fn):
      raise ValueError(f"reward {name!r}: {path} is a {type(fn).__name__}, not a function")
    fns.append(RewardFn(name, fn, weight, path))
  return fns


def spec_of(rewards: Sequence[Any]) -> str:
  """The `rewards.fns` string of Python rewards (`ebpo_jax.trainer.run(..., rewards=[...])`):
  each a function (weight 1), a `(function, weight)` pair, or a term as `rewards.fns` writes it
  (`"math_verify"`). A function becomes `NAME=WEIGHT*module:function`: the scorer processes import
  it by that path, so it must be a top-level function of an importable module (in a notebook:
  write it to a file with `%%writefile my_rewards.py` and `from my_rewards import fn`). Anything
  else is a ValueError of one line saying why."""
  terms = []
  for item in rewards:
    if isinstance(item, str):
      terms.append(item)
      continue
    fn, weight = item if isinstance(item, tuple) else (item, 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
      raise ValueError(f"{getattr(fn, '__name__', fn)!r}: weight {weight!r} is not a number")
    terms.append(f"{fn.__name__}={float(weight)!r}*{_path_of(fn)}")
  return ", ".join(terms)


def _path_of(fn: Any) -> str:
  """`module:function` of a function that a fresh process imports as this very object."""
  if not inspect.isfunction(fn):
    raise ValueError(f"{getattr(fn, '__name__', fn)} is not a Python function (def ...)")
  name, module = fn.__qualname__, fn.__module__
  if fn.__name__ == "<lambda>":
    raise ValueError(
      "a lambda cannot run in the scorer processes, which import a reward by its module path: "
      "define it with def in a module file"
    )
  if "." in name:
    raise ValueError(
      f"{fn.__name__} is defined inside {name.rpartition('.')[0]}: a reward must be defined at "
      "the top level of a module, which the scorer processes import"
    )
  if module == "__main__":
    raise ValueError(
      f"{name} is defined in __main__ (a notebook or a script), which the scorer processes "
      f"cannot import: write it to a module file (in a notebook: %%writefile my_rewards.py) and "
      f"import it from there"
    )
  path = f"{module}:{name}"
  if load_object(path) is not fn:
    raise ValueError(f"{path} does not import as the function given (redefined?)")
  return path


def combine(values_fn: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """The training reward [N] float32: sum_f weights[f] * values_fn[f], NaN (None) adding 0.

  values_fn: [F, N], NaN where a function returned None."""
  weights_f = np.asarray(weights, np.float64)[:, None]
  return np.nansum(weights_f * np.asarray(values_fn, np.float64), axis=0).astype(np.float32)


def means(values_fn: np.ndarray) -> np.ndarray:
  """[F] each function's mean over its applicable values (NaN when none was)."""
  values_fn = np.asarray(values_fn, np.float64)
  applicable = ~np.isnan(values_fn)
  totals = np.where(applicable, values_fn, 0.0).sum(axis=1)
  counts = applicable.sum(axis=1)
  return np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)


# ----------------------------------------------------------------------------- the built-ins
# Each returns floats in [0, 1] (length_penalty: [-1, 0]) and None only where noted.


def task_verifier(
  completions: list[str], rows: list[dict], *, task_score: Callable, **extras: Any
) -> list[float]:
  """The task's own verifier (arithmetic, reasoning-gym, ...), as a term of the sum."""
  return [float(task_score(c, row)) for c, row in zip(completions, rows, strict=True)]


def exact_match(completions: list[str], rows: list[dict], **extras: Any) -> list[float]:
  """1.0 when the final answer (`base.extract_final_answer`) equals row["answer"] after
  normalisation, or both are the same number (`base.answers_match`); the jsonl task's verifier."""
  return [
    float(answers_match(extract_final_answer(c), row["answer"]))
    for c, row in zip(completions, rows, strict=True)
  ]


_ANSWER_LINE = re.compile(r"\s*answer\s*:\s*\S", re.IGNORECASE)


def answer_format(completions: list[str], rows: list[dict], **extras: Any) -> list[float]:
  """1.0 when the last non-empty line is `Answer: <something>` (DAPO's format, which the `math`
  and `reasoning_gym` prompts ask for), else 0.0."""
  out = []
  for c in completions:
    lines = [line for line in c.splitlines() if line.strip()]
    out.append(float(bool(lines and _ANSWER_LINE.match(lines[-1]))))
  return out


def length_penalty(
  completions: list[str], rows: list[dict], *, lengths: list[int], max_new_tokens: int, **extras
) -> list[float]:
  """-length / max_new_tokens, in [-1, 0]: with a weight w, a full-length completion costs w."""
  return [-min(n, max_new_tokens) / max_new_tokens for n in lengths]
