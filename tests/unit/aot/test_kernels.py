"""ebpo_jax.aot.kernels: Pallas kernels counted from their bodies (matmuls per grid step that runs,
the distinct consecutive blocks their index maps address), against the hand formulas of
aot.roofline (the cross-check), and a decode kernel broken on purpose that the count sees and the
formula does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from ebpo_jax.aot import formulas, kernels, roofline
from ebpo_jax.models import attention, decode_attention
from tests.helpers.decoding import decode_jaxpr


def _pallas_eqns(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn)
    for value in eqn.params.values():
      for sub in kernels.sub_jaxprs(value):
        found += _pallas_eqns(sub)
  return found


def _count_at(eqn, written: int) -> kernels.KernelCount:
  """The decode kernel counted at one written length (its prefetched [written, layer])."""
  return kernels.count_kernel(eqn, [[np.array([written, 0], np.int32)]])


# ----------------------------------------------------------------------------- the decode kernel


@pytest.mark.parametrize("written", [1, 100, 128, 129, 300, 511, 512])
def test_decode_kernel_fetches_and_computes_only_the_written_blocks(written):
  # 2 rows x 2 kv heads of 4 q heads, D = 64, 512 slots in blocks of 128 (4 a row and kv head).
  (eqn,) = _pallas_eqns(decode_jaxpr(2, 8, 2, 512, 64).jaxpr)
  count = _count_at(eqn, written)
  blocks = -(-written // 128)  # the blocks up to the last written one
  assert count.grid_steps == 2 * 2 * 4
  assert count.computed_steps == 2 * 2 * blocks  # pl.when skips the rest
  key_bytes = 2 * 2 * blocks * 128 * 64 * 2
  keys, values = (count.operand_bytes[o] for o in list(count.operand_bytes)[1:3])
  assert keys == values == key_bytes  # the clamp repeats the last block: never fetched again
  # 2 matmuls of 2 x G x bkv x D a computed block.
  assert count.flops == 2 * 2 * blocks * 4 * 4 * 128 * 64


def test_decode_kernel_body_count_equals_the_formula():
  # The cross-check: with the cache a multiple of the block, the body count is the formula's up to
  # the mask (int32, one block per written block and kv head: the formula's; when only block 0 is
  # written its index repeats across kv heads, fetched once a row) and the 8 prefetched bytes.
  lengths = (100, 130, 290, 512)
  closed = decode_jaxpr(2, 8, 2, 512, 64)
  body = roofline.count_dots(closed, 1, attention_block=128, decode_lengths=lengths)
  (eqn,) = _pallas_eqns(closed.jaxpr)
  flops, nbytes = formulas.of_call(eqn, 128, lengths)
  assert body.counted_flops == body.kernel_flops == flops  # exact
  assert body.modelled_flops == body.modelled_bytes == 0
  assert (body.formula_flops, body.formula_bytes) == (flops, nbytes)
  assert body.kernel_bytes == pytest.approx(nbytes, rel=0.01)
  # The mask's repeat at 100 slots (2 rows x 1 kv head x 512 bytes, a quarter of the lengths).
  assert body.kernel_bytes == pytest.approx(nbytes - 2 * 512 / 4 + 8)


def test_decode_kernel_with_a_partial_last_block():
  # 300 slots in blocks of 128: the last block holds 44. Written 100, 130 and 290: 1, 2 and 3
  # blocks computed per row and kv head (each a whole block's matmuls: 4 x 4 x 64 x 128), the keys
  # and values fetched as far as the array goes: 128, 256 and 300 slots (the formula's 228 on
  # average). FLOPs 2 x 2 x 2 x 4 x 4 x 64 x 128 = 1,048,576 (the formula, slots not blocks:
  # 933,888). Bytes: keys and values 2 x 4 x 228 x 64 x 2 = 233,472; the int32 mask (1, 128) per
  # block and kv head, but at 100 slots once a row (its index repeats): (1,024 + 4,096 + 4,800) / 3;
  # queries 2,048, float32 outputs 4,096, the prefetched [written, layer] 8.
  closed = decode_jaxpr(2, 8, 2, 300, 64)
  count = roofline.count_dots(closed, 1, attention_block=128, decode_lengths=(100, 130, 290))
  assert (count.kernels, count.uncounted_kernels) == (1, [])
  assert count.kernel_flops == 1_048_576 and count.formula_flops == 933_888
  mask = (1_024 + 4_096 + 4_800) / 3
  assert count.kernel_bytes == pytest.approx(233_472 + mask + 2_048 + 4_096 + 8)
  assert count.formula_bytes == 243_264
  # Without the lengths, every call reads the whole cache.
  full = roofline.count_dots(closed, 1, attention_block=128)
  assert full.kernel_flops == 2 * 2 * 3 * 4 * 4 * 64 * 128
  assert full.kernel_bytes == 2 * 2 * 2 * 300 * 64 * 2 + 2 * 2 * 300 * 4 + 2_048 + 4_096 + 8


class _Unclamped:
  """`pallas` as decode_attention sees it, but its key, value and mask block specs (5 and 3
  dimensions; the queries' have 4) index the grid's kv block itself, not the last written block:
  a kernel that fetches the whole cache. `always=True` also runs every `pl.when` body: it
  computes every block too."""

  def __init__(self, always: bool = False):
    self.always = always

  def __getattr__(self, name):
    return getattr(pl, name)

  def BlockSpec(self, block_shape, index_map, *args, **kwargs):  # noqa: N802 - pl's name
    if len(block_shape) in (3, 5):  # (row, 0, block) and (layer, row, kv head, block, 0)
      clamped, at = index_map, len(block_shape) - 1 - (len(block_shape) == 5)
      index_map = lambda i, k, j, s: tuple(j if n == at else x
                                           for n, x in enumerate(clamped(i, k, j, s)))  # fmt: skip
    return pl.BlockSpec(block_shape, index_map, *args, **kwargs)

  def when(self, condition):
    return pl.when(True if self.always else condition)


@pytest.mark.parametrize("always", [False, True])
def test_a_decode_kernel_that_reads_the_whole_cache_counts_more(monkeypatch, always):
  # 1 row x 2 kv heads, 1,024 slots in blocks of 128, written 200 (2 blocks of 8).
  lengths = (200,)
  good = roofline.count_dots(decode_jaxpr(1, 4, 2, 1024, 64), 1, 128, decode_lengths=lengths)
  monkeypatch.setattr(decode_attention, "pl", _Unclamped(always))
  closed = decode_jaxpr(1, 4, 2, 1024, 64)
  broken = roofline.count_dots(closed, 1, 128, decode_lengths=lengths)
  # The formula sees the same shapes and lengths: it does not move.
  assert (broken.formula_flops, broken.formula_bytes) == (good.formula_flops, good.formula_bytes)
  assert good.kernel_bytes == pytest.approx(good.formula_bytes, rel=0.01)
  # The count does: keys and values of all 8 blocks, not 2 (and the mask's 8).
  kv = lambda blocks: 2 * 2 * blocks * 128 * 64 * 2 + 2 * blocks * 128 * 4
  assert broken.kernel_bytes - good.kernel_bytes == pytest.approx(kv(8) - kv(2))
  assert broken.kernel_bytes > 3 * good.kernel_bytes
  (eqn,) = _pallas_eqns(closed.jaxpr)
  steps = _count_at(eqn, 200).computed_steps
  assert steps == (2 * 8 if always else 2 * 2)
  assert broken.kernel_flops == (4 if always else 1) * good.kernel_flops


# ----------------------------------------------------------------------------- splash attention


def _splash(b, t, s, heads, kv_heads, d=128, grad=False, block=512):
  q = jnp.ones((b, t, heads, d), jnp.bfloat16)
  k = jnp.ones((b, kv_heads, s, d), jnp.bfloat16)
  masks = attention.TokenMasks(jnp.ones((b, t), bool), jnp.ones((b, s), bool))
  attend = lambda q, k, v: attention.splash_attention(q, k, v, masks, block=block, interpret=True)
  loss = lambda *a: attend(*a).astype(jnp.float32).sum()
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)) if grad else attend)(q, k, k)


@pytest.mark.parametrize("grad", [False, True])
def test_splash_body_count_equals_the_formula(grad):
  # 2 rows, 4 q heads over 2 kv heads, T = S = 2,048 in blocks of 512: 10 of the 16 blocks hold a
  # causal pair. The body count finds them from splash's own mask tables (program constants).
  closed = _splash(2, 2048, 2048, 4, 2, grad=grad)
  count = roofline.count_dots(closed, 1, attention_block=512)
  assert count.kernels == (3 if grad else 1) and count.uncounted_kernels == []
  assert count.modelled_flops == count.modelled_bytes == 0  # every kernel counted from its body
  # FLOPs: the formula's (4, 6 and 8 matmuls of bq x bkv x D per computed block) exactly.
  assert count.kernel_flops == count.formula_flops
  per_block = 512 * 512 * 128
  assert count.kernel_flops == 2 * 4 * 10 * per_block * (4 + 6 + 8 if grad else 4)
  # Bytes: the body count is above the formula, by what the formula leaves out: splash's int32
  # segment ids and query positions ([T, 128] each: twice the bf16 queries at D = 128), the key
  # side's [8, bkv] segment ids, the [bq, 128] float32 scratch outputs, the forward's log-sum-exp
  # residual ([T, 128] float32, under grad); less one key block a head that the pipeline reuses.
  assert count.formula_bytes < count.kernel_bytes < 2 * count.formula_bytes
  if not grad:  # by hand, 2 rows x 4 heads: every operand's fetches
    q = o = segments = positions = 8 * 2048 * 128 * 2
    segments = positions = 2 * q
    keys = values = 8 * 9 * 512 * 128 * 2  # 9 of the 10 computed blocks: block 0 reused
    key_segments = 8 * 9 * 8 * 512 * 4
    scratch = 3 * 2 * 512 * 128 * 4  # m, l and o, written once a row
    tables = 2 * 16  # data_next and block_mask, int8 [1, 4, 4]
    want = q + o + segments + positions + keys + values + key_segments + scratch + tables
    assert count.kernel_bytes == want


def test_splash_computes_only_the_causal_blocks():
  # 2 heads, T = S = 2,048 in blocks of 512: of the 2 x 16 grid steps, 2 x 10 compute (splash's
  # block mask, evaluated per step from its prefetched tables).
  count = roofline.count_dots(_splash(1, 2048, 2048, 2, 2), 1)
  ((name, grid_steps, computed),) = [(k["name"], k["grid_steps"], k["computed_steps"])
                                     for k in count.kernel_steps]  # fmt: skip
  assert name.startswith("splash_mha_fwd") and (grid_steps, computed) == (2 * 16, 2 * 10)
  assert count.kernel_flops == 2 * 10 * 4 * 512 * 512 * 128
