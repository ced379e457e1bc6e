"""Advantage estimators for RLVR: GRPO, Dr.GRPO, RLOO, James-Stein shrinkage and EBPO.

Pure, jittable functions over arrays. Shapes: `rewards` [B, G] (B prompts, G responses each),
`mask` [B, G] bool (True = valid response; default all valid), `cluster_ids` [B] int in [0, K).
Groups may be ragged through `mask`: masked entries get advantage 0 and enter no statistic. A group
whose valid rewards are all equal (also at values float32 cannot hold, 2/3 or 0.2) has mean
exactly that value and deviations exactly 0, so GRPO, Dr.GRPO and RLOO give it exactly 0.

EBPO (Han et al., "EBPO: Empirical Bayes Shrinkage for Stabilizing Group-Relative Policy
Optimization", arXiv 2602.05165) keeps a per-cluster prior, `PriorState`, that the caller threads
through its train-step carry: `init_prior` builds it, `ebpo` returns the updated one (optax style).

For a trainer, `from_config(config.rl)` builds an `Estimator`: the estimator's name and its frozen
hyperparameters (`GRPOParams`, ..., `EBPOParams`), with `init_prior(num_clusters)` and
`__call__(rewards_bg, mask_bg, cluster_ids_b, prior) -> (adv_bg, new_prior, metrics)`, so nothing
outside this module branches on an estimator's name.
"""

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Stats = dict[str, Array]

MODES = ("running", "batch")
NORMALIZATIONS = ("batch", "none", "group", "cluster")
# Paper Eq. 3: S = 1 when the prior predictive variance sigma^2/G + tau^2 is at most this.
MIN_PRIOR_VARIANCE = 1e-6


class Welford(NamedTuple):
  """Per-cluster running moments; the (population) variance is `m2 / count`."""

  count: Array  # [K] float32, (decayed) number of values merged so far
  mean: Array  # [K] float32
  m2: Array  # [K] float32, (decayed) sum of squared deviations from `mean`


class PriorState(NamedTuple):
  """EBPO's prior, per cluster (paper Algorithm 1, one pair of accumulators per cluster)."""

  rewards: Welford  # over individual rewards: mu_glob = mean, sigma^2 = m2 / count
  group_means: Welford  # over per-prompt mean rewards: tau^2 = m2 / count


def init_prior(num_clusters: int) -> PriorState:
  """An empty prior with `num_clusters` clusters (all counts 0)."""
  if num_clusters < 1:
    raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
  zeros = jnp.zeros((num_clusters,), jnp.float32)
  return PriorState(Welford(zeros, zeros, zeros), Welford(zeros, zeros, zeros))


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


def zero_fraction(adv: Array, mask: Array | None = None) -> Array:
  """Share of valid responses whose advantage is exactly 0 (the `adv/zero_frac` metric)."""
  valid = jnp.ones(adv.shape, bool) if mask is None else jnp.asarray(mask, bool)
  zeros = jnp.sum((adv == 0) & valid)
  return zeros / jnp.maximum(jnp.sum(valid), 1)


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


# ---------------------------------------------------------------------------------------------
# The EBPO prior: per-cluster Welford accumulators, batched by Chan's parallel merge.


def _segment_moments(parts: Welford, segment_ids: Array, k: int) -> Welford:
  """Pool per-prompt moments [B, A] into per-cluster moments [K, A] (exact: law of total variance).

  Segment sums run over prompts, not responses: M2 of a cluster is the sum of its prompts' M2
  plus count * (prompt mean - cluster mean)^2. The A accumulators share each segment sum.
  """
  # Centred on the cluster's largest prompt mean, as in `_groups`: a cluster of constant rewards
  # gets mu_glob = r and sigma2 = 0 exactly, so EBPO gives it exactly 0 (not 1.5e-8).
  ref = jax.ops.segment_max(jnp.where(parts.count > 0, parts.mean, -jnp.inf), segment_ids, k)
  ref = jnp.where(jnp.isfinite(ref), ref, 0.0)
  ref_parts = ref.at[segment_ids].get(mode="fill", fill_value=0.0)
  stacked = jnp.stack([parts.count, parts.count * (parts.mean - ref_parts)], axis=1)  # [B, 2, A]
  sums = jax.ops.segment_sum(stacked, segment_ids, k)
  count, offset = sums[:, 0], sums[:, 1]
  mean = ref + offset / jnp.maximum(count, 1e-30)
  deviation = parts.mean - mean.at[segment_ids].get(mode="fill", fill_value=0.0)
  m2 = jax.ops.segment_sum(parts.m2 + parts.count * jnp.square(deviation), segment_ids, k)
  return Welford(count, mean, m2)


