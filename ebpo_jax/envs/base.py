"""The environment interface of multi-turn rollouts, and the tool-serving environment.

An episode: `reset(row)` gives the first observation (None: the prompt alone), then each model turn
goes to `step(model_text)`, which returns `(observation or None, reward or None, done)`. The
observation's tokens are appended to the trajectory (loss mask 0) and the model's next turn
continues from there. When the episode ends with reward None, the task's verifier scores the last
model turn (or `rewards.fns`, whose terms also read the whole transcript).

Each step runs in a worker of the verifier pool (`step_in_worker`: the environment object goes to
the worker and comes back with the step's result), so a step that hangs or kills its worker costs
one error observation (`error_observation`), never the run. An environment counts its own tool
calls and failed calls (`tool_calls`, `tool_errors`): the rollouts log them.
"""

import abc
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any

from ebpo_jax.tasks import tool_calls

StepResult = tuple[str | None, float | None, bool]  # (observation, reward, done)


class Environment(abc.ABC):
  """A multi-turn episode over one data row (subclass: `reset` and `step`; picklable)."""

  tool_calls: int = 0  # tool calls the model made in this episode
  tool_errors: int = 0  # of them, the failed ones (bad call, unknown tool, raised, bad result)
  tools: tuple[Callable[..., str], ...] = ()  # rendered into the prompt by a chat template
  stop_strings: tuple[str, ...] = ()  # texts that end a model turn, as end-of-turn tokens do

  def reset(self, row: dict[str, Any]) -> str | None:
    """Starts an episode on `row`; returns the first observation, or None for none."""
    return None

  @abc.abstractmethod
  def step(self, model_text: str) -> StepResult:
    """The environment's answer to one model turn: (observation, reward, done)."""

  def error_observation(self, message: str) -> str:
    """What the model reads when a step failed outside the environment (timed out, killed its
    worker, raised): counted as a tool error."""
    return tool_calls.format_response(f"error: {message}")


class ToolEnvironment(Environment):
  """Serves plain Python functions as tools (TRL's `tools=`): a model turn holding a
  `<tool_call>` runs the named tool on its arguments and the result comes back as a
  `<tool_response>` observation; a turn without one ends the episode (the verifier scores it).
  A tool returns text (str); anything else, an exception, a malformed call or an unknown name is an
  error observation, counted in `tool_errors`. A model turn ends right after a call's close tag
  (`stop_strings`), so the model reads the response before it goes on."""

  stop_strings = (tool_calls.CALL_CLOSE,)

  def __init__(self, tools: Sequence[Callable[..., str]] = ()):
    self.tools = tuple(tools)
    self._by_name = {fn.__name__: fn for fn in self.tools}
    self.tool_calls = self.tool_errors = 0

  def reset(self, row: dict[str, Any]) -> str | None:
    self.tool_calls = self.tool_errors = 0
    return None

  def step(self, model_text: str) -> StepResult:
    try:
      call = tool_calls.parse_call(model_text)
    except ValueError as e:
      return self._failed(str(e))
    if call is None:
      return None, None, True
    self.tool_calls += 1
    fn = self._by_name.get(call.name)
    if fn is None:
      self.tool_calls -= 1  # counted once, by _failed
      return self._failed(f"unknown tool {call.name!r}; tools: {', '.join(self._by_name)}")
    try:
      result = fn(**call.arguments)
    except Exception as e:
      self.tool_errors += 1
      return tool_calls.format_response(f"error: {type(e).__name__}: {e}"), None, False
    if not isinstance(result, str):
      self.tool_errors += 1
      return tool_calls.format_response(f"error: {call.name} returned no text"), None, False
    return tool_calls.format_response(result), None, False

  def _failed(self, message: str) -> StepResult:
    self.tool_calls += 1
    self.tool_errors += 1
    return tool_calls.format_response(f"error: {message}"), None, False


def step_in_worker(env: Environment, model_text: str) -> tuple[bool, Any, str]:
  """`env.step(model_text)` in a pool worker: (ok, (env after the step, observation, reward,
  done), error message). An exception or a result of the wrong types is not ok."""
  try:
    observation, reward, done = env.step(model_text)
  except Exception as e:
    return False, None, f"{type(e).__name__}: {e}"
  if observation is not None and not isinstance(observation, str):
    return False, None, f"step returned a {type(observation).__name__} observation, not text"
  if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
    return False, None, f"step returned reward {reward!r}, not a number or None"
  return True, (env, observation, None if reward is None else float(reward), bool(done)), ""


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
  """The JSON schema of a tool (OpenAI's function format, as chat templates' `tools=` take it):
  its name, its docstring's first line, its parameters from the type hints."""
  kinds = {str: "string", int: "integer", float: "number", bool: "boolean"}
  hints = typing.get_type_hints(fn)
  parameters = inspect.signature(fn).parameters
  properties = {name: {"type": kinds.get(hints.get(name), "string")} for name in parameters}
  required = [n for n, p in parameters.items() if p.default is inspect.Parameter.empty]
  doc = (inspect.getdoc(fn) or fn.__name__).splitlines()[0]
  schema = {"type": "object", "properties": properties, "required": required}
  return {
    "type": "function",
    "function": {"name": fn.__name__, "description": doc, "parameters": schema},
  }
