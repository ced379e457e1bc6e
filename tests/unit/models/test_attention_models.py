"""`config.model.attention` through the decoder, the sampler's prefill and the train step: splash
(Pallas interpret mode on the CPU) equals xla in float32, and `auto` stays xla on the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import models, sampling
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
