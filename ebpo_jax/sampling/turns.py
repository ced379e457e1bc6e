"""Multi-turn decoding: the model's turns continue from one KV cache across environment steps.

`start` caches G copies of each prompt's tokens but the last; each `turn` then feeds the tokens not
yet cached (the token drawn last, then the new observation's tokens, right-padded) in one prefill
chunk and decodes the model's next turn from there, until every row has drawn a stop token or used
its token budget. Earlier tokens are never fed again (token-in, token-out): the cache holds the
whole transcript, at the positions the trainer's forward gives it (`sampling.sequences`: the
trajectory after the prompt is one completion, observation tokens included).

The cache has one write slot for all rows (`KVCache.index`); rows that feed fewer tokens than
others leave invalid slots, which attention skips (`KVCache.mask`), so slots need not match
positions. A row that is not live this turn (its episode is over) feeds nothing and draws nothing.
The caller sizes the cache (`cache_slots`) for all turns; the state is donated from turn to turn.
Between turns the caller may keep only the rows still running (`compact`, with `row_ids_r` naming
each row's random stream in `turn`), so that finished trajectories stop costing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ebpo_jax.models import KVCache
from ebpo_jax.sampling import draw, engine, loop
from ebpo_jax.sampling.sequences import prompt_positions


class TurnState(NamedTuple):
  """What a turn continues from, on the devices; rows prompt-major (`b * G + g`)."""

  cache: KVCache  # every fed token of every row
  pending: jax.Array  # [R] int32: the row's last token, not yet in the cache
  position: jax.Array  # [R] int32: RoPE position of `pending`


class TurnOutput(NamedTuple):
  """One model turn per row, `[R, N]` (N: max_new_tokens)."""

  tokens: jax.Array  # [R, N] int32; pad_id after the turn's end
  logprobs: jax.Array  # [R, N] float32, under the policy at temperature 1
  lengths: jax.Array  # [R] int32: tokens drawn this turn (0 for a row not live)
  stopped: jax.Array  # [R] bool: the turn ended with a stop token
  nonfinite: jax.Array  # [R] bool


def cache_slots(prompt_len: int, *, max_turns: int, chunk_width: int, max_new_tokens: int) -> int:
  """Slots of a cache for `max_turns` turns whose fed chunks are at most `chunk_width` wide."""
  return prompt_len - 1 + max_turns * (chunk_width + max_new_tokens)


def _cached_forward(params, model: nn.Module, mesh: Mesh | None):
  """The sampler's cached decoder (`engine.cached_decoder`) with `params` bound, its kernels per
  shard of `mesh`."""
  decoder = engine.cached_decoder(model)

  def apply(*args, **kwargs):
    with engine.kernel_mesh(mesh):
      return decoder.apply({"params": params}, *args, **kwargs)

  return apply


@functools.partial(jax.jit, static_argnames=("model", "group_size", "slots", "mesh"))
def start(
  params,
  prompt_ids_bp,
  prompt_mask_bp,
  *,
  model: nn.Module,
  group_size: int,
  slots: int,
  mesh: Mesh | None = None,
):
  """`TurnState` of G rows per left-padded prompt: all but its last token cached (`slots` slots);
  `params` in the sampler's layout (`engine.decode_params`); under `mesh` the
  attention kernels run per shard (`engine.kernel_mesh`)."""
  apply = _cached_forward(params, model, mesh)
  positions_bp = prompt_positions(prompt_mask_bp)
  cache = engine.empty_cache(model.config, prompt_ids_bp.shape[0], slots)
  if prompt_ids_bp.shape[1] > 1:
    head = slice(None), slice(None, -1)
    _, cache = apply(prompt_ids_bp[head], positions_bp[head], prompt_mask_bp[head], cache=cache)
  repeat = functools.partial(jnp.repeat, repeats=group_size, axis=0)
  cache = engine.repeat_rows(cache, group_size)
  return TurnState(cache, repeat(prompt_ids_bp[:, -1]), repeat(positions_bp[:, -1]))


@functools.partial(
  jax.jit,
  static_argnames=(
    "model",
    "max_new_tokens",
    "greedy",
    "top_k",
    "stop_ids",
    "stop_seqs",
    "pad_id",
    "mesh",
  ),
  donate_argnames=("state",),
)
def turn(
  params,
  state: TurnState,
  new_ids_rw: jax.Array,
  new_mask_rw: jax.Array,
  live_r: jax.Array,
  budget_r: jax.Array,
  rng: jax.Array,
  temperature: jax.Array,
  top_p: jax.Array,
  row_ids_r: jax.Array | None = None,
  *,
  model: nn.Module,
  max_new_tokens: int,
  greedy: bool,
  top_k: int,
  stop_ids: tuple[int, ...],
  pad_id: int,
  stop_seqs: tuple[tuple[int, ...], ...] = (),
  mesh: Mesh | None = None,
) -> tuple[TurnState, TurnOutput]:
  """One model turn of every live row: feeds `pending` then the row's new tokens (`new_ids_rw`,
  right-padded, `new_mask_rw` valid), then decodes up to `min(max_new_tokens, budget_r)` tokens,
  until a token of `stop_ids` or the last token of a sequence of `stop_seqs` (a stop string that
  is several tokens, such as a tool-call close tag) drawn this turn.
  Row r draws token t with `fold_in(fold_in(rng, t), row_ids_r[r])` (`loop.row_uniforms`;
  default: r), so a row draws the same tokens wherever it sits in a compacted batch (`compact`).
  Under `mesh` the attention kernels run per shard."""
  apply = _cached_forward(params, model, mesh)
  chunk_mask = jnp.concatenate([live_r[:, None], new_mask_rw & live_r[:, None]], axis=1)
  chunk_ids = jnp.concatenate([state.pending[:, None], new_ids_rw], axis=1)
  positions = state.position[:, None] + jnp.arange(chunk_ids.shape[1])[None]
  logits_rwv, cache = apply(chunk_ids, positions, chunk_mask, cache=state.cache)
  count_r = chunk_mask.sum(axis=1)
  first_logits_rv = jnp.take_along_axis(
    logits_rwv, jnp.maximum(count_r - 1, 0)[:, None, None], axis=1
  )[:, 0]
  rows = loop.initial_rows(state.position + count_r, max_new_tokens, pad_id)
  if row_ids_r is not None:
    rows = rows._replace(row_id=row_ids_r.astype(jnp.int32))
  s = loop.State(step=jnp.zeros((), jnp.int32), cache=cache, rows=rows._replace(done=~live_r))
  draw_token = functools.partial(
    draw.draw, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy
  )

  def draw_and_record(s: loop.State, logits_rv: jax.Array) -> loop.State:
    drawn = draw_token(logits_rv, loop.row_uniforms(rng, s.step, s.rows.row_id))
    s = loop.record(s, drawn, stop_ids, pad_id)
    r = s.rows
    done = r.done | (r.lengths >= budget_r) | ends_with_any(r.tokens, r.lengths, stop_seqs)
    return s._replace(rows=r._replace(done=done))

  def decode_one(s: loop.State) -> loop.State:
    # A row's last token enters the cache only while the row runs: a stopped row's stop token
    # waits in `pending` for the next turn's chunk.
    positions = (s.rows.first_position + s.step - 1)[:, None]
    live = ~s.rows.done[:, None]
    logits_r1v, cache = apply(s.rows.last_token[:, None], positions, live, cache=s.cache)
    return draw_and_record(s._replace(cache=cache), logits_r1v[:, 0])

  def keep_going(s: loop.State) -> jax.Array:
    return (s.step < max_new_tokens) & ~s.rows.done.all()

  s = jax.lax.while_loop(keep_going, decode_one, draw_and_record(s, first_logits_rv))
  out = s.rows
  drew = out.lengths > 0
  last = jnp.take_along_axis(out.tokens, jnp.maximum(out.lengths - 1, 0)[:, None], axis=1)[:, 0]
  next_state = TurnState(
    cache=s.cache,
    pending=jnp.where(drew, last, state.pending),
    position=jnp.where(drew, out.first_position + out.lengths - 1, state.position),
  )
  stop_token = jnp.isin(last, jnp.asarray(stop_ids, jnp.int32))
  stopped = drew & (stop_token | ends_with_any(out.tokens, out.lengths, stop_seqs))
  return next_state, TurnOutput(out.tokens, out.logprobs, out.lengths, stopped, out.nonfinite)


@jax.jit  # no donation: the smaller state cannot reuse the larger one's buffers
def compact(state: TurnState, take_s: jax.Array) -> TurnState:
  """The rows `take_s` [S] of `state` (cache, pending token, position), in that order: the
  trajectories still running, so that finished ones stop costing in the next turns."""
  rows = functools.partial(jnp.take, indices=take_s, axis=0)
  cache = state.cache.map_layers(rows).replace(mask=rows(state.cache.mask))
  return TurnState(cache, rows(state.pending), rows(state.position))


def ends_with_any(
  tokens_rn: jax.Array, lengths_r: jax.Array, seqs: tuple[tuple[int, ...], ...]
) -> jax.Array:
  """[R] bool: row r's first `lengths_r[r]` tokens end with one of `seqs` (static)."""
  hit = jnp.zeros(lengths_r.shape, bool)
  for seq in seqs:
    k = len(seq)
    at = jnp.clip(lengths_r[:, None] - k + jnp.arange(k)[None], 0, tokens_rn.shape[1] - 1)
    tail = jnp.take_along_axis(tokens_rn, at, axis=1)
    hit |= (lengths_r >= k) & (tail == jnp.asarray(seq, tokens_rn.dtype)).all(axis=1)
  return hit