def _merge(old: Welford, new: Welford, decay: float | Array) -> Welford:
  """Chan et al.'s parallel merge; `decay` scales the old count and M2 of clusters with new data.

  Clusters without new values keep their state exactly (no merge, no decay).
  """
  scale = jnp.where(new.count > 0, decay, 1.0)
  old_count = old.count * scale
  count = old_count + new.count
  new_share = jnp.where(count > 0, new.count / jnp.maximum(count, 1e-30), 0.0)
  delta = new.mean - old.mean
  mean = old.mean + delta * new_share
  # delta^2 * n_old * n_new / n, written to avoid n_old * n_new overflowing float32.
  m2 = old.m2 * scale + new.m2 + jnp.square(delta) * old_count * new_share
  return Welford(count, mean, m2)


def _update_prior(
  prior: PriorState, groups: _Groups, cluster_ids_b: Array, decay: float | Array
) -> PriorState:
  k = prior.rewards.count.shape[0]
  # Both accumulators side by side, [B, 2]: the prompt's rewards; its group mean as one value.
  has_data_b = (groups.count > 0).astype(jnp.float32)
  parts = Welford(
    jnp.stack([groups.count, has_data_b], -1),
    jnp.stack([groups.mean, groups.mean], -1),
    jnp.stack([groups.m2, jnp.zeros_like(groups.m2)], -1),
  )
  batch = _segment_moments(parts, cluster_ids_b, k)  # [K, 2]
  rewards_new, means_new = (jax.tree.map(lambda x, i=i: x[:, i], batch) for i in range(2))
  return PriorState(
    _merge(prior.rewards, rewards_new, decay), _merge(prior.group_means, means_new, decay)
  )


def _check_cluster_ids(cluster_ids: Array, num_prompts: int) -> Array:
  cluster_ids_b = jnp.asarray(cluster_ids)
  if cluster_ids_b.shape != (num_prompts,) or not jnp.issubdtype(cluster_ids_b.dtype, jnp.integer):
    raise ValueError(
      f"cluster_ids must be an int array of shape [{num_prompts}], "
      f"got {cluster_ids_b.dtype} {cluster_ids_b.shape}"
    )
  return cluster_ids_b


def _check_decay(decay: float | Array) -> None:
  if isinstance(decay, int | float) and not 0.0 < decay <= 1.0:
    raise ValueError(f"decay must be in (0, 1], got {decay}")


@jax.jit
def _update_prior_jit(prior, rewards_bg, mask_bg, cluster_ids_b, decay):
  return _update_prior(prior, _groups(rewards_bg, mask_bg), cluster_ids_b, decay)


def update_prior(
  prior: PriorState,
  rewards: Array,
  cluster_ids: Array,
  mask: Array | None = None,
  *,
  decay: float | Array = 1.0,
) -> PriorState:
  """Merge a batch into the prior: rewards of each cluster, and the group means of its prompts.

  Equal to pushing the values one at a time through Welford's update (Chan et al.'s parallel
  formula, per cluster by segment sums). Prompts without a valid response enter neither
  accumulator. `decay` in (0, 1] first scales count and M2 of every cluster that receives data.
  """
  _check_decay(decay)
  rewards_bg, mask_bg = _prepare(rewards, mask)
  cluster_ids_b = _check_cluster_ids(cluster_ids, rewards_bg.shape[0])
  return _update_prior_jit(prior, rewards_bg, mask_bg, cluster_ids_b, decay)


def prior_moments(prior: PriorState) -> tuple[Array, Array, Array]:
  """Per-cluster (mu_glob, sigma2, tau2), each [K]; population variances, 0 for empty clusters."""
  rewards, means = prior.rewards, prior.group_means
  sigma2 = jnp.where(rewards.count > 0, rewards.m2 / jnp.maximum(rewards.count, 1e-30), 0.0)
  tau2 = jnp.where(means.count > 0, means.m2 / jnp.maximum(means.count, 1e-30), 0.0)
  return rewards.mean, jnp.maximum(sigma2, 0.0), jnp.maximum(tau2, 0.0)


