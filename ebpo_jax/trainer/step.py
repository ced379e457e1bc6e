"""The RL step: one pure function `train_step(state, batch) -> (state, metrics)`, jitted once.

It computes the advantages (threading the estimator's prior through the state), builds the
sequences in the sampler's layout, and runs `rl.num_iterations` epochs of PPO-clip mini-batch
updates with gradient accumulation over micro-batches. Where micro-batches hold whole groups
(`uses_shared_prefix`) the forward runs each prompt once per group, not once per completion.
Nothing here knows which estimator runs: the registry entry carries its hyperparameters and names
its own metrics.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebpo_jax import advantages, losses, models, sequences, sharding
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.trainer.state import TrainState, learning_rate, learning_rate_schedule, step_keys

# The step's advantages [B, G] among its outputs: not a metric (the host pops it for the sample
# completions table, logging.samples_every).
ADVANTAGES = "advantages"


def abstract_batch(
  config: ml_collections.ConfigDict, prompt_len: int, sharding: Any = None
) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch `train_step` takes, as shapes (the one statement of its layout; rows r = b * G + g):
  prompt_ids, prompt_mask [B, P]; tokens, completion_mask, old_logps [B*G, N]; truncated,
  nonfinite (the sampler met non-finite logits) [B*G]; rewards [B, G]; cluster_ids [B]."""
  b, g, n = config.train.batch_size, config.rl.group_size, config.sampling.max_new_tokens
  shapes = {
    "prompt_ids": ((b, prompt_len), jnp.int32),
    "prompt_mask": ((b, prompt_len), jnp.bool_),
    "tokens": ((b * g, n), jnp.int32),
    "completion_mask": ((b * g, n), jnp.bool_),
    "old_logps": ((b * g, n), jnp.float32),
    "truncated": ((b * g,), jnp.bool_),
    "nonfinite": ((b * g,), jnp.bool_),
    "rewards": ((b, g), jnp.float32),
    "cluster_ids": ((b,), jnp.int32),
  }
  return {k: jax.ShapeDtypeStruct(s, t, sharding=sharding) for k, (s, t) in shapes.items()}


def completion_logits(
  model: models.Decoder, params: Any, seqs: dict, dropout_key: jax.Array | None = None
) -> jax.Array:
  """Logits [R, N, V] that predict the N completion tokens (the LM head runs at those positions
  only); with `dropout_key`, the LoRA adapters' inputs are dropped out (`model.lora.dropout`: the
  training forward only).

  `seqs` in either layout of `sequences`: one row per completion (`build_sequences`), or one per
  prompt with its G completions packed after it (`build_packed_sequences`: the shared-prefix
  forward, each prompt run once), told apart by G = rows of `targets` / rows of `input_ids`."""
  (rows, n), (seq_rows, seq_len) = seqs["targets"].shape, seqs["input_ids"].shape
  group_size = rows // seq_rows
  if group_size > 1:
    layout = {"prefix_groups": models.PrefixGroups(seq_len - group_size * n, group_size)}
  else:
    layout = {"logits_slice": (seq_len - n - 1, seq_len - 1)}
  return model.apply(
    {"params": params},
    seqs["input_ids"],
    positions=seqs["positions"],
    attention_mask=seqs["attention_mask"],
    rngs=None if dropout_key is None else {models.lora.DROPOUT_RNG: dropout_key},
    **layout,
  )


def completion_logprobs(model: models.Decoder, params: Any, seqs: dict) -> jax.Array:
  """log pi(completion token) [R, N] under `params` (`seqs` in either layout)."""
  return losses.token_logprobs(completion_logits(model, params, seqs), seqs["targets"])


def _reference_logps(model, ref_params, seqs: dict, micro_rows: int, mesh) -> jax.Array:
  """log pi_ref of the completions [R, N], one micro-batch at a time (bounded memory); `seqs` in
  either layout (a packed micro-batch holds micro_rows / G prompts)."""
  keys = ("input_ids", "positions", "attention_mask", "targets")
  num_chunks = seqs["targets"].shape[0] // micro_rows
  chunks = {k: seqs[k].reshape(num_chunks, -1, *seqs[k].shape[1:]) for k in keys}

  def one(mb):
    return completion_logprobs(model, ref_params, sharding.constrain_rows(mb, mesh))

  return jax.lax.map(one, chunks).reshape(seqs["targets"].shape)


def _loss_fn(
  params, mb, dropout_key, *, model, loss_cfg, num_tokens, num_seqs, base=None, mesh=None
):
  """The policy loss of a micro-batch as a function of the trained params only: under LoRA
  (`base` given) the adapters, so no weight gradient of the frozen base is ever computed.
  `dropout_key`: the micro-batch's LoRA dropout key, or None (no dropout)."""
  mb = sharding.constrain_rows(mb, mesh)
  full = params if base is None else models.lora.combine(params, base)
  logits = completion_logits(model, full, mb, dropout_key)
  return losses.policy_loss(
    losses.token_logprobs(logits, mb["targets"]),
    mb["old_logps"],
    mb["adv"],
    mb["loss_mask"],
    clip_low=loss_cfg.clip_low,
    clip_high=loss_cfg.clip_high,
    dual_clip=loss_cfg.dual_clip,
    agg=loss_cfg.aggregation,
    ref_logps_bt=mb.get("ref_logps"),
    kl_coef=loss_cfg.kl_coef,
    kl_kind=loss_cfg.kl_kind,
    entropy_bt=losses.entropy(logits),
    entropy_coef=loss_cfg.entropy_coef,
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    max_len=mb["targets"].shape[1],
  )


