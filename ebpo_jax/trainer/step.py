"""The RL step: one pure function `train_step(state, batch) -> (state, metrics, aux)`, jitted once.

It computes the advantages (threading the estimator's prior through the state), builds the
sequences in the sampler's layout, and runs `rl.num_iterations` epochs of PPO-clip mini-batch
updates with gradient accumulation over micro-batches. Where micro-batches hold whole groups
(`StepLayout.shared_prefix`) the forward runs each prompt once per group, not once per completion.
What the step reads of the config is in `StepOptions`, built once (`StepOptions.from_config`).
Nothing here knows which estimator runs: the registry entry carries its hyperparameters and names
its own metrics.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from ebpo_jax import advantages, losses, models, sharding
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.keys import step_keys
from ebpo_jax.sampling import sequences
from ebpo_jax.trainer.optimizer import learning_rate
from ebpo_jax.trainer.state import StateSpec, TrainState, policy_params
from ebpo_jax.trainer.step_options import StepAux, StepLayout, StepOptions

# ----------------------------------------------------------------------------- the batch


def abstract_batch(
  layout: StepLayout, prompt_len: int, max_new_tokens: int, mesh: Mesh | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
  """The batch `train_step` takes, as shapes (the one statement of its layout; rows r = b * G + g):
  prompt_ids, prompt_mask [B, P]; tokens, completion_mask, loss_mask (the tokens trained: a
  multi-turn trajectory's model tokens, else completion_mask), old_logps [B*G, N]; truncated,
  nonfinite (the sampler met non-finite logits) [B*G]; rewards [B, G]; cluster_ids [B]. With
  `mesh`, each carries its sharding: rows over the mesh's batch axes (`sharding.row_sharding`,
  as the sampler places them, so the rollout reaches the step in this layout)."""
  b, g, n = layout.num_prompts, layout.group_size, max_new_tokens
  shapes = {
    "prompt_ids": ((b, prompt_len), jnp.int32),
    "prompt_mask": ((b, prompt_len), jnp.bool_),
    "tokens": ((b * g, n), jnp.int32),
    "completion_mask": ((b * g, n), jnp.bool_),
    "loss_mask": ((b * g, n), jnp.bool_),
    "old_logps": ((b * g, n), jnp.float32),
    "truncated": ((b * g,), jnp.bool_),
    "nonfinite": ((b * g,), jnp.bool_),
    "rewards": ((b, g), jnp.float32),
    "cluster_ids": ((b,), jnp.int32),
  }
  placed = lambda shape: None if mesh is None else sharding.row_sharding(shape, mesh)
  return {k: jax.ShapeDtypeStruct(s, t, sharding=placed(s)) for k, (s, t) in shapes.items()}


def batch_shardings(layout: StepLayout, mesh: Mesh) -> dict[str, NamedSharding]:
  """The batch's shardings in the step, by field (`abstract_batch`'s; the same for every prompt
  and completion length: only the rows are split)."""
  return {k: x.sharding for k, x in abstract_batch(layout, 1, 1, mesh).items()}


# ----------------------------------------------------------------------------- the forward


def completion_logits(
  model: models.Decoder,
  params: Any,
  seqs: dict,
  *,
  packed_group_size: int | None,
  dropout_key: jax.Array | None = None,
  with_routing: bool = False,
) -> jax.Array | tuple[jax.Array, models.moe.RouterStats | None]:
  """Logits [R, N, V] that predict the N completion tokens (the LM head runs at those positions
  only); with `dropout_key`, the LoRA adapters' inputs are dropped out (`model.lora.dropout`: the
  training forward only). `with_routing`: (logits, the MoE layers' `RouterStats` or None).

  `seqs` in the layout the caller built: one row per completion (`sequences.build_sequences`;
  `packed_group_size=None`), or one per prompt with its G completions packed after it
  (`sequences.build_packed_sequences`; `packed_group_size=G`: the shared-prefix forward, each
  prompt run once)."""
  n, seq_len = seqs["targets"].shape[1], seqs["input_ids"].shape[1]
  if packed_group_size is None:
    layout = {"logits_slice": (seq_len - n - 1, seq_len - 1)}
  else:
    prefix_len = seq_len - packed_group_size * n
    layout = {"prefix_groups": models.PrefixGroups(prefix_len, packed_group_size)}
  routing = with_routing and model.config.num_experts > 0
  out = model.apply(
    {"params": params},
    seqs["input_ids"],
    positions=seqs["positions"],
    attention_mask=seqs["attention_mask"],
    rngs=None if dropout_key is None else {models.lora.DROPOUT_RNG: dropout_key},
    mutable=["intermediates"] if routing else False,
    **layout,
  )
  if not with_routing:
    return out
  return (out[0], models.moe.collect(out[1]["intermediates"])) if routing else (out, None)


def completion_logprobs(
  model: models.Decoder, params: Any, seqs: dict, *, packed_group_size: int | None
) -> jax.Array:
  """log pi(completion token) [R, N] under `params` (`seqs` in the layout `packed_group_size`
  names, as for `completion_logits`)."""
  logits = completion_logits(model, params, seqs, packed_group_size=packed_group_size)
  return losses.token_logprobs(logits, seqs["targets"])


def _packed_group_size(layout: StepLayout) -> int | None:
  return layout.group_size if layout.shared_prefix else None


def _forward_logps(model, params, seqs: dict, layout: StepLayout, mesh) -> jax.Array:
  """log pi(completion token) [R, N] under `params` (the reference's, or the policy's before the
  updates), one micro-batch at a time (bounded memory), without dropout; `seqs` in the step's
  layout (a packed micro-batch holds micro_rows / G prompts)."""
  keys = ("input_ids", "positions", "attention_mask", "targets")
  num_chunks = seqs["targets"].shape[0] // layout.micro_rows
  chunks = {k: seqs[k].reshape(num_chunks, -1, *seqs[k].shape[1:]) for k in keys}
  packed = _packed_group_size(layout)

  def one(mb):
    mb = sharding.constrain_rows(mb, mesh)
    return completion_logprobs(model, params, mb, packed_group_size=packed)

  return jax.lax.map(one, chunks).reshape(seqs["targets"].shape)


def _loss_fn(
  params, mb, dropout_key, *, model, options, num_tokens, num_seqs, base=None, mesh=None
):
  """The policy loss of a micro-batch as a function of the trained params only: under LoRA
  (`base` given) the adapters, so no weight gradient of the frozen base is ever computed.
  `dropout_key`: the micro-batch's LoRA dropout key, or None (no dropout). Aux: the loss's
  metrics and the forward's log-probs [rows, N] (no gradient: the first update's are the step's
  first pass). Where PPO's old log-probs are the first pass (`options.old_from_first_pass`), they
  and the rollout correction's weights are `mb["old_logps"]` and `mb["is_weights"]` when the step
  ran the first pass apart, else this forward's own (the step's one update)."""
  loss = options.loss
  mb = sharding.constrain_rows(mb, mesh)
  full = params if base is None else models.lora.combine(params, base)
  packed = _packed_group_size(options.layout)
  logits, routing = completion_logits(
    model, full, mb, packed_group_size=packed, dropout_key=dropout_key, with_routing=True
  )
  logps = losses.token_logprobs(logits, mb["targets"])
  old_logps, is_weights = mb["old_logps"], mb.get("is_weights")
  if options.old_from_first_pass and not options.first_pass_forward(model.config.lora_dropout):
    # The step's one update, without dropout: this forward is the first pass, and mb["old_logps"]
    # are still the sampler's.
    if loss.rollout_is != "none":
      is_weights, _ = losses.rollout_is_weights(
        logps, old_logps, mb["loss_mask"], mode=loss.rollout_is, cap=loss.rollout_is_cap
      )
    old_logps = jax.lax.stop_gradient(logps)
  loss_value, metrics = losses.policy_loss(
    logps,
    old_logps,
    mb["adv"],
    mb["loss_mask"],
    loss,
    ref_logps_bt=mb.get("ref_logps"),
    entropy_bt=losses.entropy(logits),
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    max_len=mb["targets"].shape[1],
    is_weights_bt=is_weights,
  )
  if routing is not None:
    loss_value = _add_router_loss(metrics, routing, model.config, mb["targets"].shape[0] / num_seqs)
  return loss_value, (metrics, jax.lax.stop_gradient(logps))


def _add_router_loss(metrics: dict, routing, config, share) -> jax.Array:
  """The loss with the MoE router's load-balancing term, `router_aux_loss_coef` times
  `moe.load_balancing_loss` of this micro-batch (times its `share` of the mini-batch's rows, so
  that micro-batches sum to their mean, as the other metrics), and the routing's metrics."""
  aux = models.moe.load_balancing_loss(routing) * share
  metrics[metrics_lib.MOE_AUX_LOSS] = aux
  metrics[metrics_lib.MOE_LOAD_MAX] = models.moe.load_max(routing) * share
  metrics["loss"] = metrics["loss"] + config.router_aux_loss_coef * aux
  return metrics["loss"]


