"""The training state: `TrainState`, its shardings, a fresh or an abstract one, the step's keys.

A fresh run builds params (loaded or random-init: `models.build`), warm-starts them, then
`create_state` adds the optimizer state (`trainer.optimizer`), the prior, the key and the frozen
reference, all under one jit in their shardings. A resumed run builds nothing real:
`abstract_state` gives the same tree as `jax.ShapeDtypeStruct`s with shardings, and the
checkpoint is restored straight into it.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from ebpo_jax import advantages, models, sharding
from ebpo_jax.trainer.optimizer import opt_state_shardings


class TrainState(flax.struct.PyTreeNode):
  """Everything that changes during training (plus the frozen reference policy)."""

  step: jax.Array  # int32 []: RL steps completed
  params: Any  # the trained weights: all of them, or under LoRA the adapters only
  opt_state: Any
  prior: advantages.PriorState  # the estimator's prior (EBPO's per-cluster Welford accumulators)
  rng: jax.Array  # uint32 [2]: the run's key; a step's keys come from `step_keys`
  # frozen reference policy for the KL term; None when rl.loss.kl_coef == 0, and under LoRA (the
  # reference is then `base`, the same weights without the adapters)
  ref_params: Any
  # int32 []: RL steps in a row whose update was skipped (non-finite loss, grad norm or logits);
  # in the state so that a restarted run keeps counting towards train.max_bad_steps.
  bad_steps: jax.Array
  # Under LoRA the frozen base weights (`models.lora.split`), else None. Not checkpointed
  # (`checkpointed`): a resume rebuilds it as a fresh run does (`policy.initial_params`).
  base: Any = None


def policy_params(state: TrainState) -> Any:
  """The policy's full params tree: `params`, with the frozen base under LoRA."""
  return state.params if state.base is None else models.lora.combine(state.params, state.base)


def checkpointed(state: TrainState) -> TrainState:
  """What a checkpoint holds: the state without the LoRA base (which comes from the model
  directory, as for a fresh run)."""
  return state.replace(base=None)


# ----------------------------------------------------------------------------- PRNG streams


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


# ----------------------------------------------------------------------------- the state


def _state_fn(
  config: ml_collections.ConfigDict,
  optimizer: optax.GradientTransformation,
  estimator: advantages.Estimator,
  num_clusters: int,
) -> Callable[[Any], TrainState]:
  def fresh(params) -> TrainState:
    trained, base = _trained_and_base(config, params)
    copy_reference = config.rl.loss.kl_coef > 0 and base is None
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=trained,
      opt_state=optimizer.init(trained),
      prior=estimator.init_prior(num_clusters),
      rng=jax.random.PRNGKey(config.seed),
      ref_params=jax.tree.map(jnp.copy, params) if copy_reference else None,
      bad_steps=jnp.zeros((), jnp.int32),
      base=base,
    )

  return fresh


def _trained_and_base(config: ml_collections.ConfigDict, params: Any) -> tuple[Any, Any]:
  """(trained, frozen base) of a full params tree: (adapters, base) under LoRA, else (params,
  None)."""
  return models.lora.split(params) if models.build.lora_enabled(config) else (params, None)


def state_shardings(
  config: ml_collections.ConfigDict, optimizer, estimator, num_clusters: int, params: Any
) -> TrainState:
  """The TrainState's shardings; `params` may be real or abstract."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = sharding.replicated(jax.tree.leaves(param_shardings)[0].mesh)
  shapes = jax.eval_shape(_state_fn(config, optimizer, estimator, num_clusters), params)
  trained, base = _trained_and_base(config, param_shardings)
  return TrainState(
    step=replicated,
    params=trained,
    opt_state=opt_state_shardings(optimizer, _trained_and_base(config, params)[0]),
    prior=jax.tree.map(lambda _: replicated, shapes.prior),
    rng=replicated,
    ref_params=param_shardings if shapes.ref_params is not None else None,
    bad_steps=replicated,
    base=base,
  )


def create_state(
  config: ml_collections.ConfigDict, optimizer, estimator, num_clusters: int, params: Any
) -> TrainState:
  """The step-0 TrainState around `params`, the full tree (donated: no second copy), built in
  its shardings; under LoRA split into the trained adapters and the frozen base."""
  shardings = state_shardings(config, optimizer, estimator, num_clusters, params)
  fresh = _state_fn(config, optimizer, estimator, num_clusters)
  return jax.jit(fresh, out_shardings=shardings, donate_argnums=0)(params)


def abstract_state(
  config: ml_collections.ConfigDict, optimizer, estimator, num_clusters: int, params: Any
) -> TrainState:
  """The TrainState as `jax.ShapeDtypeStruct`s with shardings (to restore a checkpoint into);
  `params` are abstract (`models.build.abstract_params`): nothing is loaded or allocated."""
  shapes = jax.eval_shape(_state_fn(config, optimizer, estimator, num_clusters), params)
  shardings = state_shardings(config, optimizer, estimator, num_clusters, params)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
  )
