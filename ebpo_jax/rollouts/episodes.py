"""Multi-turn episodes on the host: model turns on the devices, environment steps in the pool.

`run_episodes` starts one environment per trajectory (G per prompt, `config.env`), then, for up to
`env.max_turns` turns, has the sampler decode every live trajectory's next model turn from its KV
cache (`sampling.turns`), fetches the turns, and steps the environments on their text in the
verifier pool's workers (`envs.step_in_worker`, `rewards.timeout_s` per step). A step that raises,
hangs, kills its worker or returns the wrong types gives an error observation and counts as a tool
error; the episode goes on. The observation's tokens (at most `env.max_observation_tokens`) are
appended to the trajectory with loss mask 0, and the next turn continues after them: the tokens a
trajectory holds are exactly those the model read and drew, never re-tokenized. With
`sampling.compact`, finished trajectories stop costing: before each turn the state keeps only the
running rows (in halving batch sizes, `sampling.loop.stage_sizes`), which draw as they would have.

A model turn ends at one of the tokenizer's stop tokens or at one of the environment's
`stop_strings` (a tool call's close tag), encoded as the tokenizer encodes it: one token or a
sequence that the decode loop matches (`tokenizers.turn_stops`). A trajectory ends when its
environment says done, at the turn limit, when a turn ends without either (truncated:
`env.max_tokens` or `sampling.max_new_tokens` reached) or when its next observation would not
leave room for a model token (truncated). It is trained as one completion:
`tokens`, `mask` (every token), `loss_mask` (model tokens) and `logps` `[R, env.max_tokens]`.
"""

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ebpo_jax import envs, sharding
from ebpo_jax import keys as keys_lib
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.rollouts.options import EnvOptions
from ebpo_jax.rollouts.rollout import Rollout, SamplerCall
from ebpo_jax.sampling import DecodeOptions, loop, turns
from ebpo_jax.tasks import rewards as rewards_lib
from ebpo_jax.tasks import tokenizers


@dataclasses.dataclass
class _Trajectory:
  """One episode's state on the host."""

  env: envs.Environment
  observation: list[int]  # tokens to append before the next model turn
  tokens: list[int] = dataclasses.field(default_factory=list)
  trained: list[bool] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)
  transcript: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (role, text)
  live: bool = True
  closed: bool = True  # the last model turn ended with an end-of-turn token (not a stop string)
  truncated: bool = False
  nonfinite: bool = False
  reward: float | None = None  # the environment's final reward


@dataclasses.dataclass(frozen=True)
class Episodes:
  """R = N*G finished trajectories, prompt-major, on the host."""

  tokens: np.ndarray  # [R, T] int32 (T: env.max_tokens), pad after the end
  mask: np.ndarray  # [R, T] bool: the trajectory's tokens
  loss_mask: np.ndarray  # [R, T] bool: its model tokens
  logps: np.ndarray  # [R, T] float32: the sampler's log-probs at model tokens, else 0
  truncated: np.ndarray  # [R] bool
  nonfinite: np.ndarray  # [R] bool
  final_texts: list[str]  # [R] the last model turn: what the verifier scores
  transcripts: list[str]  # [R] every turn, each "[role] text" on its own line
  messages: list[list[dict[str, str]]]  # [R] every turn as {"role", "content"}, for rewards.fns
  env_rewards: np.ndarray  # [R] float32: the environment's final reward, NaN for none
  turns: np.ndarray  # [R] int32: model turns
  tool_calls: np.ndarray  # [R] int32
  tool_errors: np.ndarray  # [R] int32
  env_time_s: float


