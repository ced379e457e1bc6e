"""Splash attention's masked-block skipping, which the train step's FLOP count sees (`roofline.
count_dots` counts each kernel's body over the blocks its mask tables name, `aot.kernels`) and its
cross-check formula assumes (`aot.formulas.causal_blocks`: of each kernel's blocks, those of its
causal mask with an allowed pair). What splash computes is read off the kernels the project builds
(`models.attention._kernel`, through `attention.attend` over full rows and the shared-prefix
layout): each kernel's mask info (`splash_attention_mask_info.MaskInfo`), whose `block_mask` is 0
on a fully masked block; the forward, dq and dkv kernels run a block's compute only where it is
not 0 (`_next_nonzero`'s `should_run` under `pl.when`) and fetch the blocks `data_next` names,
which skips the masked ones. A variant whose kernels compute every block shows the check fails."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from ebpo_jax.aot import formulas, roofline
from ebpo_jax.models import attention, shared_prefix
from tests.helpers.configs import TINY_MODEL

HEADS, KV_HEADS, D = 4, 2, 16
KINDS = ("fwd", "dq", "dkv")

CASES = {  # (rows, prompt tokens P, completions per prompt G (0: full rows), tokens N, block)
  "full_rows": (2, 0, 0, 640, 256),  # 3 x 3 blocks of 256 (T padded to 768): 6 computed
  "one_block": (2, 0, 0, 200, 512),  # T = 200 in one block of 256
  # The completions' queries after their prompt's keys: 384 after 256 in blocks of 128, 12 of 15.
  "shared_prefix": (2, 256, 2, 384, 128),
  # N = 600 pads to 1024 queries, the 856 keys to 1024: splash's mask has the queries the last of
  # the unpadded keys (offset 256: 4 blocks computed), not of the padded ones (offset 0: 3). The
  # formula counts them at splash's offset; from the pallas_call's shapes alone it would give 3
  # (`test_the_padded_offset_undercounts_an_unaligned_prefix`).
  "shared_prefix_unaligned": (2, 256, 2, 600, 512),
}


def _traced(case, monkeypatch):
  """The gradient of `attention.attend` through splash, traced: its jaxpr, and per splash call
  `(rows, head_dim, kernel args, kernel)` (`attention._kernel`'s heads, padded lengths, offset,
  blocks; the kernel those build)."""
  rows, prompt, group, tokens, block = case
  calls = []
  kernel, splash_attention = attention._kernel, attention.splash_attention

  def recorded_call(q, *args, **kwargs):
    calls.append([q.shape[0], q.shape[3]])
    return splash_attention(q, *args, **kwargs)

  def recorded_kernel(*args):
    calls[-1].append(args)
    return kernel(*args)

  config = dataclasses.replace(
    TINY_MODEL, attention="splash", attention_emulate=True, attention_block=block
  )
  t = prompt + max(group, 1) * tokens
  groups = shared_prefix.PrefixGroups(prompt, group) if group else None
  valid = attention.layout("splash", jnp.ones((rows, t), bool), groups)
  loss = lambda q, k, v: attention.attend(q, k, v, valid, config).sum()
  q, kv = jnp.ones((rows, t, HEADS, D)), jnp.ones((rows, t, KV_HEADS, D))
  with monkeypatch.context() as patch:
    patch.setattr(attention, "splash_attention", recorded_call)
    patch.setattr(attention, "_kernel", recorded_kernel)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)  # closed: mask tables
  assert len(calls) == (2 if group else 1) and all(len(c) == 3 for c in calls)
  for call in calls:  # built again outside the trace: its mask info concrete, not traced
    call.append(kernel(*call[2]))
  return jaxpr, calls


def _computed_blocks(kernel, heads: int) -> dict[str, int]:
  """Blocks of one row that each splash kernel computes: its mask info's nonzero `block_mask`
  entries, over the heads (a block mask of one head serves all)."""
  infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
  counts = {}
  for kind, info in zip(KINDS, infos, strict=True):
    block_mask = np.asarray(info.block_mask)
    counts[kind] = int(np.count_nonzero(block_mask)) * heads // block_mask.shape[0]
  return counts


def _block_errors(jaxpr, calls, block: int) -> list[str]:
  """Where splash's computed blocks differ from roofline's count: per kernel, the blocks against
  `causal_blocks` of its padded lengths; and the FLOPs `count_dots` gives the traced program
  against those of the blocks splash computes."""
  errors, flops = [], 0.0
  for rows, d, (heads, q_len, kv_len, offset, bq, bkv, _), kernel in calls:
    assumed = heads * formulas.causal_blocks(q_len, kv_len, bq, bkv, offset)
    computed = _computed_blocks(kernel, heads)
    if computed != dict.fromkeys(KINDS, assumed):
      errors.append(f"{q_len} x {kv_len} in {bq} x {bkv}: splash {computed}, roofline {assumed}")
    per_block = rows * bq * bkv * d
    flops += per_block * sum(formulas.SPLASH_MATMULS[k] * n for k, n in computed.items())
  counted = roofline.count_dots(jaxpr, 1, attention_block=block)
  if (counted.kernels, counted.uncounted_kernels) != (3 * len(calls), []):
    errors.append(f"kernels {counted.kernels}, uncounted {counted.uncounted_kernels}")
  if counted.kernel_flops != flops:
    errors.append(f"roofline's kernel FLOPs {counted.kernel_flops:.4g}, splash's {flops:.4g}")
  return errors


def _forward_kv_fetches(kernel, heads: int, kv_heads: int) -> int:
  """Key (and value) blocks the forward kernel fetches for one row: its grid (heads, q blocks,
  kv steps) in order, the block at each step `data_next`'s (of the kv head serving the q head),
  fetched where it differs from the step before's."""
  data_next = np.asarray(kernel.fwd_mask_info.data_next)
  one = data_next.shape[0] == 1
  blocks = [
    (h // (heads // kv_heads), int(data_next[0 if one else h, i, j]))
    for h in range(heads)
    for i in range(data_next.shape[1])
    for j in range(data_next.shape[2])
  ]
  return 1 + sum(a != b for a, b in zip(blocks, blocks[1:], strict=False))


@pytest.mark.parametrize("case", CASES)
def test_splash_computes_the_blocks_roofline_counts(case, monkeypatch):
  """The blocks splash computes (its mask info) are those roofline counts, for the forward, dq
  and dkv kernels; fewer than all of them where the mask has an empty block; and the forward
  fetches no more key blocks than it computes (roofline's bytes: one key-side pair per block)."""
  jaxpr, calls = _traced(CASES[case], monkeypatch)
  assert _block_errors(jaxpr, calls, CASES[case][-1]) == []
  for _, _, (heads, q_len, kv_len, offset, bq, bkv, _), kernel in calls:
    computed = _computed_blocks(kernel, heads)["fwd"]
    assert _forward_kv_fetches(kernel, heads, KV_HEADS) <= computed
    if q_len > bq and offset == kv_len - q_len:  # the causal corner is empty, and skipped
      assert computed < heads * (q_len // bq) * (kv_len // bkv)


def test_the_block_check_fails_on_splash_computing_every_block(monkeypatch):
  """With the project's kernels built on a full mask (every block computed, as without the
  skipping), the check above reports the blocks the causal count does not assume, and the
  report's count (from the kernels' mask tables) rises with what they compute."""
  for case in ("full_rows", "shared_prefix"):
    jaxpr, _ = _traced(CASES[case], monkeypatch)
    skipping = roofline.count_dots(jaxpr, 1, attention_block=CASES[case][-1]).kernel_flops
    with monkeypatch.context() as patch:
      patch.setattr(splash, "CausalMask", lambda shape, offset=0: splash.FullMask(shape))
      jaxpr, calls = _traced(CASES[case], monkeypatch)
      errors = _block_errors(jaxpr, calls, CASES[case][-1])
      every = roofline.count_dots(jaxpr, 1, attention_block=CASES[case][-1]).kernel_flops
    assert sum("splash {" in e for e in errors) == len(calls), case
    assert every > 1.2 * skipping, case


def test_the_padded_offset_undercounts_an_unaligned_prefix(monkeypatch):
  """`kernel_cost` sees only the padded shapes: at an unaligned shared prefix its count (the
  padded offset) is under splash's blocks, which the report counts from the mask tables instead."""
  jaxpr, calls = _traced(CASES["shared_prefix_unaligned"], monkeypatch)
  (_, _, (heads, q_len, kv_len, offset, bq, bkv, _), kernel), *_ = calls[1:] or calls
  computed = _computed_blocks(kernel, heads)["fwd"]
  assert offset != kv_len - q_len
  assert heads * formulas.causal_blocks(q_len, kv_len, bq, bkv) < computed
  assert heads * formulas.causal_blocks(q_len, kv_len, bq, bkv, offset) == computed