def _accumulated_grads(params, mini: dict, dropout_key, *, num_micro: int, loss_fn):
  """Gradients of a mini-batch summed over micro-batches (the loss is normalised globally);
  `dropout_key` (or None) is split into one key per micro-batch."""
  num_tokens = mini["loss_mask"].sum()
  num_seqs = mini["loss_mask"].shape[0]
  micro = jax.tree.map(lambda x: x.reshape(num_micro, -1, *x.shape[1:]), mini)
  grad_fn = jax.value_and_grad(
    functools.partial(loss_fn, num_tokens=num_tokens, num_seqs=num_seqs), has_aux=True
  )

  micro_keys = None if dropout_key is None else jax.random.split(dropout_key, num_micro)

  def body(acc, mb_and_key):
    (loss, aux), grads = grad_fn(params, *mb_and_key)
    return jax.tree.map(jnp.add, acc, (loss, grads)), aux

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), aux = jax.lax.scan(body, zeros, (micro, micro_keys))
  return loss, grads, jax.tree.map(jnp.sum, aux)  # each chunk holds its share of the total


def _update_order(shuffle_key: jax.Array, num_rows: int, mini_rows: int, epochs: int):
  """[U, mini_rows] row indices of the U updates: one permutation per epoch (none for one)."""
  if epochs == 1:
    return jnp.arange(num_rows).reshape(-1, mini_rows)
  keys = jax.random.split(shuffle_key, epochs)
  return jnp.concatenate([jax.random.permutation(k, num_rows) for k in keys]).reshape(-1, mini_rows)


