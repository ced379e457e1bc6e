"""LoRA adapters (models.lora): a fresh adapter is the base; off is the base; both decoder paths
agree with trained adapters; adapters are float32 with logical axes on their big dim."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax.models import Decoder, init_cache, lora
from ebpo_jax.models.decoder import unstack_layers
from tests.helpers.decoding import prefill_then_decode
from tests.helpers.lora import trained_lora
from tests.helpers.tiny_decoder import BASE, init_params

LORA = dataclasses.replace(BASE, lora_rank=4, lora_alpha=8.0)


def _params(config, seed=0):
  return init_params(config, seed)


def _inputs():
  mask = np.arange(8)[None] >= np.array([[0], [3]])
  ids = np.random.default_rng(3).integers(0, 64, (2, 8)).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
  return np.where(mask, ids, 0), positions, mask


@pytest.mark.parametrize("targets", [lora.TARGETS, ("v", "o", "down")], ids=["all", "v_o_down"])
def test_fresh_adapters_and_adapters_off_equal_the_base_on_both_paths(targets):
  config = dataclasses.replace(LORA, lora_targets=targets)
  params = _params(config)
  adapters, base = lora.split(params)
  assert jax.tree.structure(lora.combine(adapters, base)) == jax.tree.structure(params)
  base_structure = jax.tree.structure(jax.eval_shape(lambda: _params(BASE)))  # traced, not compiled
  assert not lora.split(base)[0] and jax.tree.structure(base) == base_structure
  adapted = sum(1 for p, _ in jax.tree_util.tree_flatten_with_path(params)[0] if lora.is_adapter(p))
  assert adapted == 2 * len(targets)
  ids, positions, mask = _inputs()
  want = jax.jit(Decoder(BASE).apply)({"params": base}, ids, positions, mask)
  # Both decoder paths with every target; a subset of targets is the same code: scanned only.
  for scan in (True, False) if targets == lora.TARGETS else (True,):
    model = Decoder(config, scan_layers=scan)
    p = params if scan else jax.jit(unstack_layers)(params)  # one program, not one per leaf
    apply, base_apply = jax.jit(model.apply), jax.jit(lora.base_model(model).apply)
    np.testing.assert_array_equal(apply({"params": p}, ids, positions, mask), want)
    trained = trained_lora(p)
    changed = apply({"params": trained}, ids, positions, mask)
    assert np.abs(np.asarray(changed - want)).max() > 1e-3  # the adapters do act
    off = base_apply({"params": lora.split(trained)[1]}, ids, positions, mask)
    np.testing.assert_array_equal(off, want)
    merged_params = jax.jit(lora.merge, static_argnums=1)(trained, config)
    merged = base_apply({"params": merged_params}, ids, positions, mask)
    np.testing.assert_allclose(merged, changed, rtol=1e-5, atol=1e-5)


def test_trained_adapters_scanned_equals_cached_prefill_and_decode():
  config = dataclasses.replace(LORA, architecture="qwen2")
  params = trained_lora(_params(config))
  ids, positions, mask = _inputs()
  full = jax.jit(Decoder(config).apply)({"params": params}, ids, positions, mask)
  apply = jax.jit(Decoder(config, scan_layers=False).apply)
  layer_params = jax.jit(unstack_layers)(params)
  cache = init_cache(config, batch_size=2, max_len=10)
  cached, _ = prefill_then_decode(
    apply, layer_params, ids, positions, mask, cache, prefill=5, end=8
  )
  np.testing.assert_allclose(cached[mask], np.asarray(full)[mask], rtol=1e-5, atol=1e-5)


def test_adapters_are_float32_with_the_kernels_axes():
  config = dataclasses.replace(LORA, param_dtype="bfloat16", dtype="bfloat16")
  boxed = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
  attn = boxed["params"]["layers"]["self_attn"]
  q_a, q_b = attn["q_proj"][lora.A_NAME], attn["q_proj"][lora.B_NAME]
  assert q_a.names == ("layers", "embed", None) and q_a.value.shape == (2, 32, 4)
  assert q_b.names == ("layers", None, "heads") and q_b.value.shape == (2, 4, 32)
  o_a = attn["o_proj"][lora.A_NAME]
  assert o_a.names == ("layers", "heads", None) and o_a.value.shape == (2, 32, 4)
  assert q_a.value.dtype == jnp.float32 and attn["q_proj"]["kernel"].value.dtype == jnp.bfloat16


def test_bad_lora_settings_are_rejected():
  with pytest.raises(ValueError, match="lora_targets"):
    dataclasses.replace(BASE, lora_targets=("q", "x"))
  with pytest.raises(ValueError, match="unknown or no LoRA targets"):
    lora.parse_targets("q,proj")
  assert lora.parse_targets(" q, down ") == ("q", "down")


def test_dropout_acts_only_in_an_apply_given_its_rng():
  # The trainer passes the dropout stream to the policy-gradient loss's forward alone: without it
  # (sampling, evaluation) a dropout model is the plain adapted model, bit for bit; with it, rate 0
  # changes nothing and rate 0.5 changes the logits, the same for the same key (exact resume).
  params = trained_lora(_params(LORA))
  ids, positions, mask = _inputs()
  dropout = dataclasses.replace(LORA, lora_dropout=0.5)

  @jax.jit
  def forwards(key):  # one compile for the four applies
    apply = lambda c, **kw: Decoder(c).apply({"params": params}, ids, positions, mask, **kw)
    rngs = {lora.DROPOUT_RNG: key}
    return apply(LORA), apply(dropout), apply(LORA, rngs=rngs), apply(dropout, rngs=rngs)

  want, sampled, rate_0, train = forwards(jax.random.key(0))
  np.testing.assert_array_equal(sampled, want)
  np.testing.assert_array_equal(rate_0, want)
  assert np.abs(np.asarray(train - want)).max() > 1e-3
  np.testing.assert_array_equal(forwards(jax.random.key(0))[3], train)
  assert np.abs(np.asarray(forwards(jax.random.key(1))[3] - train)).max() > 1e-3
