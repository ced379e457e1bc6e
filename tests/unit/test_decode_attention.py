"""Decode attention over the written cache (models.decode_attention, Pallas interpret mode on the
CPU) against the XLA reference in float32: the kernel alone (left padding, holes in the slot
mask, GQA, a last block the cache does not fill, slots past the written length that hold NaN),
and the sampler decoding with it (greedy and sampled, compacting and not)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import models, sampling, sharding
from ebpo_jax.models import Decoder, attention, decode_attention
from tests.helpers.tiny_decoder import BASE, init_params

ATOL = 1e-5
SPLASH = dataclasses.replace(BASE, attention="splash", attention_emulate=True)


def _inputs(b, heads, kv_heads, slots, starts, d=16, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, 1, heads, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, kv_heads, slots, d)), jnp.float32) for _ in "kv")
  mask = np.arange(slots)[None] >= np.asarray(starts)[:, None]  # left-padded rows
  return q, k, v, mask


CASES = {  # (rows, q heads, kv heads, slots, written, block, first valid slot per row)
  "one_block": (2, 2, 2, 40, 23, 128, [0, 9]),
  "gqa_partial_last_block": (3, 4, 2, 300, 290, 128, [0, 37, 150]),
  "stops_at_written": (2, 4, 1, 384, 130, 128, [5, 100]),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_xla_over_the_written_slots(case):
  b, heads, kv_heads, slots, written, block, starts = CASES[case]
  q, k, v, mask = _inputs(b, heads, kv_heads, slots, starts)
  mask[0, 3:7] = False  # a hole (a multi-turn chunk's unused slots)
  unwritten = np.arange(slots) >= written
  want = attention.xla_attention(q, k, v, jnp.asarray(mask & ~unwritten)[:, None])
  # What lies past the written slots is never read: NaN there would poison the output.
  k, v = (jnp.where(unwritten[:, None], jnp.nan, x) for x in (k, v))
  decode = jax.jit(lambda *a: decode_attention.flash_decode(*a, block=block, interpret=True))
  got = decode(q, k, v, jnp.asarray(mask), jnp.int32(written))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  # A plausible bug (the mask ignored, or the last block dropped) moves outputs far more.
  k0, v0 = (jnp.nan_to_num(x) for x in (k, v))
  careless = attention.xla_attention(q, k0, v0, ~unwritten[None, None])
  assert float(jnp.abs(careless - want).max()) > 100 * ATOL


def test_decode_dispatch_reads_only_written_slots_on_every_backend():
  q, k, v, mask = _inputs(2, 4, 2, 64, [0, 3])
  written = jnp.int32(20)
  want = attention.xla_attention(q, k, v, jnp.asarray(mask & (np.arange(64) < 20))[:, None])
  for config in (BASE, SPLASH):
    got = attention.decode(q, k, v, jnp.asarray(mask), written, config)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=config.attention)


def _prompts():
  """Two left-padded prompts of 7 and 4 tokens."""
  mask = np.arange(7)[None] >= np.array([[0], [3]])
  ids = np.where(mask, np.random.default_rng(0).integers(1, BASE.vocab_size, mask.shape), 0)
  return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("greedy", [True, False])
def test_generate_with_the_kernel_equals_xla(greedy, compact):
  params = init_params(BASE, noise=0.1)
  ids, mask = _prompts()
  args = (params, ids, mask, jax.random.key(3))
  # 2 x 8 = 16 rows; compacting goes on in 8 once 8 rows have stopped. The stop ids are chosen so
  # that happens early: greedy, prompt 0's rows draw 54 first; sampled, several rows stop by step 2.
  stop_ids = (54,) if greedy else (0, 20, 32, 54)
  kwargs = dict(group_size=8, max_new_tokens=6, greedy=greedy, compact=compact, stop_ids=stop_ids)
  want = sampling.generate(Decoder(BASE), *args, **kwargs)
  got = sampling.generate(Decoder(SPLASH), *args, **kwargs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
  lengths = np.asarray(want.lengths)
  assert (lengths <= 3).sum() >= 8 and lengths.max() > 3  # the compacted stage decodes
  if not greedy:  # sampled rows differ from one another: the draws are exercised
    assert len({tuple(row) for row in np.asarray(want.tokens)}) > 2


def test_the_decode_step_runs_the_kernel():
  params = models.decoder.unstack_layers(init_params(BASE))
  cache = models.init_cache(SPLASH, 2, 8)
  step = lambda p: Decoder(SPLASH, scan_layers=False).apply(  # noqa: E731
    {"params": p}, jnp.ones((2, 1), jnp.int32), cache=cache
  )
  assert str(jax.make_jaxpr(step)(params)).count(f"name={decode_attention.NAME}") == BASE.num_layers


def test_generate_with_the_kernel_per_shard_equals_xla():
  """Under a mesh of 8 CPU devices (conftest) the kernel runs per shard: rows over data x fsdp,
  the 2 kv heads over tensor."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  abstract = jax.eval_shape(Decoder(BASE).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  params = init_params(BASE, noise=0.1)
  params = jax.device_put(params, sharding.logical_shardings(abstract["params"], mesh))
  ids, mask = _prompts()
  args = (params, ids, mask, jax.random.key(3))
  kwargs = dict(group_size=2, max_new_tokens=4, greedy=False, compact=False, mesh=mesh)
  want = sampling.generate(Decoder(BASE), *args, **kwargs)
  got = sampling.generate(Decoder(SPLASH), *args, **kwargs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
  temperature = top_p = jnp.float32(1.0)
  traced = sampling.trace_generate(Decoder(SPLASH), *args, temperature, top_p, **kwargs)
  assert f"name={decode_attention.NAME}" in str(traced.jaxpr) and "shard_map" in str(traced.jaxpr)
