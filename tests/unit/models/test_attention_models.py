"""`config.model.attention` through the decoder, the sampler's prefill and the train step: splash
(Pallas interpret mode on the CPU) equals xla in float32, `auto` stays xla on the CPU, and the
compute dtype's part in the choice (cudnn at bf16/fp16 only; the sampler's own `sampling.dtype`)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import models, sampling
from ebpo_jax.errors import ConfigError
from ebpo_jax.models import Decoder
from tests.helpers.configs import ARITH, load_config
from tests.helpers.tiny_decoder import BASE, init_params
from tests.helpers.tiny_step import tiny_steps

ATOL = 1e-5
SPLASH = dataclasses.replace(BASE, attention="splash", attention_emulate=True)


def _prompts():
  """Two left-padded prompts of 7 and 4 tokens."""
  mask = np.arange(7)[None] >= np.array([[0], [3]])
  ids = np.where(mask, np.random.default_rng(0).integers(1, BASE.vocab_size, mask.shape), 0)
  return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


def test_decoder_logits_equal_xla():
  params = init_params(BASE, noise=0.1)
  ids, mask = _prompts()
  want = Decoder(BASE).apply({"params": params}, ids, attention_mask=mask)
  got = Decoder(SPLASH).apply({"params": params}, ids, attention_mask=mask)
  np.testing.assert_allclose(got * mask[..., None], want * mask[..., None], atol=ATOL, rtol=0)


def test_prefill_runs_the_kernel_and_samples_as_xla():
  params = init_params(BASE, noise=0.1)
  ids, mask = _prompts()
  args = (params, ids, mask, jax.random.key(0))
  kwargs = dict(group_size=2, max_new_tokens=4, greedy=True, compact=False)
  want = sampling.generate(Decoder(BASE), *args, **kwargs)
  got = sampling.generate(Decoder(SPLASH), *args, **kwargs)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)
  # The prefill (a cache as long as the prompt) goes through splash; a decode step through the
  # decode kernel (test_decode_attention.py); a chunk of T > 1 over a cache through neither.
  per_layer = Decoder(SPLASH, scan_layers=False)
  flat = models.decoder.unstack_layers(params)
  cache = models.init_cache(SPLASH, 2, 7)
  prefill = jax.make_jaxpr(lambda p: per_layer.apply({"params": p}, ids, None, mask, cache=cache))
  assert "pallas_call" in str(prefill(flat))
  cache = models.init_cache(SPLASH, 2, 8)
  chunk = jax.make_jaxpr(lambda p: per_layer.apply({"params": p}, ids[:, :2], cache=cache))
  assert "pallas_call" not in str(chunk(flat))


def test_train_step_params_after_two_steps_equal_xla():
  """The tiny train step (the shared-prefix layout, a left-padded prompt, early stops) twice."""
  xla, splash = tiny_steps(), tiny_steps({"model.attention": "splash"})
  assert (xla.model.config.attention, splash.model.config.attention) == ("xla", "splash")
  assert splash.options.layout.shared_prefix
  state_x = state_s = xla.fresh_state()
  # jit_train_step traces under its mesh (8 devices, fsdp): the kernel runs per shard.
  assert "shard_map" in str(splash.step.trace(state_s, splash.place(splash.batch())).jaxpr)
  for seed in range(2):
    state_x, metrics_x, _ = xla(xla.batch(seed), state_x)
    state_s, metrics_s, _ = splash(splash.batch(seed), state_s)
  # Adam's normalised updates (about 2e-4 here) hide small gradient errors: the params are held
  # to 1e-6 (measured 5e-8), the gradient through its norm and the loss to 1e-5.
  pairs = zip(jax.tree.leaves(state_s.params), jax.tree.leaves(state_x.params), strict=True)
  for got, want in pairs:
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  for name in ("loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(metrics_s[name], metrics_x[name], rtol=ATOL, err_msg=name)
  start = xla.fresh_state().params
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state_x.params, start)
  assert max(jax.tree.leaves(moved)) > 100 * 1e-6  # the steps changed the params


def test_auto_is_xla_on_the_cpu():
  model = models.build.make_model(load_config(ARITH), 18)
  assert (model.config.attention, model.config.attention_emulate) == ("xla", False)


H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


def test_cudnn_in_float32_is_a_config_error_before_anything_compiles():
  """An explicit cudnn at the default float32 fails in `make_model` (nothing traced yet), naming
  both keys; on the CPU too, where it would run emulated."""
  config = load_config(ARITH, {"model.attention": "cudnn"})
  assert config.model.dtype == "float32"
  with pytest.raises(ConfigError) as error:
    models.build.make_model(config, 18)
  message = str(error.value)
  assert "config.model.attention='cudnn' with config.model.dtype='float32'" in message, message
  bf16 = load_config(ARITH, {"model.attention": "cudnn", "model.dtype": "bfloat16"})
  assert models.build.make_model(bf16, 18, H100).config.attention == "cudnn"


def test_the_sampler_resolves_attention_at_its_own_dtype():
  """`sampling.dtype` (`with_compute_dtype`) resolves `model.attention` again: on an NVIDIA GPU
  auto is xla for a float32 policy and cudnn for its bf16 sampler, and the other way round; an
  explicit cudnn under a float32 sampler is a ConfigError naming `sampling.dtype`."""
  at = lambda dtype, attention="auto": load_config(
    ARITH, {"model.dtype": dtype, "model.attention": attention}
  )
  f32 = models.build.make_model(at("float32"), 18, H100)
  assert f32.config.attention == "xla"
  sampler = models.build.with_compute_dtype(f32, "bfloat16", at("float32").model, H100)
  assert (sampler.config.dtype, sampler.config.attention) == ("bfloat16", "cudnn")
  bf16 = models.build.make_model(at("bfloat16"), 18, H100)
  assert bf16.config.attention == "cudnn"
  sampler = models.build.with_compute_dtype(bf16, "float32", at("bfloat16").model, H100)
  assert (sampler.config.dtype, sampler.config.attention) == ("float32", "xla")
  explicit = at("bfloat16", "cudnn")
  model = models.build.make_model(explicit, 18, H100)
  with pytest.raises(ConfigError, match="cudnn' with config.sampling.dtype='float32'"):
    models.build.with_compute_dtype(model, "float32", explicit.model, H100)
  with pytest.raises(ValueError, match="cannot compute in float32"):  # no config to resolve with
    models.build.with_compute_dtype(model, "float32")
