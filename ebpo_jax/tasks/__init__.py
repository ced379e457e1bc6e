"""Tasks: prompts plus verifiers, found by name in `TASKS`.

- `arithmetic`: the tiny built-in integer arithmetic task with its character tokenizer.
- `arith_tool`: multiplication that the tiny model learns to do with a calculator tool (multi-turn).
- `reasoning_gym:<dataset>[+<dataset>...]`: reasoning-gym generators and scorers; several datasets
  become clusters.
- `jsonl`: rows from a file (`path=`), scored by exact match after normalisation.
- `math`: math problems (a prepared file or a named source, e.g. CHAMP), scored by math-verify.

`TASKS` maps a name to its class as `"module:Class"`, imported only when the task is used (the
reasoning-gym and math-verify imports take seconds). A task named `KEY:ARG` (reasoning_gym) passes
ARG, split at `+`, as the keyword its class names in `name_arg`. Reward functions (`reward_fns`)
and the verifier pool (`rewards`) are the other half of scoring.
"""

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from ebpo_jax.errors import BadInput, ConfigError
from ebpo_jax.tasks.base import Task, extract_final_answer

TASKS: dict[str, str] = {
  "arithmetic": "ebpo_jax.tasks.arithmetic:ArithmeticTask",
  "reasoning_gym": "ebpo_jax.tasks.reasoning_gym_task:ReasoningGymTask",
  "jsonl": "ebpo_jax.tasks.jsonl_task:JsonlTask",
  "math": "ebpo_jax.tasks.math_task:MathTask",
  "arith_tool": "ebpo_jax.tasks.arith_tool:ArithToolTask",
}

# Constructor keywords that `from_config` sets from `config.data`, not `config.task.options`.
FROM_DATA = ("columns",)

__all__ = [
  "FROM_DATA",
  "TASKS",
  "Task",
  "extract_final_answer",
  "from_config",
  "get_task",
  "load_object",
]


def load_object(path: str) -> Any:
  """The object a `"package.module:name"` path names (a task class, a reward function); a
  ValueError of one line when the module does not import or lacks the name."""
  module_name, colon, attr = path.partition(":")
  if not colon or not module_name or not attr:
    raise ValueError(f"{path!r} is not of the form 'package.module:name'")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # the module's own error, on one line
    raise ValueError(f"cannot import {module_name!r} ({type(e).__name__}: {e})") from None
  try:
    return getattr(module, attr)
  except AttributeError:
    raise ValueError(f"module {module_name!r} has no {attr!r}") from None


def get_task(name: str, **options: Any) -> Task:
  """The task called `name`, configured by `options` (its constructor's keyword arguments; an
  unknown one is a ValueError naming the task)."""
  cls, name_kwargs = _task_class(name)
  known = _options_of(cls)
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f"task {name!r}: unknown option(s) {unknown}; options: {', '.join(known)}")
  return cls(**name_kwargs, **options)


def from_config(task_config: Mapping[str, Any], columns: Any = None) -> Task:
  """The task of `config.task`: `name`, and the entries of `options` that its constructor names
  and that are set (not None); a task whose constructor names `columns` also gets `columns` (the
  `data.Columns` of `config.data`: where its rows file keeps prompt, answer and cluster).

  `config.task.options` holds the keywords of every task (configs/common.py; None: the task's own
  default), so that any of them can be set from the command line; each task takes its own and
  leaves the others, as the grpo estimator leaves `rl.ebpo.*`. An unknown name or a bad option is
  a ConfigError of one line naming the key."""
  name = task_config["name"]
  try:
    cls, _ = _task_class(name)
  except ValueError as e:
    raise ConfigError(f"config.task.name={name!r}: {e}") from None
  known = set(_options_of(cls))
  options = {k: v for k, v in task_config["options"].items() if k in known and v is not None}
  if columns is not None and "columns" in known:  # FROM_DATA
    options["columns"] = columns
  try:
    return get_task(name, **options)
  except BadInput:  # a rows file the task reads names itself (FILE:LINE)
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.task.options: task {name!r}: {e}") from None


def _task_class(name: str) -> tuple[type, dict[str, Any]]:
  """(the registered class of `name`, the keyword its `:ARG` part sets, if any)."""
  key, colon, arg = name.partition(":")
  if key not in TASKS:
    raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
  cls = load_object(TASKS[key])
  name_arg = cls.name_arg
  if name_arg is None and colon:
    raise ValueError(f"task {key!r} takes no ':' part, got {name!r}")
  if name_arg is not None and not arg:
    raise ValueError(f"task {key!r} is named {key}:<{name_arg}>[+<...>], got {name!r}")
  return cls, ({name_arg: arg.split("+")} if name_arg else {})


def _options_of(cls: type) -> list[str]:
  """The keyword options of a task class: its constructor's parameters but `name_arg`'s."""
  parameters = list(inspect.signature(cls.__init__).parameters)[1:]
  return [p for p in parameters if p != cls.name_arg]
