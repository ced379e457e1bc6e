"""Host rollouts: prompts in, scored groups of completions out.

`Sampler` encodes prompts (`prompts.PromptEncoder`), places them on the mesh once, runs the jitted
sampler, fetches the completions to the host in one transfer per sampler call, decodes them and has
its `scoring.Scorer` score them; it reads its settings from frozen `rollout_options.RolloutOptions`,
built from the config once (`make_sampler`). What it returns, a `Rollout`, says where each field
lives: texts, rewards, lengths and rows on the host; tokens, masks and the sampler's log-probs stay
on the devices and go to `train_step` from there.
`collect_batch` makes one RL step's batch (with DAPO's dynamic sampling: a gather of the kept
groups); `evaluate_accuracy` is the in-training evaluation; `sample_and_score_batches` serves
`evaluate` and `difficulty`.
"""

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from ebpo_jax import losses, models, sampling, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.tasks import reward_fns as reward_fns_lib
from ebpo_jax.tasks import rewards as rewards_lib
from ebpo_jax.trainer import episodes as episodes_lib
from ebpo_jax.trainer import prompts as prompts_lib
from ebpo_jax.trainer import scoring
from ebpo_jax.trainer.rollout_options import BatchOptions, RolloutOptions
from ebpo_jax.trainer.state import StepKeys


@dataclasses.dataclass(frozen=True)
class Rollout:
  """N prompts x G scored completions; rows are prompt-major (`n * G + g`)."""

  # On the host (NumPy / Python), the same on every process.
  rows: list[dict]  # [N] the data rows
  texts: list[str]  # [N*G] decoded completions
  rewards: np.ndarray  # [N, G] float32: the task's verifier, or the weighted sum of rewards.fns
  lengths: np.ndarray  # [N*G] int32 completion lengths (the stop token included)
  errors: int  # failed verifier (or reward function) calls
  # On the devices (global arrays, rows over the mesh's batch axes).
  prompt_ids: jax.Array  # [N, P] int32, left-padded
  prompt_mask: jax.Array  # [N, P] bool
  tokens: jax.Array  # [N*G, T] int32: completions, or multi-turn trajectories (`episodes`)
  mask: jax.Array  # [N*G, T] bool: their tokens
  loss_mask: jax.Array  # [N*G, T] bool: the tokens trained (a trajectory's model tokens)
  old_logps: jax.Array  # [N*G, T] float32: log-probs of the sampling policy at temperature 1
  truncated: jax.Array  # [N*G] bool: no stop token within max_new_tokens (or env.max_tokens)
  nonfinite: jax.Array  # [N*G] bool: the sampler met non-finite logits (the step is bad)
  # On the host: each reward function's values {name: [N, G] float32, NaN where it returned None}
  # (training rollouts with rewards.fns; else empty).
  reward_parts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # Multi-turn rollouts: the episodes' sums (`episodes.episode_metrics`); else empty.
  stats: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def group_size(self) -> int:
    return self.rewards.shape[1]

  def device_fields(self) -> dict[str, jax.Array]:
    return {f: getattr(self, f) for f in _DEVICE_FIELDS}


_DEVICE_FIELDS = (
  "prompt_ids",
  "prompt_mask",
  "tokens",
  "mask",
  "loss_mask",
  "old_logps",
  "truncated",
  "nonfinite",
)


def _concat_rollouts(parts: Sequence[Rollout], mesh: Mesh) -> Rollout:
  """Rollouts of disjoint prompts (same prompt width) as one; the device rows in the step's
  layout (`sharding.row_sharding`)."""
  if len(parts) == 1:
    return parts[0]
  device = _concat_rows(tuple(p.device_fields() for p in parts), mesh)
  return Rollout(
    rows=[row for p in parts for row in p.rows],
    texts=[t for p in parts for t in p.texts],
    rewards=np.concatenate([p.rewards for p in parts]),
    lengths=np.concatenate([p.lengths for p in parts]),
    errors=sum(p.errors for p in parts),
    **device,
    reward_parts={
      k: np.concatenate([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts
    },
    stats={k: sum(p.stats[k] for p in parts) for k in parts[0].stats},
  )


# Small device ops of the host loop, jitted so that Python ints stay static (the loop runs under
# `jax.transfer_guard("disallow")`: an eager op with a Python scalar would be a transfer).


@functools.partial(jax.jit, static_argnums=1)
def _concat_rows(trees: tuple[dict, ...], mesh: Mesh) -> dict:
  return sharding.constrain_rows(jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees), mesh)


@functools.partial(jax.jit, static_argnums=3)
def _take_rows(tree: dict, prompts: jax.Array, responses: jax.Array, mesh: Mesh) -> dict:
  by_prompt = ("prompt_ids", "prompt_mask")
  taken = {k: x[prompts] if k in by_prompt else x[responses] for k, x in tree.items()}
  return sharding.constrain_rows(taken, mesh)  # the step's layout


@functools.partial(jax.jit, static_argnums=1)
def _first_rows(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda x: x[:n], tree)


@functools.partial(jax.jit, static_argnums=1)
def _left_pad(x: jax.Array, width: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))