def run_episodes(
  model,
  params,
  prompt_ids: jax.Array,
  prompt_mask: jax.Array,
  key: jax.Array,
  rows: Sequence[dict],
  *,
  group_size: int,
  greedy: bool,
  encoder: Any,
  pool: rewards_lib.RewardPool,
  env: EnvOptions,
  so: DecodeOptions,
  mesh: Mesh,
) -> Episodes:
  """G episodes of each of `rows` (whose prompts `prompt_ids`/`prompt_mask` [N, P] hold, placed
  on `mesh`) with `params` in the sampler's layout (`DecodeOptions.decode_params`, converted once
  per round by the worker); turn 0 samples with `key`, turn t > 0 with the t-th key split from it.
  `encoder`: the rollouts' `PromptEncoder` (observations are encoded with it)."""
  tokenizer, width = encoder.tokenizer, env.max_observation_tokens
  trajectories = _reset(rows, group_size, env, encoder)
  slots = turns.cache_slots(
    prompt_ids.shape[1],
    max_turns=env.max_turns,
    chunk_width=width + 1,
    max_new_tokens=so.max_new_tokens,
  )
  state = turns.start(
    params, prompt_ids, prompt_mask, model=model, group_size=group_size, slots=slots, mesh=mesh
  )
  stop_ids, stop_seqs = tokenizers.turn_stops(tokenizer, trajectories[0].env.stop_strings)
  scalar = lambda x: sharding.place_from_host(np.float32(x), sharding.replicated(mesh))
  settings = dict(
    temperature=scalar(so.temperature),
    top_p=scalar(so.top_p),
    model=model,
    max_new_tokens=so.max_new_tokens,
    greedy=greedy,
    top_k=so.top_k,
    stop_ids=stop_ids,
    stop_seqs=stop_seqs,
    pad_id=tokenizer.pad_id,
    mesh=mesh,
  )
  env_time = 0.0
  place = functools.partial(sharding.place_rows, mesh=mesh)
  rows = len(trajectories)
  sizes = loop.stage_sizes(rows, compact=so.compact, shards=loop.batch_shards(rows, mesh))
  in_state = np.arange(rows)  # the trajectory of each row of `state`; -1: a filler row
  # The first turn draws with `key` itself: an episode of one turn is `sampling.generate`'s sample.
  for turn_key in (key, *keys_lib.split_keys(key, env.max_turns)[1:]):
    inputs = _next_inputs(trajectories, width, env.max_tokens, tokenizer.pad_id)
    if not inputs[2].any():
      break
    state, in_state = _compact(state, in_state, inputs[2], sizes, place)
    ordered = [place(x) for x in _state_order(inputs, in_state)]
    row_ids = place(np.maximum(in_state, 0).astype(np.int32))
    state, out = turns.turn(params, state, *ordered, turn_key, row_ids_r=row_ids, **settings)
    out = _by_trajectory(sharding.to_host(out), in_state, rows)
    stepping = _record_turn(trajectories, out, tokenizer)
    started = time.perf_counter()
    _step_envs(trajectories, stepping, pool, encoder, width)
    if stepping and env.tool_latency_s:
      time.sleep(env.tool_latency_s)  # a slow tool service (env.tool_latency_s)
    env_time += time.perf_counter() - started
  for t in trajectories:
    t.live = False  # the turn limit
  return _assemble(trajectories, env.max_tokens, tokenizer.pad_id, env_time)


def _reset(rows, group_size: int, env: EnvOptions, encoder) -> list[_Trajectory]:
  """A fresh environment per trajectory, reset on its row (in this process: no tool runs)."""
  trajectories = []
  for row in rows:
    for _ in range(group_size):
      environment = env.factory()
      first = environment.reset(row)
      t = _Trajectory(environment, [])
      if first is not None:
        t.observation = encoder.observation_ids(first)[: env.max_observation_tokens]
        t.transcript.append(("observation", first))
      trajectories.append(t)
  return trajectories


def _next_inputs(trajectories: list[_Trajectory], width: int, max_tokens: int, pad_id: int):
  """The next turn's `(new_ids [R, W], new_mask, live [R], budget [R])`: each live trajectory's
  observation (appended to it here) and the model tokens left it. One whose observation would
  leave no room for a model token ends, truncated."""
  rows = len(trajectories)
  new_ids = np.full((rows, width), pad_id, np.int32)
  new_mask = np.zeros((rows, width), bool)
  live, budget = np.zeros(rows, bool), np.zeros(rows, np.int32)
  for r, t in enumerate(trajectories):
    if not t.live:
      continue
    room = max_tokens - len(t.tokens) - len(t.observation)
    if room < 1:
      t.live, t.truncated = False, True
      continue
    n = len(t.observation)
    new_ids[r, :n], new_mask[r, :n] = t.observation, True
    t.tokens += t.observation
    t.trained += [False] * n
    t.logps += [0.0] * n
    t.observation = []
    live[r], budget[r] = True, room
  return new_ids, new_mask, live, budget


