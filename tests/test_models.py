"""Decoder numerics: KV-cache decode equals a full forward; padding, remat, dtypes, config I/O."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax.models import Decoder, ModelConfig, init_cache

TINY = ModelConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope_theta=500.0,
  rms_norm_eps=1e-5,
)


def _init(config: ModelConfig, seed: int = 0):
  model = Decoder(config)
  ids = jnp.zeros((1, 4), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(seed), ids)["params"]
  return model, nn.meta.unbox(params)


def _left_padded_batch(rng: np.random.Generator, lengths: list[int], width: int, vocab: int):
  ids = rng.integers(0, vocab, (len(lengths), width)).astype(np.int32)
  mask = np.arange(width)[None] >= (width - np.array(lengths))[:, None]
  ids = np.where(mask, ids, 0)
  return jnp.asarray(ids), jnp.asarray(mask)


def _positions(mask):
  return jnp.maximum(jnp.cumsum(mask, -1) - 1, 0).astype(jnp.int32)


@pytest.mark.parametrize(
  "config",
  [
    TINY,
    dataclasses.replace(TINY, qk_norm=True, attention_bias=True, tie_word_embeddings=True),
  ],
  ids=["llama", "bias_qknorm_tied"],
)
def test_cached_prefill_and_decode_equal_full_forward(config):
  model, params = _init(config)
  rng = np.random.default_rng(0)
  prompt_len, decode_steps = 6, 5
  ids, mask = _left_padded_batch(rng, [6, 3, 1], prompt_len + decode_steps, config.vocab_size)
  # The batch is left-padded over the prompt part only; decode tokens are all real.
  prompt_mask = mask.at[:, prompt_len:].set(True)
  ids = jnp.where(prompt_mask, ids, 0)
  positions = _positions(prompt_mask)
  full = model.apply({"params": params}, ids, positions, prompt_mask)

  apply = jax.jit(model.apply)
  cache = init_cache(config, batch_size=3, max_len=16)
  p = slice(0, prompt_len)
  logits, cache = apply({"params": params}, ids[:, p], positions[:, p], prompt_mask[:, p], cache)
  steps = [logits]
  for t in range(prompt_len, prompt_len + decode_steps):
    s = slice(t, t + 1)
    logits, cache = apply({"params": params}, ids[:, s], positions[:, s], prompt_mask[:, s], cache)
    steps.append(logits)
  cached = jnp.concatenate(steps, axis=1)
  assert int(cache.index) == prompt_len + decode_steps
  np.testing.assert_array_equal(np.asarray(cache.mask[:, : prompt_len + decode_steps]), prompt_mask)
  real = np.asarray(prompt_mask)
  np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(full)[real], rtol=1e-5, atol=1e-5)
  assert cached.dtype == jnp.float32


def test_left_padding_does_not_change_real_token_logits():
  model, params = _init(TINY)
  rng = np.random.default_rng(1)
  ids = jnp.asarray(rng.integers(0, TINY.vocab_size, (1, 5)), jnp.int32)
  alone = model.apply({"params": params}, ids)
  padded_ids = jnp.concatenate([jnp.full((1, 3), 7, jnp.int32), ids], axis=1)
  mask = jnp.arange(8)[None] >= 3
  padded = model.apply({"params": params}, padded_ids, _positions(mask), mask)
  np.testing.assert_allclose(np.asarray(padded[:, 3:]), np.asarray(alone), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(padded)).all()