@functools.partial(jax.jit, static_argnums=1)
def _split_keys(key: jax.Array, n: int) -> tuple[jax.Array, ...]:
  return tuple(jax.random.split(key, n))


class Sampler:
  """Samples completions of data rows with the policy's jitted sampler and has `scorer` score
  them. Under LoRA the adapters are applied on the fly (merging them once per step was no faster,
  and holds a second base: bench/RESULTS.md)."""

  def __init__(
    self,
    model: models.Decoder,
    encoder: prompts_lib.PromptEncoder,
    scorer: scoring.Scorer,
    options: RolloutOptions,
    mesh: Mesh,
  ):
    self.model, self.encoder, self.scorer = model, encoder, scorer
    self.options, self.mesh = options, mesh
    self._shapes_seen = set()  # the sampler calls' shapes: a new one compiles (one line says so)

  def rollout(
    self,
    params,
    rows: Sequence[dict],
    key: jax.Array,
    *,
    group_size: int,
    greedy: bool,
    training: bool = False,
  ) -> Rollout:
    """`group_size` scored completions of each row, `sampling.prompts_per_call` rows per sampler
    call (0: all at once). A short last call is padded with copies of its last prompt, so every
    call has one shape (one compile); the copies' completions are dropped (`call_plan`).
    `training`: scored with the reward functions (when configured), else with the task's verifier.
    """
    rows = list(rows)
    prompt_ids, prompt_mask = self.encoder.prompts(rows)
    params, chunk, calls = self.call_plan(params, len(rows), key)
    parts = []
    for start, call_key in calls:
      ids, mask = prompt_ids[start : start + chunk], prompt_mask[start : start + chunk]
      fill = np.full(chunk - len(ids), len(ids) - 1)
      ids, mask = np.concatenate([ids, ids[fill]]), np.concatenate([mask, mask[fill]])
      call_rows = rows[start : start + chunk]
      args = (params, ids, mask, call_key, call_rows, group_size, greedy, training)
      if self.options.env is None:
        parts.append(self._sample_call(*args))
      else:
        parts.append(Rollout(rows=call_rows, **episodes_lib.rollout_fields(self, *args)))
    return _concat_rollouts(parts, self.mesh)

  def call_plan(self, params, num_rows: int, key: jax.Array):
    """`(params, chunk, [(start, key)])` of `num_rows` rows sampled `sampling.prompts_per_call`
    (0: all) at a time: the weights are put in the sampler's layout once for the round
    (`SamplingOptions.decode_params`), and call i samples rows `[start, start + chunk)` with its
    key."""
    chunk = self.options.sampling.prompts_per_call or num_rows
    starts = range(0, num_rows, chunk)
    keys = [key] if len(starts) == 1 else _split_keys(key, len(starts))
    params = self.options.sampling.decode_params(params, self.model.config)
    return params, chunk, list(zip(starts, keys, strict=True))

  def _sample_call(
    self, params, ids, mask, key, rows, group_size: int, greedy: bool, training: bool
  ) -> Rollout:
    """One sampler call over (possibly padded) prompts: they are placed on the mesh once, the
    completions fetched in one transfer, and those of the first len(rows) prompts scored."""
    so, tokenizer = self.options.sampling, self.encoder.tokenizer
    spec = sharding.row_sharding(ids.shape, self.mesh)
    ids, mask = sharding.place_from_host(ids, spec), sharding.place_from_host(mask, spec)
    options = so.generate_options(tokenizer, group_size=group_size, greedy=greedy)
    if (ids.shape, group_size, greedy) not in self._shapes_seen:
      self._shapes_seen.add((ids.shape, group_size, greedy))
      logging.info(
        "compiling the sampler for %d prompts x %d tokens, %d %s each ...",
        *ids.shape,
        group_size,
        "greedy" if greedy else "samples",
      )
    out = sampling.generate(
      self.model,
      params,
      ids,
      mask,
      key,
      temperature=so.temperature,
      top_p=so.top_p,
      mesh=self.mesh,
      **options,
    )
    tokens, lengths = sharding.to_host((out.tokens, out.lengths))
    n = len(rows)
    if ids.shape[0] > n:  # a padded call: drop the copies' rows
      ids, mask = _first_rows((ids, mask), n)
      out = _first_rows(out, n * group_size)
      tokens, lengths = tokens[: n * group_size], lengths[: n * group_size]
    lengths = lengths.astype(np.int32)
    texts = [tokenizer.decode(t[:k].tolist()) for t, k in zip(tokens, lengths, strict=True)]
    rewards, reward_parts, errors = self.scorer.score(
      texts, rows, lengths, group_size, training=training
    )
    return Rollout(
      rows=rows,
      texts=texts,
      rewards=rewards,
      lengths=lengths,
      errors=errors,
      prompt_ids=ids,
      prompt_mask=mask,
      tokens=out.tokens,
      mask=out.mask,
      loss_mask=out.mask,
      old_logps=out.logprobs,
      truncated=out.truncated,
      nonfinite=out.nonfinite,
      reward_parts=reward_parts,
    )


