"""The training state and what builds it: the model, its params, the optimizer, the PRNG streams.

A fresh run builds params (loaded or random-init), warm-starts them, then `create_state` adds the
optimizer state, the prior, the key and the frozen reference, all under one jit in their
shardings. A resumed run builds nothing real: `abstract_state` gives the same tree as
`jax.ShapeDtypeStruct`s with shardings, and the checkpoint is restored straight into it.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebpo_jax import advantages, files, models, sharding, tasks
from ebpo_jax.models import hf_io
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer.config import ConfigError


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


# ----------------------------------------------------------------------------- model

_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def random_init_config(mc: ml_collections.ConfigDict, vocab_size: int) -> models.ModelConfig:
  """The ModelConfig of a random-init decoder from `config.model` (shape keys, `architecture`,
  `tie_word_embeddings`, `rope_theta`, and how it computes: dtypes, remat, the unrolled loop)."""
  arch = mc.architecture
  if arch not in _ARCHITECTURES:
    raise ConfigError(f"config.model.architecture={arch!r}: must be one of {_ARCHITECTURES}")
  return models.ModelConfig(
    vocab_size=vocab_size,
    hidden_size=mc.hidden_size,
    intermediate_size=mc.intermediate_size,
    num_layers=mc.num_layers,
    num_heads=mc.num_heads,
    num_kv_heads=mc.num_kv_heads,
    head_dim=mc.head_dim,
    architecture=arch,
    tie_word_embeddings=bool(mc.tie_word_embeddings),
    rope_theta=float(mc.rope_theta),
    dtype=mc.dtype,
    param_dtype=mc.param_dtype,
    remat=mc.remat,
    unroll_layers=bool(mc.unroll_layers),
  )


def model_dir(config: ml_collections.ConfigDict) -> str:
  """The Hugging Face directory of `config.model.path` (local or gs://; a `packaged:` model is
  converted once); ConfigError naming the key when there is none."""
  try:
    path = models.resolve_model_path(config.model.path)
  except ValueError as e:
    raise ConfigError(f"config.model.path={config.model.path!r}: {e}") from e
  if not files.isfile(files.join(path, hf_io.CONFIG_FILE)):
    raise ConfigError(
      f"config.model.path={config.model.path!r}: not a Hugging Face model directory "
      f"({files.join(path, hf_io.CONFIG_FILE)} not found)"
    )
  return path


def load_tokenizer(config: ml_collections.ConfigDict, task: tasks.Task):
  """The model directory's tokenizer, or the task's own for a random-init model."""
  if config.model.path:
    return tokenizers.HFTokenizer(model_dir(config), chat_template=config.model.chat_template)
  return task.tokenizer


def make_model(config: ml_collections.ConfigDict, vocab_size: int) -> models.Decoder:
  """The policy's module: the Hugging Face directory's architecture (no weights read), or a
  random-init decoder of `config.model`'s shape over `vocab_size` tokens; with LoRA adapters
  when `model.lora.rank > 0` (base weights in `model.lora.base_dtype` if set)."""
  mc = config.model
  if mc.path:
    model_config = hf_io.pretrained_config(
      model_dir(config),
      mc.dtype,
      param_dtype=mc.param_dtype,
      remat=mc.remat,
      unroll_layers=bool(mc.unroll_layers),
    )
  else:
    model_config = random_init_config(mc, vocab_size)
  return models.Decoder(with_lora(model_config, mc.lora))


def with_lora(
  model_config: models.ModelConfig, lc: ml_collections.ConfigDict
) -> models.ModelConfig:
  """`model_config` with `config.model.lora`'s adapters (`lc`), unchanged when the rank is 0."""
  if lc.rank == 0:
    return model_config
  return dataclasses.replace(
    model_config,
    lora_rank=lc.rank,
    lora_alpha=float(lc.alpha),
    lora_targets=models.lora.parse_targets(lc.targets),
    lora_dropout=float(lc.dropout),
    param_dtype=lc.base_dtype or model_config.param_dtype,
  )


def lora_enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether the policy trains LoRA adapters only (`model.lora.rank > 0`)."""
  return config.model.lora.rank > 0


def abstract_params(model: models.Decoder, mesh: Mesh) -> Any:
  """The params as `jax.ShapeDtypeStruct`s carrying their shardings on `mesh`."""
  boxed = hf_io.abstract_params(model)
  shardings = sharding.logical_shardings(boxed, mesh, sharding.DEFAULT_RULES)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed), shardings
  )


def init_params(config: ml_collections.ConfigDict, model: models.Decoder, mesh: Mesh) -> Any:
  """Real params in their shardings: read from `config.model.path`, else random (`config.seed`).
  Under LoRA use `policy.initial_params`, which builds the base and the adapters apart."""
  if config.model.path:
    return hf_io.load_params(model_dir(config), model, mesh)
  shardings = jax.tree.map(lambda x: x.sharding, abstract_params(model, mesh))
  init = lambda rng: nn.unbox(model.init(rng, jnp.zeros((1, 4), jnp.int32))["params"])
  return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(config.seed))


def fresh_adapters(config: ml_collections.ConfigDict, model: models.Decoder, mesh: Mesh) -> Any:
  """A LoRA model's adapters at step 0 (A random from `config.seed`, B zero), in their
  shardings; the base the same init would build is dead code under the jit."""
  shardings = models.lora.split(jax.tree.map(lambda x: x.sharding, abstract_params(model, mesh)))[0]

  def init(rng):
    params = nn.unbox(model.init(rng, jnp.zeros((1, 4), jnp.int32))["params"])
    return models.lora.split(params)[0]

  return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(config.seed))


# ----------------------------------------------------------------------------- optimizer


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
  replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, PartitionSpec())
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
  return models.lora.split(params) if lora_enabled(config) else (params, None)


def state_shardings(
  config: ml_collections.ConfigDict, optimizer, estimator, num_clusters: int, params: Any
) -> TrainState:
  """The TrainState's shardings; `params` may be real or abstract."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, PartitionSpec())
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
  `params` are abstract (`abstract_params`): nothing is loaded or allocated."""
  shapes = jax.eval_shape(_state_fn(config, optimizer, estimator, num_clusters), params)
  shardings = state_shardings(config, optimizer, estimator, num_clusters, params)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
  )
