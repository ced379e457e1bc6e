"""The trainer: RL with verifiable rewards (GRPO family, EBPO) on a decoder language model.

  python -m ebpo_jax.train --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo \
      [--config.rl.advantage=grpo ...]

`main` reads top to bottom: check the config, mesh, task and data, model and optimizer, state,
checkpoint (resume or warm start), then the loop. Each RL step samples G responses per prompt with
the jitted sampler, scores them on the host, and hands everything to `train_step`, one pure jitted
function that computes the advantages (threading the EBPO prior), builds the sequences and runs
`rl.num_iterations` epochs of PPO-clip mini-batch updates.
"""

import collections
import functools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from absl import app, flags, logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from ebpo_jax import advantages, checkpoint, data, losses, models, sampling, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.tasks import rewards as rewards_lib
from ebpo_jax.tasks import tokenizers

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")

# Keys that measure wall-clock time: they differ between an interrupted and a straight run.
TIMING_KEYS = ("time/step_s", "time/tokens_per_s", "time/sample_s", "time/update_s")


class ConfigError(ValueError):
  """An invalid config value; the message names the key and the value."""


class TrainState(flax.struct.PyTreeNode):
  """Everything that changes during training (plus the frozen reference policy)."""

  step: jax.Array  # int32 []: RL steps completed
  params: Any
  opt_state: Any
  prior: advantages.PriorState  # EBPO's per-cluster Welford accumulators
  rng: jax.Array  # uint32 [2]: raw PRNG key; per-step keys are fold_in(rng, step)
  ref_params: Any  # frozen reference policy for the KL term; None when rl.loss.kl_coef == 0


# ----------------------------------------------------------------------------- config


def _choice(config, key: str, allowed: Sequence[str]) -> None:
  value = _get(config, key)
  if value not in allowed:
    raise ConfigError(f"config.{key}={value!r}: must be one of {', '.join(map(str, allowed))}")