# ---------------------------------------------------------------------------------------------
# EBPO.


def _normalization_name(normalize: bool | str) -> str:
  if isinstance(normalize, bool):
    return "batch" if normalize else "none"
  if isinstance(normalize, str) and normalize in NORMALIZATIONS:
    return normalize
  raise ValueError(f"normalize must be True, False or one of {NORMALIZATIONS}, got {normalize!r}")


def _normalize(
  raw_bg: Array,
  mask_bg: Array,
  how: str,
  groups: _Groups,
  baseline_b: Array,
  cluster_std_b: Array,
  eps: float | Array,
) -> Array:
  if how == "none":
    return raw_bg
  if how == "batch":
    # Batch mean and unbiased variance of raw, from group moments (no extra pass over [B, G]):
    # raw has mean (group mean - V) and the group's M2 within each group.
    offset_b = groups.mean - baseline_b
    count = groups.count.sum()
    mean = (groups.count * offset_b).sum() / jnp.maximum(count, 1.0)
    m2 = (groups.m2 + groups.count * jnp.square(offset_b - mean)).sum()
    std = jnp.sqrt(m2 / jnp.maximum(count - 1.0, 1.0))
    return _divide(raw_bg - mean, std + eps)
  if how == "group":
    group_std_b = jnp.sqrt(groups.var)  # exactly 0 for an all-equal group
    scale_b = jnp.where(group_std_b > eps, group_std_b, cluster_std_b)
  else:
    scale_b = cluster_std_b
  return _divide(raw_bg, scale_b[:, None] + eps)


def _ebpo(
  rewards_bg: Array,
  mask_bg: Array,
  cluster_ids_b: Array,
  prior: PriorState,
  decay: float | Array,
  eps: float | Array,
  *,
  mode: str,
  normalize: str,
) -> tuple[Array, PriorState, Stats]:
  k = prior.rewards.count.shape[0]
  groups = _groups(rewards_bg, mask_bg)
  new_prior = _update_prior(prior, groups, cluster_ids_b, decay)
  read_from = (
    new_prior if mode == "running" else _update_prior(init_prior(k), groups, cluster_ids_b, 1.0)
  )
  # Out-of-range cluster ids read NaN, so they surface as non-finite advantages.
  moments_b3 = (
    jnp.stack(prior_moments(read_from), -1)
    .at[cluster_ids_b]
    .get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
  )
  mu_glob_b, sigma2_b, tau2_b = moments_b3[:, 0], moments_b3[:, 1], moments_b3[:, 2]
  noise_b = sigma2_b / jnp.maximum(groups.count, 1.0)
  total_b = noise_b + tau2_b
  flat_prior_b = (total_b <= MIN_PRIOR_VARIANCE) | (groups.count == 0)
  shrinkage_b = jnp.where(flat_prior_b, 1.0, noise_b / jnp.where(flat_prior_b, 1.0, total_b))
  baseline_b = (1.0 - shrinkage_b) * groups.mean + shrinkage_b * mu_glob_b
  raw_bg = rewards_bg - baseline_b[:, None]
  adv_bg = _normalize(raw_bg, mask_bg, normalize, groups, baseline_b, jnp.sqrt(sigma2_b), eps)
  adv_bg = _masked(adv_bg, mask_bg)
  stats = {
    "shrinkage": shrinkage_b,
    "mu_glob": mu_glob_b,
    "sigma2": sigma2_b,
    "tau2": tau2_b,
    "baseline": jnp.broadcast_to(baseline_b[:, None], rewards_bg.shape),
    "zero_frac": zero_fraction(adv_bg, mask_bg),
  }
  return adv_bg, new_prior, stats


_ebpo_jit = jax.jit(_ebpo, static_argnames=("mode", "normalize"))