def _accumulated_grads(params, mini: dict, dropout_key, *, num_micro: int, loss_fn):
  """Gradients of a mini-batch summed over micro-batches (the loss is normalised globally), the
  loss's metrics summed and the forward's log-probs [mini_rows, N]; `dropout_key` (or None) is
  split into one key per micro-batch."""
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
  (loss, grads), (aux, logps) = jax.lax.scan(body, zeros, (micro, micro_keys))
  logps = logps.reshape(-1, logps.shape[-1])
  return loss, grads, jax.tree.map(jnp.sum, aux), logps  # each chunk: its share of the total


def _update_order(shuffle_key: jax.Array, num_rows: int, mini_rows: int, epochs: int):
  """[U, mini_rows] row indices of the U updates: one permutation per epoch (none for one)."""
  if epochs == 1:
    return jnp.arange(num_rows).reshape(-1, mini_rows)
  keys = jax.random.split(shuffle_key, epochs)
  return jnp.concatenate([jax.random.permutation(k, num_rows) for k in keys]).reshape(-1, mini_rows)


def _sequences(batch: dict, layout: StepLayout) -> tuple[dict, dict]:
  """The batch's sequences as (per-row arrays [R, ...], per-prompt arrays [B, ...]): in the
  shared-prefix layout the model's inputs are per prompt, else all is per row."""
  shared = layout.shared_prefix
  build = sequences.build_packed_sequences if shared else sequences.build_sequences
  seqs = build(
    batch["prompt_ids"],
    batch["prompt_mask"],
    batch["tokens"],
    batch["completion_mask"],
    layout.group_size,
    batch["loss_mask"],
  )
  prompt_keys = ("input_ids", "positions", "attention_mask") if shared else ()
  return seqs, {k: seqs.pop(k) for k in prompt_keys}