def _compact(state, in_state: np.ndarray, live: np.ndarray, sizes: tuple[int, ...], place):
  """(state, in_state) with only the running trajectories' rows (`sampling.compact`): the
  smallest of `sizes` (`sampling.loop.stage_sizes`) that holds them, topped up with copies of one
  (filler rows, never live); unchanged when that is not smaller."""
  running = np.flatnonzero((in_state >= 0) & live[np.maximum(in_state, 0)])
  size = min(s for s in sizes if s >= len(running))
  if size >= len(in_state):
    return state, in_state
  filler = size - len(running)
  take = np.concatenate([running, np.full(filler, running[0])]).astype(np.int32)
  state = turns.compact(state, place(take))
  return state, np.concatenate([in_state[running], np.full(filler, -1)])


def _state_order(inputs, in_state: np.ndarray) -> list[np.ndarray]:
  """`_next_inputs`' arrays [R, ...] by trajectory as rows of the state; filler rows not live."""
  real = in_state >= 0
  new_ids, new_mask, live, budget = (x[np.maximum(in_state, 0)] for x in inputs)
  return [new_ids, new_mask & real[:, None], live & real, budget]


def _by_trajectory(out, in_state: np.ndarray, rows: int):
  """A turn's host outputs [S, ...] by state row as [R, ...] by trajectory (nothing drawn for a
  trajectory without a row)."""
  if len(in_state) == rows:  # never compacted: the same order
    return out
  real = in_state >= 0

  def spread(x):
    full = np.zeros((rows, *x.shape[1:]), x.dtype)
    full[in_state[real]] = x[real]
    return full

  return jax.tree.map(spread, out)


def _record_turn(trajectories: list[_Trajectory], out, tokenizer) -> dict[int, str]:
  """Appends each live trajectory's model turn; returns {row: turn text} of those that go on to
  an environment step (the turn ended with a stop token)."""
  stepping = {}
  for r, t in enumerate(trajectories):
    n = int(out.lengths[r])
    if not t.live or n == 0:
      continue
    ids = out.tokens[r, :n].tolist()
    t.tokens += ids
    t.trained += [True] * n
    t.logps += out.logprobs[r, :n].tolist()
    text = tokenizer.decode(ids)
    t.transcript.append(("assistant", text))
    t.closed = ids[-1] in tokenizer.stop_ids
    if out.nonfinite[r]:
      t.live, t.nonfinite = False, True
    elif not out.stopped[r]:
      t.live, t.truncated = False, True
    else:
      stepping[r] = text
  return stepping


def _step_envs(trajectories, stepping: dict[int, str], pool, encoder, width: int) -> None:
  """Steps the environments of `stepping` in the pool; a failed step is an error observation."""
  order = list(stepping)
  calls = [(trajectories[r].env, stepping[r]) for r in order]
  for r, (ok, value, message) in zip(order, pool.run(envs.step_in_worker, calls), strict=True):
    t = trajectories[r]
    if ok:
      t.env, observation, reward, done = value
    else:
      t.env.tool_errors += 1
      observation, reward, done = t.env.error_observation(message), None, False
    if done:
      t.live, t.reward = False, reward
      continue
    observation = observation or ""
    t.observation = encoder.observation_ids(observation, after_end_of_turn=t.closed)[:width]
    t.transcript.append(("observation", observation))


def _assemble(trajectories, max_tokens: int, pad_id: int, env_time: float) -> Episodes:
  rows = len(trajectories)
  tokens = np.full((rows, max_tokens), pad_id, np.int32)
  mask, loss_mask = np.zeros((rows, max_tokens), bool), np.zeros((rows, max_tokens), bool)
  logps = np.zeros((rows, max_tokens), np.float32)
  for r, t in enumerate(trajectories):
    n = len(t.tokens)
    tokens[r, :n], mask[r, :n], loss_mask[r, :n], logps[r, :n] = t.tokens, True, t.trained, t.logps
  model_turns = [[text for role, text in t.transcript if role == "assistant"] for t in trajectories]
  return Episodes(
    tokens=tokens,
    mask=mask,
    loss_mask=loss_mask,
    logps=logps,
    truncated=np.array([t.truncated for t in trajectories]),
    nonfinite=np.array([t.nonfinite for t in trajectories]),
    final_texts=[said[-1] if said else "" for said in model_turns],
    transcripts=[
      "\n".join(f"[{role}] {text}" for role, text in t.transcript) for t in trajectories
    ],
    messages=[
      [{"role": role, "content": text} for role, text in t.transcript] for t in trajectories
    ],
    env_rewards=np.array(
      [np.nan if t.reward is None else t.reward for t in trajectories], np.float32
    ),
    turns=np.array([len(said) for said in model_turns], np.int32),
    tool_calls=np.array([t.env.tool_calls for t in trajectories], np.int32),
    tool_errors=np.array([t.env.tool_errors for t in trajectories], np.int32),
    env_time_s=env_time,
  )


