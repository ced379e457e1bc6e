"""Host rollouts: prompts in, scored groups of completions out.

`Sampler` tokenizes prompts, places them on the mesh once, runs the jitted sampler, fetches the
completions to the host in one transfer per sampler call, decodes and scores them. What it returns,
a `Rollout`, says where each field lives: texts, rewards, lengths and rows on the host; tokens,
masks and the sampler's log-probs stay on the devices and go to `train_step` from there.
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
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebpo_jax import losses, models, sampling, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.tasks import reward_fns as reward_fns_lib
from ebpo_jax.tasks import rewards as rewards_lib
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
  tokens: jax.Array  # [N*G, T] int32
  mask: jax.Array  # [N*G, T] bool
  old_logps: jax.Array  # [N*G, T] float32: log-probs of the sampling policy at temperature 1
  truncated: jax.Array  # [N*G] bool: no stop token within max_new_tokens
  nonfinite: jax.Array  # [N*G] bool: the sampler met non-finite logits (the step is bad)
  # On the host: each reward function's values {name: [N, G] float32, NaN where it returned None}
  # (training rollouts with rewards.fns; else empty).
  reward_parts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

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
  "old_logps",
  "truncated",
  "nonfinite",
)


def _concat_rollouts(parts: Sequence[Rollout]) -> Rollout:
  """Rollouts of disjoint prompts (same prompt width) as one."""
  if len(parts) == 1:
    return parts[0]
  cat = lambda f: jnp.concatenate([getattr(p, f) for p in parts])
  return Rollout(
    rows=[row for p in parts for row in p.rows],
    texts=[t for p in parts for t in p.texts],
    rewards=np.concatenate([p.rewards for p in parts]),
    lengths=np.concatenate([p.lengths for p in parts]),
    errors=sum(p.errors for p in parts),
    **{f: cat(f) for f in _DEVICE_FIELDS},
    reward_parts={
      k: np.concatenate([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts
    },
  )


# Small device ops of the host loop, jitted so that Python ints stay static (the loop runs under
# `jax.transfer_guard("disallow")`: an eager op with a Python scalar would be a transfer).


@jax.jit
def _take_rows(tree: dict, prompts: jax.Array, responses: jax.Array) -> dict:
  by_prompt = ("prompt_ids", "prompt_mask")
  return {k: x[prompts] if k in by_prompt else x[responses] for k, x in tree.items()}


@functools.partial(jax.jit, static_argnums=1)
def _first_rows(tree: Any, n: int) -> Any:
  return jax.tree.map(lambda x: x[:n], tree)


@functools.partial(jax.jit, static_argnums=1)
def _left_pad(x: jax.Array, width: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))


@functools.partial(jax.jit, static_argnums=1)
def _split_keys(key: jax.Array, n: int) -> tuple[jax.Array, ...]:
  return tuple(jax.random.split(key, n))


def generate_options(config, tokenizer, *, group_size: int, greedy: bool) -> dict:
  """The Sampler's static `sampling.generate` options (one compile per set; aot's too)."""
  sc = config.sampling
  return {
    "group_size": group_size,
    "max_new_tokens": sc.max_new_tokens,
    "top_k": sc.top_k,
    "greedy": greedy,
    "stop_ids": tokenizer.stop_ids,
    "pad_id": tokenizer.pad_id,
    "compact": sc.compact,
  }


class Sampler:
  """Samples and scores completions of data rows with the policy's jitted sampler. Training
  rollouts are scored with `reward_fns` when there are any (config.rewards.fns), every other
  rollout (evaluation) with the task's verifier. Under LoRA the adapters are applied on the fly
  (merging them once per step was no faster, and holds a second base: bench/RESULTS.md)."""

  def __init__(
    self,
    model: models.Decoder,
    task: tasks.Task,
    tokenizer,
    config,
    pool,
    mesh: Mesh,
    reward_fns: Sequence[reward_fns_lib.RewardFn] = (),
  ):
    self.model, self.task, self.tokenizer = model, task, tokenizer
    self.config, self.pool, self.mesh = config, pool, mesh
    self.reward_fns = tuple(reward_fns)
    self._shapes_seen = set()  # the sampler calls' shapes: a new one compiles (one line says so)

  def prompts(self, rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Host `(ids, mask)` [N, P] of the rows' prompts, left-padded to a length bucket."""
    system = self.task.system_prompt
    token_lists = [self.tokenizer.prompt_ids(self.task.format_prompt(row), system) for row in rows]
    return sampling.pad_prompts(
      token_lists, self.tokenizer.pad_id, tuple(self.config.sampling.prompt_buckets)
    )

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
    prompt_ids, prompt_mask = self.prompts(rows)
    params, chunk, calls = self.call_plan(params, len(rows), key)
    parts = []
    for start, call_key in calls:
      ids, mask = prompt_ids[start : start + chunk], prompt_mask[start : start + chunk]
      fill = np.full(chunk - len(ids), len(ids) - 1)
      ids, mask = np.concatenate([ids, ids[fill]]), np.concatenate([mask, mask[fill]])
      call_rows = rows[start : start + chunk]
      parts.append(
        self._sample_call(params, ids, mask, call_key, call_rows, group_size, greedy, training)
      )
    return _concat_rollouts(parts)

  def call_plan(self, params, num_rows: int, key: jax.Array):
    """`(params, chunk, [(start, key)])` of `num_rows` rows sampled `sampling.prompts_per_call`
    (0: all) at a time: over several calls the weights are put in the sampler's layout once
    (`sampling.decode_params`), and call i samples rows `[start, start + chunk)` with its key."""
    chunk = self.config.sampling.prompts_per_call or num_rows
    starts = range(0, num_rows, chunk)
    if len(starts) == 1:
      return params, chunk, [(0, key)]
    keys = _split_keys(key, len(starts))
    return sampling.decode_params(params), chunk, list(zip(starts, keys, strict=True))

  def _sample_call(
    self, params, ids, mask, key, rows, group_size: int, greedy: bool, training: bool
  ) -> Rollout:
    """One sampler call over (possibly padded) prompts: they are placed on the mesh once, the
    completions fetched in one transfer, and those of the first len(rows) prompts scored."""
    sc = self.config.sampling
    spec = sharding.row_sharding(ids.shape, self.mesh)
    ids, mask = sharding.place_from_host(ids, spec), sharding.place_from_host(mask, spec)
    options = generate_options(self.config, self.tokenizer, group_size=group_size, greedy=greedy)
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
      temperature=sc.temperature,
      top_p=sc.top_p,
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
    texts = [self.tokenizer.decode(t[:k].tolist()) for t, k in zip(tokens, lengths, strict=True)]
    fns = self.reward_fns if training else ()
    rewards, reward_parts, errors = self._score(texts, rows, lengths, group_size, fns)
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
      old_logps=out.logprobs,
      truncated=out.truncated,
      nonfinite=out.nonfinite,
      reward_parts=reward_parts,
    )

  def _score(self, texts: list[str], rows: list[dict], lengths: np.ndarray, group_size: int, fns):
    """(rewards [N, G] float32, each reward function's values {name: [N, G]}, failed calls): the
    weighted sum of `fns`, or without any the task's verifier. With several processes each scores
    its own contiguous share of the completions and all receive every value."""
    rows_g = [row for row in rows for _ in range(group_size)]
    share = -(-len(texts) // jax.process_count())
    mine = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
    if fns:
      max_new_tokens = self.config.sampling.max_new_tokens
      extras = [
        {"lengths": [int(n)], "max_new_tokens": max_new_tokens, "task_score": self.task.score}
        for n in lengths[mine]
      ]
      named = [(f.name, f.fn) for f in fns]
      values, errors = self.pool.score_rewards(named, texts[mine], rows_g[mine], extras)
    else:
      rewards, errors = self.pool.score(self.task.score, texts[mine], rows_g[mine])
      values = rewards[None]  # [1, n]
    if jax.process_count() > 1:
      padded = np.zeros((len(values), share), values.dtype)
      padded[:, : values.shape[1]] = values
      gathered = multihost_utils.process_allgather(np.concatenate([padded.reshape(-1), [errors]]))
      by_process = gathered[:, :-1].reshape(len(gathered), len(values), share)
      values = by_process.transpose(1, 0, 2).reshape(len(values), -1)[:, : len(texts)]
      errors = int(gathered[:, -1].sum())
    shape = (len(rows), group_size)
    if not fns:
      return np.asarray(values[0], np.float32).reshape(shape), {}, errors
    total = reward_fns_lib.combine(values, [f.weight for f in fns])
    parts = {f.name: v.reshape(shape) for f, v in zip(fns, values, strict=True)}
    return total.reshape(shape), parts, errors


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
  whole = _concat_rollouts(widened)
  offsets = np.cumsum([0] + [len(p.rows) for p in parts])
  prompts = np.concatenate([idx + off for idx, off in zip(picks, offsets, strict=False)])
  g = whole.group_size
  responses = (prompts[:, None] * g + np.arange(g)).reshape(-1)
  replicated = NamedSharding(mesh, PartitionSpec())
  place = lambda x: sharding.place_from_host(x.astype(np.int32), replicated)
  gathered = _take_rows(whole.device_fields(), place(prompts), place(responses))
  return Rollout(
    rows=[whole.rows[i] for i in prompts],
    texts=[whole.texts[i] for i in responses],
    rewards=whole.rewards[prompts],
    lengths=whole.lengths[responses],
    errors=whole.errors,
    **gathered,
    reward_parts={k: v[prompts] for k, v in whole.reward_parts.items()},
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


def _shaped_rewards(rollout: Rollout, config: ml_collections.ConfigDict) -> np.ndarray:
  """The task rewards plus DAPO's overlong penalty (when `rl.overlong_buffer` > 0)."""
  if config.rl.overlong_buffer == 0:
    return rollout.rewards
  penalty = losses.overlong_penalty(
    rollout.lengths,
    max_len=config.sampling.max_new_tokens,
    buffer=config.rl.overlong_buffer,
    penalty=config.rl.overlong_penalty,
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
  rl = sampler.config.rl
  sample = lambda key: sampler.rollout(
    params,
    [rows[i] for i in next(batches)],
    key,
    group_size=rl.group_size,
    greedy=False,
    training=True,
  )
  parts = [sample(keys.rollout)]
  rollout, logs = parts[0], {}
  if rl.dynamic_sampling:
    num_prompts = len(parts[0].rows)
    while sum(_varied(p).sum() for p in parts) < num_prompts and len(parts) <= rl.max_refill_rounds:
      parts.append(sample(keys.refill[len(parts) - 1]))
    rollout, logs = _dapo_select(parts, num_prompts, sampler.mesh)
  rewards = _shaped_rewards(rollout, sampler.config)
  logs.update(
    {
      metrics_lib.REWARD_ERRORS: sum(p.errors for p in parts),
      metrics_lib.ROLLOUT_TOKENS: int(sum(p.lengths.sum() for p in parts)),
      metrics_lib.REWARD_OVERLONG_PENALTY: float((rewards - rollout.rewards).mean()),
    }
  )
  if rollout.reward_parts:  # each reward function's mean over the batch, beside reward/mean
    names = list(rollout.reward_parts)
    values = np.stack([rollout.reward_parts[n].reshape(-1) for n in names])
    means = reward_fns_lib.means(values)
    logs.update({metrics_lib.reward_fn_key(n): float(m) for n, m in zip(names, means, strict=True)})
  return to_batch(rollout, rewards, sampler.mesh), rollout, logs


def to_batch(rollout: Rollout, rewards: np.ndarray, mesh: Mesh) -> dict:
  """The `train_step` batch: the rollout's device fields (resharded, explicitly, to the step's
  batch sharding when a sampler call had another), the rewards and cluster ids placed."""
  spec = sharding.batch_sharding(mesh)
  cluster_ids = np.array([row["cluster"] for row in rollout.rows], np.int32)
  on_device = rollout.device_fields()
  on_device["completion_mask"] = on_device.pop("mask")  # the step's name for it
  return {
    **jax.device_put(on_device, spec),
    "rewards": sharding.place_from_host(np.asarray(rewards, np.float32), spec),
    "cluster_ids": sharding.place_from_host(cluster_ids, spec),
  }


def sample_rows(
  rollout: Rollout, advantages_bg: np.ndarray, cluster_names: Sequence[str], num: int
) -> list[dict]:
  """The sample completions table of a step: its first `num` completions (prompt-major, so whole
  groups side by side), each with its prompt, answer, reward (before DAPO's overlong penalty),
  advantage [B, G] from the step and cluster name."""
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
      }
    )
  return table


# ----------------------------------------------------------------------------- evaluation


def eval_sampling(config: ml_collections.ConfigDict) -> tuple[int, bool]:
  """(k, greedy): `eval.num_samples` responses per problem, greedy only when k == 1."""
  k = config.eval.num_samples
  return k, bool(config.eval.greedy and k == 1)


def evaluate_accuracy(
  sampler: Sampler, params, eval_rows: Sequence[dict], cluster_names: Sequence[str], key
) -> dict[str, float]:
  """avg@k on held-out prompts (the share of responses with the full reward; `eval_sampling`),
  overall and per cluster, and the number of failed verifier calls (each scored 0)."""
  k, greedy = eval_sampling(sampler.config)
  rollout = sampler.rollout(params, eval_rows, key, group_size=k, greedy=greedy)
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
  key = jax.random.PRNGKey(sampler.config.seed)
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
  """A Sampler with its own verifier pool (`sampler.pool.close()`) and `config.rewards.fns`."""
  fns = reward_fns_lib.load(config.rewards.fns)
  pool = rewards_lib.RewardPool(config.rewards.workers, config.rewards.timeout_s)
  return Sampler(model, task, tokenizer, config, pool, mesh, fns)
