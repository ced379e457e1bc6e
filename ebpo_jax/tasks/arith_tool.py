"""Multiplication with a calculator tool: "123*456=" -> "56088", for multi-turn RL (`env.name=tool`
with `env.tools=calc`, configs/arith_tool.py).

The tiny decoder cannot multiply 3- and 4-digit numbers itself; it can call `calc`
(`<tool_call>{"name": "calc", "arguments": {"expression": "123*456"}}</tool_call>`), read the
`<tool_response>` and copy the result. The warm start's transcripts (`target_turns`) call the tool
in a share `tool_fraction` of the rows (chosen by a hash of the prompt) and answer directly in the
others, so RL has to find out that the tool pays. The tokenizer holds the call's fixed text and the
tags as pieces (`tokenizers.PieceTokenizer`): a call is 9-11 tokens.
"""

import hashlib
from collections.abc import Sequence
from typing import Any

from ebpo_jax.tasks import tool_calls
from ebpo_jax.tasks.arithmetic import ArithmeticTask, score_arithmetic
from ebpo_jax.tasks.tokenizers import PieceTokenizer

_CALL_HEAD, _CALL_TAIL = tool_calls.format_call("calc", {"expression": "@"}).split("@")


def tool_tokenizer() -> PieceTokenizer:
  """Bytes plus the tags and the calc call's fixed text; a turn ends at EOS or `</tool_call>`.
  Digits stay one token each: with 3-digit chunks (1000 rare tokens) the warm start did not make
  the copies sharp enough to be sampled right at temperature 1."""
  pieces = [_CALL_HEAD, _CALL_TAIL, tool_calls.RESPONSE_OPEN, tool_calls.RESPONSE_CLOSE]
  return PieceTokenizer(pieces, stop_pieces=(_CALL_TAIL,))


class ArithToolTask(ArithmeticTask):
  """Integer arithmetic (clusters by operation and digits, `ArithmeticTask`) whose warm start
  demonstrates the `calc` tool in a share of the rows."""

  score = staticmethod(score_arithmetic)

  def __init__(
    self,
    ops: Sequence[str] = ("mul",),
    digits: Sequence[int] = (3, 4),
    clusters: Sequence[str] | None = None,
    eval_fraction: float = 0.2,
    tool_fraction: float = 0.25,
  ):
    super().__init__(ops, digits, clusters, eval_fraction)
    if not 0.0 <= tool_fraction <= 1.0:
      raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction!r}")
    self.name, self.tool_fraction = "arith_tool", tool_fraction
    self.tokenizer = tool_tokenizer()

  def target_turns(self, row: dict[str, Any]) -> list[tuple[str, str]]:
    """The warm start's transcript: a calc call, its response and the answer; or the answer, of
    which only the first digit is trained (the choice to answer directly, not a multiplication
    this model cannot learn: fitting more of its digits crowds out copying the numbers in and out
    of the tool in the other rows; with 3 digits, 1 of 3 seeds learned to copy)."""
    if not _uses_tool(row["prompt"], self.tool_fraction):
      answer = row["answer"]
      return [("model", answer[:1]), ("untrained", answer[1:])]
    expression = row["prompt"].removesuffix("=")
    return [
      ("model", tool_calls.format_call("calc", {"expression": expression})),
      ("observation", tool_calls.format_response(row["answer"])),
      ("model", row["answer"]),
    ]


def _uses_tool(prompt: str, fraction: float) -> bool:
  digest = hashlib.blake2b(f"tool:{prompt}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") < fraction * 2**64