# ----------------------------------------------------------------------------- the step


def train_step(
  state: TrainState,
  batch: dict,
  *,
  model: models.Decoder,
  optimizer: optax.GradientTransformation,
  estimator: advantages.Estimator,
  options: StepOptions,
  mesh: Mesh | None = None,
) -> tuple[TrainState, dict, StepAux]:
  """One RL step on a scored rollout batch (`abstract_batch`): advantages, then PPO-clip updates.

  The forward runs each prompt once for its G completions where `options.layout.shared_prefix`
  (one PPO epoch, micro-batches of whole groups, their prompts split over the devices as their
  rows), else every row's prompt and completion in full; the same math either way.

  With `mesh`, micro-batch rows are kept sharded over its batch axes. Metrics are scalars, or
  per-cluster vectors [K] that the host splits by cluster name; the aux holds the advantages.

  The non-finite policy: an update whose loss or grad norm is not finite is skipped (params and
  optimizer state kept); a batch whose sampling met non-finite logits skips every update and the
  prior's. A step with any skipped update is bad: `bad_updates` counts them, `state.bad_steps`
  counts bad steps in a row (reset by a good step).

  Sampler-trainer mismatch: every step logs `losses.sampler_mismatch` of the first-pass log-probs
  (this step's params before any update) against the sampler's (`batch["old_logps"]`) at the
  loss-mask tokens; with `rl.loss.rollout_is` the policy-gradient terms are weighted by
  `losses.rollout_is_weights` of the same two. With the correction or `rl.recompute_old_logps`,
  PPO's old log-probs are the first pass. The first pass is a forward of its own before the
  updates where `options.first_pass_forward` says so (it then covers every row), else the first
  update's forward (every row when the step makes one update; else that update's mini-batch).
  """
  layout = options.layout
  rollout_finite = ~batch["nonfinite"].any()
  rewards, clusters = batch["rewards"], batch["cluster_ids"]
  adv_bg, prior, adv_metrics = estimator(rewards, cluster_ids_b=clusters, prior=state.prior)
  prior = jax.tree.map(lambda new, old: jnp.where(rollout_finite, new, old), prior, state.prior)
  seqs, prompts = _sequences(batch, layout)
  seqs["old_logps"] = sampler_logps = batch["old_logps"]
  seqs["adv"] = adv_bg.reshape(-1)
  ref_logps = _reference_logps(state, seqs | prompts, model=model, options=options, mesh=mesh)
  if ref_logps is not None:
    seqs["ref_logps"] = ref_logps
  first_logps = None  # the first pass [R, N], when the step runs it on its own
  if options.first_pass_forward(model.config.lora_dropout):
    first_logps = _forward_logps(model, policy_params(state), seqs | prompts, layout, mesh)
    seqs["old_logps"] = first_logps
    if options.loss.rollout_is != "none":
      seqs["is_weights"], _ = _rollout_is(first_logps, sampler_logps, seqs["loss_mask"], options)
  keys = step_keys(state.rng, state.step)
  order = _update_order(keys.shuffle, seqs["adv"].shape[0], layout.mini_rows, layout.epochs)
  g = layout.group_size
  prompt_order = order[:, ::g] // g if layout.shared_prefix else None  # whole groups
  # LoRA dropout: one key per update (each split per micro-batch), from the step's own stream, so
  # a resumed run drops the same inputs; none at all when off (the step is then exactly as before).
  dropout_keys = None
  if model.config.lora_dropout > 0:
    dropout_keys = jax.random.split(keys.lora_dropout, order.shape[0])
  loss_fn = functools.partial(_loss_fn, model=model, options=options, base=state.base, mesh=mesh)
  scanned = (order, prompt_order, dropout_keys)
  update = functools.partial(_updates, optimizer=optimizer, options=options, loss_fn=loss_fn)
  (params, opt_state, first_update_logps), upd = update(
    state, seqs, prompts, scanned, rollout_finite
  )
  bad = upd.pop("bad")
  metrics = {k: v.mean() for k, v in upd.items()}
  metrics[metrics_lib.BAD_UPDATES] = bad.sum()
  bad_steps = jnp.where(bad.sum() > 0, state.bad_steps + 1, 0)
  if first_logps is None:  # the first update's forward: the rows of its mini-batch
    rows = order[0]
    first = (first_update_logps, sampler_logps[rows], seqs["loss_mask"][rows])
  else:
    first = (first_logps, sampler_logps, seqs["loss_mask"])
  metrics.update(_mismatch_metrics(*first, options))
  metrics.update(_rollout_metrics(batch, adv_bg))
  metrics.update(adv_metrics)
  new_state = state.replace(
    step=state.step + 1, params=params, opt_state=opt_state, prior=prior, bad_steps=bad_steps
  )
  return new_state, metrics, StepAux(advantages=adv_bg, layout=layout)


