"""Scoring decoded completions on the host: the task's verifier or the weighted reward functions,
in a verifier pool, shared out over the processes."""

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ebpo_jax import errors as errors_lib
from ebpo_jax import tasks
from ebpo_jax.tasks import reward_fns as reward_fns_lib
from ebpo_jax.tasks import rewards as rewards_lib


class Scorer:
  """Scores training rollouts with `reward_fns` when there are any (config.rewards.fns), every
  other rollout (evaluation) with the task's verifier; calls run in `pool` (`tasks.rewards`'
  RewardPool, which its owner closes). With several processes each scores its own contiguous share
  of the completions and all receive every value. It counts the training calls that fail, and
  `check_step` stops a step whose failures exceed `max_error_frac` of its calls."""

  def __init__(
    self,
    task: tasks.Task,
    pool: rewards_lib.RewardPool,
    reward_fns: Sequence[reward_fns_lib.RewardFn] = (),
    *,
    max_new_tokens: int,
    max_error_frac: float = 1.0,
  ):
    self.task, self.pool, self.reward_fns = task, pool, tuple(reward_fns)
    self.max_new_tokens = max_new_tokens  # the reward functions' `max_new_tokens` extra
    self.max_error_frac = max_error_frac  # rewards.max_error_frac
    self._calls, self._errors, self._first_error = 0, 0, ""  # the step's, until check_step

  def check_step(self) -> None:
    """Stops the run (a BadInput of one line: the function and its first error) when more than
    `max_error_frac` of the training calls since the last check failed; starts the count anew."""
    calls, failed, first = self._calls, self._errors, self._first_error
    self._calls, self._errors, self._first_error = 0, 0, ""
    if calls and failed > self.max_error_frac * calls:
      raise errors_lib.BadInput(
        f"rewards.max_error_frac={self.max_error_frac}: {failed} of {calls} reward calls failed "
        f"in this step; first: {first or '(on another process)'}"
      )

  def score(
    self,
    texts: list[str],
    rows: list[dict],
    lengths: np.ndarray,
    group_size: int,
    *,
    training: bool,
    transcripts: Sequence[list[dict[str, str]]] | None = None,
  ) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """(rewards [N, G] float32, each reward function's values {name: [N, G]}, failed calls) of the
    N rows' G completions each (prompt-major): for `training`, the weighted sum of the reward
    functions (when configured), else the task's verifier. `transcripts`: each completion's whole
    trajectory as messages `{"role", "content"}` (multi-turn), which the reward functions receive
    as their `transcripts` extra; None: each completion is one model turn."""
    fns = self.reward_fns if training else ()
    rows_g = [row for row in rows for _ in range(group_size)]
    share = -(-len(texts) // jax.process_count())
    mine = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
    if fns:
      if transcripts is None:
        transcripts = [[{"role": "assistant", "content": text}] for text in texts]
      extras = [
        {"lengths": [int(n)], "max_new_tokens": self.max_new_tokens, "task_score": self.task.score,
         "transcripts": [messages]}
        for n, messages in zip(lengths[mine], transcripts[mine], strict=True)
      ]  # fmt: skip
      named = [(f.name, f.fn) for f in fns]
      values, errors = self.pool.score_rewards(named, texts[mine], rows_g[mine], extras)
    else:
      rewards, errors = self.pool.score(self.task.score, texts[mine], rows_g[mine])
      values = rewards[None]  # [1, n]
    if training:
      self._note(errors, len(fns))
    if jax.process_count() > 1:
      values, errors = _gather_shares(values, errors, share, len(texts))
    if training:
      self._calls += len(texts) * max(len(fns), 1)
      self._errors += errors
    shape = (len(rows), group_size)
    if not fns:
      return np.asarray(values[0], np.float32).reshape(shape), {}, errors
    total = reward_fns_lib.combine(values, [f.weight for f in fns])
    parts = {f.name: v.reshape(shape) for f, v in zip(fns, values, strict=True)}
    return total.reshape(shape), parts, errors

  def _note(self, errors: int, num_fns: int) -> None:
    """Keeps this process's first failed call of the step, named: a reward term's own message
    starts with its name; the verifier's gets the function's."""
    if not errors or self._first_error or not self.pool.last_errors:
      return
    first = self.pool.last_errors[0]
    if not num_fns:
      fn = self.task.score
      first = f"the task's verifier {fn.__module__}.{fn.__qualname__}: {first}"
    self._first_error = first


def _gather_shares(values: np.ndarray, errors: int, share: int, total: int) -> tuple:
  """Every process's `values` [F, <= share] (its share of the completions) and `errors`, as
  (values [F, total] in process order, the errors summed), on every process."""
  padded = np.zeros((len(values), share), values.dtype)
  padded[:, : values.shape[1]] = values
  gathered = multihost_utils.process_allgather(np.concatenate([padded.reshape(-1), [errors]]))
  by_process = gathered[:, :-1].reshape(len(gathered), len(values), share)
  values = by_process.transpose(1, 0, 2).reshape(len(values), -1)[:, :total]
  return values, int(gathered[:, -1].sum())
