"""A step's training batch and the evaluations, from a `worker.RolloutWorker`'s rollouts.

`collect_batch` makes one RL step's batch (with DAPO's dynamic sampling: a gather of the kept
groups) and `to_batch` places it as `train_step` reads it; `evaluate_accuracy` is the in-training
evaluation; `sample_and_score_batches` serves `evaluate` and `difficulty`.
"""

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ebpo_jax import losses, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.keys import StepKeys
from ebpo_jax.rollouts import episodes
from ebpo_jax.rollouts.options import BatchOptions
from ebpo_jax.rollouts.rollout import Rollout, concat_rollouts
from ebpo_jax.rollouts.worker import RolloutWorker
from ebpo_jax.tasks import reward_fns as reward_fns_lib


@functools.partial(jax.jit, static_argnums=3)
def _take_rows(tree: dict, prompts: jax.Array, responses: jax.Array, mesh: Mesh) -> dict:
  by_prompt = ("prompt_ids", "prompt_mask")
  taken = {k: x[prompts] if k in by_prompt else x[responses] for k, x in tree.items()}
  return sharding.constrain_rows(taken, mesh)  # the step's layout


@functools.partial(jax.jit, static_argnums=1)
def _left_pad(x: jax.Array, width: int) -> jax.Array:
  return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)))


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
  whole = concat_rollouts(widened, mesh)
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
  worker: RolloutWorker, params, keys: StepKeys, rows: Sequence[dict], batches: Iterator
) -> tuple[dict, Rollout, dict]:
  """One step's `train_step` batch (B prompts x G responses), its rollout and rollout metrics.

  With `rl.dynamic_sampling` (DAPO), groups whose task rewards are all equal are dropped and up
  to `rl.max_refill_rounds` further batches of prompts are sampled to refill the batch; if it is
  still short, the dropped groups of the first round fill it (counted in `dapo/filled_groups`).
  Round 0 samples with `keys.rollout`, refill round r with `keys.refill[r - 1]`.
  """
  bo = worker.options.batch
  sample = lambda key: worker.rollout(
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
    rollout, logs = _dapo_select(parts, num_prompts, worker.mesh)
  rewards = _shaped_rewards(rollout, bo, worker.options.completion_width)
  logs.update(
    {
      metrics_lib.REWARD_ERRORS: sum(p.errors for p in parts),
      metrics_lib.ROLLOUT_TOKENS: int(sum(p.lengths.sum() for p in parts)),
      metrics_lib.REWARD_OVERLONG_PENALTY: float((rewards - rollout.rewards).mean()),
    }
  )
  if rollout.stats:  # multi-turn: turns, tool calls and errors, masked share, environment time
    logs.update(episodes.episode_metrics([p.stats for p in parts]))
  if rollout.reward_parts:  # each reward function's mean over the batch, beside reward/mean
    names = list(rollout.reward_parts)
    values = np.stack([rollout.reward_parts[n].reshape(-1) for n in names])
    means = reward_fns_lib.means(values)
    logs.update({metrics_lib.reward_fn_key(n): float(m) for n, m in zip(names, means, strict=True)})
  return to_batch(rollout, rewards, worker.mesh), rollout, logs


def to_batch(rollout: Rollout, rewards: np.ndarray, mesh: Mesh) -> dict:
  """The `train_step` batch: the rollout's device fields, already in the step's layout (rows
  over the mesh's batch axes, `sharding.row_sharding`), the rewards and cluster ids placed so."""
  cluster_ids = np.array([row["cluster"] for row in rollout.rows], np.int32)
  on_device = rollout.device_fields()
  on_device["completion_mask"] = on_device.pop("mask")  # the step's name for it
  place = functools.partial(sharding.place_rows, mesh=mesh)
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
  worker: RolloutWorker, params, eval_rows: Sequence[dict], cluster_names: Sequence[str], key
) -> dict[str, float]:
  """avg@k on held-out prompts (the share of responses with the full reward; `EvalOptions`),
  overall and per cluster, and the number of failed verifier calls (each scored 0)."""
  eo = worker.options.eval
  rollout = worker.rollout(params, eval_rows, key, group_size=eo.num_samples, greedy=eo.greedy)
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
  worker: RolloutWorker,
  params,
  rows: Sequence[dict],
  *,
  num_samples: int,
  greedy: bool,
  skip: int = 0,
) -> Iterator[ScoredBatch]:
  """k completions per row, decoded and scored, one sampler call (`sampling.prompts_per_call`
  rows; 0: all) at a time, so a caller shows progress and keeps what is done. The calls' keys are
  those of one `worker.rollout` over all rows (the same results however they are taken); `skip`
  leaves out the first calls (done by an earlier, stopped run)."""
  key = jax.random.PRNGKey(worker.options.seed)
  params, chunk, calls = worker.call_plan(params, len(rows), key)
  for start, call_key in calls[skip:]:
    part = rows[start : start + chunk]
    rollout = worker.rollout(params, part, call_key, group_size=num_samples, greedy=greedy)
    texts = [rollout.texts[i * num_samples : (i + 1) * num_samples] for i in range(len(part))]
    yield ScoredBatch(start, texts, rollout.rewards, rollout.errors)


def join_batches(batches: Sequence[ScoredBatch]) -> tuple[list[list[str]], np.ndarray, int]:
  """The batches of `sample_and_score_batches` as one: (texts [N][k], rewards [N, k], errors)."""
  texts = [group for batch in batches for group in batch.texts]
  rewards = np.concatenate([batch.rewards for batch in batches])
  return texts, rewards, sum(batch.errors for batch in batches)