def _reference_logps(state: TrainState, rows: dict, *, model, options: StepOptions, mesh):
  """The KL reference's log-probs of `rows`: the reference params' forward, or with LoRA the
  base's (no adapters) where the KL term is on; None without a reference."""
  if state.ref_params is not None:
    return _forward_logps(model, state.ref_params, rows, options.layout, mesh)
  if state.base is not None and options.loss.kl_coef > 0:
    return _forward_logps(models.lora.base_model(model), state.base, rows, options.layout, mesh)
  return None


def _mismatch_metrics(logps, sampler_logps, mask, options: StepOptions) -> dict:
  """The sampler-trainer mismatch of the first pass, and the correction's metrics when it is on."""
  metrics = losses.sampler_mismatch(logps, sampler_logps, mask)
  if options.loss.rollout_is != "none":
    metrics.update(_rollout_is(logps, sampler_logps, mask, options)[1])
  return metrics


def _rollout_is(logps, sampler_logps, mask, options: StepOptions):
  loss = options.loss
  return losses.rollout_is_weights(
    logps, sampler_logps, mask, mode=loss.rollout_is, cap=loss.rollout_is_cap
  )


def _updates(state, seqs, prompts, scanned, rollout_finite, *, optimizer, options, loss_fn):
  """The step's optimizer updates from `state`'s params and optimizer state, one per (row
  indices, prompt indices, dropout key) of `scanned`: `((params, opt_state, the first update's
  forward log-probs [mini_rows, N]), per-update metrics)`. An update is applied only when its
  loss, its grad norm and the rollout are finite."""
  layout = options.layout

  def apply_update(params, opt_state, grads):
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state

  def update(carry, indices_and_key):
    params, opt_state, first_logps, count = carry
    idx, prompt_idx, dropout_key = indices_and_key
    take = lambda tree, i: jax.tree.map(lambda x: jnp.take(x, i, axis=0), tree)
    mini = take(seqs, idx) | take(prompts, prompt_idx)
    loss, grads, aux, logps = _accumulated_grads(
      params, mini, dropout_key, num_micro=layout.mini_rows // layout.micro_rows, loss_fn=loss_fn
    )
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & rollout_finite
    # A branch, not a select over the new and old trees: a select reads params and both Adam
    # moments twice more per update (0.5 s of a SmolLM2-shape step on a 2-core CPU).
    params, opt_state = jax.lax.cond(
      finite, apply_update, lambda p, o, g: (p, o), params, opt_state, grads
    )
    first_logps = jnp.where(count == 0, logps, first_logps)  # the params before any update
    return (params, opt_state, first_logps, count + 1), {
      metrics_lib.LOSS: loss,
      metrics_lib.GRAD_NORM: grad_norm,
      metrics_lib.LEARNING_RATE: learning_rate(options.schedule, opt_state),  # this update's
      "bad": 1.0 - finite,
      **aux,
    }

  first_logps = jnp.zeros((layout.mini_rows, seqs["targets"].shape[1]), jnp.float32)
  carry = (state.params, state.opt_state, first_logps, jnp.zeros((), jnp.int32))
  (params, opt_state, first_logps, _), metrics = jax.lax.scan(update, carry, scanned)
  return (params, opt_state, first_logps), metrics


