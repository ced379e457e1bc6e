"""Multi-turn decoding: continuing from the KV cache gives the log-probs of one prefill of the whole
transcript; rows not live draw nothing; budgets cut turns."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import sampling, sharding
from ebpo_jax.models import Decoder
from ebpo_jax.sampling import sequences, turns
from tests.helpers.configs import TINY_MODEL

PROMPTS = [[5, 9, 2, 7, 11, 3], [8]]
G, N, PAD = 2, 5, 0
STOPS = (1, 2, 3, 4, 5, 6)  # frequent stops: turns of different lengths


@pytest.fixture(scope="module")
def policy():
  model = Decoder(TINY_MODEL)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  return model, nn.meta.unbox(params)  # the init's scale: near-uniform draws, stops now and then


def _turn(model, params, state, new_ids, live, budget, key, mesh=None, row_ids=None):
  new_ids = np.asarray(new_ids, np.int32)
  return turns.turn(
    params, state, new_ids, new_ids > 0, np.asarray(live), np.asarray(budget, np.int32),
    jax.random.key(key), jnp.float32(1.0), jnp.float32(1.0), row_ids, model=model,
    max_new_tokens=N, greedy=False, top_k=0, stop_ids=STOPS, pad_id=PAD, mesh=mesh,
  )  # fmt: skip


def _two_turns(policy, mesh=None, keep=None):
  """Two turns of every row; with `keep`, the second of those rows only (`turns.compact`
  between the turns)."""
  model, params = policy
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, (6,))
  slots = turns.cache_slots(6, max_turns=2, chunk_width=4, max_new_tokens=N)
  dparams = sampling.decode_params(params, model.config)
  if mesh is not None:  # the weights replicated, the rows' arrays placed by jit
    dparams = jax.device_put(dparams, sharding.replicated(mesh))
  state = turns.start(dparams, ids, mask, model=model, group_size=G, slots=slots, mesh=mesh)
  rows = len(PROMPTS) * G
  first_inputs = (np.zeros((rows, 3)), [True] * rows, [9] * rows, 1, mesh)
  state, first = _turn(model, dparams, state, *first_inputs)
  observations = [[20, 21, 22], [23, 0, 0], [0, 0, 0], [24, 25, 0]]
  live, budget = [True, True, True, False], [9, 9, 2, 9]
  if keep is None:
    state, second = _turn(model, dparams, state, observations, live, budget, 2, mesh)
  else:
    state = turns.compact(state, jnp.asarray(keep, jnp.int32))
    kept = [[x[r] for r in keep] for x in (observations, live, budget)]
    state, second = _turn(model, dparams, state, *kept, 2, mesh, jnp.asarray(keep, jnp.int32))
  return (ids, mask), first, observations, live, second


def test_continuing_from_the_cache_equals_one_prefill_of_the_transcript(policy):
  model, params = policy
  (ids, mask), first, observations, live, second = _two_turns(policy)
  width = 2 * N + 3
  tokens = np.zeros((len(live), width), np.int32)
  model_tokens = np.zeros((len(live), width), bool)
  logps = np.zeros((len(live), width), np.float32)
  for r in range(len(live)):
    parts = [(first, True)] + ([(observations[r], False), (second, True)] if live[r] else [])
    n = 0
    for part, is_model in parts:
      if is_model:
        k = int(part.lengths[r])
        tokens[r, n : n + k] = np.asarray(part.tokens)[r, :k]
        logps[r, n : n + k] = np.asarray(part.logprobs)[r, :k]
      else:
        k = sum(t > 0 for t in part)
        tokens[r, n : n + k] = part[:k]
      model_tokens[r, n : n + k] = is_model
      n += k
  real = np.cumsum(tokens[:, ::-1] > 0, axis=1)[:, ::-1] > 0  # up to the last token
  real |= model_tokens
  seqs = sequences.build_sequences(ids, mask, tokens, real, G)
  logits = model.apply({"params": params}, seqs["input_ids"], seqs["positions"],
                       seqs["attention_mask"])  # fmt: skip
  full = jax.nn.log_softmax(logits[:, 6 - 1 : -1], axis=-1)
  full = np.take_along_axis(np.asarray(full), tokens[..., None], axis=-1)[..., 0]
  assert model_tokens.sum() > 6 and (~model_tokens & real).sum() == 4  # both kinds were there
  np.testing.assert_allclose(full[model_tokens], logps[model_tokens], atol=1e-5, rtol=0)


def test_a_row_not_live_draws_nothing_and_a_budget_cuts_its_turn(policy):
  _, first, _, live, second = _two_turns(policy)
  lengths = np.asarray(second.lengths)
  assert lengths[3] == 0 and not live[3]
  assert (np.asarray(second.tokens)[3] == PAD).all()
  assert 1 <= lengths[2] <= 2  # budget 2
  assert (np.asarray(first.lengths) >= 1).all()
  stopped = np.asarray(first.stopped)
  ends = np.asarray(first.tokens)[np.arange(4), np.asarray(first.lengths) - 1]
  np.testing.assert_array_equal(stopped, np.isin(ends, STOPS))


def _one_turn(policy, *, stop_ids, stop_seqs=(), width=12):
  model, params = policy
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, (6,))
  slots = turns.cache_slots(6, max_turns=1, chunk_width=1, max_new_tokens=width)
  dparams = sampling.decode_params(params, model.config)
  state = turns.start(dparams, ids, mask, model=model, group_size=G, slots=slots)
  rows = len(PROMPTS) * G
  _, out = turns.turn(
    dparams, state, np.zeros((rows, 0), np.int32), np.zeros((rows, 0), bool),
    np.ones(rows, bool), np.full(rows, width, np.int32), jax.random.key(3), jnp.float32(1.0),
    jnp.float32(1.0), model=model, max_new_tokens=width, greedy=False, top_k=0,
    stop_ids=stop_ids, stop_seqs=stop_seqs, pad_id=PAD,
  )  # fmt: skip
  return jax.tree.map(np.asarray, out)


def test_a_stop_sequence_of_several_tokens_ends_the_turn_right_after_it(policy):
  # A tool-call close tag that the tokenizer splits into several tokens (SmolLM2: "</tool_call>"
  # is 5) must end the turn as a stop token does. Rows draw by (key, step, row) alone, so the turn
  # with the stop sequence is the turn without it, cut right after the sequence's first end.
  free = _one_turn(policy, stop_ids=(PAD,))
  seq = tuple(int(t) for t in free.tokens[0, 2:5])  # row 0 draws it at steps 2-4
  cut = _one_turn(policy, stop_ids=(PAD,), stop_seqs=(seq,))
  for r in range(len(PROMPTS) * G):
    drawn = free.tokens[r, : free.lengths[r]].tolist()
    ends = [i + 3 for i in range(len(drawn) - 2) if tuple(drawn[i : i + 3]) == seq]
    n = ends[0] if ends else len(drawn)
    assert cut.lengths[r] == n and cut.stopped[r] == (bool(ends) or bool(free.stopped[r]))
    np.testing.assert_array_equal(cut.tokens[r, :n], drawn[:n])
    np.testing.assert_allclose(cut.logprobs[r, :n], free.logprobs[r, :n], atol=1e-6)
    assert (cut.tokens[r, n:] == PAD).all()
  assert cut.lengths[0] == 5 and cut.stopped[0] and not free.stopped[0]


def test_turns_of_the_rolled_layer_loop_equal_the_unrolled_ones(policy):
  """TINY_MODEL's rolled loop (stacked params and cache) against the unrolled one (per layer):
  the same turns, the second continuing from the first's cache after a compaction."""
  model, params = policy
  unrolled = Decoder(dataclasses.replace(TINY_MODEL, unroll_layers=True))
  assert not model.config.unroll_layers
  want, got = _two_turns((unrolled, params), keep=[0, 1, 3]), _two_turns(policy, keep=[0, 1, 3])
  for w, g in ((want[1], got[1]), (want[4], got[4])):
    np.testing.assert_array_equal(g.tokens, w.tokens)
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
  assert int(np.asarray(want[4].lengths).sum()) > 3  # the second turn decoded


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "per_shard"])
def test_decoding_turns_with_the_decode_kernel_equals_xla(policy, sharded):
  """The decode kernel (splash, interpreted) over a cache with holes: the observations' padding
  and the slots of rows that fed fewer tokens stay invalid (`KVCache.mask`). Under a mesh the
  kernels run per shard: rows over data x fsdp, kv heads over tensor (without the mesh context a
  Mosaic kernel is not partitioned)."""
  model, params = policy
  kernel = Decoder(dataclasses.replace(TINY_MODEL, attention="splash", attention_emulate=True))
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
  want, got = _two_turns(policy), _two_turns((kernel, params), mesh)
  for w, g in ((want[1], got[1]), (want[4], got[4])):
    np.testing.assert_array_equal(g.tokens, w.tokens)
    np.testing.assert_array_equal(g.lengths, w.lengths)
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)
  assert int(np.asarray(want[4].lengths).sum()) > 4  # the second turn decoded after the holes
  if sharded:  # the decode kernel ran per shard: the traced turn holds it inside shard_map
    ids, mask = sampling.pad_prompts(PROMPTS, PAD, (6,))
    dparams = sampling.decode_params(params, model.config)
    state = turns.start(dparams, ids, mask, model=kernel, group_size=G, slots=20)
    rows, no_ids = len(PROMPTS) * G, np.zeros((len(PROMPTS) * G, 1), np.int32)
    traced = turns.turn.trace(
      dparams, state, no_ids, no_ids > 0, np.ones(rows, bool), np.full(rows, 3, np.int32),
      jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0), model=kernel, max_new_tokens=3,
      greedy=False, top_k=0, stop_ids=STOPS, pad_id=PAD, mesh=mesh,
    )  # fmt: skip
    assert "shard_map" in str(traced.jaxpr)
