"""The optimizer: AdamW after global-norm clipping, its learning-rate schedule, its state's
shardings.

The schedule counts optimizer updates (PPO epochs x mini-batches per RL step,
`updates_per_step`); `learning_rate` reads the rate of the next update back from the state.
"""

from typing import Any

import jax
import ml_collections
import optax

from ebpo_jax import sharding


def updates_per_step(config: ml_collections.ConfigDict) -> int:
  """Optimizer updates in one RL step: PPO epochs x mini-batches."""
  return config.rl.num_iterations * (config.train.batch_size // config.train.mini_batch_size)


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The learning rate by optimizer update count: linear warmup from 0 over `train.warmup_steps`
  updates, then constant or cosine decay to 0 at the last update."""
  tc = config.train
  total_updates = tc.num_steps * updates_per_step(config)
  warmup = max(tc.warmup_steps, 0)
  if tc.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
      0.0, tc.learning_rate, warmup, max(total_updates, warmup + 1)
    )
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, tc.learning_rate, warmup),
      optax.constant_schedule(tc.learning_rate),
    ],
    [warmup],
  )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, at `learning_rate_schedule(config)`, over the trained
  params (under LoRA the adapters only: the base has no optimizer state)."""
  tc = config.train
  return optax.chain(
    optax.clip_by_global_norm(tc.grad_clip),
    optax.adamw(learning_rate_schedule(config), weight_decay=tc.weight_decay),
  )


def learning_rate(schedule: optax.Schedule, opt_state: Any) -> jax.Array:
  """The learning rate of the next update from `opt_state` (of `make_optimizer`): the schedule at
  the state's update count, which counts applied updates only (a skipped one keeps the state)."""
  is_schedule_count = lambda path, _: path[-1] == _SCHEDULE_COUNT
  return schedule(optax.tree_utils.tree_get(opt_state, "count", filtering=is_schedule_count))


# The update counter of the schedule's state in the optimizer state (Adam's has its own count).
_SCHEDULE_COUNT = optax.tree_utils.NamedTupleKey("ScaleByScheduleState", "count")


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any) -> Any:
  """Shardings of the optimizer state: moments follow their parameters, counters are replicated.
  `params` may be real or abstract (each leaf has `.sharding`)."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = sharding.replicated(jax.tree.leaves(param_shardings)[0].mesh)
  return optax.tree_map_params(
    optimizer,
    lambda _, s: s,
    jax.eval_shape(optimizer.init, params),
    param_shardings,
    transform_non_params=lambda _: replicated,
  )


def init_opt_state(optimizer: optax.GradientTransformation, params: Any) -> Any:
  """The optimizer state of `params`, built in its shardings."""
  return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params))(params)
