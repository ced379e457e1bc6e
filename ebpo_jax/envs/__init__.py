"""Environments and tools for multi-turn rollouts (`config.env`); they know nothing of the trainer,
the sampler or the models: text in, text out.

- `tool`: `ToolEnvironment`, which serves `config.env.tools` (plain functions) to the model.
- `package.module:Class`: an `Environment` subclass of your own.

Tools are named like reward functions: a built-in (`calc`) or `package.module:function`.
"""

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ebpo_jax.envs.base import Environment, ToolEnvironment, step_in_worker, tool_schema
from ebpo_jax.errors import ConfigError
from ebpo_jax.tasks import load_object

ENVS: dict[str, str] = {"tool": "ebpo_jax.envs.base:ToolEnvironment"}
TOOLS: dict[str, str] = {"calc": "ebpo_jax.envs.tools:calc"}

__all__ = [
  "ENVS",
  "TOOLS",
  "Environment",
  "ToolEnvironment",
  "from_config",
  "load_tools",
  "step_in_worker",
  "tool_schema",
]


def load_tools(spec: str) -> tuple[Callable[..., str], ...]:
  """The tools of a comma-separated list of built-in names and `package.module:function` paths."""
  names = [s.strip() for s in spec.split(",") if s.strip()]
  tools = tuple(load_object(TOOLS.get(name, name)) for name in names)
  for name, fn in zip(names, tools, strict=True):
    if not callable(fn):
      raise ValueError(f"tool {name!r} is not a function")
  return tools


def from_config(env_config: Mapping[str, Any]) -> Callable[[], Environment] | None:
  """A factory of fresh environments (one per trajectory; picklable) for `config.env`, or None
  when `env.name` is "" (single-turn rollouts). A bad name, tool or option: a ConfigError naming
  the key."""
  name = env_config["name"]
  if not name:
    return None
  try:
    cls = load_object(ENVS.get(name, name))
  except ValueError as e:
    raise ConfigError(f"config.env.name={name!r}: {e}; built-in: {', '.join(ENVS)}") from None
  if not (inspect.isclass(cls) and issubclass(cls, Environment)):
    raise ConfigError(f"config.env.name={name!r} is not an ebpo_jax.envs.Environment subclass")
  try:
    tools = load_tools(env_config["tools"])
  except ValueError as e:
    raise ConfigError(f"config.env.tools={env_config['tools']!r}: {e}") from None
  kwargs = dict(env_config["options"])
  if "tools" in inspect.signature(cls.__init__).parameters:
    kwargs["tools"] = tools
  elif tools:
    raise ConfigError(f"config.env.tools: environment {name!r} takes no tools")
  factory = functools.partial(cls, **kwargs)
  try:
    factory()
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.env.options: environment {name!r}: {e}") from None
  return factory
