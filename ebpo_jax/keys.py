"""The PRNG streams, derived in one place: a step's keys from the run's key and the step, split
once into named streams (`step_keys`), and a key split into the keys of n calls (`split_keys`).
A stream is passed down by name; no site folds in a number of its own."""

import functools
from typing import NamedTuple

import jax


class StepKeys(NamedTuple):
  """The keys one RL step uses, each for one purpose only."""

  rollout: jax.Array  # sampling the step's batch
  refill: tuple[jax.Array, ...]  # DAPO refill round r (1, 2, ...) samples with refill[r - 1]
  shuffle: jax.Array  # mini-batch order of the PPO epochs (inside train_step)
  eval: jax.Array  # the evaluation logged at this step
  lora_dropout: jax.Array  # the adapters' dropout masks in the step's updates (inside train_step)


@functools.partial(jax.jit, static_argnums=2)
def step_keys(rng: jax.Array, step: jax.Array, num_refill_rounds: int = 0) -> StepKeys:
  """The keys of step `step` (a device scalar, e.g. `state.step`): `fold_in(rng, step)` split
  once into the five streams. The one derivation of a step's keys, for the host loop and inside
  train_step alike."""
  # The first four are those of a split in four (threefry's split is counter-based): the streams
  # that existed before lora_dropout kept their keys.
  rollout, refill, shuffle, eval_key, dropout = jax.random.split(jax.random.fold_in(rng, step), 5)
  refill_keys = tuple(jax.random.split(refill, max(num_refill_rounds, 1)))
  return StepKeys(rollout, refill_keys, shuffle, eval_key, dropout)


@functools.partial(jax.jit, static_argnums=(2, 3))
def step_keys_ahead(
  rng: jax.Array, step: jax.Array, ahead: int, num_refill_rounds: int = 0
) -> StepKeys:
  """`step_keys` of step `step + ahead` (`step` a device scalar): the keys of a batch sampled
  `ahead` steps before it is trained (rollouts.pipeline)."""
  return step_keys(rng, step + ahead, num_refill_rounds)


@functools.partial(jax.jit, static_argnums=1)
def split_keys(key: jax.Array, n: int) -> tuple[jax.Array, ...]:
  """`key` split into n keys, one per sampler call or turn (jitted: n stays static, and the host
  loops run under `jax.transfer_guard("disallow")`)."""
  return tuple(jax.random.split(key, n))
