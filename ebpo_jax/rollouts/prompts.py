"""One prompt encoder: a task's rows as the policy reads them, for the rollouts
(`worker.RolloutWorker`), the row checks before anything compiles (`task_rows`) and the
supervised warm start's answers.

A row's prompt is the task's prompt format under its system prompt, through the tokenizer's chat
template, left-padded to the smallest of `sampling.prompt_buckets` that fits the longest prompt of
a batch (`sampling.pad_prompts`); its answer is the task's target format, then EOS.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from ebpo_jax import envs, sampling, tasks


@dataclasses.dataclass(frozen=True, eq=False)
class PromptEncoder:
  """Encodes rows of `task` with `tokenizer` (`tasks.tokenizers`' interface: `prompt_ids`,
  `encode`, `pad_id`, `eos_id`) into prompt length buckets."""

  task: tasks.Task
  tokenizer: Any
  buckets: tuple[int, ...]  # sampling.prompt_buckets
  tools: tuple[dict, ...] = ()  # the environment's tool schemas (`envs.tool_schema`)

  @classmethod
  def from_config(
    cls, config: ml_collections.ConfigDict, task: tasks.Task, tokenizer
  ) -> "PromptEncoder":
    factory = envs.from_config(config.env)
    tools = () if factory is None else tuple(envs.tool_schema(fn) for fn in factory().tools)
    return cls(task, tokenizer, tuple(config.sampling.prompt_buckets), tools)

  def prompt_ids(self, row: dict) -> list[int]:
    """The row's prompt tokens, as the sampler sees them: a chat row's (`messages`) earlier turns
    before its last user turn, which the task formats (with the tools, for a chat template)."""
    history = row.get("messages", [])[:-1]
    text = self.task.format_prompt(row)
    return self.tokenizer.prompt_ids(text, self.task.system_prompt, history, self.tools)

  def target_ids(self, row: dict) -> list[int]:
    """The row's answer tokens (the task's transcript `target_turns`, no EOS), as the warm start
    sees them."""
    return self.target_turns(row)[0]

  def target_turns(self, row: dict) -> tuple[list[int], list[bool]]:
    """(tokens, trained) of the row's warm-start transcript (no EOS): "model" turns are trained;
    observations are encoded as the rollouts encode them (`observation_ids`); other roles are
    not trained (`Task.target_turns`)."""
    ids, trained = [], []
    for role, text in self.task.target_turns(row):
      part = self.observation_ids(text) if role == "observation" else self.tokenizer.encode(text)
      ids += part
      trained += [role == "model"] * len(part)
    return ids, trained

  def observation_ids(self, text: str, *, after_end_of_turn: bool = True) -> list[int]:
    """An environment's observation as the tokens appended to a trajectory (`after_end_of_turn`:
    the model's turn ended with one of the tokenizer's stop ids, not at a stop string)."""
    return self.tokenizer.observation_ids(text, after_end_of_turn=after_end_of_turn)

  def prompts(self, rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Host `(ids, mask)` [N, P] of the rows' prompts, left-padded to a length bucket."""
    token_lists = [self.prompt_ids(row) for row in rows]
    return sampling.pad_prompts(token_lists, self.tokenizer.pad_id, self.buckets)

  def targets(
    self, rows: Sequence[dict], max_len: int
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows' transcripts + EOS, cut to `max_len` tokens, as `(ids, mask, loss_mask)`
    [N, max_len]; `loss_mask` leaves out observation tokens."""
    tokenizer = self.tokenizer
    targets = np.full((len(rows), max_len), tokenizer.pad_id, np.int32)
    target_mask = np.zeros((len(rows), max_len), bool)  # pad may equal EOS: mask by length
    loss_mask = np.zeros((len(rows), max_len), bool)
    for i, row in enumerate(rows):
      ids, trained = self.target_turns(row)
      ids, trained = ids[: max_len - 1] + [tokenizer.eos_id], trained[: max_len - 1] + [True]
      targets[i, : len(ids)] = ids
      target_mask[i, : len(ids)] = True
      loss_mask[i, : len(ids)] = trained
    return targets, target_mask, loss_mask

  def check(self, row: dict) -> str | None:
    """The row's problem, or None: its prompt and answer encode, and the prompt fits the largest
    prompt bucket."""
    largest = max(self.buckets)
    problem = self.task.check_row(row)
    if problem:
      return problem
    try:
      length = len(self.prompt_ids(row))
    except (ValueError, KeyError) as e:
      return f"prompt: {e}"
    try:
      self.target_ids(row)
    except (ValueError, KeyError) as e:
      return f"answer: {e}"
    if length > largest:
      return (
        f"prompt: {length} tokens, longer than the largest prompt bucket {largest} "
        "(sampling.prompt_buckets)"
      )
    return None
