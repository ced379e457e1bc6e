"""Decode attention over the written part of the KV cache: a Pallas TPU flash-decoding kernel.

A decode step's query (T = 1 per row) attends to the cache's slots `[0, written)`, `written` the
shared write index after this step's write (the longest row's written length; `KVCache.index`).
The XLA path (`attention.xla_attention`) reads all S slots of every layer's `[B, Hkv, S, D]` buffer
on every step: over a decode of N tokens after a prompt of P that is about S / (P + N / 2) times
the bytes the keys and values written so far hold.

The kernel runs on the cache's own layout, over the grid (rows, kv heads, kv blocks of `bkv`
slots). A stacked cache `[L, B, Hkv, S, D]` (the rolled layer loop's) is read in place at the
layer's index, which is scalar-prefetched into the key and value index maps, so the loop body never
copies a layer's slice out of the stack; one layer's buffer runs as a stack of one. `written` is
scalar-prefetched too: the key, value and mask blocks' index maps (`kv_index_map`, `mask_index_map`)
clamp the block index to the last written block, so blocks past it are never fetched (the pipeline
skips the copy when a block index repeats) and `pl.when` (`computes`) skips their compute; the
tests evaluate those functions over the grid. The G = H / Hkv query heads of one
kv head run together as the `[G, D]` rows of one matmul (GQA: nothing repeated). Softmax is online
(flash attention's running max m, sum l and unnormalised output in VMEM scratch):

    m' = max(m, max_s x_s),  l' = e^(m - m') l + sum_s e^(x_s - m'),
    o' = e^(m - m') o + sum_s e^(x_s - m') v_s

with `x_s = q . k_s / sqrt(D)` over the block's valid slots (`s < written` and the `[B, S]` slot
mask: left padding, a multi-turn chunk's unused slots), then `o / l` after the last block. Slots
past the array's end (a last block that S does not fill) hold unspecified values: their scores are
masked and their values zeroed before the second matmul.

Under a context mesh the kernel runs per shard in `shard_map` (a Mosaic kernel is not partitioned
otherwise): rows over ('data', 'fsdp') and kv heads over 'tensor', each only where it divides, as
the cache is sharded (`sharding`'s `batch` and `kv_heads` rules). On a platform without the
kernel (`ModelConfig.attention_emulate`) it runs in Pallas interpret mode, for CPU tests.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

NAME = "flash_decode"  # the pallas_call's name; `roofline` counts the kernel by it
_NEG_INF = -1e30  # finite: a block with no valid slot leaves m finite (e^(m - m') is then 0 or 1)


def kv_block(slots: int, block: int) -> int:
  """The kernel's block of slots: `block` (a multiple of 128), or all `slots` when fewer."""
  return slots if slots <= block else block


# The block skipping, as the kernel runs it: its index maps and its compute predicate, also
# evaluated on plain integers (or numpy grids) by the tests. `scalars` is the scalar-prefetched
# `[written, layer]`.
def last_written_block(written, bkv: int):
  """The last block holding a written slot (block 0 when none is)."""
  return jnp.maximum(written - 1, 0) // bkv


def kv_index_map(i, k, j, scalars, *, bkv: int):
  """Key and value block of grid step (row i, kv head k, kv block j) in the stacked cache
  `[L, B, Hkv, S, D]`: block j clamped to the last written one, so a step past it repeats the
  previous step's block and the pipeline fetches nothing."""
  return scalars[1], i, k, jnp.minimum(j, last_written_block(scalars[0], bkv)), 0


def mask_index_map(i, k, j, scalars, *, bkv: int):
  """Slot-mask block `[B, 1, S]` of grid step (i, k, j), clamped as `kv_index_map`."""
  del k
  return i, 0, jnp.minimum(j, last_written_block(scalars[0], bkv))


def computes(j, written, bkv: int):
  """Whether kv block j's step computes (`pl.when`): the block holds a written slot."""
  return j * bkv < written