def _get(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _require(ok: bool, config, key: str, rule: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}={_get(config, key)!r}: {rule}")


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Validates every value before anything compiles; raises ConfigError naming key and value."""
  _choice(config, "rl.advantage", advantages.ESTIMATORS)
  _choice(config, "rl.ebpo.mode", ("running", "batch"))
  _choice(config, "rl.ebpo.normalize", advantages.NORMALIZATIONS)
  _choice(config, "rl.ebpo.per_cluster", (True, False))
  _choice(config, "rl.loss.aggregation", losses.AGG_MODES)
  _choice(config, "rl.loss.kl_kind", losses.KL_KINDS)
  _choice(config, "data.order", data.ORDERS)
  _choice(config, "train.schedule", ("constant", "cosine"))
  _choice(config, "model.remat", tuple(models.decoder.REMAT_POLICIES))
  rl, tc = config.rl, config.train
  _require(rl.group_size >= 2, config, "rl.group_size", "must be >= 2")
  _require(0.0 < rl.ebpo.decay <= 1.0, config, "rl.ebpo.decay", "must lie in (0, 1]")
  _require(rl.num_iterations >= 1, config, "rl.num_iterations", "must be >= 1")
  _require(tc.num_steps >= 0, config, "train.num_steps", "must be >= 0")
  _require(tc.batch_size >= 1, config, "train.batch_size", "must be >= 1")
  _require(tc.learning_rate > 0, config, "train.learning_rate", "must be > 0")
  _require(tc.max_bad_steps >= 1, config, "train.max_bad_steps", "must be >= 1")
  _require(config.sampling.temperature > 0, config, "sampling.temperature", "must be > 0")
  _require(0 < config.sampling.top_p <= 1, config, "sampling.top_p", "must lie in (0, 1]")
  _require(config.sampling.max_new_tokens >= 1, config, "sampling.max_new_tokens", "must be >= 1")
  _require(
    config.sampling.prompts_per_call >= 0,
    config,
    "sampling.prompts_per_call",
    "must be >= 0 (0: all prompts in one sampler call)",
  )
  _choice(config, "rl.dynamic_sampling", (True, False))
  _require(rl.max_refill_rounds >= 0, config, "rl.max_refill_rounds", "must be >= 0")
  _require(
    0 <= rl.overlong_buffer <= config.sampling.max_new_tokens,
    config,
    "rl.overlong_buffer",
    f"must lie in [0, sampling.max_new_tokens={config.sampling.max_new_tokens}]",
  )
  _require(rl.overlong_penalty >= 0, config, "rl.overlong_penalty", "must be >= 0")
  _require(config.rl.loss.clip_low >= 0, config, "rl.loss.clip_low", "must be >= 0")
  _require(config.rl.loss.clip_high >= 0, config, "rl.loss.clip_high", "must be >= 0")
  _require(
    tc.batch_size % tc.mini_batch_size == 0,
    config,
    "train.mini_batch_size",
    f"must divide train.batch_size={tc.batch_size}",
  )
  mini_rows = tc.mini_batch_size * rl.group_size
  micro = tc.micro_batch_size or mini_rows
  _require(
    mini_rows % micro == 0,
    config,
    "train.micro_batch_size",
    f"must divide mini_batch_size * group_size = {mini_rows}",
  )
  data_shards = _data_shards(config, num_devices)
  _require(
    micro % data_shards == 0 and tc.batch_size % data_shards == 0,
    config,
    "train.batch_size",
    f"prompts per step and rows per micro-batch ({micro}) must be divisible by the mesh's "
    f"data x fsdp = {data_shards} devices",
  )


def _data_shards(config, num_devices: int) -> int:
  sizes = dict(config.mesh)
  known = math.prod(v for v in sizes.values() if v != -1)
  if num_devices % known:
    raise ConfigError(f"config.mesh={sizes}: does not divide the {num_devices} devices")
  sizes = {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f"config.mesh={dict(config.mesh)}: needs {num_devices} devices in all")
  return sizes["data"] * sizes["fsdp"]


# ----------------------------------------------------------------------------- model, optimizer

_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def random_init_config(mc, vocab_size: int) -> models.ModelConfig:
  """The ModelConfig of a random-init decoder from `config.model` (shape keys, and the optional
  family keys `architecture` (llama | qwen2 | qwen3), `tie_word_embeddings`, `rope_theta`)."""
  arch = mc.get("architecture", "llama")
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
    attention_bias=arch == "qwen2",
    qk_norm=arch == "qwen3",
    tie_word_embeddings=bool(mc.get("tie_word_embeddings", True)),
    rope_theta=float(mc.get("rope_theta", 10000.0)),
    dtype=mc.dtype,
    param_dtype=mc.param_dtype,
    remat=mc.remat,
  )


def build_model(config, tokenizer, mesh) -> tuple[models.Decoder, Any]:
  """The policy and its sharded parameters: a Hugging Face directory or a random-init decoder."""
  mc = config.model
  if mc.path:
    return models.from_pretrained(
      models.resolve_model_path(mc.path),
      dtype=jnp.dtype(mc.dtype),
      param_dtype=mc.param_dtype,
      remat=mc.remat,
      mesh=mesh,
    )
  model_config = random_init_config(mc, tokenizer.vocab_size)
  model = models.Decoder(model_config)
  dummy = jnp.zeros((1, 4), jnp.int32)
  init = lambda rng: model.init(rng, dummy)["params"]
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  shardings = sharding.logical_shardings(abstract, mesh, sharding.DEFAULT_RULES)
  init_fn = jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)
  return model, init_fn(jax.random.PRNGKey(config.seed))


def make_optimizer(tc, total_updates: int) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, with linear warmup then constant or cosine decay."""
  warmup = max(tc.warmup_steps, 0)
  if tc.schedule == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(
      0.0, tc.learning_rate, warmup, max(total_updates, warmup + 1)
    )
  else:
    schedule = optax.join_schedules(
      [
        optax.linear_schedule(0.0, tc.learning_rate, warmup),
        optax.constant_schedule(tc.learning_rate),
      ],
      [warmup],
    )
  return optax.chain(
    optax.clip_by_global_norm(tc.grad_clip),
    optax.adamw(schedule, weight_decay=tc.weight_decay),
  )


# ----------------------------------------------------------------------------- sequences


def build_sequences(prompt_ids_bp, prompt_mask_bp, tokens_rn, mask_rn, group_size: int) -> dict:
  """Prompt (left-padded, repeated G times) + completion, with positions matching the sampler.

  Row r = b * G + g holds sample g of prompt b. Completion token n sits at slot P + n and is
  predicted by the logits at slot P + n - 1.
  """
  ids = jnp.repeat(prompt_ids_bp, group_size, axis=0)
  pmask = jnp.repeat(prompt_mask_bp, group_size, axis=0)
  prompt_pos = jnp.maximum(jnp.cumsum(pmask, axis=-1) - 1, 0)
  prompt_len = pmask.sum(-1, keepdims=True)
  completion_pos = prompt_len + jnp.arange(tokens_rn.shape[1])[None]
  return {
    "input_ids": jnp.concatenate([ids, tokens_rn], axis=1),
    "positions": jnp.concatenate([prompt_pos, completion_pos], axis=1).astype(jnp.int32),
    "attention_mask": jnp.concatenate([pmask, mask_rn], axis=1),
    "targets": tokens_rn,
    "loss_mask": mask_rn,
  }


def completion_logits(model, params, seqs: dict) -> jax.Array:
  """Logits [R, N, V] that predict the N completion tokens."""
  logits = model.apply(
    {"params": params},
    seqs["input_ids"],
    positions=seqs["positions"],
    attention_mask=seqs["attention_mask"],
  )
  n = seqs["targets"].shape[1]
  return logits[:, -n - 1 : -1]


# ----------------------------------------------------------------------------- train step


def shard_rows(tree, mesh):
  """Constrains the leading (row) dimension of every array to the mesh's batch axes, so that XLA
  keeps micro-batches split over devices instead of spreading the weights' sharding onto them."""
  if mesh is None:
    return tree

  def constrain(x):
    names = ("batch",) + (None,) * (x.ndim - 1)
    spec = sharding.logical_to_spec(x.shape, names, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return jax.tree.map(constrain, tree)


def _reference_logps(model, ref_params, seqs: dict, micro_rows: int, mesh) -> jax.Array:
  """log pi_ref of the completions [R, N], one micro-batch at a time (bounded memory)."""
  keys = ("input_ids", "positions", "attention_mask", "targets")
  chunks = {k: seqs[k].reshape(-1, micro_rows, *seqs[k].shape[1:]) for k in keys}

  def one(mb):
    mb = shard_rows(mb, mesh)
    return losses.token_logprobs(completion_logits(model, ref_params, mb), mb["targets"])

  return jax.lax.map(one, chunks).reshape(seqs["targets"].shape)


def _loss_fn(params, mb, *, model, loss_cfg, num_tokens, num_seqs, mesh=None):
  mb = shard_rows(mb, mesh)
  logits = completion_logits(model, params, mb)
  logps = losses.token_logprobs(logits, mb["targets"])
  ent = losses.entropy(logits)
  return losses.policy_loss(
    logps,
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
    entropy_bt=ent,
    entropy_coef=loss_cfg.entropy_coef,
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    max_len=mb["targets"].shape[1],
  )


def _accumulated_grads(params, mini: dict, *, num_micro: int, loss_fn):
  """Gradients of a mini-batch summed over micro-batches (the loss is normalised globally)."""
  num_tokens = mini["loss_mask"].sum()
  num_seqs = mini["loss_mask"].shape[0]
  micro = jax.tree.map(lambda x: x.reshape(num_micro, -1, *x.shape[1:]), mini)
  grad_fn = jax.value_and_grad(
    functools.partial(loss_fn, num_tokens=num_tokens, num_seqs=num_seqs), has_aux=True
  )

  def body(acc, mb):
    (loss, aux), grads = grad_fn(params, mb)
    return jax.tree.map(jnp.add, acc, (loss, grads)), aux

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), aux = jax.lax.scan(body, zeros, micro)
  return loss, grads, jax.tree.map(jnp.sum, aux)  # each chunk holds its share of the total


def train_step(
  state: TrainState, batch: dict, *, model, optimizer, config, mesh=None
) -> tuple[TrainState, dict]:
  """One RL step on a scored rollout batch: advantages, then PPO-clip updates. Pure; jitted once.

  batch: prompt_ids/prompt_mask [B, P], tokens/completion_mask/old_logps [B*G, N],
  rewards [B, G], cluster_ids [B]. With `mesh`, micro-batch rows are kept sharded over its
  batch axes.
  """
  rl, tc = config.rl, config.train
  group_size = rl.group_size
  estimator = advantages.get(rl.advantage)
  cluster_ids = batch["cluster_ids"]
  if rl.advantage == "ebpo" and not rl.ebpo.per_cluster:
    cluster_ids = jnp.zeros_like(cluster_ids)  # one global prior, in slot 0 (authors' code)
  adv_bg, prior, adv_stats = estimator(
    batch["rewards"], None, cluster_ids, state.prior, **_estimator_kwargs(rl)
  )
  seqs = build_sequences(
    batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["completion_mask"], group_size
  )
  seqs["old_logps"] = batch["old_logps"]
  seqs["adv"] = adv_bg.reshape(-1)
  num_rows = seqs["adv"].shape[0]
  mini_rows = tc.mini_batch_size * group_size
  micro_rows = tc.micro_batch_size or mini_rows
  num_micro = mini_rows // micro_rows
  if state.ref_params is not None:
    seqs["ref_logps"] = _reference_logps(model, state.ref_params, seqs, micro_rows, mesh)
  shuffle_key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
  perms = [
    jax.random.permutation(jax.random.fold_in(shuffle_key, i), num_rows)
    if rl.num_iterations > 1
    else jnp.arange(num_rows)
    for i in range(rl.num_iterations)
  ]
  order = jnp.concatenate(perms).reshape(-1, mini_rows)  # [U, mini_rows], U updates
  loss_fn = functools.partial(_loss_fn, model=model, loss_cfg=rl.loss, mesh=mesh)

  def update(carry, idx):
    params, opt_state = carry
    mini = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), seqs)
    loss, grads, aux = _accumulated_grads(params, mini, num_micro=num_micro, loss_fn=loss_fn)
    grad_norm = optax.global_norm(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    carry = (keep(new_params, params), keep(new_opt_state, opt_state))
    return carry, {"loss": loss, "grad_norm": grad_norm, "bad": 1.0 - finite, **aux}

  (params, opt_state), upd = jax.lax.scan(update, (state.params, state.opt_state), order)
  bad = upd.pop("bad")
  metrics = {k: v.mean() for k, v in upd.items()}
  metrics["bad_updates"] = bad.sum()
  metrics.update(_rollout_metrics(batch, adv_bg, adv_stats, prior, rl.advantage))
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, prior=prior)
  return new_state, metrics


