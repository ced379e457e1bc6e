"""The sampler's layouts: the rolled layer loop (`model.unroll_layers=False`: one layer body over
the stacked params and a stacked KV cache) against the unrolled one, and the rollout layout of the
weights (`sampling.decode_params`: replicated over the rows' axes, the compute dtype)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from ebpo_jax import sampling, sharding
from ebpo_jax.aot import collectives
from ebpo_jax.models import Decoder
from tests.helpers import sampler as sampler_helpers
from tests.helpers.configs import TINY_MODEL
from tests.helpers.sampler import BUCKETS, PAD, PROMPTS, SHARDED_ATOL, long_tailed_sample, on_mesh


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh"])
def test_the_rolled_layer_loop_samples_as_the_unrolled_one(policy, sharded):
  """`unroll_layers=False` decodes with one layer body over the stacked params and a stacked
  cache: the unrolled loop's tokens and log-probs, sampled and compacting (one device and a
  mesh), greedy and plain (one device)."""
  model, params = policy
  rolled = Decoder(TINY_MODEL)
  assert not rolled.config.unroll_layers and model.config.unroll_layers
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4}) if sharded else None
  if sharded:
    params = on_mesh(model, params, mesh)
  atol = SHARDED_ATOL if sharded else 1e-5
  ids, mask = sampling.pad_prompts([PROMPTS[i % 3] for i in range(8)], PAD, BUCKETS)
  greedy = dict(group_size=2, max_new_tokens=6, greedy=True, compact=False, pad_id=PAD, mesh=mesh)
  runs = [lambda m: long_tailed_sample(m, params, compact=True, mesh=mesh)]
  if not sharded:  # greedy and plain once: the mesh adds nothing to them
    runs.insert(0, lambda m: sampling.generate(m, params, ids, mask, jax.random.key(0), **greedy))
  for run in runs:
    want, got = run(model), run(rolled)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    # Sharded, the two programs split their float32 sums differently: SHARDED_ATOL's reason
    # (measured 3.2e-5 here; one device 1e-5 holds).
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=atol)
  assert len(set(np.asarray(want.lengths))) > 3  # the compacting stages decoded


def test_the_rolled_decode_loop_carries_the_stacked_cache_in_place(policy):
  """The decode loops carry one `[L, R, Hkv, S, D]` stack of keys and one of values; each layer
  writes its new slot into the stack (a dynamic-update-slice, in place in a loop), nothing copies
  a whole stack (the XLA path may slice out the layer it reads; the kernel does not), and the
  compacting stages keep the first stage's stack (no smaller copy beside it: 1.5x the cache)."""
  _, params = policy
  # The rolled compacting sampler of test_the_rolled_layer_loop_samples_as_the_unrolled_one (one
  # compile for both): stages of 32, 16 and 8 rows.
  hlo = sampler_helpers.long_tailed_program(Decoder(TINY_MODEL), params, compact=True).as_text()
  stack = "f32[2,32,2,19,8]"  # L = 2, 32 rows, 2 kv heads, P + N - 1 = 4 + 15 slots, D = 8
  loops = [line for line in hlo.splitlines() if " while(" in line and stack in line]
  assert len(loops) >= 3  # every stage carries it
  assert sampler_helpers.while_body(hlo, stack).count(stack) >= 2
  assert "f32[2,16,2,19,8]" not in hlo  # the second stage's 16 rows: no stack of them
  ops = re.findall(r"(%[\w.\-]+) = f32\[([\d,]*)\]\S* (\w[\w-]*)\(", hlo)
  on_stack = [(name, op) for name, dims, op in ops if dims == "2,32,2,19,8"]
  assert "dynamic-update-slice" in {op for _, op in on_stack}, on_stack
  for name, op in on_stack:
    assert op != "copy" and "copy" not in name and "transpose" not in name, (name, op)