def flash_decode(
  q_bthd, k_bksd, v_bksd, slot_mask_bs, written, *, layer=None, block: int, interpret: bool
):
  """Attention of one query per row (`q [B, 1, H, D]`) over the written slots `[0, written)` of
  heads-first `[B, Hkv, S, D]` keys and values, or of layer `layer` of stacked `[L, B, Hkv, S, D]`
  ones, whose `slot_mask_bs [B, S]` is true (module docstring); per shard under a context mesh.
  Returns `[B, 1, H, D]` float32."""
  b, t, h, d = q_bthd.shape
  if t != 1:
    raise ValueError(f"flash_decode takes one query per row, got T={t}")
  if layer is None:  # one layer's buffers: a stack of one (a bitcast, no copy)
    k_bksd, v_bksd, layer = k_bksd[None], v_bksd[None], 0
  kv_heads = k_bksd.shape[2]
  q_bkgd = q_bthd.reshape(b, kv_heads, h // kv_heads, d).astype(k_bksd.dtype)
  scalars = jnp.stack([jnp.asarray(written, jnp.int32), jnp.asarray(layer, jnp.int32)])
  mask_b1s = slot_mask_bs.astype(jnp.int32)[:, None, :]
  call = functools.partial(_decode_call, block=block, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    call = _per_shard(call, mesh, b, kv_heads)
  out_bkgd = call(scalars, q_bkgd, k_bksd, v_bksd, mask_b1s)
  return out_bkgd.reshape(b, 1, h, d)


def _decode_call(scalars, q_bkgd, k_lbksd, v_lbksd, mask_b1s, *, block: int, interpret: bool):
  """The `pallas_call` over (rows, kv heads, kv blocks) of layer `scalars[1]` of the stacked
  cache; `[B, Hkv, G, D]` float32 out. The layer index, like `written` (`scalars[0]`), is
  scalar-prefetched into the key and value index maps: the kernel reads the stack in place."""
  b, kv_heads, groups, d = q_bkgd.shape
  slots = k_lbksd.shape[3]
  bkv = kv_block(slots, block)
  query_spec = pl.BlockSpec((None, None, groups, d), lambda i, k, j, s: (i, k, 0, 0))
  kv_spec = pl.BlockSpec((None, None, None, bkv, d), functools.partial(kv_index_map, bkv=bkv))
  mask_spec = pl.BlockSpec((None, 1, bkv), functools.partial(mask_index_map, bkv=bkv))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(b, kv_heads, pl.cdiv(slots, bkv)),
    in_specs=[query_spec, kv_spec, kv_spec, mask_spec],
    out_specs=query_spec,
    scratch_shapes=[
      pltpu.VMEM((groups, 1), jnp.float32),  # m: running max
      pltpu.VMEM((groups, 1), jnp.float32),  # l: running sum
      pltpu.VMEM((groups, d), jnp.float32),  # unnormalised output
    ],
  )
  return pl.pallas_call(
    functools.partial(_kernel, bkv=bkv, scale=d**-0.5),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q_bkgd.shape, jnp.float32),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
    name=NAME,
  )(scalars, q_bkgd, k_lbksd, v_lbksd, mask_b1s)


def _kernel(
  scalars_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *, bkv, scale
):
  """One (row, kv head, kv block) step of the online softmax (module docstring)."""
  j = pl.program_id(2)
  written = scalars_ref[0]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, _NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(computes(j, written, bkv))
  def _accumulate():
    k, v = k_ref[...], v_ref[...]
    dims = (((1,), (1,)), ((), ()))  # [G, D] x [bkv, D] -> [G, bkv]
    x = jax.lax.dot_general(q_ref[...], k, dims, preferred_element_type=jnp.float32) * scale
    slot = j * bkv + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    valid = (slot < written) & (mask_ref[...] != 0)
    x = jnp.where(valid, x, _NEG_INF)
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, x.max(axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(x - m_new), 0.0)
    rescale = jnp.exp(m_old - m_new)
    l_ref[...] = rescale * l_ref[...] + p.sum(axis=1, keepdims=True)
    m_ref[...] = m_new
    slot_rows = j * bkv + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where(slot_rows < written, v, jnp.zeros_like(v))  # past the array: unspecified
    pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_ref[...] = rescale * acc_ref[...] + pv

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    total = l_ref[...]
    o_ref[...] = acc_ref[...] / jnp.where(total > 0, total, 1.0)  # no valid slot: 0 (unread)


def _per_shard(call, mesh, batch: int, kv_heads: int):
  """`call` in `shard_map`: rows over the mesh's ('data', 'fsdp') and kv heads (with their query
  heads) over 'tensor', each only where the mesh has the axes and they divide; the stacked cache's
  layers and the scalars whole."""
  sizes = dict(mesh.shape)
  row_axes = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  rows = row_axes if row_axes and batch % math.prod(sizes[a] for a in row_axes) == 0 else None
  tensor = sizes.get("tensor", 1)
  heads = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
  spec, stacked = PartitionSpec(rows, heads), PartitionSpec(None, rows, heads)
  return jax.shard_map(
    call,
    mesh=mesh,
    in_specs=(PartitionSpec(), spec, stacked, stacked, PartitionSpec(rows)),
    out_specs=spec,
    check_vma=False,
  )
