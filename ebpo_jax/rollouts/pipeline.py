"""Asynchronous RL with a fixed lag (`rl.max_staleness` = k > 0): the batch trained at step t is
sampled with the policy of step max(0, t - k), decided by the schedule and never by timing, so a
run is a pure function of its config and seed, and resumes exactly.

At step t the trainer copies its params θ_t (the train step donates its state; the copy is the
"weight transfer" of a shared mesh, `async/transfer_s`) and hands them to the producer thread,
which samples, steps the environments (their tools) and scores batch t + k with them and step
t + k's keys, while the train step trains on batch t; the trainer then waits for the producer
(`async/trainer_wait_s`) so that the iterator's draws and the worker's calls stay in batch order
(one producer, one batch at a time). Batches t + 1 .. t + k - 1 are already made: k batches are in
flight between steps, sampled with θ_{t+1-k} .. θ_t.

What a checkpoint at step s needs to go on exactly: the params those in-flight batches were sampled
with (`TrainState.behind`: θ_{s-k} .. θ_{s-1}, clamped at 0), and the data iterator's position
before their draws (`saving` puts it there for the save). A resume samples them again (`fill`):
the same params, keys and rows give the same batches, bit for bit. The EBPO prior is carried by
the train step, in batch order. Under LoRA the params copied and kept behind are the adapters; the
producer samples with them on the frozen base (`TrainState.base`, which the train step does not
donate: `trainer.step.TrainStep`).
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from ebpo_jax import keys as keys_lib
from ebpo_jax import models, sharding
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts.rollout import Rollout
from ebpo_jax.rollouts.worker import RolloutWorker


@dataclasses.dataclass(frozen=True)
class Made:
  """One batch the producer made: `collect_batch`'s (batch, rollout, logs), the iterator's state
  before its draws, and the seconds it took."""

  batch: dict
  rollout: Rollout
  logs: dict
  position: Any  # the data iterator's `get_state()` before this batch's draws
  seconds: float


class Pipeline:
  """The producer of a fixed-lag run: k batches in flight, made in batch order by one thread."""

  def __init__(
    self,
    worker: RolloutWorker,
    rows: list[dict],
    batches: Any,
    *,
    staleness: int,
    num_steps: int,
    num_refill_rounds: int,
    transfer_guard: str,
    params_sharding: Any,
    batch_mesh: Any,
  ):
    if staleness < 1:
      raise ValueError(f"a pipeline needs staleness >= 1, got {staleness}")
    self.staleness, self._num_steps = staleness, num_steps
    self._worker, self._rows, self._batches = worker, rows, batches
    self._rounds, self._guard, self._batch_mesh = num_refill_rounds, transfer_guard, batch_mesh
    self._in_flight: collections.deque[Made] = collections.deque()
    self._running: concurrent.futures.Future | None = None
    self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
    copy = lambda params: jax.tree.map(jnp.copy, params)
    self._copy = jax.jit(copy, out_shardings=params_sharding)

  def close(self) -> None:
    """Waits for a batch being made (its errors are dropped: the run is ending) and stops."""
    self._thread.shutdown(wait=True, cancel_futures=True)

  def fill(self, state, step: int) -> None:
    """Makes the batches in flight at `state.step` = `step` (a start or a resume): batch step + i
    with `state.behind[i]`, in order, before the first train step (none past `num_steps`)."""
    if self._in_flight or self._running is not None:
      raise RuntimeError("the pipeline is already filled")
    ahead = max(0, min(self.staleness, self._num_steps - step))
    for i, params in enumerate(state.behind[:ahead]):
      self._in_flight.append(self._make(_policy(params, state), _keys(state, i, self._rounds)))

  def copy_params(self, params) -> tuple[Any, float]:
    """(a copy of the trained `params`, the seconds it took): what the producer samples with while
    the train step consumes (donates) the originals."""
    start = time.perf_counter()
    copied = jax.block_until_ready(self._copy(params))
    return copied, time.perf_counter() - start

  def start_next(self, state, step: int, params) -> None:
    """Starts making batch `state.step` + k (`step`: state.step, on the host) with `params`
    (`copy_params`' of state.params); none past the run's last step."""
    if self._running is not None:
      raise RuntimeError("a batch is being made already")
    if step + self.staleness >= self._num_steps:
      return
    keys = _keys(state, self.staleness, self._rounds)
    self._running = self._thread.submit(self._make, _policy(params, state), keys)

  def next_batch(self) -> Made:
    """The oldest batch in flight: the one the current step trains on."""
    return self._in_flight.popleft()

  def wait(self) -> tuple[float, float]:
    """Waits for the batch being made and puts it in flight: (the seconds waited, the seconds it
    took to make; 0, 0 when none was started)."""
    if self._running is None:
      return 0.0, 0.0
    start = time.perf_counter()
    running, self._running = self._running, None
    made = running.result()  # an error of the producer is raised here
    self._in_flight.append(made)
    return time.perf_counter() - start, made.seconds

  @contextlib.contextmanager
  def saving(self):
    """The data iterator at the trainer's position for a checkpoint (before the draws of the
    batches in flight), back at the producer's after; the producer must be idle."""
    if self._running is not None:
      raise RuntimeError("saving while a batch is being made")
    if not self._in_flight:  # the run's last steps: nothing drawn ahead
      yield
      return
    producer = self._batches.get_state()
    self._batches.set_state(self._in_flight[0].position)
    try:
      yield
    finally:
      self._batches.set_state(producer)

  def _make(self, params, keys: keys_lib.StepKeys) -> Made:
    with jax.transfer_guard(self._guard):  # the loop's guard: thread-local, so set here too
      position = self._batches.get_state()
      start = time.perf_counter()
      batch, rollout, logs = rollout_batch.collect_batch(
        self._worker, params, keys, self._rows, self._batches
      )
      self._worker.scorer.check_step()  # rewards.max_error_frac, as the synchronous loop
      batch = sharding.to_mesh(batch, self._batch_mesh, rows=True)  # to the trainer's, if split
      return Made(batch, rollout, logs, position, time.perf_counter() - start)


def behind_after(behind: tuple, trained_before: Any) -> tuple:
  """`TrainState.behind` after a step: the oldest params out, the step's own (before its update,
  `trained_before`) in."""
  return (*behind[1:], trained_before)


def _policy(trained: Any, state) -> Any:
  """The policy's full params of `trained` (state.params or one of `behind`): with the frozen
  base under LoRA (`models.lora.combine`)."""
  return trained if state.base is None else models.lora.combine(trained, state.base)


def _keys(state, ahead: int, rounds: int) -> keys_lib.StepKeys:
  """The keys of step `state.step + ahead`: the batch of that step samples with them."""
  return keys_lib.step_keys_ahead(state.rng, state.step, ahead, rounds)
