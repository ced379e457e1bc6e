"""The decode loop of `sampling.generate`: the rows' state, recording a drawn token, and the while
loops that decode, plain or compacting.

Plain: one `lax.while_loop` over all R rows until every row has drawn a stop token. RL responses
have long tails, so most of its row-steps decode rows that have already stopped.

Compacting: the same loop in stages of static, halving row counts (`stage_sizes`: R, R/2, ...,
down to a minimum bucket). Stage k decodes while more rows run than stage k + 1 holds; then its
running rows (KV cache rows, last token, position, id, outputs so far) are gathered into the next,
smaller batch, topped up with finished rows (done: they write only padding). A stacked cache (the
rolled layer loop's) keeps its rows: the running ones move to the front of each device's block in
place (`models.KVCache.row_blocks`), as a smaller copy beside it would hold 1.5x the cache.
At the end of each stage its rows are written back to their output rows (`Rows.row_id`). With a
mesh the rows are split over devices, and each device compacts its own block (no row moves between
devices, so no cache crosses the interconnect): a stage ends when no device runs more rows than its
block of the next stage holds. All in one program: no host round trip, one loop body per stage.
Rows draw from per-row random streams (`row_uniforms`, by output row, not by place in the batch),
so both give the same tokens for the same key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ebpo_jax import sharding
from ebpo_jax.models import KVCache

# Compacting stops halving at this many rows: each stage is one more loop body to compile, and in
# bench/compact.py (CPU, 64 rows) going on down to 4 rows was no faster.
MIN_STAGE_ROWS = 8


class Rows(NamedTuple):
  """Per-row state of the decode loop; every leaf's leading axis is the row."""

  row_id: jax.Array  # [R] int32: the output row (b * G + g); also names the row's random stream
  first_position: jax.Array  # [R] int32: RoPE position of completion token 0
  last_token: jax.Array  # [R] int32: token drawn at step - 1
  done: jax.Array  # [R] bool: a stop token has been drawn (or the row broke)
  lengths: jax.Array  # [R] int32
  tokens: jax.Array  # [R, N] int32
  logprobs: jax.Array  # [R, N] float32
  nonfinite: jax.Array  # [R] bool: a live row met non-finite logits (and was ended)


class State(NamedTuple):
  step: jax.Array  # int32: index of the token drawn next
  cache: KVCache  # row-major buffers (per layer or stacked); one write slot (`index`) for all rows
  rows: Rows


class Drawn(NamedTuple):
  token: jax.Array  # [R] int32
  logprob: jax.Array  # [R] float32, under the policy at temperature 1
  nonfinite: jax.Array  # [R] bool: the row's logits hold a NaN or inf (token and logprob unusable)


def initial_rows(first_position_r: jax.Array, width: int, pad_id: int) -> Rows:
  """Rows `0 .. R-1` before the first draw: nothing drawn, nothing done."""
  rows = first_position_r.shape[0]
  return Rows(
    row_id=jnp.arange(rows, dtype=jnp.int32),
    first_position=first_position_r.astype(jnp.int32),
    last_token=jnp.zeros((rows,), jnp.int32),
    done=jnp.zeros((rows,), bool),
    lengths=jnp.zeros((rows,), jnp.int32),
    tokens=jnp.full((rows, width), pad_id, jnp.int32),
    logprobs=jnp.zeros((rows, width), jnp.float32),
    nonfinite=jnp.zeros((rows,), bool),
  )


def row_uniforms(rng: jax.Array, step: jax.Array, row_id: jax.Array) -> jax.Array:
  """The uniform in [0, 1) that output row r draws its token at `step` with:
  `uniform(fold_in(fold_in(rng, step), r))`, wherever the row sits in the batch."""
  step_key = jax.random.fold_in(rng, step)
  return jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(step_key, r)))(row_id)