def ebpo(
  rewards: Array,
  cluster_ids: Array,
  prior: PriorState,
  mask: Array | None = None,
  *,
  mode: str = "running",
  decay: float | Array = 1.0,
  normalize: bool | str = True,
  eps: float | Array = 1e-6,
) -> tuple[Array, PriorState, Stats]:
  """EBPO advantages (Han et al., arXiv 2602.05165, Eq. 2-4 and Algorithm 1), per-cluster prior.

      V_q   = (1 - S_q) * mean(r_q) + S_q * mu_glob
      S_q   = (sigma2 / G_q) / (sigma2 / G_q + tau2)     (S_q = 1 if the denominator <= 1e-6)
      raw_i = r_i - V_q

  mu_glob and sigma2 (population) come from the prompt's cluster's reward accumulator, tau2
  (population variance of group means) from its group-mean accumulator; G_q counts valid
  responses. Then `normalize` scales raw:
    - True / "batch" (paper): (raw - mean_batch(raw)) / (std_batch(raw) + eps), unbiased std over
      all valid responses of the batch.
    - False / "none": raw itself (centred by V only).
    - "group": raw / (std(r_q) + eps), unbiased group std; a group whose std is <= eps (all rewards
      equal, or one response) is scaled by its cluster's sqrt(sigma2) instead.
    - "cluster": raw / (sqrt(sigma2) + eps) of the prompt's cluster.

  mode="running" (paper Algorithm 1): merge the batch into the prior (Chan's parallel Welford,
  with `decay` applied first), then read it. mode="batch" (the authors' released code): read
  moments of the current batch only, per cluster (pass all-zero cluster ids for their single
  global prior); the returned prior is still the running one, updated exactly as in "running"
  mode, so switching modes mid-run costs nothing.

  Masked entries get advantage 0. Cluster ids outside [0, K) give NaN advantages. `mode` and
  `normalize` are static under jit; `decay` and `eps` are traced. Returns (adv [B, G], new_prior,
  stats) with stats: shrinkage, mu_glob, sigma2, tau2 [B] (the values read for each prompt),
  baseline [B, G] (V_q) and zero_frac (scalar).
  """
  how = _normalization_name(normalize)
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  _check_decay(decay)
  rewards_bg, mask_bg = _prepare(rewards, mask)
  cluster_ids_b = _check_cluster_ids(cluster_ids, rewards_bg.shape[0])
  return _ebpo_jit(rewards_bg, mask_bg, cluster_ids_b, prior, decay, eps, mode=mode, normalize=how)


# ---------------------------------------------------------------------------------------------
# Hyperparameters, one frozen (hashable, hence static under jit) dataclass per estimator.


class _InvalidParam(ValueError):
  """A hyperparameter outside its range; `field`, `value` and `rule` let callers name their key."""

  def __init__(self, params: object, field: str, rule: str):
    self.field, self.value, self.rule = field, getattr(params, field), rule
    super().__init__(f"{type(params).__name__}.{field}={self.value!r}: {rule}")