# ----------------------------------------------------------------------------- training batches


def _varied(rollout: Rollout) -> np.ndarray:
  """[N] bool: the group's task rewards are not all equal (it carries a learning signal)."""
  return rollout.rewards.max(axis=1) > rollout.rewards.min(axis=1)


def _select_groups(parts: Sequence[Rollout], picks: Sequence[np.ndarray], mesh) -> Rollout:
  """The picked groups (`picks[i]`: prompt indices into `parts[i]`) as one rollout. Prompts are
  left-padded to the widest part (pads are masked); the device rows are gathered on device."""
  width = max(p.prompt_ids.shape[1] for p in parts)
  widened = []
  for p in parts:
    if p.prompt_ids.shape[1] < width:
      p = dataclasses.replace(
        p, prompt_ids=_left_pad(p.prompt_ids, width), prompt_mask=_left_pad(p.prompt_mask, width)
      )
    widened.append(p)
  whole = _concat_rollouts(widened, mesh)
  offsets = np.cumsum([0] + [len(p.rows) for p in parts])
  prompts = np.concatenate([idx + off for idx, off in zip(picks, offsets, strict=False)])
  g = whole.group_size
  responses = (prompts[:, None] * g + np.arange(g)).reshape(-1)
  replicated = sharding.replicated(mesh)
  place = lambda x: sharding.place_from_host(x.astype(np.int32), replicated)
  gathered = _take_rows(whole.device_fields(), place(prompts), place(responses), mesh)
  return Rollout(
    rows=[whole.rows[i] for i in prompts],
    texts=[whole.texts[i] for i in responses],
    rewards=whole.rewards[prompts],
    lengths=whole.lengths[responses],
    errors=whole.errors,
    **gathered,
    reward_parts={k: v[prompts] for k, v in whole.reward_parts.items()},
    stats=whole.stats,
  )


def _dapo_select(parts: Sequence[Rollout], num_prompts: int, mesh) -> tuple[Rollout, dict]:
  """DAPO's batch: the first `num_prompts` groups with varied rewards over the rounds, topped up
  with the first round's uniform groups when they are too few."""
  picks, left = [], num_prompts
  for part in parts:
    picks.append(np.flatnonzero(_varied(part))[:left])
    left -= len(picks[-1])
  first_uniform = np.flatnonzero(~_varied(parts[0]))[:left]
  picks[0] = np.concatenate([picks[0], first_uniform])
  logs = {
    metrics_lib.DAPO_KEPT_FRAC: float(_varied(parts[0]).mean()),
    metrics_lib.DAPO_ROUNDS: len(parts),
    metrics_lib.DAPO_FILLED_GROUPS: len(first_uniform),
  }
  return _select_groups(parts, picks, mesh), logs