def record(state: State, drawn: Drawn, stop_ids: tuple[int, ...], pad_id: int) -> State:
  """Writes the token drawn at `state.step` (pad and 0 for rows already done). A live row whose
  logits were non-finite gets pad_id there, is flagged and ends."""
  r = state.rows
  live = ~r.done
  broken = live & drawn.nonfinite
  token = jnp.where(live & ~broken, drawn.token, pad_id)
  stopped = live & jnp.isin(token, jnp.asarray(stop_ids, jnp.int32))
  column = (slice(None), state.step)
  rows = r._replace(
    last_token=token,
    done=r.done | stopped | broken,
    lengths=r.lengths + live,
    tokens=r.tokens.at[column].set(token),
    logprobs=r.logprobs.at[column].set(jnp.where(live & ~broken, drawn.logprob, 0.0)),
    nonfinite=r.nonfinite | broken,
  )
  return State(step=state.step + 1, cache=state.cache, rows=rows)


# ----------------------------------------------------------------------------- stages


def batch_shards(rows: int, mesh: Mesh | None) -> int:
  """How many devices the row axis of `rows` rows is split over (1 without a mesh)."""
  if mesh is None:
    return 1
  spec = sharding.logical_to_spec((rows,), ("batch",), mesh)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
  return int(np.prod([mesh.shape[a] for a in axes], dtype=int))


