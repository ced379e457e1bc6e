"""The sampler's use of the KV cache, by hand: the decoder's logits from a prefill and then one
token at a time, for comparison with one full forward."""

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.models import decode_attention


def prefill_then_decode(apply, params, ids, positions, mask, cache, *, prefill: int, end: int):
  """(logits [B, end, V], the cache after them) of `apply` (a cached decoder's apply) over tokens
  [0, prefill) at once, then each of [prefill, end) alone."""
  p = slice(0, prefill)
  logits, cache = apply({"params": params}, ids[:, p], positions[:, p], mask[:, p], cache)
  steps = [logits]
  for t in range(prefill, end):
    s = slice(t, t + 1)
    logits, cache = apply({"params": params}, ids[:, s], positions[:, s], mask[:, s], cache)
    steps.append(logits)
  return np.concatenate([np.asarray(x) for x in steps], axis=1), cache


def decode_jaxpr(b, heads, kv_heads, slots, d, dtype=jnp.bfloat16, block=128):
  """The closed jaxpr of one decode-kernel call (interpret mode) on `b` rows of a `slots`-slot
  cache, written length a traced scalar: what the kernel counts read."""
  q = jnp.ones((b, 1, heads, d), dtype)
  k = jnp.ones((b, kv_heads, slots, d), dtype)
  mask = jnp.ones((b, slots), bool)

  def step(q, k, v, written):
    return decode_attention.flash_decode(q, k, v, mask, written, block=block, interpret=True)

  return jax.make_jaxpr(step)(q, k, k, jnp.int32(1))
