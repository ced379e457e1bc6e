"""The training state: `TrainState`, and `StateSpec`, what it holds, which builds a fresh or an
abstract one and its shardings.

A fresh run builds params (loaded or random-init: `models.build`), warm-starts them, then
`StateSpec.create` adds the optimizer state (`trainer.optimizer`), the prior, the key and the
frozen reference, all under one jit in their shardings. A resumed run builds nothing real:
`StateSpec.abstract` gives the same tree as `jax.ShapeDtypeStruct`s with shardings, and the
checkpoint is restored straight into it.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from ebpo_jax import advantages, models, sharding
from ebpo_jax.trainer.optimizer import make_optimizer, opt_state_shardings


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
  # rl.max_staleness = k > 0: the trained params of steps step - k .. step - 1 (clamped at 0),
  # which sample the k batches in flight (`rollouts.pipeline`); checkpointed, so that a resume
  # samples them again exactly. Passed through the train step untouched; None when k = 0.
  behind: tuple | None = None


def policy_params(state: TrainState) -> Any:
  """The policy's full params tree: `params`, with the frozen base under LoRA."""
  return state.params if state.base is None else models.lora.combine(state.params, state.base)


def checkpointed(state: TrainState) -> TrainState:
  """What a checkpoint holds: the state without the LoRA base (which comes from the model
  directory, as for a fresh run)."""
  return state.replace(base=None)


# ----------------------------------------------------------------------------- the state


@dataclasses.dataclass(frozen=True, eq=False)
class StateSpec:
  """What a run's TrainState holds, read from the config once (`from_config`): the optimizer whose
  state it carries, the advantage estimator whose prior it threads (over `num_clusters`), the run's
  seed, whether the trained params are LoRA adapters (the base frozen beside them) and whether it
  keeps a frozen reference copy for the KL term (`rl.loss.kl_coef` > 0, without LoRA: there the
  base is the reference). Every TrainState of the run, fresh, abstract or its shardings, comes
  from one spec."""

  optimizer: optax.GradientTransformation
  estimator: advantages.Estimator
  num_clusters: int
  seed: int
  lora: bool
  kl_reference: bool
  staleness: int = 0  # rl.max_staleness: the params kept `behind`

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, num_clusters: int) -> "StateSpec":
    return cls(
      optimizer=make_optimizer(config),
      estimator=advantages.from_config(config.rl),
      num_clusters=num_clusters,
      seed=config.seed,
      lora=models.build.lora_enabled(config),
      kl_reference=config.rl.loss.kl_coef > 0,
      staleness=config.rl.max_staleness,
    )

  def shardings(self, params: Any) -> TrainState:
    """The TrainState's shardings; `params` (the full tree) may be real or abstract."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    replicated = sharding.replicated(jax.tree.leaves(param_shardings)[0].mesh)
    shapes = jax.eval_shape(self._fresh, params)
    trained, base = self._trained_and_base(param_shardings)
    return TrainState(
      step=replicated,
      params=trained,
      opt_state=opt_state_shardings(self.optimizer, self._trained_and_base(params)[0]),
      prior=jax.tree.map(lambda _: replicated, shapes.prior),
      rng=replicated,
      ref_params=param_shardings if shapes.ref_params is not None else None,
      bad_steps=replicated,
      base=base,
      behind=(trained,) * self.staleness or None,
    )

  def create(self, params: Any) -> TrainState:
    """The step-0 TrainState around `params`, the full tree (donated: no second copy), built in
    its shardings; under LoRA split into the trained adapters and the frozen base."""
    fresh = jax.jit(self._fresh, out_shardings=self.shardings(params), donate_argnums=0)
    return fresh(params)

  def abstract(self, params: Any) -> TrainState:
    """The TrainState as `jax.ShapeDtypeStruct`s with shardings (to restore a checkpoint into);
    `params` are abstract (`models.build.abstract_params`): nothing is loaded or allocated."""
    shapes = jax.eval_shape(self._fresh, params)
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes,
      self.shardings(params),
    )

  def _fresh(self, params) -> TrainState:
    trained, base = self._trained_and_base(params)
    copy_reference = self.kl_reference and base is None
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=trained,
      opt_state=self.optimizer.init(trained),
      prior=self.estimator.init_prior(self.num_clusters),
      rng=jax.random.PRNGKey(self.seed),
      ref_params=jax.tree.map(jnp.copy, params) if copy_reference else None,
      bad_steps=jnp.zeros((), jnp.int32),
      base=base,
      behind=tuple(jax.tree.map(jnp.copy, trained) for _ in range(self.staleness)) or None,
    )

  def _trained_and_base(self, params: Any) -> tuple[Any, Any]:
    """(trained, frozen base) of a full params tree: (adapters, base) under LoRA, else (params,
    None)."""
    return models.lora.split(params) if self.lora else (params, None)
