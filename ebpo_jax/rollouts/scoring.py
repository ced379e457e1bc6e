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
  of the completions and all receive every value. It counts the training calls that fail, per
  reward term, and `check_step` stops a step in which a term's failures exceed `max_error_frac` of
  its calls (a dead term beside working ones included)."""

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
    terms = max(len(self.reward_fns), 1)  # the reward functions, or the task's verifier
    # The step's, until check_step: calls and failures per term, each term's first failure here.
    self._calls, self._errors = 0, np.zeros(terms, np.int64)
    self._first_error = [""] * terms

  def check_step(self) -> None:
    """Stops the run (a BadInput of one line: the term, its failures and its first error) when
    more than `max_error_frac` of a term's training calls since the last check failed; starts the
    counts anew."""
    calls, failed, first = self._calls, self._errors, self._first_error
    self._calls, self._errors = 0, np.zeros_like(failed)
    self._first_error = [""] * len(failed)
    over = np.flatnonzero(failed > self.max_error_frac * calls) if calls else []
    if len(over):
      i = over[0]
      what = f"calls of reward {self.reward_fns[i].name!r}" if self.reward_fns else "reward calls"
      raise errors_lib.BadInput(
        f"rewards.max_error_frac={self.max_error_frac}: {failed[i]} of {calls} {what} failed "
        f"in this step; first: {first[i] or '(on another process)'}"
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
    mine_transcripts = None if transcripts is None else transcripts[mine]
    with self.pool.lock:  # the pool's last_errors are this call's (concurrent sampler calls)
      values, errors = self._score_mine(
        fns, texts[mine], rows_g[mine], lengths[mine], mine_transcripts, training=training
      )
    if jax.process_count() > 1:
      values, errors = _gather_shares(values, errors, share, len(texts))
    if training:
      with self.pool.lock:
        self._calls += len(texts)  # per term
        self._errors += errors
    errors = int(errors.sum())
    shape = (len(rows), group_size)
    if not fns:
      return np.asarray(values[0], np.float32).reshape(shape), {}, errors
    total = reward_fns_lib.combine(values, [f.weight for f in fns])
    parts = {f.name: v.reshape(shape) for f, v in zip(fns, values, strict=True)}
    return total.reshape(shape), parts, errors

  def _score_mine(self, fns, texts, rows_g, lengths, transcripts, *, training: bool):
    """(values [terms, n], errors [terms]) of this process's share of the completions."""
    if fns:
      if transcripts is None:
        transcripts = [[{"role": "assistant", "content": text}] for text in texts]
      extras = [
        {"lengths": [int(n)], "max_new_tokens": self.max_new_tokens, "task_score": self.task.score,
         "transcripts": [messages]}
        for n, messages in zip(lengths, transcripts, strict=True)
      ]  # fmt: skip
      named = [(f.name, f.fn) for f in fns]
      values, errors = self.pool.score_rewards(named, texts, rows_g, extras)
    else:
      rewards, errors = self.pool.score(self.task.score, texts, rows_g)
      values, errors = rewards[None], np.array([errors])  # [1, n], [1]
    if training:
      self._note(errors)
    return values, errors

  def _note(self, errors: np.ndarray) -> None:
    """Keeps this process's first failed call of the step per term, named: a reward term's own
    message starts with its name; the verifier's gets the function's."""
    for i in np.flatnonzero(errors):
      if self._first_error[i]:
        continue
      if self.reward_fns:
        name = f"{self.reward_fns[i].name}: "
        first = next((m for m in self.pool.last_errors if m.startswith(name)), "")
      else:
        fn, first = self.task.score, next(iter(self.pool.last_errors), "")
        first = first and f"the task's verifier {fn.__module__}.{fn.__qualname__}: {first}"
      self._first_error[i] = first


def _gather_shares(values: np.ndarray, errors: np.ndarray, share: int, total: int) -> tuple:
  """Every process's `values` [F, <= share] (its share of the completions) and `errors` [F], as
  (values [F, total] in process order, the errors summed per term), on every process."""
  f = len(values)
  padded = np.zeros((f, share), values.dtype)
  padded[:, : values.shape[1]] = values
  flat = np.concatenate([padded.reshape(-1), errors.astype(values.dtype)])
  gathered = multihost_utils.process_allgather(flat)
  by_process = gathered[:, :-f].reshape(len(gathered), f, share)
  values = by_process.transpose(1, 0, 2).reshape(f, -1)[:, :total]
  return values, gathered[:, -f:].sum(axis=0).astype(np.int64)