class MultiTurn:
  """The multi-turn strategy: G episodes of each prompt of a call (`run_episodes`), the final
  turns scored (the environment's final reward where it gave one; the reward functions also read
  the whole trajectory, their `transcripts` extra), the transcripts as the rollout's texts, and
  `stats`, the episodes' sums (`episode_metrics`)."""

  def __init__(self, model, encoder, scorer, decode: DecodeOptions, env: EnvOptions, mesh: Mesh):
    self.model, self.encoder, self.scorer = model, encoder, scorer
    self.decode, self.env, self.mesh = decode, env, mesh

  def __call__(self, call: SamplerCall) -> Rollout:
    n, g = len(call.rows), call.group_size
    place = functools.partial(sharding.place_rows, mesh=self.mesh)
    padded = list(call.rows) + [call.rows[-1]] * (call.ids.shape[0] - n)
    ep = run_episodes(
      self.model, call.params, place(call.ids), place(call.mask), call.key, padded,
      group_size=g, greedy=call.greedy, encoder=self.encoder, pool=self.scorer.pool,
      env=self.env, so=self.decode, mesh=self.mesh,
    )  # fmt: skip
    r = n * g
    lengths = ep.mask[:r].sum(axis=1).astype(np.int32)
    scored, reward_parts, errors = self.scorer.score(
      ep.final_texts[:r], list(call.rows), lengths, g, training=call.training,
      transcripts=ep.messages[:r],
    )  # fmt: skip
    from_env = ep.env_rewards[:r].reshape(scored.shape)
    on_host = {"tokens": ep.tokens, "mask": ep.mask, "loss_mask": ep.loss_mask,
               "old_logps": ep.logps, "truncated": ep.truncated,
               "nonfinite": ep.nonfinite}  # fmt: skip
    return Rollout(
      rows=list(call.rows),
      texts=ep.transcripts[:r],
      rewards=np.where(np.isnan(from_env), scored, from_env).astype(np.float32),
      lengths=lengths,
      errors=errors,
      prompt_ids=place(call.ids[:n]),
      prompt_mask=place(call.mask[:n]),
      **{k: place(v[:r]) for k, v in on_host.items()},
      reward_parts=reward_parts,
      stats=_episode_sums(ep, r, lengths),
    )


def _episode_sums(ep: Episodes, r: int, lengths: np.ndarray) -> dict:
  """The sums over the first r trajectories that `episode_metrics` reads."""
  return {
    "trajectories": r,
    "turns": int(ep.turns[:r].sum()),
    "tool_calls": int(ep.tool_calls[:r].sum()),
    "tool_errors": int(ep.tool_errors[:r].sum()),
    "observation_tokens": int((ep.mask & ~ep.loss_mask)[:r].sum()),
    "tokens": int(lengths.sum()),
    "env_time_s": ep.env_time_s,
  }


def episode_metrics(stats: Sequence[dict]) -> dict[str, float]:
  """The multi-turn metrics of one step from its rollouts' `stats` (all refill rounds)."""
  total = {k: sum(s[k] for s in stats) for k in stats[0]}
  return {
    metrics_lib.TURNS_MEAN: total["turns"] / total["trajectories"],
    metrics_lib.TOOL_CALLS_MEAN: total["tool_calls"] / total["trajectories"],
    metrics_lib.TOOL_ERRORS: total["tool_errors"],
    metrics_lib.MASKED_FRAC: total["observation_tokens"] / max(total["tokens"], 1),
    metrics_lib.ENV_TIME_S: total["env_time_s"],
  }