def _estimator_kwargs(rl) -> dict:
  if rl.advantage != "ebpo":
    return {}
  return {"mode": rl.ebpo.mode, "decay": rl.ebpo.decay, "normalize": rl.ebpo.normalize}


def _rollout_metrics(batch, adv_bg, adv_stats, prior, name: str) -> dict:
  mask = batch["completion_mask"]
  out = {
    "reward/mean": batch["rewards"].mean(),
    "adv/zero_frac": advantages.zero_fraction(adv_bg),
    "adv/abs_mean": jnp.abs(adv_bg).mean(),
    "response_len/mean": mask.sum(-1).mean(),
    "truncated_frac": batch["truncated"].mean(),
  }
  if name == "ebpo":
    out["ebpo/shrinkage_mean"] = adv_stats["shrinkage"].mean()
    out["ebpo/prior_mean"] = prior.rewards.mean  # [K]; split per cluster on the host
  return out


# ----------------------------------------------------------------------------- rollouts on host


class Rollouts:
  """Tokenizes prompts, samples groups with the jitted sampler and scores them on the host."""

  def __init__(self, model, task, tokenizer, config, pool, mesh):
    self.model, self.task, self.tokenizer = model, task, tokenizer
    self.config, self.pool, self.mesh = config, pool, mesh

  def prompts(self, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    system = self.task.system_prompt
    token_lists = [self.tokenizer.prompt_ids(self.task.format_prompt(row), system) for row in rows]
    return sampling.pad_prompts(
      token_lists, self.tokenizer.pad_id, tuple(self.config.sampling.prompt_buckets)
    )

  def sample(self, params, rows, rng, *, group_size: int, greedy: bool):
    """`group_size` completions per row, `sampling.prompts_per_call` prompts per sampler call
    (0: all at once). A short last call is padded with copies of its last prompt, so every call
    has one shape (one compile); the copies' completions are dropped."""
    prompt_ids, prompt_mask = self.prompts(rows)
    chunk = self.config.sampling.prompts_per_call or len(rows)
    if chunk >= len(rows):
      out = self._generate(params, prompt_ids, prompt_mask, rng, group_size, greedy)
      return prompt_ids, prompt_mask, out
    outs = []
    for start in range(0, len(rows), chunk):
      ids, mask = prompt_ids[start : start + chunk], prompt_mask[start : start + chunk]
      real = len(ids)
      fill = np.full(chunk - real, real - 1)
      ids, mask = np.concatenate([ids, ids[fill]]), np.concatenate([mask, mask[fill]])
      key = jax.random.fold_in(rng, start // chunk)
      out = self._generate(params, ids, mask, key, group_size, greedy)
      outs.append(jax.tree.map(lambda x, n=real * group_size: x[:n], out))
    out = sampling.SampleOutput(*(jnp.concatenate(parts) for parts in zip(*outs, strict=True)))
    return prompt_ids, prompt_mask, out

  def _generate(self, params, prompt_ids, prompt_mask, rng, group_size: int, greedy: bool):
    sc = self.config.sampling
    return sampling.generate(
      self.model,
      params,
      prompt_ids,  # host arrays: `generate` places them on the mesh (every process has them)
      prompt_mask,
      rng,
      group_size=group_size,
      max_new_tokens=sc.max_new_tokens,
      temperature=sc.temperature,
      top_p=sc.top_p,
      top_k=sc.top_k,
      greedy=greedy,
      stop_ids=self.tokenizer.stop_ids,
      pad_id=self.tokenizer.pad_id,
      mesh=self.mesh,
    )

  def texts(self, out) -> list[str]:
    """The decoded completions, in row order ([N * G]), on every process."""
    tokens, mask = _to_host(out.tokens), _to_host(out.mask)
    return [self.tokenizer.decode(t[m].tolist()) for t, m in zip(tokens, mask, strict=True)]

  def score(self, out, rows: list[dict], group_size: int) -> tuple[np.ndarray, int]:
    """Rewards [N, G] and the number of failed verifier calls. With several processes each
    scores its own contiguous share of the completions and all receive every reward."""
    texts = self.texts(out)
    rows_g = [row for row in rows for _ in range(group_size)]
    share = -(-len(texts) // jax.process_count())
    mine = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
    rewards, errors = self.pool.score(self.task.score, texts[mine], rows_g[mine])
    if jax.process_count() > 1:
      padded = np.zeros(share, np.float32)
      padded[: len(rewards)] = rewards
      gathered = multihost_utils.process_allgather(np.concatenate([padded, [errors]]))
      rewards, errors = gathered[:, :share].reshape(-1)[: len(texts)], int(gathered[:, -1].sum())
    return rewards.reshape(len(rows), group_size), errors


def on_mesh(batch: dict, mesh) -> dict:
  """Host arrays of a batch as global arrays split over the mesh's batch axes (a jitted function
  may not take NumPy inputs with such shardings when there are several processes)."""
  spec = sharding.batch_sharding(mesh)
  place = lambda x: x if isinstance(x, jax.Array) else sharding.place_from_host(np.asarray(x), spec)
  return {k: place(v) for k, v in batch.items()}


def _to_host(x: jax.Array) -> np.ndarray:
  """The whole of a (possibly multi-process) global array, as NumPy on this process."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def sample_part(rollouts: Rollouts, params, key, batch_rows: list[dict]) -> dict:
  """B prompts x G sampled responses, scored (with DAPO's overlong penalty when configured)."""
  config = rollouts.config
  group_size = config.rl.group_size
  prompt_ids, prompt_mask, out = rollouts.sample(
    params, batch_rows, key, group_size=group_size, greedy=False
  )
  task_rewards, errors = rollouts.score(out, batch_rows, group_size)
  penalty = losses.overlong_penalty(
    _to_host(out.lengths),  # on the host: every process holds the whole [B*G] lengths
    max_len=config.sampling.max_new_tokens,
    buffer=config.rl.overlong_buffer,
    penalty=config.rl.overlong_penalty,
  )
  penalty = np.asarray(penalty).reshape(task_rewards.shape)
  return {
    "rows": batch_rows,
    "task_rewards": task_rewards,
    "errors": errors,
    "sampled_tokens": int(jnp.sum(out.mask)),
    "overlong_penalty": float(penalty.mean()),
    "batch": {
      "prompt_ids": prompt_ids,
      "prompt_mask": prompt_mask,
      "tokens": out.tokens,
      "completion_mask": out.mask,
      "old_logps": out.logprobs,
      "truncated": out.truncated,
      "rewards": (task_rewards + penalty).astype(np.float32),
      "cluster_ids": np.array([r["cluster"] for r in batch_rows], np.int32),
    },
  }


def collect_batch(rollouts: Rollouts, params, key, rows, batches) -> tuple[dict, list[dict], dict]:
  """One step's train_step batch (B prompts x G responses), its rows and rollout metrics.

  With `rl.dynamic_sampling` (DAPO), groups whose task rewards are all equal are dropped and up
  to `rl.max_refill_rounds` further batches of prompts are sampled to refill the batch; if it is
  still short, the dropped groups of the first round fill it (counted in `dapo/filled_groups`).
  """
  rl = rollouts.config.rl
  first = sample_part(
    rollouts, params, jax.random.fold_in(key, 0), [rows[i] for i in next(batches)]
  )
  logs = {
    "reward/errors": first["errors"],
    "rollout/tokens": first["sampled_tokens"],
    "reward/overlong_penalty": first["overlong_penalty"],
  }
  if not rl.dynamic_sampling:
    return first["batch"], first["rows"], logs
  num_prompts = len(first["rows"])
  parts, rounds = [first], 1
  while sum(_varied(p).sum() for p in parts) < num_prompts and rounds <= rl.max_refill_rounds:
    batch_rows = [rows[i] for i in next(batches)]
    parts.append(sample_part(rollouts, params, jax.random.fold_in(key, rounds), batch_rows))
    logs["reward/errors"] += parts[-1]["errors"]
    logs["rollout/tokens"] += parts[-1]["sampled_tokens"]
    rounds += 1
  picks = [(part, np.flatnonzero(_varied(part))) for part in parts]
  kept = sum(len(idx) for _, idx in picks)
  if kept < num_prompts:  # still short: the first round's dropped groups fill the rest
    picks.append((first, np.flatnonzero(~_varied(first))[: num_prompts - kept]))
  batch, batch_rows = _select_groups(picks, num_prompts, rl.group_size)
  logs.update(
    {
      "dapo/kept_frac": float(_varied(first).mean()),
      "dapo/rounds": rounds,
      "dapo/filled_groups": max(num_prompts - kept, 0),
    }
  )
  return batch, batch_rows, logs


def _varied(part: dict) -> np.ndarray:
  """[B] bool: the group's task rewards are not all equal (it carries a learning signal)."""
  rewards = part["task_rewards"]
  return rewards.max(axis=1) > rewards.min(axis=1)


def _select_groups(picks, num_prompts: int, group_size: int) -> tuple[dict, list[dict]]:
  """The first `num_prompts` picked groups of several parts as one batch of host arrays, prompts
  left-padded to the widest part (pads are masked, so their id does not matter)."""
  width = max(part["batch"]["prompt_ids"].shape[1] for part, _ in picks)
  pieces, batch_rows = collections.defaultdict(list), []
  for part, idx in picks:
    idx = idx[: num_prompts - len(batch_rows)]
    b = {k: _to_host(v) if isinstance(v, jax.Array) else v for k, v in part["batch"].items()}
    pad = ((0, 0), (width - b["prompt_ids"].shape[1], 0))
    responses = (idx[:, None] * group_size + np.arange(group_size)).reshape(-1)
    pieces["prompt_ids"].append(np.pad(b["prompt_ids"][idx], pad))
    pieces["prompt_mask"].append(np.pad(b["prompt_mask"][idx], pad))
    for k in ("rewards", "cluster_ids"):
      pieces[k].append(b[k][idx])
    for k in ("tokens", "completion_mask", "old_logps", "truncated"):
      pieces[k].append(b[k][responses])
    batch_rows += [part["rows"][i] for i in idx]
  return {k: np.concatenate(v) for k, v in pieces.items()}, batch_rows


def evaluate_accuracy(rollouts: Rollouts, params, eval_rows, cluster_names, rng) -> dict:
  """Greedy (or sampled) accuracy on held-out prompts, overall and per cluster."""
  _, _, out = rollouts.sample(
    params, eval_rows, rng, group_size=1, greedy=rollouts.config.eval.greedy
  )
  rewards, _ = rollouts.score(out, eval_rows, 1)
  rewards = rewards[:, 0]
  clusters = np.array([row["cluster"] for row in eval_rows])
  result = {"eval/accuracy": float(rewards.mean())}
  for k, name in enumerate(cluster_names):
    if (clusters == k).any():
      result[f"eval/accuracy/{name}"] = float(rewards[clusters == k].mean())
  return result


# ----------------------------------------------------------------------------- setup helpers


def load_task_and_rows(config) -> tuple[Any, list[dict], list[str], list[dict]]:
  """The task, training rows and their cluster names, and held-out evaluation rows.

  Training rows come from `data.path` when set (clusters named in the file), else from the task;
  evaluation rows always come from the task's eval split (`task.num_eval` per cluster).
  """
  task = tasks.get_task(config.task.name, **config.task.options)
  if config.data.path:
    rows, cluster_names = data.load_rows_and_clusters(config.data.path)
  else:
    rows, cluster_names = task.rows("train", config.task.num_train, config.seed), task.cluster_names
  eval_rows = task.rows("eval", config.task.num_eval * len(task.cluster_names), config.seed)
  return task, rows, cluster_names, eval_rows


def load_tokenizer(config, task):
  """The model directory's tokenizer, or the task's own for a random-init model."""
  if config.model.path:
    return tokenizers.HFTokenizer(
      models.resolve_model_path(config.model.path), chat_template=config.model.chat_template
    )
  return task.tokenizer


def init_opt_state(optimizer: optax.GradientTransformation, params):
  """The optimizer state, sharded: moments follow their parameters, counters are replicated."""
  replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())
  opt_sharding = optax.tree_map_params(
    optimizer,
    lambda _, s: s,
    jax.eval_shape(optimizer.init, params),
    jax.tree.map(lambda x: x.sharding, params),
    transform_non_params=lambda _: replicated,
  )
  return jax.jit(optimizer.init, out_shardings=opt_sharding)(params)


def create_state(config, params, optimizer, num_clusters: int) -> TrainState:
  """The initial TrainState, built directly in its shardings."""
  replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())
  opt_state = init_opt_state(optimizer, params)
  # Built under jit so every leaf gets its own buffer (the state is donated each step).
  prior, rng, step = jax.jit(
    lambda: (
      advantages.init_prior(num_clusters),
      jax.random.PRNGKey(config.seed),
      jnp.zeros((), jnp.int32),
    ),
    out_shardings=replicated,
  )()
  ref_params = jax.tree.map(jnp.copy, params) if config.rl.loss.kl_coef > 0 else None
  return TrainState(
    step=step, params=params, opt_state=opt_state, prior=prior, rng=rng, ref_params=ref_params
  )


def warm_start(config, model, state: TrainState, rows, rollouts) -> TrainState:
  """Supervised steps on prompt -> answer (`config.sft`); RL and its reference start from here."""
  sc = config.sft
  if sc.num_steps == 0:
    return state
  optimizer = optax.adamw(sc.learning_rate)
  tokenizer = rollouts.tokenizer
  max_len = config.sampling.max_new_tokens

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sft_step(params, opt_state, batch):
    def loss_fn(p):
      seqs = build_sequences(
        batch["prompt_ids"], batch["prompt_mask"], batch["targets"], batch["target_mask"], 1
      )
      logps = losses.token_logprobs(completion_logits(model, p, seqs), seqs["targets"])
      return -(logps * seqs["loss_mask"]).sum() / seqs["loss_mask"].sum()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.copy, state.params)
  opt_state = init_opt_state(optimizer, params)
  rng = np.random.default_rng(config.seed)
  for _ in tqdm.trange(sc.num_steps, desc="warm start", disable=jax.process_index() != 0):
    batch_rows = [rows[i] for i in rng.integers(0, len(rows), sc.batch_size)]
    prompt_ids, prompt_mask = rollouts.prompts(batch_rows)
    targets = np.full((len(batch_rows), max_len), tokenizer.pad_id, np.int32)
    target_mask = np.zeros((len(batch_rows), max_len), bool)  # pad may equal EOS: mask by length
    for i, row in enumerate(batch_rows):
      ids = tokenizer.encode(rollouts.task.format_target(row))[: max_len - 1] + [tokenizer.eos_id]
      targets[i, : len(ids)] = ids
      target_mask[i, : len(ids)] = True
    batch = {
      "prompt_ids": prompt_ids,
      "prompt_mask": prompt_mask,
      "targets": targets,
      "target_mask": target_mask,
    }
    params, opt_state, loss = sft_step(params, opt_state, batch)
  if jax.process_index() == 0:
    print(
      f"warm start: {sc.num_steps} supervised steps, final loss {float(loss):.4f}", file=sys.stderr
    )
  return state.replace(params=params)


def host_metrics(step_metrics: dict, rows, rewards_bg, cluster_names) -> dict:
  """Device metrics as floats; per-cluster vectors split into one key per cluster."""
  out = {}
  for key, value in step_metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      out[key] = float(value)
    else:
      out.update({f"{key}/{name}": float(v) for name, v in zip(cluster_names, value, strict=True)})
  clusters = np.array([row["cluster"] for row in rows])
  for k, name in enumerate(cluster_names):
    if (clusters == k).any():
      out[f"reward/{name}"] = float(rewards_bg[clusters == k].mean())
  return out


def log_eval(rollouts, state, eval_rows, task, writer, step: int, logged=None) -> dict:
  """Evaluates; merges the result into `logged` or, without it, writes its own line."""
  key = jax.random.fold_in(jax.random.fold_in(state.rng, step), 2)
  result = evaluate_accuracy(rollouts, state.params, eval_rows, task.cluster_names, key)
  if logged is None:
    writer.write(step, result)
  else:
    logged.update(result)
  return result


def finish(workdir: str, last_eval: dict, cluster_names) -> None:
  """The end-of-run summary: accuracy per cluster before and after RL, and the plots."""
  history = [
    m for m in metrics_lib.read_metrics(f"{workdir}/metrics.jsonl") if "eval/accuracy" in m
  ]
  if not history:
    return
  first, last = history[0], history[-1]
  table = {
    name: {"before": first.get(f"eval/accuracy/{name}"), "after": last.get(f"eval/accuracy/{name}")}
    for name in cluster_names
  }
  table["all"] = {"before": first["eval/accuracy"], "after": last["eval/accuracy"]}
  print(f"held-out accuracy, step {first['step']} -> step {last['step']}")
  print(metrics_lib.summary_table(table))
  plots = metrics_lib.plot_metrics(workdir)
  print(f"{len(plots)} plots in {workdir}/plots/")


def _counting(fn, counter: collections.Counter, name: str):
  """`fn` that adds 1 to `counter[name]` each time it runs in Python, i.e. each time jit traces."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    counter[name] += 1
    return fn(*args, **kwargs)

  return wrapped


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  config, workdir = _CONFIG.value, _WORKDIR.value
  if workdir is None:
    raise app.UsageError("--workdir is required")
  try:
    sharding.init_distributed()
    check_config(config, jax.device_count())
    run(config, workdir)
  except (ConfigError, data.DataError) as e:
    sys.exit(f"error: {e}")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) under `config` in `workdir`; returns the last evaluation."""
  is_main = jax.process_index() == 0
  mesh = sharding.make_mesh(dict(config.mesh))

  # Task and data.
  task, rows, cluster_names, eval_rows = load_task_and_rows(config)
  tokenizer = load_tokenizer(config, task)
  batches = data.make_batches(
    rows, batch_size=config.train.batch_size, order=config.data.order, seed=config.seed
  )

  # Model, optimizer, state.
  model, params = build_model(config, tokenizer, mesh)
  updates_per_step = config.rl.num_iterations * (
    config.train.batch_size // config.train.mini_batch_size
  )
  optimizer = make_optimizer(config.train, config.train.num_steps * updates_per_step)
  state = create_state(config, params, optimizer, len(cluster_names))
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  traces = collections.Counter()  # Python runs only while tracing: counts (re)compiles
  step_fn = jax.jit(
    _counting(
      functools.partial(train_step, model=model, optimizer=optimizer, config=config, mesh=mesh),
      traces,
      "train_step",
    ),
    in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
    out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())),
    donate_argnums=(0,),
  )

  # Checkpoint: resume, or warm-start and save step 0.
  ckpt = checkpoint.Checkpointer(
    f"{workdir}/checkpoints",
    max_to_keep=config.checkpoint.max_to_keep,
    save_every=config.checkpoint.every_steps,
  )
  rollouts = Rollouts(
    model,
    task,
    tokenizer,
    config,
    rewards_lib.RewardPool(config.rewards.workers, config.rewards.timeout_s),
    mesh,
  )
  latest = ckpt.latest_step()
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main, resume_step=latest)
  if latest is None:
    state = warm_start(config, model, state, rows, rollouts)
    if config.rl.loss.kl_coef > 0:
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    last_eval = log_eval(rollouts, state, eval_rows, task, writer, 0)
    ckpt.save(0, state, data_iter=batches, config=config.to_dict(), force=True)
  else:
    state, _ = ckpt.restore(latest, abstract, data_iter=batches)
    last_eval = {}

  # The loop.
  sigterm = checkpoint.install_sigterm_flag()
  bad_in_a_row = 0
  start = int(state.step)
  bar = tqdm.tqdm(
    range(start, config.train.num_steps),
    initial=start,
    total=config.train.num_steps,
    desc="rl",
    disable=not is_main,
  )
  for step in bar:
    t0 = time.perf_counter()
    key = jax.random.fold_in(state.rng, step)
    batch, batch_rows, rollout_logs = collect_batch(rollouts, state.params, key, rows, batches)
    t1 = time.perf_counter()
    state, step_metrics = step_fn(state, on_mesh(batch, mesh))
    step_metrics = jax.device_get(step_metrics)
    t2 = time.perf_counter()
    bad_in_a_row = bad_in_a_row + 1 if step_metrics["bad_updates"] > 0 else 0
    if bad_in_a_row >= config.train.max_bad_steps:
      ckpt.close()
      sys.exit(
        f"error: non-finite loss or grad norm in {bad_in_a_row} steps in a row "
        f"(train.max_bad_steps={config.train.max_bad_steps}); last good checkpoint kept"
      )
    logged = host_metrics(step_metrics, batch_rows, batch["rewards"], cluster_names)
    logged.update(
      {
        **rollout_logs,
        "time/step_s": t2 - t0,
        "time/sample_s": t1 - t0,
        "time/update_s": t2 - t1,
        "compiles/train_step": traces["train_step"],
        "time/tokens_per_s": rollout_logs["rollout/tokens"] / (t2 - t0),
      }
    )
    if (step + 1) % config.eval.every_steps == 0 or step + 1 == config.train.num_steps:
      last_eval = log_eval(rollouts, state, eval_rows, task, writer, step + 1, logged)
    if (step + 1) % config.train.log_every == 0 or "eval/accuracy" in logged:
      writer.write(step + 1, logged)
    bar.set_postfix(
      reward=f"{logged['reward/mean']:.3f}",
      acc=f"{last_eval.get('eval/accuracy', float('nan')):.3f}",
    )
    stop = sigterm.requested_anywhere()  # every process saves and stops at the same step
    ckpt.save(
      step + 1,
      state,
      data_iter=batches,
      config=config.to_dict(),
      force=step + 1 == config.train.num_steps or stop,
    )
    if stop:
      ckpt.wait()
      ckpt.close()
      writer.close()
      print(f"SIGTERM: saved the checkpoint of step {step + 1}; exiting", file=sys.stderr)
      sys.exit(143)
  ckpt.wait()
  ckpt.close()
  writer.close()
  if is_main:
    finish(workdir, last_eval, task.cluster_names)
  return last_eval


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