def uses_shared_prefix(config: ml_collections.ConfigDict, mesh: Mesh | None) -> bool:
  """Whether `train_step` runs each prompt once per group (the shared-prefix forward,
  `models.shared_prefix`) rather than once per completion: when every micro-batch holds whole
  groups of G > 1, which is when there is one PPO epoch (`rl.num_iterations == 1`: rows are
  taken in order, unshuffled), the micro-batch rows are a multiple of G, and, with a mesh, a
  micro-batch's prompts split over the same devices as its rows. Otherwise each row runs its
  prompt and completion in full (the same math, more work)."""
  rl, tc = config.rl, config.train
  g = rl.group_size
  micro_rows = tc.micro_batch_size or tc.mini_batch_size * g
  if rl.num_iterations != 1 or g == 1 or micro_rows % g:
    return False
  if mesh is None:
    return True
  spec = lambda num: sharding.row_sharding((num,), mesh).spec  # noqa: E731
  return spec(micro_rows // g) == spec(micro_rows)


def _sequences(batch: dict, group_size: int, shared: bool) -> tuple[dict, dict]:
  """The batch's sequences as (per-row arrays [R, ...], per-prompt arrays [B, ...]): in the
  shared-prefix layout (`shared`) the model's inputs are per prompt, else all is per row."""
  build = sequences.build_packed_sequences if shared else sequences.build_sequences
  seqs = build(
    batch["prompt_ids"],
    batch["prompt_mask"],
    batch["tokens"],
    batch["completion_mask"],
    group_size,
  )
  prompt_keys = ("input_ids", "positions", "attention_mask") if shared else ()
  return seqs, {k: seqs.pop(k) for k in prompt_keys}


def train_step(
  state: TrainState,
  batch: dict,
  *,
  model: models.Decoder,
  optimizer: optax.GradientTransformation,
  estimator: advantages.Estimator,
  config: ml_collections.ConfigDict,
  mesh: Mesh | None = None,
) -> tuple[TrainState, dict]:
  """One RL step on a scored rollout batch (`abstract_batch`): advantages, then PPO-clip updates.

  The forward runs each prompt once for its G completions where `uses_shared_prefix` (one PPO
  epoch, micro-batches of whole groups, their prompts split over the devices as their rows), else
  every row's prompt and completion in full; the same math either way.

  With `mesh`, micro-batch rows are kept sharded over its batch axes. Metrics are scalars, or
  per-cluster vectors [K] that the host splits by cluster name, and ADVANTAGES [B, G].

  The non-finite policy: an update whose loss or grad norm is not finite is skipped (params and
  optimizer state kept); a batch whose sampling met non-finite logits skips every update and the
  prior's. A step with any skipped update is bad: `bad_updates` counts them, `state.bad_steps`
  counts bad steps in a row (reset by a good step).
  """
  rl, tc = config.rl, config.train
  rollout_finite = ~batch["nonfinite"].any()
  adv_bg, prior, adv_metrics = estimator(batch["rewards"], None, batch["cluster_ids"], state.prior)
  prior = jax.tree.map(lambda new, old: jnp.where(rollout_finite, new, old), prior, state.prior)
  shared = uses_shared_prefix(config, mesh)
  seqs, prompts = _sequences(batch, rl.group_size, shared)
  seqs["old_logps"] = batch["old_logps"]
  seqs["adv"] = adv_bg.reshape(-1)
  mini_rows = tc.mini_batch_size * rl.group_size
  micro_rows = tc.micro_batch_size or mini_rows
  if state.ref_params is not None:
    seqs["ref_logps"] = _reference_logps(model, state.ref_params, seqs | prompts, micro_rows, mesh)
  elif state.base is not None and rl.loss.kl_coef > 0:  # LoRA: the base, without the adapters
    base_model = models.lora.base_model(model)
    seqs["ref_logps"] = _reference_logps(base_model, state.base, seqs | prompts, micro_rows, mesh)
  keys = step_keys(state.rng, state.step)
  order = _update_order(keys.shuffle, seqs["adv"].shape[0], mini_rows, rl.num_iterations)
  prompt_order = order[:, :: rl.group_size] // rl.group_size if shared else None  # whole groups
  # LoRA dropout: one key per update (each split per micro-batch), from the step's own stream, so
  # a resumed run drops the same inputs; none at all when off (the step is then exactly as before).
  dropout_keys = None
  if model.config.lora_dropout > 0:
    dropout_keys = jax.random.split(keys.lora_dropout, order.shape[0])
  loss_fn = functools.partial(_loss_fn, model=model, loss_cfg=rl.loss, base=state.base, mesh=mesh)
  schedule = learning_rate_schedule(config)

  def apply_update(params, opt_state, grads):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state

  def update(carry, indices_and_key):
    params, opt_state = carry
    idx, prompt_idx, dropout_key = indices_and_key
    take = lambda tree, i: jax.tree.map(lambda x: jnp.take(x, i, axis=0), tree)  # noqa: E731
    mini = take(seqs, idx) | take(prompts, prompt_idx)
    loss, grads, aux = _accumulated_grads(
      params, mini, dropout_key, num_micro=mini_rows // micro_rows, loss_fn=loss_fn
    )
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & rollout_finite
    # A branch, not a select over the new and old trees: a select reads params and both Adam
    # moments twice more per update (0.5 s of a SmolLM2-shape step on a 2-core CPU).
    carry = jax.lax.cond(finite, apply_update, lambda p, o, g: (p, o), params, opt_state, grads)
    return carry, {
      metrics_lib.LOSS: loss,
      metrics_lib.GRAD_NORM: grad_norm,
      metrics_lib.LEARNING_RATE: learning_rate(schedule, opt_state),  # what this update used
      "bad": 1.0 - finite,
      **aux,
    }

  carry = (state.params, state.opt_state)
  (params, opt_state), upd = jax.lax.scan(update, carry, (order, prompt_order, dropout_keys))
  bad = upd.pop("bad")
  metrics = {k: v.mean() for k, v in upd.items()}
  metrics[metrics_lib.BAD_UPDATES] = bad.sum()
  bad_steps = jnp.where(bad.sum() > 0, state.bad_steps + 1, 0)
  metrics.update(_rollout_metrics(batch, adv_bg))
  metrics.update(adv_metrics)
  metrics[ADVANTAGES] = adv_bg
  new_state = state.replace(
    step=state.step + 1, params=params, opt_state=opt_state, prior=prior, bad_steps=bad_steps
  )
  return new_state, metrics


def jit_train_step(
  config: ml_collections.ConfigDict,
  model: models.Decoder,
  optimizer: optax.GradientTransformation,
  estimator: advantages.Estimator,
  mesh: Mesh,
  state_shardings: Any,
  *,
  donate: bool = True,
  on_trace: Callable[[], None] | None = None,
):
  """`train_step` jitted as the trainer runs it: explicit state and batch shardings (so a second
  step hits the compile cache), metrics replicated, the state donated. `on_trace` is called each
  time jit traces the step (a retrace counter)."""
  fn = functools.partial(
    train_step, model=model, optimizer=optimizer, estimator=estimator, config=config, mesh=mesh
  )
  if on_trace is not None:
    traced_fn = fn

    def fn(state, batch):
      on_trace()
      return traced_fn(state, batch)

  return jax.jit(
    fn,
    in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
    out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
    donate_argnums=(0,) if donate else (),
  )


def _rollout_metrics(batch: dict, adv_bg: jax.Array) -> dict:
  return {
    metrics_lib.REWARD_MEAN: batch["rewards"].mean(),
    metrics_lib.ADV_ZERO_FRAC: advantages.zero_fraction(adv_bg),
    metrics_lib.ADV_ALL_EQUAL_FRAC: advantages.all_equal_fraction(batch["rewards"]),
    metrics_lib.ADV_ABS_MEAN: jnp.abs(adv_bg).mean(),
    metrics_lib.RESPONSE_LEN_MEAN: batch["completion_mask"].sum(-1).mean(),
    metrics_lib.TRUNCATED_FRAC: batch["truncated"].mean(),
  }
