"""Decode attention over the written cache (models.decode_attention, Pallas interpret mode on the
CPU) against the XLA reference in float32: the kernel alone (left padding, holes in the slot
mask, GQA, a last block the cache does not fill, slots past the written length that hold NaN, a
layer of a stacked cache); that it fetches and computes only the written blocks (its index maps
evaluated over the grid, its compute steps recorded; broken variants shown to fail the check); and
the sampler decoding with it (greedy and sampled, compacting and not; the rolled layer loop of
BASE, and unrolled)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import models, sampling, sharding
from ebpo_jax.aot import formulas
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


# ----------------------------------------------------------------------------- block skipping
# Masking makes the outputs the same whether or not the kernel reads the blocks past the written
# length, so the tests above cannot see the skipping. These read it off the kernel itself: the
# index maps its pallas_call carries (the jaxpr's block mappings, evaluated as interpret mode
# evaluates them) over the whole grid in grid order, where the pipeline fetches a block at each
# step whose block differs from the step before's (a repeated block is not copied again); and the
# grid steps whose compute ran, recorded in interpret mode.

SKIP_CASES = {  # (slots, block, written lengths)
  "five_blocks": (640, 128, [1, 127, 128, 129, 300, 512, 640]),
  "partial_last_block": (300, 128, [1, 256, 257, 300]),
  "one_block": (100, 128, [1, 50, 100]),
}
ROWS, KV_HEADS, GROUPS, D, LAYERS = 2, 2, 2, 8, 2  # the cache read at layer 1 of 2


def _decode_fn(block):
  return lambda q, k, v, mask, written, layer: decode_attention.flash_decode(
    q, k, v, mask, written, layer=layer, block=block, interpret=True
  )


def _decode_args(slots):
  """Queries, a stacked cache and a slot mask; each key holds its (slot, row, kv head, layer) in
  its first four entries, so a block's keys tell which block the kernel computed on."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(ROWS, 1, KV_HEADS * GROUPS, D)), jnp.float32)
  kv_shape = (LAYERS, ROWS, KV_HEADS, slots, D)
  layer, row, head, slot = np.meshgrid(*map(np.arange, kv_shape[:4]), indexing="ij")
  k = np.zeros(kv_shape, np.float32)
  k[..., :4] = np.stack([slot, row, head, layer], axis=-1)
  v = jnp.asarray(rng.normal(size=kv_shape), jnp.float32)
  return q, jnp.asarray(k), v, jnp.ones((ROWS, slots), bool)


def _fetches(slots, block, lengths) -> list[dict]:
  """Per written length, the blocks of keys, values and slot mask the kernel's pipeline fetches:
  `{name: [(grid step, block start), ...]}` at the steps whose block differs from the step
  before's."""
  q, k, v, mask = _decode_args(slots)
  jaxpr = jax.make_jaxpr(_decode_fn(block))(q, k, v, mask, jnp.int32(1), jnp.int32(1)).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.params.get("name") == decode_attention.NAME]
  mapping = eqn.params["grid_mapping"]
  operands = {"keys": 1, "values": 2, "slot mask": 3}  # after the queries
  assert [mapping.block_mappings[n].array_aval.shape for n in operands.values()] == [
    k.shape,
    v.shape,
    (ROWS, 1, slots),
  ]
  steps = np.array(list(itertools.product(*map(range, mapping.grid))), np.int32)
  fetches = []
  for written in lengths:
    scalars = jnp.array([written, 1], jnp.int32)  # the scalar-prefetched [written, layer]
    per_operand = {}
    for name, n in operands.items():
      starts_of = mapping.block_mappings[n].compute_start_indices_interpret
      starts = jax.vmap(lambda step, s, f=starts_of: f(tuple(step), s), in_axes=(0, None))(
        steps, scalars
      )
      starts = np.stack([np.asarray(x) for x in starts], axis=1)
      fetched = np.r_[True, (starts[1:] != starts[:-1]).any(axis=1)]
      per_operand[name] = [
        (tuple(map(int, s)), tuple(map(int, b)))
        for s, b in zip(steps[fetched], starts[fetched], strict=True)
      ]
    fetches.append(per_operand)
  return fetches


