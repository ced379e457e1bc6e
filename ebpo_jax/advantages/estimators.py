"""The group-relative estimators (stateless): GRPO, Dr.GRPO, RLOO and James-Stein shrinkage.

Also the helpers every estimator shares: input checks, group moments centred on a valid reward
(so that all-equal groups come out exact), and the `adv/zero_frac`, `adv/all_equal_frac` and signal
metrics.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Stats = dict[str, Array]


# ---------------------------------------------------------------------------------------------
# Shared helpers.


def _prepare(rewards: Array, mask: Array | None) -> tuple[Array, Array]:
  rewards_bg = jnp.asarray(rewards, jnp.float32)
  if rewards_bg.ndim != 2:
    raise ValueError(f"rewards must have shape [B, G], got shape {rewards_bg.shape}")
  if mask is None:
    return rewards_bg, jnp.ones(rewards_bg.shape, bool)
  mask_bg = jnp.asarray(mask, bool)
  if mask_bg.shape != rewards_bg.shape:
    raise ValueError(f"mask shape {mask_bg.shape} != rewards shape {rewards_bg.shape}")
  # Masked rewards may be anything (a failed verifier's NaN); they must not reach any statistic.
  return jnp.where(mask_bg, rewards_bg, 0.0), mask_bg


class _Groups(NamedTuple):
  count: Array  # [B] number of valid responses G_q
  ref: Array  # [B] largest valid reward (0 for an empty group): the sums below are centred on it
  offset: Array  # [B] sum over valid responses of (r - ref)
  mean: Array  # [B] group mean (0 for an empty group)
  m2: Array  # [B] sum of squared deviations from the group mean
  var: Array  # [B] unbiased group variance (0 for groups with fewer than 2 responses)


def _groups(rewards_bg: Array, mask_bg: Array) -> _Groups:
  """Group moments, centred on a valid reward so that all-equal groups come out exact.

  float32 rounds the sum of G copies of 2/3, so sum / G misses 2/3 by an ulp and the group std
  is ~1e-7, not 0: GRPO's (r - mean) / (std + 1e-6) gave 0.06-0.19 for such a group. Centred on
  one of its rewards, every r - ref is exactly 0, so mean = ref and the deviations are exactly 0.
  """
  weights_bg = mask_bg.astype(jnp.float32)
  count_b = weights_bg.sum(-1)
  ref_b = jnp.max(jnp.where(mask_bg, rewards_bg, -jnp.inf), -1)
  ref_b = jnp.where(count_b > 0, ref_b, 0.0)
  offset_b = ((rewards_bg - ref_b[:, None]) * weights_bg).sum(-1)
  mean_b = ref_b + offset_b / jnp.maximum(count_b, 1.0)
  m2_b = (jnp.square(rewards_bg - mean_b[:, None]) * weights_bg).sum(-1)
  var_b = m2_b / jnp.maximum(count_b - 1.0, 1.0)
  return _Groups(count_b, ref_b, offset_b, mean_b, m2_b, var_b)


def _masked(values_bg: Array, mask_bg: Array) -> Array:
  return jnp.where(mask_bg, values_bg, 0.0)


def _divide(numerator: Array, denominator: Array) -> Array:
  """numerator / denominator, and numerator itself where the denominator is 0 (eps = 0).

  Every caller's numerator is exactly 0 where its std is 0, so eps = 0 gives 0 there, not NaN.
  """
  return numerator / jnp.where(denominator > 0, denominator, 1.0)


def _masked_mean(values_b: Array, weights_b: Array) -> Array:
  return (values_b * weights_b).sum() / jnp.maximum(weights_b.sum(), 1.0)


def _check_cluster_ids(cluster_ids: Array, num_prompts: int) -> Array:
  cluster_ids_b = jnp.asarray(cluster_ids)
  if cluster_ids_b.shape != (num_prompts,) or not jnp.issubdtype(cluster_ids_b.dtype, jnp.integer):
    raise ValueError(
      f"cluster_ids must be an int array of shape [{num_prompts}], "
      f"got {cluster_ids_b.dtype} {cluster_ids_b.shape}"
    )
  return cluster_ids_b


def zero_fraction(adv: Array, mask: Array | None = None) -> Array:
  """Share of valid responses whose advantage is exactly 0 (the `adv/zero_frac` metric)."""
  valid = jnp.ones(adv.shape, bool) if mask is None else jnp.asarray(mask, bool)
  zeros = jnp.sum((adv == 0) & valid)
  return zeros / jnp.maximum(jnp.sum(valid), 1)


def all_equal_fraction(rewards: Array, mask: Array | None = None) -> Array:
  """Share of prompts with a valid response whose valid rewards are all equal (one response
  included): the groups GRPO gives exactly zero advantage, whatever estimator runs (the
  `adv/all_equal_frac` metric)."""
  rewards_bg = jnp.asarray(rewards, jnp.float32)
  valid = jnp.ones(rewards_bg.shape, bool) if mask is None else jnp.asarray(mask, bool)
  # max == min over the valid rewards: exact, unlike a float32 std (see `_groups`).
  high_b = jnp.max(jnp.where(valid, rewards_bg, -jnp.inf), axis=-1)
  low_b = jnp.min(jnp.where(valid, rewards_bg, jnp.inf), axis=-1)
  has_valid_b = jnp.any(valid, axis=-1)
  return jnp.sum(has_valid_b & (high_b == low_b)) / jnp.maximum(jnp.sum(has_valid_b), 1)


def signal_fraction(adv: Array, mask: Array | None = None) -> Array:
  """Share of prompts with a valid response that carry any non-zero advantage (gradient signal)."""
  valid = jnp.ones(adv.shape, bool) if mask is None else jnp.asarray(mask, bool)
  has_signal_b = jnp.any((adv != 0) & valid, axis=-1)
  has_valid_b = jnp.any(valid, axis=-1)
  return jnp.sum(has_signal_b) / jnp.maximum(jnp.sum(has_valid_b), 1)


# ---------------------------------------------------------------------------------------------
# Group-relative estimators (stateless).


def _grpo(rewards_bg: Array, mask_bg: Array, eps: float | Array = 1e-6) -> tuple[Array, Stats]:
  groups = _groups(rewards_bg, mask_bg)
  std_b = jnp.sqrt(groups.var)
  adv_bg = _divide(rewards_bg - groups.mean[:, None], std_b[:, None] + eps)
  return _masked(adv_bg, mask_bg), {"baseline": _per_response(groups.mean, rewards_bg)}


def _per_response(values_b: Array, like_bg: Array) -> Array:
  return jnp.broadcast_to(values_b[:, None], like_bg.shape)


@jax.jit
def grpo(rewards: Array, mask: Array | None = None, eps: float | Array = 1e-6) -> Array:
  """GRPO (Shao et al., arXiv 2402.03300): A_i = (r_i - mean(r)) / (std(r) + eps).

  Mean and unbiased std over the group's valid responses. A group whose valid rewards are all
  equal (one valid response included) has std 0 and advantage exactly 0, also for eps = 0.
  """
  return _grpo(*_prepare(rewards, mask), eps)[0]


def _dr_grpo(rewards_bg: Array, mask_bg: Array) -> tuple[Array, Stats]:
  mean_bg = _per_response(_groups(rewards_bg, mask_bg).mean, rewards_bg)
  return _masked(rewards_bg - mean_bg, mask_bg), {"baseline": mean_bg}


@jax.jit
def dr_grpo(rewards: Array, mask: Array | None = None) -> Array:
  """Dr.GRPO (Liu et al., arXiv 2503.20783): A_i = r_i - mean(r), no std scaling."""
  return _dr_grpo(*_prepare(rewards, mask))[0]


def _leave_one_out_mean(rewards_bg: Array, mask_bg: Array, groups: _Groups) -> Array:
  """Mean of the group's other valid responses; r_i itself where there is no other response.

  Centred on the group's `ref`, so an all-equal group's leave-one-out mean is r_i, exactly.
  """
  others = jnp.maximum(groups.count - 1.0, 1.0)[:, None]
  deviation_bg = rewards_bg - groups.ref[:, None]
  loo_bg = groups.ref[:, None] + (groups.offset[:, None] - deviation_bg) / others
  return jnp.where((groups.count >= 2)[:, None] & mask_bg, loo_bg, rewards_bg)


def _rloo(rewards_bg: Array, mask_bg: Array) -> tuple[Array, Stats]:
  baseline_bg = _leave_one_out_mean(rewards_bg, mask_bg, _groups(rewards_bg, mask_bg))
  return _masked(rewards_bg - baseline_bg, mask_bg), {"baseline": baseline_bg}


@jax.jit
def rloo(rewards: Array, mask: Array | None = None) -> Array:
  """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = r_i - mean_{j != i}(r_j).

  A group with a single valid response has no leave-one-out baseline and gets advantage 0, as
  does a group whose valid rewards are all equal.
  """
  return _rloo(*_prepare(rewards, mask))[0]


def _leave_one_prompt_out(values_b: Array, weights_b: Array) -> tuple[Array, Array, Array]:
  """Mean and population variance of `values` over the *other* weighted prompts, and their count.

  Values are centred on the overall mean first, so the sums-of-squares formula stays accurate.
  """
  total_weight = weights_b.sum()
  centre = (weights_b * values_b).sum() / jnp.maximum(total_weight, 1.0)
  centred_b = values_b - centre
  count_b = total_weight - weights_b
  sum_b = (weights_b * centred_b).sum() - weights_b * centred_b
  sum_sq_b = (weights_b * centred_b**2).sum() - weights_b * centred_b**2
  safe_count_b = jnp.maximum(count_b, 1.0)
  mean_b = sum_b / safe_count_b
  var_b = jnp.maximum(sum_sq_b / safe_count_b - mean_b**2, 0.0)
  return mean_b + centre, var_b, count_b


def _js_shrinkage(
  rewards_bg: Array, mask_bg: Array, eps: float | Array = 1e-6
) -> tuple[Array, Stats]:
  groups = _groups(rewards_bg, mask_bg)
  has_data_b = (groups.count > 0).astype(jnp.float32)
  prior_mean_b, spread_b, others_b = _leave_one_prompt_out(groups.mean, has_data_b)
  # v^2: mean over the other prompts of the variance of their group mean, var / G.
  has_var_b = (groups.count >= 2).astype(jnp.float32)
  noise_b, _, _ = _leave_one_prompt_out(groups.var / jnp.maximum(groups.count, 1.0), has_var_b)
  lam_b = jnp.where(others_b >= 1, _divide(noise_b, noise_b + spread_b + eps), 0.0)
  # Without another response in the group, all weight goes to the other prompts (if any).
  lam_b = jnp.where(groups.count >= 2, lam_b, (others_b >= 1).astype(jnp.float32))
  loo_bg = _leave_one_out_mean(rewards_bg, mask_bg, groups)
  baseline_bg = (1.0 - lam_b[:, None]) * loo_bg + lam_b[:, None] * prior_mean_b[:, None]
  return _masked(rewards_bg - baseline_bg, mask_bg), {"baseline": baseline_bg, "shrinkage": lam_b}


@jax.jit
def js_shrinkage(rewards: Array, mask: Array | None = None, eps: float | Array = 1e-6) -> Array:
  """James-Stein leave-one-out shrinkage baseline (Zeng et al., arXiv 2511.03710), no std scaling.

      b_qi = (1 - lam_q) * mean_{j != i}(r_qj) + lam_q * mu_{-q}
      lam_q = v2_{-q} / (v2_{-q} + s2_{-q} + eps),   A_qi = r_qi - b_qi

  Everything in b_qi leaves r_qi out (hence unbiased): mu_{-q} is the mean of the other prompts'
  group means, s2_{-q} their population variance, v2_{-q} the mean of var_unbiased(r_p) / G_p
  over the other prompts p. With equal group sizes mu_{-q} is the pooled mean of the other
  prompts' rewards, as in the authors' code. A group with one valid response uses lam = 1. It
  divides by no group std: an all-equal group gets r - mu_{-q} scaled by lam, by design.
  """
  return _js_shrinkage(*_prepare(rewards, mask), eps)[0]