def bound_train_step(
  model: models.Decoder, spec: StateSpec, options: StepOptions, mesh: Mesh | None = None
) -> Callable:
  """`train_step(state, batch)` with its static parts bound: the model, the state's optimizer and
  estimator (`spec`), the step's options and the mesh (None: no sharding constraints)."""
  return functools.partial(
    train_step,
    model=model,
    optimizer=spec.optimizer,
    estimator=spec.estimator,
    options=options,
    mesh=mesh,
  )


def jit_train_step(
  model: models.Decoder,
  spec: StateSpec,
  options: StepOptions,
  mesh: Mesh,
  state_shardings: Any,
  *,
  donate: bool = True,
  on_trace: Callable[[], None] | None = None,
) -> "TrainStep":
  """`train_step` jitted as the trainer runs it: explicit state and batch shardings (so a second
  step hits the compile cache), metrics and aux replicated, the state donated but for the LoRA
  base (`TrainStep`). `on_trace` is called each time jit traces the step (a retrace counter).
  `spec`: the state's optimizer and estimator."""
  step = bound_train_step(model, spec, options, mesh)

  def fn(state, base, batch):
    if on_trace is not None:
      on_trace()
    # Under the mesh: the attention kernels run per shard (models.attention's shard_map).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      new, metrics, aux = step(state.replace(base=base), batch)
    return new.replace(base=None), metrics, aux

  replicated = sharding.replicated(mesh)
  trained = state_shardings.replace(base=None)
  jitted = jax.jit(
    fn,
    in_shardings=(trained, state_shardings.base, batch_shardings(options.layout, mesh)),
    out_shardings=(trained, replicated, replicated),
    donate_argnums=(0,) if donate else (),
  )
  return TrainStep(jitted)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The jitted train step, `(state, batch) -> (state, metrics, aux)`. The frozen LoRA base goes
  in beside the donated state, neither donated nor returned: the new state holds the same arrays,
  so an asynchronous run's producer samples with them while the step runs (`rollouts.pipeline`),
  and no copy of the base is made. `trace` and `compile` take the same (state, batch)."""

  jitted: Any  # jit(fn(state without base, base, batch)), or its compiled executable

  def __call__(self, state: TrainState, batch: dict):
    new, metrics, aux = self.jitted(state.replace(base=None), state.base, batch)
    return new.replace(base=state.base), metrics, aux

  def trace(self, state: TrainState, batch: dict):
    return self.jitted.trace(state.replace(base=None), state.base, batch)

  def compile(self, state: TrainState, batch: dict) -> "TrainStep":
    """The step compiled for these (abstract or real) arguments, called as this one."""
    return TrainStep(self.jitted.lower(state.replace(base=None), state.base, batch).compile())


def _rollout_metrics(batch: dict, adv_bg: jax.Array) -> dict:
  return {
    metrics_lib.REWARD_MEAN: batch["rewards"].mean(),
    metrics_lib.ADV_ZERO_FRAC: advantages.zero_fraction(adv_bg),
    metrics_lib.ADV_ALL_EQUAL_FRAC: advantages.all_equal_fraction(batch["rewards"]),
    metrics_lib.ADV_ABS_MEAN: jnp.abs(adv_bg).mean(),
    metrics_lib.RESPONSE_LEN_MEAN: batch["completion_mask"].sum(-1).mean(),
    metrics_lib.TRUNCATED_FRAC: batch["truncated"].mean(),
  }