def _computed(monkeypatch, slots, block, lengths) -> list[list]:
  """Per written length, the blocks (row, kv head, kv block, layer) the kernel's compute ran on, in
  interpret mode: a callback beside its first matmul (its one `jax.lax.dot_general`, in the
  `pl.when` branch) reads them off the key block's first key (`_decode_args`)."""
  bkv = decode_attention.kv_block(slots, block)
  ran, dot_general = [], jax.lax.dot_general

  def record(first_key):
    slot, row, head, layer = map(int, first_key)
    ran.append((row, head, slot // bkv, layer))

  def recorded(lhs, rhs, *args, **kwargs):
    jax.debug.callback(record, rhs[0, :4])
    return dot_general(lhs, rhs, *args, **kwargs)

  computed = []
  with monkeypatch.context() as patch:
    patch.setattr(jax.lax, "dot_general", recorded)
    decode, args = jax.jit(_decode_fn(block)), _decode_args(slots)
    for written in lengths:
      ran.clear()
      decode(*args, jnp.int32(written), jnp.int32(1)).block_until_ready()
      jax.effects_barrier()
      computed.append(sorted(ran))
  return computed


def _skipping_errors(fetches: dict, computed: list, written: int, slots: int, block: int):
  """What the kernel fetches or computes beyond each row's and kv head's written blocks
  `0 .. ceil(written / bkv) - 1` (block 0 fetched when none is written), or misses of them: none
  when it reads each once (the slot mask once per row and kv head at most) and computes those."""
  bkv = decode_attention.kv_block(slots, block)
  blocks = -(-written // bkv)
  want = list(range(max(blocks, 1)))
  errors = []
  for name, got in fetches.items():
    mask = name == "slot mask"
    read = {}
    for (i, k, _), start in got:
      read.setdefault(i if mask else (i, k), []).append(start[-1 if mask else -2] // bkv)
      if not mask and start[:3] != (1, i, k):
        errors.append(f"{name}: step ({i}, {k}) reads layer, row, kv head {start[:3]}")
    for where, got_blocks in read.items():
      too_many = len(got_blocks) > (KV_HEADS if mask else 1) * len(want)
      if sorted(set(got_blocks)) != want or too_many or (not mask and got_blocks != want):
        errors.append(f"{name} of {where}: blocks {got_blocks} fetched, written {want}")
  grid = sorted(itertools.product(range(ROWS), range(KV_HEADS), range(blocks), [1]))
  if computed != grid:  # each written block of layer 1 once, nothing else
    extra = [step for step in computed if step not in grid]
    errors.append(f"computed on {len(computed)} blocks, written {len(grid)}: others {extra}")
  return errors


@pytest.mark.parametrize("case", SKIP_CASES)
def test_kernel_fetches_and_computes_only_the_written_blocks(case, monkeypatch):
  """Each row and kv head fetches its written blocks once and computes them, nothing past them;
  and roofline's decode model (`decode_cost`) counts exactly those blocks' slots."""
  slots, block, lengths = SKIP_CASES[case]
  bkv = decode_attention.kv_block(slots, block)
  fetches, computed = _fetches(slots, block, lengths), _computed(monkeypatch, slots, block, lengths)
  for written, fetched, ran in zip(lengths, fetches, computed, strict=True):
    assert _skipping_errors(fetched, ran, written, slots, block) == [], written
    read = sum(min(bkv, slots - j * bkv) for j in {b[3] // bkv for _, b in fetched["keys"]})
    q_shape, k_shape = (ROWS, KV_HEADS, GROUPS, D), (LAYERS, ROWS, KV_HEADS, slots, D)
    flops, _ = formulas.decode_cost(q_shape, k_shape, 4, 4, block, [written])
    assert flops == 4 * ROWS * KV_HEADS * GROUPS * D * read, written


BROKEN = {  # kernel variants that read or compute past the written blocks, by what they replace
  "unclamped_maps": dict(
    kv_index_map=lambda i, k, j, s, *, bkv: (s[1], i, k, j, 0),
    mask_index_map=lambda i, k, j, s, *, bkv: (i, 0, j),
  ),
  "clamped_one_block_late": dict(  # off by one when written is a multiple of the block
    kv_index_map=lambda i, k, j, s, *, bkv: (s[1], i, k, jnp.minimum(j, s[0] // bkv), 0),
  ),
  "computes_every_block": dict(computes=lambda j, written, bkv: j >= 0),
}


@pytest.mark.parametrize("variant", BROKEN)
def test_the_skipping_check_fails_on_a_kernel_that_reads_past_the_written_blocks(
  variant, monkeypatch
):
  """The check above reports each broken variant (the kernel runs the module's index maps and
  compute predicate, so replacing them there breaks the kernel): it can fail."""
  for name, fn in BROKEN[variant].items():
    monkeypatch.setattr(decode_attention, name, fn)
  slots, block, lengths = 640, 128, [128, 300]
  fetches, computed = _fetches(slots, block, lengths), _computed(monkeypatch, slots, block, lengths)
  failed = [
    bool(_skipping_errors(fetched, ran, written, slots, block))
    for written, fetched, ran in zip(lengths, fetches, computed, strict=True)
  ]
  # One block late reads past 128 written slots (1 block) but not past 300 (the last is partial).
  assert failed == ([True, False] if variant == "clamped_one_block_late" else [True, True])


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
