"""The tool-call text format of Hermes/Qwen chat templates, written and read in one place.

A model calls a tool with `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` and reads its
result as `<tool_response>TEXT</tool_response>`; `tools_system_prompt` tells it so, for a chat
template that does not render the tool schemas itself. The environments (`ebpo_jax.envs`) parse
calls and format responses with these functions; a task's warm-start transcripts (`arith_tool`)
write them.
"""

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]


def format_call(name: str, arguments: dict[str, Any]) -> str:
  """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
  return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def tools_system_prompt(schemas: Sequence[dict[str, Any]]) -> str:
  """The tool schemas (`envs.tool_schema`'s) and the call format, in the words of the Hermes/Qwen
  chat templates' system prompt: what a template that ignores `tools=` leaves out."""
  listed = "\n".join(json.dumps(schema) for schema in schemas)
  return (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    f"<tools>\n{listed}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n"
    f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
  )


def format_response(text: str) -> str:
  """`<tool_response>text</tool_response>`: a tool's result as the model reads it."""
  return f"{RESPONSE_OPEN}{text}{RESPONSE_CLOSE}"


def parse_call(text: str) -> ToolCall | None:
  """The first tool call of a model turn; None when the turn holds none (a final answer).
  A malformed call (unclosed, bad JSON, no name, arguments not an object) raises ValueError."""
  start = text.find(CALL_OPEN)
  if start < 0:
    return None
  body, closed, _ = text[start + len(CALL_OPEN) :].partition(CALL_CLOSE)
  if not closed:
    raise ValueError(f"the tool call is not closed by {CALL_CLOSE}")
  try:
    call = json.loads(body)
  except json.JSONDecodeError as e:
    raise ValueError(f"the tool call is not JSON ({e})") from None
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    raise ValueError('the tool call has no "name"')
  arguments = call.get("arguments", {})
  if not isinstance(arguments, dict):
    raise ValueError('the tool call\'s "arguments" is not an object')
  return ToolCall(call["name"], arguments)
