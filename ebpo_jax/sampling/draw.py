"""Drawing one token per row from the sampler's logits: temperature, top-k, top-p, then the draw.

Sampling runs on CPU as well as on accelerators, which shaped two choices: a token is drawn by
inverse-CDF from one uniform per row (a Gumbel draw needs V random numbers per row, ~5x slower on
CPU), and top-p finds its cut-off by bisection over the float order (XLA's CPU sort of a whole
vocabulary costs ~0.1 s per step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ebpo_jax.sampling import loop

_BLOCK = 256  # vocabulary block of the two-level inverse-CDF draw


def _float_order_key(x: jax.Array) -> jax.Array:
  """int32 keys ordered like the float32 values (an order-preserving bit map)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def top_k_filter(logits_bv: jax.Array, k: int) -> jax.Array:
  """Keeps the k largest logits per row (and any tied with the k-th), the rest -> -inf."""
  # min over the top-k values, not [..., -1]: XLA CPU rewrites that slice into a full sort.
  kth_b = jax.lax.top_k(logits_bv, k)[0].min(axis=-1)
  return jnp.where(logits_bv >= kth_b[:, None], logits_bv, -jnp.inf)


def top_p_filter(logits_bv: jax.Array, top_p: jax.Array) -> jax.Array:
  """Nucleus filter: keeps the most likely tokens whose total probability first reaches `top_p`.

  Finds the largest threshold t with `sum(p[logit >= t]) >= top_p` by bisection over the 2^32
  float orders (32 masked sums; exact, and no sort).
  """
  probs_bv = jax.nn.softmax(logits_bv, axis=-1)
  keys_bv = _float_order_key(logits_bv)

  def halve(_, bounds):
    lo, hi = bounds  # invariant: mass(lo) >= top_p > mass(hi)
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
    mass = jnp.sum(jnp.where(keys_bv >= mid[:, None], probs_bv, 0.0), axis=-1)
    keep = mass >= top_p
    return jnp.where(keep, mid, lo), jnp.where(keep, hi, mid)

  lo = keys_bv.min(axis=-1)
  hi = keys_bv.max(axis=-1) + 1
  lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  return jnp.where(keys_bv >= lo[:, None], logits_bv, -jnp.inf)


def _first_true_or_last(cond_bv: jax.Array, fallback_bv: jax.Array) -> jax.Array:
  """Index of the first True of `cond` per row, else of the last True of `fallback`."""
  last = fallback_bv.shape[-1] - 1 - jnp.argmax(fallback_bv[:, ::-1], axis=-1)
  return jnp.where(cond_bv.any(axis=-1), jnp.argmax(cond_bv, axis=-1), last)


def inverse_cdf_draw(probs_bv: jax.Array, u_b: jax.Array) -> jax.Array:
  """Index i with `cdf[i-1] <= u * total < cdf[i]`, for unnormalised `probs >= 0` and u in [0, 1).

  Two levels (blocks of 256, then within the block) keep the prefix sums short. Never returns an
  index of probability 0, rounding included.
  """
  b, v = probs_bv.shape
  width = -(-v // _BLOCK) * _BLOCK
  blocks_bnk = jnp.pad(probs_bv, ((0, 0), (0, width - v))).reshape(b, width // _BLOCK, _BLOCK)
  block_mass_bn = blocks_bnk.sum(axis=-1)
  block_cdf_bn = jnp.cumsum(block_mass_bn, axis=-1)
  target_b = u_b * block_cdf_bn[:, -1]
  block_b = _first_true_or_last(
    (block_cdf_bn > target_b[:, None]) & (block_mass_bn > 0), block_mass_bn > 0
  )
  inner_bk = jnp.take_along_axis(blocks_bnk, block_b[:, None, None], axis=1)[:, 0]
  pick = functools.partial(jnp.take_along_axis, indices=block_b[:, None], axis=1)
  residual_b = target_b - (pick(block_cdf_bn)[:, 0] - pick(block_mass_bn)[:, 0])
  inner_cdf_bk = jnp.cumsum(inner_bk, axis=-1)
  within_b = _first_true_or_last(
    (inner_cdf_bk > residual_b[:, None]) & (inner_bk > 0), inner_bk > 0
  )
  return block_b * _BLOCK + within_b


def draw(
  logits_bv: jax.Array,
  u_b: jax.Array,
  temperature: jax.Array,
  top_p: jax.Array,
  *,
  top_k: int,
  greedy: bool,
) -> loop.Drawn:
  """Draws one token per row: temperature, then top-k, then top-p (HF's order), by inverse CDF
  at the row's uniform `u_b` in [0, 1); or argmax (`u_b` unused)."""
  logits_bv = logits_bv.astype(jnp.float32)
  rows = jnp.arange(logits_bv.shape[0])
  if greedy:
    token = jnp.argmax(logits_bv, axis=-1)
  else:
    scaled_bv = logits_bv / temperature
    if top_k:
      scaled_bv = top_k_filter(scaled_bv, top_k)
    scaled_bv = jax.lax.cond(top_p < 1.0, top_p_filter, lambda x, _: x, scaled_bv, top_p)
    shifted_bv = scaled_bv - scaled_bv.max(axis=-1, keepdims=True)
    probs_bv = jnp.exp(shifted_bv)
    token = inverse_cdf_draw(probs_bv, u_b)
  logprob = logits_bv[rows, token] - jax.nn.logsumexp(logits_bv, axis=-1)
  # NaN probabilities send the inverse-CDF search into the padded vocabulary (ids >= V).
  nonfinite = ~jnp.isfinite(logits_bv).all(axis=-1)
  return loop.Drawn(token.astype(jnp.int32), logprob, nonfinite)