def stage_sizes(rows: int, *, compact: bool, shards: int = 1) -> tuple[int, ...]:
  """Row counts of the decode stages: `(rows,)` plain; compacting, halved (rounded up to a multiple
  of `shards`, so each stage splits over the same devices) while that is smaller and at least
  `max(MIN_STAGE_ROWS, shards)`."""
  sizes = [rows]
  floor = max(MIN_STAGE_ROWS, shards)
  while compact:
    half = -(-sizes[-1] // (2 * shards)) * shards  # ceil(rows / 2), rounded up to the shards
    if half < floor or half >= sizes[-1]:
      break
    sizes.append(half)
  return tuple(sizes)


def constrain_cache(cache: KVCache, mesh: Mesh | None) -> KVCache:
  """Shards a cache's rows over the mesh's batch axes (kv heads over tensor, a stack's layers
  whole)."""
  if mesh is None:
    return cache
  constrain = lambda x: jax.lax.with_sharding_constraint(x, _kv_sharding(x.shape, mesh))
  rows = sharding.row_sharding(cache.mask.shape, mesh)
  return cache.replace(
    k=jax.tree.map(constrain, cache.k),
    v=jax.tree.map(constrain, cache.v),
    mask=jax.lax.with_sharding_constraint(cache.mask, rows),
  )


def _kv_sharding(shape, mesh: Mesh) -> NamedSharding:
  """A cache buffer's `[B, Hkv, S, D]` (or a stack's `[L, B, Hkv, S, D]`): rows over the batch
  axes, heads over tensor, layers whole."""
  names = ("layers", "batch", "kv_heads", "length", "head_dim")[-len(shape) :]
  return NamedSharding(mesh, sharding.logical_to_spec(shape, names, mesh))


def with_shardings(state: State, mesh: Mesh) -> State:
  """An abstract `state` (`jax.ShapeDtypeStruct`s) with the shardings the loop keeps it in:
  the cache as `constrain_cache`, every row's leaf over the batch axes, the step replicated."""
  c = state.cache
  placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  kv = lambda x: placed(x, _kv_sharding(x.shape, mesh))
  rows = lambda x: placed(x, sharding.row_sharding(x.shape, mesh))
  whole = lambda x: placed(x, sharding.replicated(mesh))
  cache = c.replace(
    k=jax.tree.map(kv, c.k), v=jax.tree.map(kv, c.v), mask=rows(c.mask), index=whole(c.index)
  )
  return State(step=whole(state.step), cache=cache, rows=jax.tree.map(rows, state.rows))


def _per_shard(x: jax.Array, shards: int) -> jax.Array:
  """`[R, ...]` -> `[shards, R / shards, ...]`: each device's block of rows on its own index."""
  return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def _most_running_per_shard(state: State, shards: int) -> jax.Array:
  return jnp.max(jnp.sum(~_per_shard(state.rows.done, shards), axis=1, dtype=jnp.int32))


def _gather_running(state: State, size: int, shards: int, mesh: Mesh | None) -> State:
  """`size` rows of `state`: on each device, its running rows first (all of them: at most
  `size / shards` run on any), then its finished ones. Rows never leave their device, so the
  gather needs no communication (across devices it would gather the whole cache on every one)."""
  done_dr = _per_shard(state.rows.done, shards).astype(jnp.int32)
  order_dk = jnp.argsort(done_dr, axis=1, stable=True)[:, : size // shards]
  take_one = functools.partial(jnp.take, axis=0, unique_indices=True)

  def take(x):
    return jax.vmap(take_one)(_per_shard(x, shards), order_dk).reshape(size, *x.shape[1:])

  c = state.cache
  if c.stacked:  # the running rows to the front of each device's block, in place
    move = functools.partial(_to_front, order_dk=order_dk, shards=shards)
    cache = c.replace(k=move(c.k), v=move(c.v), mask=take(c.mask), row_blocks=shards)
  else:
    cache = c.map_layers(take).replace(mask=take(c.mask))
  rows = sharding.constrain_rows(jax.tree.map(take, state.rows), mesh)
  return State(step=state.step, cache=constrain_cache(cache, mesh), rows=rows)


def _to_front(stack: jax.Array, order_dk: jax.Array, shards: int) -> jax.Array:
  """A stacked cache `[L, R, Hkv, S, D]` with, in each of the `shards` blocks of rows, the block's
  rows `order_dk[d]` moved to its front: one layer at a time in a loop that updates the stack in
  place, so that the peak holds one layer more, not a smaller copy of the whole stack (as a
  gather into the next stage's rows would: 1.5x the cache at the first stage's end). Rows past
  the front keep stale values that the next stages never read (`KVCache.row_blocks`)."""
  num_layers, rows, *rest = stack.shape
  blocked = stack.reshape(num_layers, shards, rows // shards, *rest)
  take_one = functools.partial(jnp.take, axis=0, unique_indices=True)

  def move_layer(i, blocked):
    layer = jax.lax.dynamic_index_in_dim(blocked, i, 0, keepdims=False)
    front = jax.vmap(take_one)(layer, order_dk)  # [shards, n, Hkv, S, D]
    return jax.lax.dynamic_update_slice(blocked, front[None], (i, 0, 0, 0, 0, 0))

  return jax.lax.fori_loop(0, num_layers, move_layer, blocked).reshape(stack.shape)


def _write_back(out: Rows, rows: Rows, shards: int, mesh: Mesh | None) -> Rows:
  """`out` with the rows of `rows` written to their output rows (`rows.row_id`, all distinct, each
  on the device that holds it in `out`)."""
  local_dk = _per_shard(rows.row_id % (out.row_id.shape[0] // shards), shards)
  put_one = lambda o, i, r: o.at[i].set(r, unique_indices=True)

  def put(o, r):
    written = jax.vmap(put_one)(_per_shard(o, shards), local_dk, _per_shard(r, shards))
    return written.reshape(o.shape)

  return sharding.constrain_rows(jax.tree.map(put, out, rows), mesh)


def decode(
  state: State,
  decode_one: Callable[[State], State],
  *,
  width: int,
  sizes: tuple[int, ...],
  mesh: Mesh | None,
) -> Rows:
  """Runs `decode_one` until every row is done or `width` tokens are drawn, in stages of `sizes`
  rows (`stage_sizes`; `state` holds `sizes[0]` rows); returns the rows in output order."""
  shards, out = batch_shards(sizes[0], mesh), None
  for k, size in enumerate(sizes):
    if k:
      state = _gather_running(state, size, shards, mesh)
    leave_above = sizes[k + 1] // shards if k + 1 < len(sizes) else 0  # rows on any one device

    def keep_going(s: State, leave_above=leave_above) -> jax.Array:
      return (s.step < width) & (_most_running_per_shard(s, shards) > leave_above)

    state = jax.lax.while_loop(keep_going, decode_one, state)
    out = state.rows if out is None else _write_back(out, state.rows, shards, mesh)
  return out
