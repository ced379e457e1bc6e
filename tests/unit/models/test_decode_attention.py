"""Decode attention over the written cache (models.decode_attention, Pallas interpret mode on the
CPU) against the XLA reference in float32: the kernel alone (left padding, holes in the slot
mask, GQA, a last block the cache does not fill, slots past the written length that hold NaN, a
layer of a stacked cache), and the sampler decoding with it (greedy and sampled, compacting and
not; the rolled layer loop of BASE, and unrolled)."""

import dataclasses
import functools

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


def test_kernel_reads_its_layer_of_a_stacked_cache_in_place():
  """Given the rolled loop's stacked `[L, B, Hkv, S, D]` cache and a (traced) layer index, the
  kernel reads that layer's blocks from the stack (the index map, not a slice out of it)."""
  q, k, v, mask = _inputs(2, 4, 2, 200, [0, 30])
  want = attention.xla_attention(q, k, v, jnp.asarray(mask & (np.arange(200) < 150))[:, None])
  # Layer 1 of 3; the other layers hold NaN: a read of the wrong layer poisons the output.
  stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])
  decode = jax.jit(
    lambda *a: decode_attention.flash_decode(*a[:5], layer=a[5], block=128, interpret=True)
  )
  args = (q, stack(k), stack(v), jnp.asarray(mask), jnp.int32(150), jnp.int32(1))
  np.testing.assert_allclose(decode(*args), want, atol=ATOL, rtol=0)
  kernel_inputs, outside = _pallas_inputs_and_other_ops(jax.make_jaxpr(decode)(*args).jaxpr)
  assert (3, 2, 2, 200, 16) in kernel_inputs and "dynamic_slice" not in outside
  for config in (BASE, SPLASH):  # the dispatch, whose XLA path slices the layer out
    got = attention.decode(q, *args[1:5], config, layer=jnp.int32(1))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=config.attention)


def _pallas_inputs_and_other_ops(jaxpr) -> tuple[list, set]:
  """The shapes of the pallas_call's operands, and the primitives outside any kernel."""
  shapes, others = [], set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      shapes += [v.aval.shape for v in eqn.invars]
      continue
    others.add(eqn.primitive.name)
    if "jaxpr" in eqn.params:  # jit, shard_map
      inner_jaxpr = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])
      inner = _pallas_inputs_and_other_ops(inner_jaxpr)
      shapes, others = shapes + inner[0], others | inner[1]
  return shapes, others


def test_decode_dispatch_reads_only_written_slots_on_every_backend():
  q, k, v, mask = _inputs(2, 4, 2, 64, [0, 3])
  written = jnp.int32(20)
  want = attention.xla_attention(q, k, v, jnp.asarray(mask & (np.arange(64) < 20))[:, None])
  for config in (BASE, SPLASH):
    got = attention.decode(q, k, v, jnp.asarray(mask), written, config)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=config.attention)


@functools.cache  # one init program in a process; the tests only read the params
def _noisy_params():
  return init_params(BASE, noise=0.1)


def _prompts():
  """Two left-padded prompts of 7 and 4 tokens."""
  mask = np.arange(7)[None] >= np.array([[0], [3]])
  ids = np.where(mask, np.random.default_rng(0).integers(1, BASE.vocab_size, mask.shape), 0)
  return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


# Greedy and sampled differ in the draw, which the kernel never sees, so each of the two is run
# once: greedy on the plain loop, sampled (rows of many lengths) compacting. Sampled on the plain
# loop is held to XLA on a mesh below (test_generate_with_the_kernel_per_shard_equals_xla).
@pytest.mark.parametrize(
  "greedy, compact", [(True, False), (False, True)], ids=["greedy_plain", "sampled_compacting"]
)
def test_generate_with_the_kernel_equals_xla(greedy, compact):
  params = _noisy_params()
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


@pytest.mark.parametrize("rolled", [False, True], ids=["per_layer", "rolled"])
def test_the_decode_step_runs_the_kernel(rolled):
  """Once per layer unrolled; once in the rolled loop's body, on the whole stacked cache."""
  params = jax.eval_shape(lambda: init_params(BASE))  # shapes: only the trace is read
  if not rolled:
    params = jax.eval_shape(models.decoder.unstack_layers, params)
  cache = models.init_cache(SPLASH, 2, 8, stacked=rolled)
  step = lambda p: Decoder(SPLASH, scan_layers=rolled).apply(
    {"params": p}, jnp.ones((2, 1), jnp.int32), cache=cache
  )
  jaxpr = str(jax.make_jaxpr(step)(params))
  assert jaxpr.count(f"name={decode_attention.NAME}") == (1 if rolled else BASE.num_layers)
  if rolled:
    assert "f32[2,2,2,8,8]" in jaxpr.split("pallas_call")[1]  # [L, B, Hkv, S, D] goes in


def test_rolled_generate_with_the_kernel_equals_the_unrolled_one():
  """The rolled loop (BASE: unroll_layers False) against the unrolled one, both on the kernel."""
  params = _noisy_params()
  ids, mask = _prompts()
  # test_generate_with_the_kernel_equals_xla[sampled_compacting]'s sampler: the rolled run is
  # its program (one compile for both tests in a process); the unrolled one decodes as it does.
  kwargs = dict(
    group_size=8, max_new_tokens=6, greedy=False, compact=True, stop_ids=(0, 20, 32, 54)
  )
  unrolled = Decoder(dataclasses.replace(SPLASH, unroll_layers=True))
  want = sampling.generate(unrolled, params, ids, mask, jax.random.key(3), **kwargs)
  got = sampling.generate(Decoder(SPLASH), params, ids, mask, jax.random.key(3), **kwargs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)


def test_generate_with_the_kernel_per_shard_equals_xla():
  """Under a mesh of 8 CPU devices (conftest) the kernel runs per shard: rows over data x fsdp,
  the 2 kv heads over tensor."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  abstract = jax.eval_shape(Decoder(BASE).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  params = _noisy_params()
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
