"""EBPO: the per-cluster prior (Welford accumulators, batched by Chan's parallel merge) and the
estimator that shrinks each group's mean towards its cluster's prior mean."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax.advantages.estimators import (
  Array,
  Stats,
  _check_cluster_ids,
  _divide,
  _Groups,
  _groups,
  _masked,
  _prepare,
  zero_fraction,
)

MODES = ("running", "batch")
NORMALIZATIONS = ("batch", "none", "group", "cluster")
# Paper Eq. 3: S = 1 when the prior predictive variance sigma^2/G + tau^2 is at most this.
MIN_PRIOR_VARIANCE = 1e-6


# ---------------------------------------------------------------------------------------------
# The EBPO prior: per-cluster Welford accumulators, batched by Chan's parallel merge.


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


def shrinkage_weight(sigma2: Array, tau2: Array, count: Array) -> Array:
  """S = (sigma2 / n) / (sigma2 / n + tau2) (paper Eq. 3): the baseline's weight on the prior mean
  for a group of n = `count` valid responses (1 - S on the group's own mean); 1 (the prior alone)
  for a flat prior (total variance <= MIN_PRIOR_VARIANCE) or an empty group."""
  noise = sigma2 / jnp.maximum(count, 1.0)
  total = noise + tau2
  flat = (total <= MIN_PRIOR_VARIANCE) | (count == 0)
  return jnp.where(flat, 1.0, noise / jnp.where(flat, 1.0, total))


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
  shrinkage_b = shrinkage_weight(sigma2_b, tau2_b, groups.count)
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
