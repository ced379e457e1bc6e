"""The hand formulas of the Pallas kernels' costs, from their shapes: `(FLOPs, HBM bytes)` of a
splash kernel (`kernel_cost`, over the blocks a causal mask allows: `causal_blocks`) and of the
decode kernel at the written lengths (`decode_cost`). Only a cross-check: the report counts the
kernels from their bodies (`aot.kernels`), and tests compare the two; a kernel whose body cannot be
counted falls back to its formula, reported as modelled."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from ebpo_jax.models import attention, decode_attention

# FLOPs per (bq x bkv x D) block of each splash kernel, by the name its pallas_call carries.
SPLASH_MATMULS = {"fwd": 4, "dq": 6, "dkv": 8}


def of_call(eqn, block: int, lengths: tuple[int, ...]) -> tuple[float, float] | None:
  """The hand formula's `(FLOPs, bytes)` of a splash or decode kernel's call; None for another."""
  kernel = str(eqn.params.get("name", "?"))
  floats = [v.aval for v in eqn.invars if _floating(v.aval.dtype) and len(v.aval.shape) >= 3]
  if kernel == decode_attention.NAME:
    q, k = floats[0], floats[1]
    return decode_cost(q.shape, k.shape, q.dtype.itemsize, k.dtype.itemsize, block, lengths)
  kind = kernel.split("_")[2] if kernel.startswith(("splash_mha_", "splash_mqa_")) else None
  if kind not in SPLASH_MATMULS or len(floats) < 2:
    return None
  return kernel_cost(kind, floats[0].shape, floats[1].shape, floats[0].dtype.itemsize, block)


def _floating(dtype) -> bool:
  """Float dtypes, bfloat16 included (numpy's kind of bfloat16 is 'V', not 'f')."""
  return jnp.issubdtype(dtype, jnp.floating)


def causal_blocks(q_len: int, kv_len: int, bq: int, bkv: int, offset: int | None = None) -> int:
  """Blocks of a `q_len x kv_len` causal mask with an allowed pair: the blocks splash computes.
  Query i sees the keys up to i + `offset`; None: `kv_len - q_len`, the queries the last of the
  keys at these (padded) lengths. `kernel_cost` has only the padded shapes, so it takes None: exact
  when padding adds no block (the unpadded lengths multiples of the block, as at the paper's
  shapes); else it under-counts, and splash's own offset (`attention._kernel`'s, from the unpadded
  lengths) gives the blocks it computes. The report counts splash from its mask tables, not this."""
  offset = kv_len - q_len if offset is None else offset
  last_queries = ((i + 1) * bq - 1 + offset for i in range(q_len // bq))
  return sum(min(kv_len // bkv, max(0, q // bkv + 1)) for q in last_queries)


def kernel_cost(kind: str, q_shape, k_shape, itemsize: int, block: int) -> tuple[float, float]:
  """`(FLOPs, HBM bytes)` of one splash kernel (`fwd`, `dq` or `dkv`) on queries `[..., H, Tq, D]`
  and keys `[..., Hkv, Tk, D]` (padded; leading axes: rows), blocks of at most `block`."""
  *rows, heads, q_len, d = q_shape
  kv_len = k_shape[-2]
  bq, bkv = attention.block_size(q_len, block), attention.block_size(kv_len, block)
  blocks = math.prod(rows) * heads * causal_blocks(q_len, kv_len, bq, bkv)
  flops = SPLASH_MATMULS[kind] * blocks * bq * bkv * d
  query_side = {"fwd": 2, "dq": 3, "dkv": 0}[kind] * math.prod(rows) * heads * q_len * d
  streamed = blocks * 2 * d * (bq if kind == "dkv" else bkv)
  written_kv = 4 * math.prod(rows) * heads * kv_len * d if kind == "dkv" else 0  # k, v; dk, dv
  return float(flops), float(itemsize * (query_side + streamed + written_kv))


def decode_cost(
  q_shape, k_shape, q_itemsize: int, kv_itemsize: int, block: int, lengths: Sequence[int] = ()
) -> tuple[float, float]:
  """`(FLOPs, HBM bytes)` of one decode-kernel call on queries `[B, Hkv, G, D]` and a cache
  `[..., B, Hkv, S, D]` (a stack: one layer read), at the mean over the written `lengths` (none:
  all S) of the slots it reads."""
  rows, kv_heads, groups, d = q_shape
  slots = k_shape[-2]
  bkv = decode_attention.kv_block(slots, block)
  read = [min(-(-w // bkv) * bkv, slots) for w in lengths] or [slots]
  mean_read = sum(read) / len(read)
  flops = 4 * rows * kv_heads * groups * d * mean_read
  streamed = rows * kv_heads * mean_read * (2 * d * kv_itemsize + 4)  # keys, values, slot mask
  query_side = rows * kv_heads * groups * d * (q_itemsize + 4)  # queries in, float32 out
  return float(flops), float(streamed + query_side)