def _shaped_rewards(rollout: Rollout, bo: BatchOptions, max_new_tokens: int) -> np.ndarray:
  """The task rewards plus DAPO's overlong penalty (when `rl.overlong_buffer` > 0)."""
  if bo.overlong_buffer == 0:
    return rollout.rewards
  penalty = losses.overlong_penalty(
    rollout.lengths,
    max_len=max_new_tokens,
    buffer=bo.overlong_buffer,
    penalty=bo.overlong_penalty,
  )
  return rollout.rewards + penalty.reshape(rollout.rewards.shape)


def collect_batch(
  sampler: Sampler, params, keys: StepKeys, rows: Sequence[dict], batches: Iterator
) -> tuple[dict, Rollout, dict]:
  """One step's `train_step` batch (B prompts x G responses), its rollout and rollout metrics.

  With `rl.dynamic_sampling` (DAPO), groups whose task rewards are all equal are dropped and up
  to `rl.max_refill_rounds` further batches of prompts are sampled to refill the batch; if it is
  still short, the dropped groups of the first round fill it (counted in `dapo/filled_groups`).
  Round 0 samples with `keys.rollout`, refill round r with `keys.refill[r - 1]`.
  """
  bo = sampler.options.batch
  sample = lambda key: sampler.rollout(
    params,
    [rows[i] for i in next(batches)],
    key,
    group_size=bo.group_size,
    greedy=False,
    training=True,
  )
  parts = [sample(keys.rollout)]
  rollout, logs = parts[0], {}
  if bo.dynamic_sampling:
    num_prompts = len(parts[0].rows)
    while sum(_varied(p).sum() for p in parts) < num_prompts and len(parts) <= bo.max_refill_rounds:
      parts.append(sample(keys.refill[len(parts) - 1]))
    rollout, logs = _dapo_select(parts, num_prompts, sampler.mesh)
  rewards = _shaped_rewards(rollout, bo, sampler.options.completion_width)
  logs.update(
    {
      metrics_lib.REWARD_ERRORS: sum(p.errors for p in parts),
      metrics_lib.ROLLOUT_TOKENS: int(sum(p.lengths.sum() for p in parts)),
      metrics_lib.REWARD_OVERLONG_PENALTY: float((rewards - rollout.rewards).mean()),
    }
  )
  if rollout.stats:  # multi-turn: turns, tool calls and errors, masked share, environment time
    logs.update(episodes_lib.episode_metrics([p.stats for p in parts]))
  if rollout.reward_parts:  # each reward function's mean over the batch, beside reward/mean
    names = list(rollout.reward_parts)
    values = np.stack([rollout.reward_parts[n].reshape(-1) for n in names])
    means = reward_fns_lib.means(values)
    logs.update({metrics_lib.reward_fn_key(n): float(m) for n, m in zip(names, means, strict=True)})
  return to_batch(rollout, rewards, sampler.mesh), rollout, logs


def to_batch(rollout: Rollout, rewards: np.ndarray, mesh: Mesh) -> dict:
  """The `train_step` batch: the rollout's device fields, already in the step's layout (rows
  over the mesh's batch axes, `sharding.row_sharding`), the rewards and cluster ids placed so."""
  cluster_ids = np.array([row["cluster"] for row in rollout.rows], np.int32)
  on_device = rollout.device_fields()
  on_device["completion_mask"] = on_device.pop("mask")  # the step's name for it
  place = lambda x: sharding.place_from_host(x, sharding.row_sharding(x.shape, mesh))  # noqa: E731
  return {
    **on_device,
    "rewards": place(np.asarray(rewards, np.float32)),
    "cluster_ids": place(cluster_ids),
  }