def _check_eps(params: object) -> None:
  eps = params.eps
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
    raise _InvalidParam(params, "eps", "must be a finite number >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOParams:
  """Hyperparameters of `grpo`."""

  eps: float = 1e-6  # added to the group std

  def __post_init__(self):
    _check_eps(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrGRPOParams:
  """`dr_grpo` has no hyperparameters."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLOOParams:
  """`rloo` has no hyperparameters."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JSShrinkageParams:
  """Hyperparameters of `js_shrinkage`."""

  eps: float = 1e-6  # added to the denominator of lam

  def __post_init__(self):
    _check_eps(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EBPOParams:
  """Hyperparameters of `ebpo`, plus `per_cluster` (one prior per cluster, or one for all)."""

  mode: str = "running"  # one of MODES; see `ebpo`
  decay: float = 1.0  # in (0, 1]; 1 is the paper
  normalize: str = "batch"  # one of NORMALIZATIONS; "batch" is the paper
  per_cluster: bool = True  # False: one global prior (every cluster id read as 0)
  eps: float = 1e-6  # added to the std that `normalize` divides by

  def __post_init__(self):
    if self.mode not in MODES:
      raise _InvalidParam(self, "mode", f"must be one of {', '.join(MODES)}")
    if self.normalize not in NORMALIZATIONS:
      raise _InvalidParam(self, "normalize", f"must be one of {', '.join(NORMALIZATIONS)}")
    decay = self.decay
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay <= 1:
      raise _InvalidParam(self, "decay", "must lie in (0, 1]")
    if not isinstance(self.per_cluster, bool):
      raise _InvalidParam(self, "per_cluster", "must be True or False")
    _check_eps(self)


Params = GRPOParams | DrGRPOParams | RLOOParams | JSShrinkageParams | EBPOParams


# ---------------------------------------------------------------------------------------------
# Estimator entries: one calling convention and ready-to-log metrics for the trainer.


def _stateless(core: Callable[..., tuple[Array, Stats]]) -> Callable[..., tuple[Array, Any, Stats]]:
  """Apply for an estimator without state: the prior passes through unchanged."""

  def apply(params, rewards_bg, mask_bg, cluster_ids_b, prior):
    del cluster_ids_b
    adv_bg, stats = core(rewards_bg, mask_bg, **dataclasses.asdict(params))
    return adv_bg, prior, stats

  return apply


def _ebpo_apply(params: EBPOParams, rewards_bg, mask_bg, cluster_ids_b, prior):
  if not params.per_cluster:
    cluster_ids_b = jnp.zeros_like(cluster_ids_b)  # one global prior, in slot 0 (authors' code)
  return _ebpo(
    rewards_bg,
    mask_bg,
    cluster_ids_b,
    prior,
    params.decay,
    params.eps,
    mode=params.mode,
    normalize=params.normalize,
  )


def _no_metrics(params, stats, has_data_b, new_prior) -> Stats:
  del params, stats, has_data_b, new_prior
  return {}


def _js_metrics(params, stats, has_data_b, new_prior) -> Stats:
  del params, new_prior
  return {"js/shrinkage_mean": _masked_mean(stats["shrinkage"], has_data_b)}


def _ebpo_metrics(params: EBPOParams, stats, has_data_b, new_prior) -> Stats:
  prior_mean = new_prior.rewards.mean
  return {
    "ebpo/shrinkage_mean": _masked_mean(stats["shrinkage"], has_data_b),
    "ebpo/prior_mean": prior_mean if params.per_cluster else prior_mean[0],
  }


class _Spec(NamedTuple):
  params_type: type
  config_keys: dict[str, str]  # hyperparameter -> its key under `config.rl`
  apply: Callable[..., tuple[Array, PriorState, Stats]]
  metrics: Callable[..., Stats]
  prior_size: Callable[[Any, int], int]  # (params, num_clusters) -> K of the prior it threads


def _placeholder_prior(params, num_clusters: int) -> int:
  del params, num_clusters
  return 1


_SPECS: dict[str, _Spec] = {
  "grpo": _Spec(GRPOParams, {"eps": "eps"}, _stateless(_grpo), _no_metrics, _placeholder_prior),
  "dr_grpo": _Spec(DrGRPOParams, {}, _stateless(_dr_grpo), _no_metrics, _placeholder_prior),
  "rloo": _Spec(RLOOParams, {}, _stateless(_rloo), _no_metrics, _placeholder_prior),
  "js_shrinkage": _Spec(
    JSShrinkageParams,
    {"eps": "eps"},
    _stateless(_js_shrinkage),
    _js_metrics,
    _placeholder_prior,
  ),
  "ebpo": _Spec(
    EBPOParams,
    {f: f"ebpo.{f}" for f in ("mode", "decay", "normalize", "per_cluster")} | {"eps": "eps"},
    _ebpo_apply,
    _ebpo_metrics,
    lambda params, num_clusters: num_clusters if params.per_cluster else 1,
  ),
}
ESTIMATORS = tuple(_SPECS)


@dataclasses.dataclass(frozen=True)
class Estimator:
  """One advantage estimator with its hyperparameters; hashable, so static under jit.

  `Estimator("grpo")` takes the default hyperparameters; `from_config` builds one from a config.

  Metrics rule: every value is ready to log under its key. An array of shape [K] (K = number of
  clusters) is per-cluster (the trainer logs it as `<key>/<cluster name>`); a scalar is global.
  - grpo, dr_grpo, rloo: none.
  - js_shrinkage: "js/shrinkage_mean", mean lam over prompts with a valid response.
  - ebpo: "ebpo/shrinkage_mean", mean S over prompts with a valid response; "ebpo/prior_mean",
    mu_glob of the updated prior, [K] with per_cluster, a scalar without.
  The trainer computes `adv/zero_frac` itself (`zero_fraction`).
  """

  name: str
  params: Params | None = None  # None: the estimator's default hyperparameters

  def __post_init__(self):
    if self.name not in _SPECS:
      raise ValueError(f"unknown advantage estimator {self.name!r}; known: {', '.join(ESTIMATORS)}")
    params_type = _SPECS[self.name].params_type
    if self.params is None:
      object.__setattr__(self, "params", params_type())
    elif type(self.params) is not params_type:
      raise TypeError(f"{self.name} takes {params_type.__name__}, got {self.params!r}")

  def init_prior(self, num_clusters: int) -> PriorState:
    """The prior this estimator threads: K = num_clusters for per-cluster EBPO, else K = 1.

    Stateless estimators get `init_prior(1)`, a 6-float placeholder they return unchanged, so
    every estimator's train state has the same structure.
    """
    return init_prior(_SPECS[self.name].prior_size(self.params, num_clusters))

  def __call__(
    self, rewards_bg: Array, mask_bg: Array | None, cluster_ids_b: Array, prior: PriorState
  ) -> tuple[Array, PriorState, Stats]:
    """(adv_bg [B, G], new_prior, metrics); see the class docstring for the metrics."""
    adv_bg, new_prior, _, metrics = _run(self, rewards_bg, mask_bg, cluster_ids_b, prior)
    return adv_bg, new_prior, metrics

  def with_stats(
    self, rewards_bg: Array, mask_bg: Array | None, cluster_ids_b: Array, prior: PriorState
  ) -> tuple[Array, PriorState, Stats]:
    """(adv_bg, new_prior, stats), stats per prompt instead of metrics (for analysis).

    stats: "baseline" [B, G] (what is subtracted from each reward); js_shrinkage and ebpo add
    "shrinkage" [B]; ebpo adds "mu_glob", "sigma2", "tau2" [B] and "zero_frac".
    """
    adv_bg, new_prior, stats, _ = _run(self, rewards_bg, mask_bg, cluster_ids_b, prior)
    return adv_bg, new_prior, stats


@jax.jit(static_argnums=0)
def _run(estimator: Estimator, rewards_bg, mask_bg, cluster_ids_b, prior):
  spec = _SPECS[estimator.name]
  rewards_bg, mask_bg = _prepare(rewards_bg, mask_bg)
  cluster_ids_b = _check_cluster_ids(cluster_ids_b, rewards_bg.shape[0])
  adv_bg, new_prior, stats = spec.apply(estimator.params, rewards_bg, mask_bg, cluster_ids_b, prior)
  has_data_b = mask_bg.any(-1).astype(jnp.float32)
  metrics = spec.metrics(estimator.params, stats, has_data_b, new_prior)
  return adv_bg, new_prior, stats, metrics


def _lookup(rl: Mapping[str, Any], key: str, why: str = "") -> Any:
  node = rl
  try:
    for part in key.split("."):
      node = node[part]
  except (KeyError, AttributeError, TypeError):
    raise ValueError(f"config.rl.{key} is missing{why}") from None
  return node


def from_config(rl: Mapping[str, Any]) -> Estimator:
  """The estimator `rl["advantage"]` with its hyperparameters from `config.rl`.

  Keys read: `advantage` (one of ESTIMATORS); `eps` (grpo, js_shrinkage, ebpo); ebpo also reads
  `ebpo.mode`, `ebpo.decay`, `ebpo.normalize`, `ebpo.per_cluster`. Any mapping works (an
  ml_collections ConfigDict, a dict). Raises ValueError naming the config key and its value.
  """
  name = _lookup(rl, "advantage")
  if name not in _SPECS:
    raise ValueError(
      f"config.rl.advantage={name!r}: unknown advantage estimator; known: {', '.join(ESTIMATORS)}"
    )
  spec = _SPECS[name]
  why = f" (needed by rl.advantage={name!r})"
  hparams = {field: _lookup(rl, key, why) for field, key in spec.config_keys.items()}
  try:
    params = spec.params_type(**hparams)
  except _InvalidParam as error:
    key = spec.config_keys[error.field]
    raise ValueError(f"config.rl.{key}={error.value!r}: {error.rule}") from None
  return Estimator(name, params)
