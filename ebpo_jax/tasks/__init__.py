"""Tasks: prompts plus verifiers, by name.

- `arithmetic`: the tiny built-in integer arithmetic task with its character tokenizer.
- `reasoning_gym:<dataset>[+<dataset>...]`: reasoning-gym generators and scorers; several datasets
  become clusters.
- `jsonl`: rows from a file (`path=`), scored by exact match after normalisation.
- `math`: math problems (a prepared file or a named source, e.g. CHAMP), scored by math-verify.
"""

import inspect
from typing import Any

from ebpo_jax.tasks.base import Task, extract_final_answer

TASK_NAMES = ("arithmetic", "reasoning_gym:<dataset>[+<dataset>...]", "jsonl", "math")

__all__ = ["TASK_NAMES", "Task", "extract_final_answer", "get_task"]


def get_task(name: str, **cfg: Any) -> Task:
  """The task called `name`, configured by `cfg` (its constructor's keyword arguments)."""
  if name == "arithmetic":
    from ebpo_jax.tasks.arithmetic import ArithmeticTask

    return _construct(name, ArithmeticTask, cfg)
  if name == "jsonl":
    from ebpo_jax.tasks.jsonl_task import JsonlTask

    return _construct(name, JsonlTask, cfg)
  if name == "math":
    from ebpo_jax.tasks.math_task import MathTask

    return _construct(name, MathTask, cfg)
  if name.startswith("reasoning_gym:"):
    from ebpo_jax.tasks.reasoning_gym_task import ReasoningGymTask

    datasets = name.removeprefix("reasoning_gym:").split("+")
    return _construct(name, ReasoningGymTask, cfg, datasets)
  raise ValueError(f"unknown task {name!r}; known: {', '.join(TASK_NAMES)}")


def _construct(name: str, cls: type, cfg: dict[str, Any], *args: Any) -> Task:
  """cls(*args, **cfg), with unknown options reported as a ValueError naming the task."""
  options = list(inspect.signature(cls.__init__).parameters)[1 + len(args) :]
  unknown = sorted(set(cfg) - set(options))
  if unknown:
    raise ValueError(f"task {name!r}: unknown option(s) {unknown}; options: {', '.join(options)}")
  return cls(*args, **cfg)