def sample_rows(
  rollout: Rollout, advantages_bg: np.ndarray, cluster_names: Sequence[str], num: int
) -> list[dict]:
  """The sample completions table of a step: its first `num` completions (prompt-major, so whole
  groups side by side), each with its prompt, answer, reward (before DAPO's overlong penalty),
  advantage [B, G] from the step and cluster name, and each reward function's value
  (`reward/<name>`, NaN where it returned None) when `rewards.fns` is set."""
  g = rollout.group_size
  table = []
  for i in range(min(num, len(rollout.texts))):
    row = rollout.rows[i // g]
    table.append(
      {
        "prompt": row["prompt"],
        "completion": rollout.texts[i],
        "answer": row["answer"],
        "reward": float(rollout.rewards[i // g, i % g]),
        "advantage": float(advantages_bg[i // g, i % g]),
        "cluster": cluster_names[row["cluster"]],
        **{
          metrics_lib.reward_fn_key(name): float(part[i // g, i % g])
          for name, part in rollout.reward_parts.items()
        },
      }
    )
  return table


# ----------------------------------------------------------------------------- evaluation


def evaluate_accuracy(
  sampler: Sampler, params, eval_rows: Sequence[dict], cluster_names: Sequence[str], key
) -> dict[str, float]:
  """avg@k on held-out prompts (the share of responses with the full reward; `EvalOptions`),
  overall and per cluster, and the number of failed verifier calls (each scored 0)."""
  eo = sampler.options.eval
  rollout = sampler.rollout(params, eval_rows, key, group_size=eo.num_samples, greedy=eo.greedy)
  correct = (np.asarray(rollout.rewards) >= tasks.base.FULL_REWARD).mean(axis=1)
  clusters = np.array([row["cluster"] for row in eval_rows])
  accuracy = metrics_lib.EVAL_ACCURACY
  return {
    accuracy: float(correct.mean()),
    metrics_lib.EVAL_VERIFIER_ERRORS: int(rollout.errors),
    **{
      metrics_lib.per_cluster(accuracy, name): float(correct[clusters == c].mean())
      for c, name in enumerate(cluster_names)
      if (clusters == c).any()
    },
  }


class ScoredBatch(NamedTuple):
  """One sampler call of `sample_and_score_batches`: rows [start, start + len(texts))."""

  start: int
  texts: list[list[str]]  # [n][k] decoded completions
  rewards: np.ndarray  # [n, k] float32
  errors: int


def sample_and_score_batches(
  sampler: Sampler, params, rows: Sequence[dict], *, num_samples: int, greedy: bool, skip: int = 0
) -> Iterator[ScoredBatch]:
  """k completions per row, decoded and scored, one sampler call (`sampling.prompts_per_call`
  rows; 0: all) at a time, so a caller shows progress and keeps what is done. The calls' keys are
  those of one `sampler.rollout` over all rows (the same results however they are taken); `skip`
  leaves out the first calls (done by an earlier, stopped run)."""
  key = jax.random.PRNGKey(sampler.options.seed)
  params, chunk, calls = sampler.call_plan(params, len(rows), key)
  for start, call_key in calls[skip:]:
    part = rows[start : start + chunk]
    rollout = sampler.rollout(params, part, call_key, group_size=num_samples, greedy=greedy)
    texts = [rollout.texts[i * num_samples : (i + 1) * num_samples] for i in range(len(part))]
    yield ScoredBatch(start, texts, rollout.rewards, rollout.errors)


def join_batches(batches: Sequence[ScoredBatch]) -> tuple[list[list[str]], np.ndarray, int]:
  """The batches of `sample_and_score_batches` as one: (texts [N][k], rewards [N, k], errors)."""
  texts = [group for batch in batches for group in batch.texts]
  rewards = np.concatenate([batch.rewards for batch in batches])
  return texts, rewards, sum(batch.errors for batch in batches)


def make_sampler(model, task, tokenizer, config: ml_collections.ConfigDict, mesh) -> Sampler:
  """The Sampler of `config` (the one place the rollouts read it): its options, the prompt encoder,
  a scorer with its own verifier pool (`sampler.scorer.pool.close()`) and `config.rewards.fns`,
  and `model` computing in `sampling.dtype` (default: the model's own)."""
  options = RolloutOptions.from_config(config)
  encoder = prompts_lib.PromptEncoder.from_config(config, task, tokenizer)
  fns = reward_fns_lib.load(config.rewards.fns)
  pool = rewards_lib.RewardPool(config.rewards.workers, config.rewards.timeout_s)
  scorer = scoring.Scorer(
    task,
    pool,
    fns,
    max_new_tokens=options.completion_width,
    max_error_frac=config.rewards.max_error_frac,
  )
  sampler_model = models.build.with_compute_dtype(model, config.sampling.dtype)
  return Sampler(sampler_model, encoder, scorer, options, mesh)
