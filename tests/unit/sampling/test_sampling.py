"""Sampler: greedy = stepwise argmax, log-probs = full forward, filters, stops, sharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from scipy import stats

from ebpo_jax import sampling, sharding
from ebpo_jax.models import Decoder
from ebpo_jax.sampling import SampleOutput, draw, loop, sequences
from tests.helpers.configs import TINY_MODEL
from tests.helpers.sampler import (
  BUCKETS,
  PAD,
  PROMPTS,
  SHARDED_ATOL,
  long_tailed_program,
  long_tailed_sample,
  on_mesh,
  while_body,
)


@pytest.fixture(scope="module")
def long_tailed(policy):
  """`long_tailed(compact, sharded)`: `long_tailed_sample` of the policy, on one device or a mesh
  (data 2 x fsdp 4, the weights placed as the trainer places them), each sampled once for the
  tests that read it (each is a compile of the sampler: seconds)."""
  model, params = policy
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  placed = on_mesh(model, params, mesh)
  samples = {}

  def sample(compact: bool, sharded: bool) -> SampleOutput:
    if (compact, sharded) not in samples:
      on = dict(params=placed, mesh=mesh) if sharded else dict(params=params)
      samples[compact, sharded] = long_tailed_sample(model, compact=compact, **on)
    return samples[compact, sharded]

  return sample


def _full_forward_logits(model, params, ids_bt, mask_bt):
  """Logits of one uncached forward over left-padded prompts followed by their completions
  (jitted: eagerly, each of its operations compiles apart, about 4x the time)."""

  def forward(params, ids_bt, mask_bt):
    positions = sequences.prompt_positions(mask_bt)
    return model.apply({"params": params}, ids_bt, positions, mask_bt)

  return jax.jit(forward)(params, ids_bt, mask_bt)


def _reference_greedy(forward, prompt, num_tokens, width):
  """Argmax of a full forward, one token at a time (right-padded to a fixed width: one compile)."""
  seq = list(prompt)
  for _ in range(num_tokens):
    ids = np.zeros((1, width), np.int32)
    ids[0, : len(seq)] = seq
    mask = np.arange(width)[None] < len(seq)
    logits = forward(ids, mask)
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt) :]


def test_bucket_length_and_pad_prompts():
  assert sampling.bucket_length(3, (4, 8)) == 4
  assert sampling.bucket_length(4, (8, 4)) == 4
  assert sampling.bucket_length(5, (4, 8)) == 8
  with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
    sampling.bucket_length(9, (4, 8))
  ids, mask = sampling.pad_prompts([[1, 2, 3, 4, 5], [6]], pad_id=0, buckets=(4, 8))
  np.testing.assert_array_equal(ids, [[0, 0, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0, 0, 6]])
  np.testing.assert_array_equal(mask.sum(-1), [5, 1])
  assert ids.dtype == np.int32 and mask.dtype == bool
  with pytest.raises(ValueError, match="no empty prompt"):
    sampling.pad_prompts([[1], []], pad_id=0, buckets=(4,))


def _greedy(model, params, prompts):
  ids, mask = sampling.pad_prompts(prompts, PAD, BUCKETS)
  return sampling.generate(
    model, params, ids, mask, jax.random.key(0), group_size=2, max_new_tokens=6, greedy=True,
    pad_id=PAD,
  )  # fmt: skip


def test_greedy_equals_stepwise_argmax_of_full_forwards(policy):
  model, params = policy
  out = _greedy(model, params, PROMPTS)
  forward = jax.jit(lambda ids, mask: _full_forward_logits(model, params, ids, mask))
  width = max(map(len, PROMPTS)) + 6  # one width for every prompt: one compile
  for row, prompt in enumerate(PROMPTS):
    expected = _reference_greedy(forward, prompt, 6, width)
    # Rows are prompt-major: both samples of prompt b are rows 2b and 2b + 1.
    assert out.tokens[2 * row].tolist() == expected, row
    assert out.tokens[2 * row + 1].tolist() == expected, row
  assert out.mask.all() and out.truncated.all()
  np.testing.assert_array_equal(out.lengths, 6)


def test_greedy_output_of_a_prompt_does_not_depend_on_the_batch(policy):
  model, params = policy
  alone = _greedy(model, params, [PROMPTS[1]])  # bucket 4, no neighbours
  crowded = _greedy(model, params, [PROMPTS[0], PROMPTS[2], PROMPTS[1]])  # bucket 8, more padding
  np.testing.assert_array_equal(crowded.tokens[4:6], alone.tokens)
  np.testing.assert_allclose(crowded.logprobs[4:6], alone.logprobs, atol=1e-5)


def _logsumexp(x):
  top = np.max(x, -1, keepdims=True)
  return top + np.log(np.sum(np.exp(x - top), -1, keepdims=True))


def _assert_logprobs_match_full_forward(
  model, params, out, prompt_ids, prompt_mask, *, temperature, top_k, top_p
):
  """`out.logprobs` against one uncached forward; every drawn token lies inside the filters
  (rebuilt in NumPy)."""
  group = out.tokens.shape[0] // prompt_ids.shape[0]
  steps = out.tokens.shape[1]
  ids = np.concatenate([np.repeat(prompt_ids, group, 0), np.asarray(out.tokens)], 1)
  mask = np.concatenate([np.repeat(prompt_mask, group, 0), np.asarray(out.mask)], 1)
  # Logits at position P - 1 + t predict completion token t.
  logits = np.asarray(_full_forward_logits(model, params, ids, mask))[:, prompt_ids.shape[1] - 1 :]
  logits = logits[:, :steps].astype(np.float64)
  tokens, valid = np.asarray(out.tokens)[..., None], np.asarray(out.mask)
  expected = np.take_along_axis(logits - _logsumexp(logits), tokens, -1)[..., 0]
  np.testing.assert_allclose(
    np.where(valid, out.logprobs, 0), np.where(valid, expected, 0), atol=1e-4
  )
  np.testing.assert_array_equal(np.where(valid, 0, out.logprobs), 0)
  # The sampling distribution: temperature, then top-k, then top-p.
  scaled = logits / temperature
  if top_k:
    kth = np.sort(scaled, -1)[..., -top_k][..., None]
    scaled = np.where(scaled >= kth, scaled, -np.inf)
  probs = np.exp(scaled - _logsumexp(scaled))
  order = np.argsort(-probs, -1)
  sorted_probs = np.take_along_axis(probs, order, -1)
  keep = np.zeros_like(probs, bool)
  np.put_along_axis(keep, order, np.cumsum(sorted_probs, -1) - sorted_probs < top_p, -1)
  scaled = np.where(keep, scaled, -np.inf)
  expected_q = np.take_along_axis(scaled - _logsumexp(scaled), tokens, -1)[..., 0]
  assert np.isfinite(expected_q[valid]).all(), "drew a token the filters remove"


STOPS = tuple(range(1, 64, 3))  # about a third of the vocabulary


def _sample(model, params, key, stop_ids=()):
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, BUCKETS)
  out = sampling.generate(
    model, params, ids, mask, key, group_size=4, max_new_tokens=12, stop_ids=stop_ids, pad_id=PAD
  )
  return out, ids, mask


def test_stop_tokens_end_sequences_and_mask_the_rest(policy):
  model, params = policy
  free, _, _ = _sample(model, params, jax.random.key(7))
  out, ids, mask = _sample(model, params, jax.random.key(7), STOPS)
  tokens, free_tokens = np.asarray(out.tokens), np.asarray(free.tokens)
  lengths = []
  for row in range(tokens.shape[0]):
    hits = np.flatnonzero(np.isin(free_tokens[row], STOPS))
    length = hits[0] + 1 if hits.size else 12
    lengths.append(length)
    # Up to and including the stop token the draws are those of the run without stops.
    np.testing.assert_array_equal(tokens[row, :length], free_tokens[row, :length])
    assert (tokens[row, length:] == PAD).all()
    assert bool(out.truncated[row]) == (hits.size == 0)
  np.testing.assert_array_equal(out.lengths, lengths)
  np.testing.assert_array_equal(out.mask, np.arange(12)[None] < np.array(lengths)[:, None])
  assert len(set(lengths)) > 3, lengths  # a real mix of ends
  _assert_logprobs_match_full_forward(
    model, params, out, ids, mask, temperature=1.0, top_k=0, top_p=1.0
  )


def test_filtered_samples_stay_in_the_filters_and_logprobs_equal_a_full_forward(policy):
  model, params = policy
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, BUCKETS)
  settings = dict(temperature=0.7, top_k=5, top_p=0.9)
  out = sampling.generate(
    model, params, ids, mask, jax.random.key(3), group_size=3, max_new_tokens=7,
    stop_ids=(1, 2, 3), pad_id=PAD, **settings,
  )  # fmt: skip
  _assert_logprobs_match_full_forward(model, params, out, ids, mask, **settings)


def test_stops_early_when_every_sequence_is_done(policy):
  model, params = policy
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, BUCKETS)
  everything = tuple(range(TINY_MODEL.vocab_size))  # the first token always stops
  out = sampling.generate(
    model, params, ids, mask, jax.random.key(1), max_new_tokens=9, stop_ids=everything
  )
  np.testing.assert_array_equal(out.lengths, 1)
  assert not out.truncated.any()
  assert (np.asarray(out.tokens)[:, 1:] == PAD).all()


def test_same_key_same_output_other_key_other_output(policy):
  model, params = policy
  first, again, other = (_sample(model, params, jax.random.key(k))[0] for k in (5, 5, 6))
  for a, b in zip(first, again, strict=True):
    np.testing.assert_array_equal(a, b)
  assert (np.asarray(first.tokens) != np.asarray(other.tokens)).mean() > 0.5
  assert (first.tokens[0] != first.tokens[1]).any()  # samples of one group differ


# ----------------------------------------------------------------------------- the token draw


TARGET = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])


def _draw_counts(logits_v, num_draws, *, temperature=1.0, top_k=0, top_p=1.0, vocab=None):
  """Token counts of `num_draws` draws from one row of logits (each row its own uniform)."""
  logits = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (num_draws, len(logits_v)))
  uniforms = jax.random.uniform(jax.random.key(0), (num_draws,))
  drawn = jax.jit(draw.draw, static_argnames=("top_k", "greedy"))(
    logits, uniforms, jnp.float32(temperature), jnp.float32(top_p), top_k=top_k, greedy=False
  )
  return np.bincount(np.asarray(drawn.token), minlength=len(logits_v))


def _assert_frequencies(counts, target_probs):
  """Chi-square goodness of fit at the 0.1% level (fixed seed, so the test is deterministic)."""
  support = target_probs > 0
  assert counts[~support].sum() == 0, "drew a token the filter should have removed"
  expected = target_probs[support] * counts.sum()
  _, p_value = stats.chisquare(counts[support], expected)
  assert p_value > 1e-3, (counts, expected)


@pytest.mark.parametrize(
  ("kwargs", "target"),
  [
    # Plain: the target itself.
    (dict(), TARGET),
    # Temperature 2: p^(1/2) renormalised.
    (dict(temperature=2.0), np.sqrt(TARGET) / np.sqrt(TARGET).sum()),
    # Top-k 3: [0.4, 0.25, 0.15] / 0.8 = [0.5, 0.3125, 0.1875].
    (dict(top_k=3), np.array([0.5, 0.3125, 0.1875, 0, 0, 0])),
    # Top-p 0.6: 0.4 < 0.6 so the second token is needed; 0.65 >= 0.6 so the third is not.
    (dict(top_p=0.6), np.array([0.4, 0.25, 0, 0, 0, 0]) / 0.65),
    # Top-k 4 then top-p 0.8 on the renormalised [0.4, 0.25, 0.15, 0.1] / 0.9: mass before the
    # third is 0.722 < 0.8, before the fourth 0.889 -> keep three.
    (dict(top_k=4, top_p=0.8), np.array([0.5, 0.3125, 0.1875, 0, 0, 0])),
  ],
  ids=["plain", "temperature", "top_k", "top_p", "top_k_top_p"],
)
def test_draw_matches_target_frequencies(kwargs, target):
  _assert_frequencies(_draw_counts(np.log(TARGET), 20_000, **kwargs), target)


def test_draw_over_many_vocabulary_blocks():
  # 1000 tokens = 4 blocks of 256 (the last one padded); mass on a few tokens across blocks,
  # the rest exactly zero (-inf logits) so any off-support draw is a bug.
  target = np.zeros(1000)
  target[[3, 255, 256, 511, 700, 999]] = [0.3, 0.1, 0.2, 0.05, 0.25, 0.1]
  with np.errstate(divide="ignore"):
    logits = np.log(target)
  _assert_frequencies(_draw_counts(logits, 20_000), target)


def test_inverse_cdf_draw_never_returns_a_zero_probability_token():
  # u at the edges: 0 picks the first nonzero token, u -> 1 the last nonzero one.
  probs = jnp.array([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
  u = jnp.array([0.0, 0.5, np.nextafter(np.float32(1), np.float32(0))])
  np.testing.assert_array_equal(draw.inverse_cdf_draw(probs, u), [2, 4, 4])


# ----------------------------------------------------------------------------- compiles, sharding


def test_compiles_once_per_bucket(policy):
  model, params = policy
  common = dict(group_size=2, max_new_tokens=2, stop_ids=(1,), pad_id=PAD)
  run = lambda prompts, **kw: sampling.generate(
    model, params, *sampling.pad_prompts(prompts, PAD, (4, 8)), jax.random.key(0), **common, **kw
  )
  run([[1, 2], [3, 4, 5]])
  before = sampling.compile_count()
  run([[7], [8, 9, 10, 11]])  # same bucket (4), other prompts
  run([[7, 7, 7], [6]], temperature=0.5, top_p=0.9)  # traced settings change
  assert sampling.compile_count() == before
  run([[1, 2, 3, 4, 5], [6]])  # prompt bucket 8
  assert sampling.compile_count() == before + 1


def test_sharded_over_eight_devices_equals_single_device(long_tailed):
  assert jax.device_count() == 8, "conftest forces 8 CPU devices"
  # 8 prompts x G = 4, temperature and top-p, stop tokens (the samples the compacting test reads).
  single, sharded = (
    long_tailed(compact=False, sharded=False),
    long_tailed(compact=False, sharded=True),
  )
  assert len(sharded.tokens.sharding.device_set) == 8
  assert sharded.tokens.addressable_shards[0].data.shape == (4, 16)  # 32 rows over 8 devices
  np.testing.assert_array_equal(sharded.tokens, single.tokens)
  np.testing.assert_array_equal(sharded.mask, single.mask)
  # The tokens are equal, the log-probs to SHARDED_ATOL: float32 sums split across devices.
  np.testing.assert_allclose(sharded.logprobs, single.logprobs, rtol=1e-5, atol=SHARDED_ATOL)


# ----------------------------------------------------------------------------- compacting


def test_stage_sizes_halve_down_to_the_minimum_in_multiples_of_the_shards():
  assert loop.stage_sizes(64, compact=False) == (64,)
  assert loop.stage_sizes(64, compact=True) == (64, 32, 16, 8)
  assert loop.stage_sizes(48, compact=True, shards=8) == (48, 24, 16, 8)
  assert loop.stage_sizes(96, compact=True, shards=32) == (96, 64, 32)
  assert loop.stage_sizes(12, compact=True) == (12,)  # 6 < 8 rows: one stage


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh"])
def test_compacting_decode_equals_the_plain_loop(long_tailed, sharded):
  plain = long_tailed(compact=False, sharded=sharded)
  compact = long_tailed(compact=True, sharded=sharded)
  # The last stage (8 rows) decodes something: the 9th longest row ends before the longest.
  lengths = np.sort(np.asarray(plain.lengths))[::-1]
  assert lengths[8] < lengths[0] and lengths[-1] < 5 and len(set(lengths)) > 5, lengths
  for name in SampleOutput._fields:
    if name == "logprobs" and sharded:  # the smaller batches' sums split otherwise over devices
      np.testing.assert_allclose(compact.logprobs, plain.logprobs, rtol=1e-5, atol=SHARDED_ATOL)
    else:  # one device: bit for bit, the same arithmetic per row in any batch
      np.testing.assert_array_equal(getattr(compact, name), getattr(plain, name), err_msg=name)
  if sharded:
    assert len(compact.tokens.sharding.device_set) == 8


def _collective_sizes(hlo: str) -> list[int]:
  """Element counts of the results of the program's cross-device collectives."""
  ops = r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|collective-permute)\("
  return [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(ops, hlo)]


@pytest.mark.parametrize("rolled", [False, True], ids=["unrolled", "rolled"])
def test_compacting_under_a_mesh_moves_no_row_between_devices(policy, rolled):
  """Each device compacts its own block of rows: no collective beyond the plain loop's. (A global
  gather moved cache rows, tokens and log-probs between devices.) Rolled, the rows move to the
  front of each device's block of the stacked cache."""
  model, params = policy  # replicated weights: the only collectives are the sampler's own
  model = Decoder(TINY_MODEL) if rolled else model
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  prompts = [PROMPTS[i % 3][: 1 + i % 5] for i in range(8)]
  ids, mask = sampling.pad_prompts(prompts, PAD, BUCKETS)
  # 16 rows: stages of 16 and 8 rows (2 and 1 a device), one compaction; more rows add stages of
  # the same code to compile.
  hlo = {
    compact: sampling.trace_generate(
      model, params, ids, mask, jax.random.key(0), jnp.float32(1), jnp.float32(1), group_size=2,
      max_new_tokens=16, stop_ids=(1,), mesh=mesh, compact=compact,
    ).lower().compile().as_text()
    for compact in (False, True)
  }  # fmt: skip
  assert max(_collective_sizes(hlo[True])) <= max(_collective_sizes(hlo[False]))
  assert "collective-permute(" not in hlo[True]


@pytest.mark.parametrize(
  ("compact", "stage_rows"), [(False, (32,)), (True, (32, 16, 8))], ids=["plain", "compacting"]
)
def test_decode_loop_updates_the_cache_in_place(long_tailed, policy, compact, stage_rows):
  model, params = policy
  # The long-tailed samplers on one device: the programs that the fixture compiled (its call
  # first, so that the HLO read is of the program the tests ran; the same compile).
  long_tailed(compact=compact, sharded=False)
  hlo = long_tailed_program(model, params, compact=compact).as_text()
  for rows in stage_rows:  # one decode loop per stage (`_while_body` finds it or fails)
    # Each carries one cache buffer per layer and k/v: [rows, kv heads, P + N - 1 slots, head
    # dim] = [rows, 2, 4 + 15, 8], and per-layer weights (q_proj [32, 4, 8], read as its 2-D
    # [32, 32] matmul operand) instead of the stack.
    shape = [str(rows), "2", "19", "8"]
    body = while_body(hlo, f"f32[{','.join(shape)}]")
    assert body.count(f"f32[{','.join(shape)}]") >= 2 * TINY_MODEL.num_layers
    assert "f32[32,32]" in body
    assert "f32[2,32,4,8]" not in body and "f32[2,32,32]" not in body
    # No instruction of the loop copies or transposes a whole cache buffer (any axis order) or
    # slices a weight out of a stack: every step works on the buffers in place.
    for name, dims, op in re.findall(r"(%[\w.\-]+) = f32\[([\d,]*)\]\S* (\w[\w-]*)\(", body):
      if sorted(dims.split(",")) == sorted(shape):
        assert op != "copy" and "copy" not in name and "transpose" not in name, (name, dims, op)
      assert "dynamic-slice" not in op and "dynamic_slice" not in name, (name, dims, op)


def test_non_finite_logits_are_flagged_and_never_give_an_out_of_vocabulary_token(policy):
  model, params = policy
  # NaN in the final norm's scale: every logit of every row is NaN. The draw's probabilities are
  # then NaN and the inverse-CDF search ran off into the padded vocabulary (ids up to 255 of 64).
  params = dict(params, norm=jax.tree.map(lambda x: x * jnp.nan, params["norm"]))
  out, _, _ = _sample(model, params, jax.random.key(2))
  assert out.nonfinite.shape == (len(PROMPTS) * 4,)
  assert np.asarray(out.nonfinite).all()
  assert (np.asarray(out.tokens) < TINY_MODEL.vocab_size).all()
  clean, _, _ = _sample(model, policy[1], jax.random.key(2))
  assert not np.asarray(clean.nonfinite).any()


def test_decode_params_sample_the_same_and_skip_the_per_call_weight_copy(policy):
  """Params converted once by `decode_params` give the same samples as the stacked params, and
  the call's program no longer slices the weights out of the stack (the copy per call)."""
  model, params = policy
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, BUCKETS)
  decoded = sampling.decode_params(params, model.config)
  assert sampling.is_decode_params(decoded) and not sampling.is_decode_params(params)
  assert sampling.decode_params(decoded, model.config) is decoded
  # test_stop_tokens_end_sequences_and_mask_the_rest's program: one compile of it for both tests.
  stacked_out, _, _ = _sample(model, params, jax.random.key(3), STOPS)
  decoded_out, _, _ = _sample(model, decoded, jax.random.key(3), STOPS)
  for a, b in zip(stacked_out, decoded_out, strict=True):
    np.testing.assert_array_equal(a, b)

  def weight_slices(p) -> int:  # slices of the [2, 32, 4, 8] q_proj stack into [1, 32, 4, 8]
    hlo = sampling.trace_generate(
      model, p, ids, mask, jax.random.key(0), jnp.float32(1), jnp.float32(1), group_size=2,
      max_new_tokens=6, stop_ids=(1,), pad_id=PAD,
    ).lower().as_text()  # fmt: skip
    return hlo.count("tensor<2x32x4x8xf32>) -> tensor<1x32x4x8xf32>")

  assert weight_slices(params) >= TINY_MODEL.num_layers  # the positive control: the copy is there
  assert weight_slices(decoded) == 0


def test_decode_params_keep_each_weights_sharding(policy):
  model, params = policy
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  placed = jax.device_put(params, sharding.logical_shardings(abstract["params"], mesh))
  decoded = sampling.decode_params(placed, model.config)
  stacked_q = placed["layers"]["self_attn"]["q_proj"]["kernel"]
  assert stacked_q.sharding.spec[1] is not None  # split over the mesh: the check below can fail
  for i in range(TINY_MODEL.num_layers):
    q = decoded[f"layers_{i}"]["self_attn"]["q_proj"]["kernel"]
    expected = NamedSharding(mesh, PartitionSpec(*stacked_q.sharding.spec[1:]))
    assert q.sharding.is_equivalent_to(expected, q.ndim), (q.sharding, expected)
  assert decoded["embed_tokens"].sharding == placed["embed_tokens"].sharding