def test_the_rolled_samplers_decode_params_stay_stacked(policy):
  """For the rolled loop `decode_params` keeps the stack (cast, and replicated over the rows'
  axes), and `generate` refuses per-layer params, which that loop cannot read."""
  model, params = policy
  rolled = Decoder(TINY_MODEL)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  placed = on_mesh(model, params, mesh)
  converted = sampling.decode_params(
    placed, rolled.config, dtype="bfloat16", replicate_over=sharding.ROW_AXES
  )
  after = converted["layers"]["mlp"]["gate_proj"]["kernel"]  # [L, embed, mlp (tensor)]
  assert after.sharding.spec == PartitionSpec(None, None, "tensor") and after.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    after, placed["layers"]["mlp"]["gate_proj"]["kernel"].astype(after.dtype)
  )
  ids, mask = sampling.pad_prompts(PROMPTS, PAD, BUCKETS)
  per_layer = sampling.decode_params(params, model.config)
  with pytest.raises(
    ValueError, match="per-layer params given for a model with unroll_layers=False"
  ):
    sampling.generate(rolled, per_layer, ids, mask, jax.random.key(0), max_new_tokens=2)


# ----------------------------------------------------------------------------- the rollout layout


def test_decode_params_replicate_weights_over_the_row_axes_in_the_compute_dtype(policy):
  model, params = policy
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  placed = on_mesh(model, params, mesh)
  converted = sampling.decode_params(
    placed, model.config, dtype="bfloat16", replicate_over=sharding.ROW_AXES
  )
  assert sampling.is_decode_params(converted) and not sampling.is_decode_params(placed)
  before = placed["layers"]["mlp"]["gate_proj"]["kernel"]  # [L, embed (fsdp), mlp (tensor)]
  after = converted["layers_1"]["mlp"]["gate_proj"]["kernel"]
  assert before.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
  assert after.sharding.spec == PartitionSpec(None, "tensor") and after.dtype == jnp.bfloat16
  np.testing.assert_array_equal(after, before[1].astype(jnp.bfloat16))
  for leaf in jax.tree.leaves(converted):  # no weight is split over a row axis
    assert not {"data", "fsdp"} & set(jax.tree.leaves(tuple(leaf.sharding.spec)))
  assert sampling.decode_params(converted, model.config) is converted  # converted once per round


def test_sampling_from_the_rollout_layout_equals_the_training_layout(policy):
  model, params = policy
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  placed = on_mesh(model, params, mesh)
  converted = sampling.decode_params(placed, model.config, replicate_over=sharding.ROW_AXES)
  # One decode loop (compacting off): the weights' layout is the point; compacting on a mesh is
  # test_compacting_decode_equals_the_plain_loop's.
  trained = long_tailed_sample(model, placed, compact=False, mesh=mesh)
  rollout = long_tailed_sample(model, converted, compact=False, mesh=mesh)
  np.testing.assert_array_equal(rollout.tokens, trained.tokens)
  # Other float32 sums split over other devices: SHARDED_ATOL's reason.
  np.testing.assert_allclose(rollout.logprobs, trained.logprobs, rtol=1e-5, atol=SHARDED_ATOL)


def test_a_decode_step_traced_alone_sends_what_the_decode_loop_sends(policy):
  """`trace_parts`' step is what aot costs a call by: its collectives are those of one trip of the
  whole program's decode loop (compacting off: one loop)."""
  model, params = policy
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  placed = on_mesh(model, params, mesh)
  converted = sampling.decode_params(placed, model.config, replicate_over=sharding.ROW_AXES)
  ids, mask = sampling.pad_prompts([PROMPTS[i % 3] for i in range(8)], PAD, BUCKETS)
  spec = sharding.row_sharding(ids.shape, mesh)
  args = (converted, jax.device_put(ids, spec), jax.device_put(mask, spec), jax.random.key(1))
  args += (jnp.float32(0.9), jnp.float32(0.95))
  options = dict(group_size=2, max_new_tokens=8, stop_ids=(1,), mesh=mesh, compact=False)
  whole = sampling.trace_generate(model, *args, **options).lower().compile().as_text()
  (loop,) = collectives.outer_loop_collectives(whole, 8)
  _, step = sampling.trace_parts(model, *args, **options)
  assert collectives.collectives(step.lower().compile().as_text(), 8) == loop
  assert loop["all-reduce"]["count"] > 0  # the 'tensor' shards' partial sums
