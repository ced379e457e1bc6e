"""Decoder numerics: KV-cache decode equals a full forward; padding, remat, dtypes, config I/O."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax.models import Decoder, ModelConfig, init_cache
from ebpo_jax.models.decoder import stack_layers, unstack_layers
from tests.helpers.configs import TINY_MODEL
from tests.helpers.decoding import prefill_then_decode

TINY = dataclasses.replace(TINY_MODEL, rope_theta=500.0, rms_norm_eps=1e-5)


@functools.cache  # one init program per config and seed in a process; tests only read params
def _init(config: ModelConfig, seed: int = 0):
  model = Decoder(config)
  ids = jnp.zeros((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(seed), ids)["params"]
  return model, nn.meta.unbox(params)


@functools.cache  # one per config in a process: its tests share the compiled per-layer programs
def _per_layer(config: ModelConfig):
  """(the decoder that takes a KV cache: `scan_layers=False`, its jitted apply, `_init(config)`'s
  params unstacked)."""
  model, params = _init(config)
  decoder = model.clone(scan_layers=False)
  return decoder, jax.jit(decoder.apply), unstack_layers(params)


def _positions(mask: np.ndarray) -> np.ndarray:
  return np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)


@pytest.mark.parametrize(
  "config",
  [
    TINY,
    dataclasses.replace(TINY, architecture="qwen2", tie_word_embeddings=True),
    dataclasses.replace(TINY, architecture="qwen3"),
  ],
  ids=["llama", "qwen2_bias_tied", "qwen3_qknorm"],
)
def test_cached_prefill_and_decode_equal_full_forward(config):
  model, params = _init(config)
  prompt_len, decode_steps = 6, 5
  width = prompt_len + decode_steps
  # Prompts of 6, 3 and 1 real tokens, left-padded to 6; the decoded tokens are all real.
  lengths = np.array([6, 3, 1])
  mask = np.arange(width)[None] >= (prompt_len - lengths)[:, None]
  ids = np.where(mask, np.random.default_rng(0).integers(0, config.vocab_size, (3, width)), 0)
  ids, positions = ids.astype(np.int32), _positions(mask)
  full = jax.jit(model.apply)({"params": params}, ids, positions, mask)

  _, apply, layer_params = _per_layer(config)
  cache = init_cache(config, batch_size=3, max_len=16)
  cached, cache = prefill_then_decode(
    apply, layer_params, ids, positions, mask, cache, prefill=prompt_len, end=width
  )
  assert int(cache.index) == width
  np.testing.assert_array_equal(np.asarray(cache.mask)[:, :width], mask)
  assert not np.asarray(cache.mask)[:, width:].any()
  np.testing.assert_allclose(cached[mask], np.asarray(full)[mask], rtol=1e-5, atol=1e-5)
  assert cached.dtype == np.float32


# 3 layers (a middle one), Qwen3's q/k norm, each layer rematerialised as the paper configs run
# them (remat recomputes the forward in the backward pass only: the forward's values are as
# without). One config for the two tests below: they share its params and per-layer decode.
QWEN3_3 = dataclasses.replace(TINY, architecture="qwen3", num_layers=3, remat="full")


def test_per_layer_decode_equals_scanned_full_forward():
  config = QWEN3_3
  model, params = _init(config)
  unscanned, apply, layer_params = _per_layer(config)
  fresh = jax.eval_shape(unscanned.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  assert jax.tree.structure(nn.meta.unbox(fresh["params"])) == jax.tree.structure(layer_params)
  np.testing.assert_array_equal(layer_params["layers_2"]["mlp"]["up_proj"]["kernel"],
                                params["layers"]["mlp"]["up_proj"]["kernel"][2])  # fmt: skip
  jax.tree.map(np.testing.assert_array_equal, stack_layers(layer_params), params)
  # Two left-padded rows (5 and 2 real prompt tokens), then 3 decoded tokens each.
  mask = np.arange(8)[None] >= np.array([[0], [3]])
  ids = np.random.default_rng(3).integers(0, config.vocab_size, (2, 8)).astype(np.int32)
  ids, positions = np.where(mask, ids, 0), _positions(mask)
  full = jax.jit(model.apply)({"params": params}, ids, positions, mask)
  full_unscanned = apply({"params": layer_params}, ids, positions, mask)
  np.testing.assert_allclose(full_unscanned[mask], full[mask], rtol=1e-5, atol=1e-5)

  # Prefill then one token at a time, as the sampler (float32: equal to the scanned forward).
  cache = init_cache(config, batch_size=2, max_len=10)
  assert len(cache.k) == 3 and cache.k[0].shape == (2, 2, 10, 8)  # L x [B, Hkv, S, D]
  cached, cache = prefill_then_decode(
    apply, layer_params, ids, positions, mask, cache, prefill=5, end=8
  )
  assert cached.dtype == np.float32
  np.testing.assert_allclose(cached[mask], np.asarray(full)[mask], rtol=1e-5, atol=1e-5)
  assert int(cache.index) == 8 and not np.asarray(cache.mask)[:, 8:].any()
  assert np.abs(np.asarray(cache.k[1])[:, :, 8:]).max() == 0  # nothing written past the index


def test_rolled_decode_over_a_stacked_cache_equals_the_per_layer_decode():
  """The scanned decoder over a stacked cache (the rolled layer loop) gives the per-layer
  decoder's logits and cache, and writes nothing past the index (layers rematerialised, as the
  paper configs run them)."""
  config = QWEN3_3
  model, params = _init(config)
  _, apply, layer_params = _per_layer(config)
  mask = np.arange(8)[None] >= np.array([[0], [3]])
  ids = np.random.default_rng(4).integers(0, config.vocab_size, (2, 8)).astype(np.int32)
  ids, positions = np.where(mask, ids, 0), _positions(mask)
  run = functools.partial(prefill_then_decode, ids=ids, positions=positions, mask=mask,
                          prefill=5, end=8)  # fmt: skip
  stacked = init_cache(config, batch_size=2, max_len=10, stacked=True)
  assert stacked.stacked and stacked.k.shape == (3, 2, 2, 10, 8)  # [L, B, Hkv, S, D]
  rolled, rolled_cache = run(jax.jit(model.apply), params, cache=stacked)
  per_layer, cache = run(apply, layer_params, cache=init_cache(config, 2, 10))
  np.testing.assert_allclose(rolled[mask], per_layer[mask], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rolled_cache.k, np.stack(cache.k), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(rolled_cache.v, np.stack(cache.v), rtol=1e-5, atol=1e-6)
  assert int(rolled_cache.index) == 8 and np.abs(np.asarray(rolled_cache.k)[..., 8:, :]).max() == 0


def test_decoder_rejects_a_cache_of_the_other_layout():
  model, params = _init(TINY)
  ids = jnp.ones((2, 3), jnp.int32)
  with pytest.raises(ValueError, match=r"per-layer KV cache given to Decoder\(scan_layers=True\)"):
    model.apply({"params": params}, ids, cache=init_cache(TINY, batch_size=2, max_len=8))
  stacked = init_cache(TINY, batch_size=2, max_len=8, stacked=True)
  unscanned, _, layer_params = _per_layer(TINY)
  with pytest.raises(ValueError, match=r"stacked KV cache given to Decoder\(scan_layers=False\)"):
    unscanned.apply({"params": layer_params}, ids, cache=stacked)


def test_left_padding_does_not_change_real_token_logits():
  model, params = _init(TINY)
  rng = np.random.default_rng(1)
  ids = rng.integers(0, TINY.vocab_size, (1, 5)).astype(np.int32)
  alone = jax.jit(model.apply)({"params": params}, ids)
  padded_ids = np.concatenate([np.full((1, 3), 7, np.int32), ids], axis=1)
  mask = np.arange(8)[None] >= 3
  padded = jax.jit(model.apply)({"params": params}, padded_ids, _positions(mask), mask)
  np.testing.assert_allclose(np.asarray(padded[:, 3:]), np.asarray(alone), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(padded)).all()


def _layer_loop_loss(config: ModelConfig):
  """(loss of `config`'s decoder on TINY's params and fixed ids, those params)."""
  model, params = _init(TINY)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 7)), jnp.int32)
  module = model.clone(config=config)
  return lambda p: jnp.mean(jax.nn.log_softmax(module.apply({"params": p}, ids))[..., 0]), params


@functools.cache  # the baseline the three layer-loop variants share (one compile per process)
def _layer_loop_value_and_grad(config: ModelConfig):
  loss, params = _layer_loop_loss(config)
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
  "change, in_hlo",
  [
    ({"remat": "full"}, lambda hlo: "while" in hlo),  # remat keeps the rolled loop
    ({"remat": "dots"}, lambda hlo: "while" in hlo),
    ({"unroll_layers": True}, lambda hlo: "while" not in hlo),  # no layer loop left
  ],
  ids=["remat_full", "remat_dots", "unrolled"],
)
def test_layer_loop_variants_keep_loss_and_grads(change, in_hlo):
  value, grads = _layer_loop_value_and_grad(TINY)  # the plain rolled loop: computed once
  loss, params = _layer_loop_loss(dataclasses.replace(TINY, **change))
  fn = jax.jit(jax.value_and_grad(loss))
  new_value, new_grads = fn(params)
  jaxpr, hlo = str(jax.make_jaxpr(loss)(params)), fn.lower(params).as_text()
  assert ("remat" in jaxpr) == ("remat" in change) and in_hlo(hlo)
  np.testing.assert_allclose(new_value, value, rtol=1e-6)
  check = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  jax.tree.map(check, new_grads, grads)


def test_logits_slice_equals_the_slice_of_all_logits():
  # Tied embeddings (the LM head is the embedding's transpose): test_cached_prefill's Qwen2
  # config, whose params are built already.
  model, params = _init(dataclasses.replace(TINY, architecture="qwen2", tie_word_embeddings=True))
  ids = jnp.asarray(np.random.default_rng(4).integers(0, TINY.vocab_size, (2, 9)), jnp.int32)
  apply = jax.jit(model.apply, static_argnames="logits_slice")  # eagerly: about 4x the time
  full = apply({"params": params}, ids)
  part = apply({"params": params}, ids, logits_slice=(3, 8))
  assert part.shape == (2, 5, TINY.vocab_size)
  np.testing.assert_allclose(part, full[:, 3:8], rtol=1e-6, atol=1e-6)


def test_every_param_has_logical_axes():
  leaves = []
  for arch in ("qwen2", "qwen3"):
    config = dataclasses.replace(TINY, architecture=arch)
    boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    leaves += jax.tree.leaves(boxed["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(isinstance(leaf, nn.Partitioned) for leaf in leaves)
  allowed = {"layers", "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim"}
  for leaf in leaves:
    assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= allowed
  q = boxed["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
  assert q.names == ("layers", "embed", "heads", "head_dim") and q.value.shape == (2, 32, 4, 8)


def test_from_hf_reads_old_rope_keys_and_defaults():
  hf = {
    "model_type": "llama",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "rope_theta": 5e5,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
  }  # fmt: skip
  config = ModelConfig.from_hf(hf, remat="full")
  assert (config.num_kv_heads, config.head_dim, config.rope_theta, config.remat) == (
    2,
    4,
    5e5,
    "full",
  )
  assert dict(config.rope_scaling)["rope_type"] == "llama3" and "type" not in dict(
    config.rope_scaling
  )
  assert hash(config) == hash(ModelConfig.from_hf(hf, remat="full"))
  assert ModelConfig.from_hf(config.to_hf(), remat="full") == config


def test_architecture_sets_its_flags():
  """Qwen2's q/k/v bias and Qwen3's q/k norm follow the architecture (one place says so)."""
  configs = {a: dataclasses.replace(TINY, architecture=a) for a in ("llama", "qwen2", "qwen3")}
  flags = {a: (c.attention_bias, c.qk_norm) for a, c in configs.items()}
  assert flags == {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


@pytest.mark.parametrize(
  "change, message",
  [
    ({"remat": "some"}, "remat='some'"),
    ({"num_kv_heads": 3}, "not a multiple"),
    ({"dtype": "float17"}, "float17"),
    ({"rope_scaling": (("rope_type", "yarn"),)}, "yarn"),
    ({"architecture": "gpt2"}, "architecture='gpt2'"),
  ],
)
def test_config_rejects_bad_values(change, message):
  with pytest.raises((ValueError, TypeError), match=message):
    dataclasses.replace(TINY, **change)


def test_unsupported_hf_configs_are_rejected():
  with pytest.raises(ValueError, match="model_type='gpt2'"):
    ModelConfig.from_hf({"model_type": "gpt2"})
  with pytest.raises(ValueError, match="use_sliding_window=True"):
    ModelConfig.from_hf({"model_type": "qwen2", "use_sliding_window": True})
  with pytest.raises(ValueError, match="attention_bias=True is not supported for 'llama'"):
    ModelConfig.from_hf({"model_type": "llama", "attention_bias": True})


def test_bfloat16_cache_and_compute():
  config = dataclasses.replace(TINY, dtype="bfloat16", param_dtype="bfloat16")
  model, params = _init(config)
  _, apply, layer_params = _per_layer(config)
  cache = init_cache(config, batch_size=2, max_len=8)
  assert len(cache.k) == 2 and cache.k[0].shape == (2, 2, 8, 8)
  assert all(x.dtype == jnp.bfloat16 for x in cache.k + cache.v)
  ids = jnp.ones((2, 3), jnp.int32)
  logits, cache = apply({"params": layer_params}, ids, cache=cache)
  assert logits.dtype == jnp.float32 and int(cache.index) == 3
  assert all(x.dtype == jnp.bfloat16 for x in cache.k + cache.v)
  full = jax.jit(model.apply)({"params": params}, jnp.ones((2, 3), jnp.int32))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(full), rtol=0.05, atol=0.05)
