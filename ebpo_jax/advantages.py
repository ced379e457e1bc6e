"""Advantage estimators for RLVR: GRPO, Dr.GRPO, RLOO, James-Stein shrinkage and EBPO.

Pure, jittable functions over arrays. Shapes: `rewards` [B, G] (B prompts, G responses each),
`mask` [B, G] bool (True = valid response; default all valid), `cluster_ids` [B] int in [0, K).
Groups may be ragged through `mask`: masked entries get advantage 0 and enter no statistic.

EBPO (Han et al., "EBPO: Empirical Bayes Shrinkage for Stabilizing Group-Relative Policy
Optimization", arXiv 2602.05165) keeps a per-cluster prior, `PriorState`, that the caller threads
through its train-step carry: `init_prior` builds it, `ebpo` returns the updated one (optax style).

`get(name)` gives every estimator one calling convention for the trainer:
`fn(rewards_bg, mask_bg, cluster_ids_b, prior, **hparams) -> (adv_bg, new_prior, stats)`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Stats = dict[str, Array]
Estimator = Callable[..., tuple[Array, "PriorState", Stats]]

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
  total: Array  # [B] sum of valid rewards
  mean: Array  # [B] group mean (0 for an empty group)
  m2: Array  # [B] sum of squared deviations from the group mean
  var: Array  # [B] unbiased group variance (0 for groups with fewer than 2 responses)


def _groups(rewards_bg: Array, mask_bg: Array) -> _Groups:
  weights_bg = mask_bg.astype(jnp.float32)
  count_b = weights_bg.sum(-1)
  total_b = (rewards_bg * weights_bg).sum(-1)
  mean_b = total_b / jnp.maximum(count_b, 1.0)
  m2_b = (jnp.square(rewards_bg - mean_b[:, None]) * weights_bg).sum(-1)
  var_b = m2_b / jnp.maximum(count_b - 1.0, 1.0)
  return _Groups(count_b, total_b, mean_b, m2_b, var_b)


def _masked(values_bg: Array, mask_bg: Array) -> Array:
  return jnp.where(mask_bg, values_bg, 0.0)


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


def _grpo(rewards_bg: Array, mask_bg: Array, eps: float | Array = 1e-6) -> tuple[Array, Array]:
  groups = _groups(rewards_bg, mask_bg)
  std_b = jnp.sqrt(groups.var)
  adv_bg = (rewards_bg - groups.mean[:, None]) / (std_b[:, None] + eps)
  return _masked(adv_bg, mask_bg), jnp.broadcast_to(groups.mean[:, None], rewards_bg.shape)


@jax.jit
def grpo(rewards: Array, mask: Array | None = None, eps: float | Array = 1e-6) -> Array:
  """GRPO (Shao et al., arXiv 2402.03300): A_i = (r_i - mean(r)) / (std(r) + eps).

  Mean and unbiased std over the group's valid responses; a group with one valid response has
  std 0 and advantage 0.
  """
  return _grpo(*_prepare(rewards, mask), eps)[0]


def _dr_grpo(rewards_bg: Array, mask_bg: Array) -> tuple[Array, Array]:
  mean_bg = jnp.broadcast_to(_groups(rewards_bg, mask_bg).mean[:, None], rewards_bg.shape)
  return _masked(rewards_bg - mean_bg, mask_bg), mean_bg


@jax.jit
def dr_grpo(rewards: Array, mask: Array | None = None) -> Array:
  """Dr.GRPO (Liu et al., arXiv 2503.20783): A_i = r_i - mean(r), no std scaling."""
  return _dr_grpo(*_prepare(rewards, mask))[0]


def _leave_one_out_mean(rewards_bg: Array, mask_bg: Array, groups: _Groups) -> Array:
  """Mean of the group's other valid responses; r_i itself where there is no other response."""
  others = jnp.maximum(groups.count - 1.0, 1.0)[:, None]
  loo_bg = (groups.total[:, None] - rewards_bg) / others
  return jnp.where((groups.count >= 2)[:, None] & mask_bg, loo_bg, rewards_bg)


def _rloo(rewards_bg: Array, mask_bg: Array) -> tuple[Array, Array]:
  baseline_bg = _leave_one_out_mean(rewards_bg, mask_bg, _groups(rewards_bg, mask_bg))
  return _masked(rewards_bg - baseline_bg, mask_bg), baseline_bg


@jax.jit
def rloo(rewards: Array, mask: Array | None = None) -> Array:
  """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = r_i - mean_{j != i}(r_j).

  A group with a single valid response has no leave-one-out baseline and gets advantage 0.
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
) -> tuple[Array, Array, Array]:
  groups = _groups(rewards_bg, mask_bg)
  has_data_b = (groups.count > 0).astype(jnp.float32)
  prior_mean_b, spread_b, others_b = _leave_one_prompt_out(groups.mean, has_data_b)
  # v^2: mean over the other prompts of the variance of their group mean, var / G.
  has_var_b = (groups.count >= 2).astype(jnp.float32)
  noise_b, _, _ = _leave_one_prompt_out(groups.var / jnp.maximum(groups.count, 1.0), has_var_b)
  lam_b = jnp.where(others_b >= 1, noise_b / (noise_b + spread_b + eps), 0.0)
  # Without another response in the group, all weight goes to the other prompts (if any).
  lam_b = jnp.where(groups.count >= 2, lam_b, (others_b >= 1).astype(jnp.float32))
  loo_bg = _leave_one_out_mean(rewards_bg, mask_bg, groups)
  baseline_bg = (1.0 - lam_b[:, None]) * loo_bg + lam_b[:, None] * prior_mean_b[:, None]
  return _masked(rewards_bg - baseline_bg, mask_bg), baseline_bg, lam_b


@jax.jit
def js_shrinkage(rewards: Array, mask: Array | None = None, eps: float | Array = 1e-6) -> Array:
  """James-Stein leave-one-out shrinkage baseline (Zeng et al., arXiv 2511.03710), no std scaling.

      b_qi = (1 - lam_q) * mean_{j != i}(r_qj) + lam_q * mu_{-q}
      lam_q = v2_{-q} / (v2_{-q} + s2_{-q} + eps),   A_qi = r_qi - b_qi

  Everything in b_qi leaves r_qi out (hence unbiased): mu_{-q} is the mean of the other prompts'
  group means, s2_{-q} their population variance, v2_{-q} the mean of var_unbiased(r_p) / G_p
  over the other prompts p. With equal group sizes mu_{-q} is the pooled mean of the other
  prompts' rewards, as in the authors' code. A group with one valid response uses lam = 1.
  """
  return _js_shrinkage(*_prepare(rewards, mask), eps)[0]


# ---------------------------------------------------------------------------------------------
# The EBPO prior: per-cluster Welford accumulators, batched by Chan's parallel merge.


def _segment_moments(parts: Welford, segment_ids: Array, k: int) -> Welford:
  """Pool per-prompt moments [B, A] into per-cluster moments [K, A] (exact: law of total variance).

  Segment sums run over prompts, not responses: M2 of a cluster is the sum of its prompts' M2
  plus count * (prompt mean - cluster mean)^2. The A accumulators share each segment sum.
  """
  stacked = jnp.stack([parts.count, parts.count * parts.mean], axis=1)  # [B, 2, A]
  sums = jax.ops.segment_sum(stacked, segment_ids, k)
  count, total = sums[:, 0], sums[:, 1]
  mean = total / jnp.maximum(count, 1e-30)
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
    return (raw_bg - mean) / (std + eps)
  if how == "group":
    group_std_b = jnp.sqrt(groups.var)
    scale_b = jnp.where(group_std_b > eps, group_std_b, cluster_std_b)
  else:
    scale_b = cluster_std_b
  return raw_bg / (scale_b[:, None] + eps)


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
# Registry: one calling convention for the trainer.


def _stateless(core: Callable[..., tuple[Array, ...]], stat_names: tuple[str, ...]) -> Estimator:
  """Wrap a stateless estimator: the prior passes through unchanged."""

  def estimator(
    rewards_bg: Array,
    mask_bg: Array | None,
    cluster_ids_b: Array,
    prior: PriorState,
    **hparams: Any,
  ) -> tuple[Array, PriorState, Stats]:
    del cluster_ids_b
    rewards_bg, mask_bg = _prepare(rewards_bg, mask_bg)
    adv_bg, baseline_bg, *extra = core(rewards_bg, mask_bg, **hparams)
    stats = {"baseline": baseline_bg, "zero_frac": zero_fraction(adv_bg, mask_bg)}
    stats.update(zip(stat_names, extra, strict=True))
    return adv_bg, prior, stats

  return jax.jit(estimator)


def _ebpo_estimator(
  rewards_bg: Array,
  mask_bg: Array | None,
  cluster_ids_b: Array,
  prior: PriorState,
  **hparams: Any,
) -> tuple[Array, PriorState, Stats]:
  return ebpo(rewards_bg, cluster_ids_b, prior, mask_bg, **hparams)


_REGISTRY: dict[str, Estimator] = {
  "grpo": _stateless(_grpo, ()),
  "dr_grpo": _stateless(_dr_grpo, ()),
  "rloo": _stateless(_rloo, ()),
  "js_shrinkage": _stateless(_js_shrinkage, ("shrinkage",)),
  "ebpo": _ebpo_estimator,
}
ESTIMATORS = tuple(_REGISTRY)


def get(name: str) -> Estimator:
  """The estimator `name` as `fn(rewards_bg, mask_bg, cluster_ids_b, prior, **hparams)`.

  Returns (adv_bg, new_prior, stats). Stateless estimators return the prior unchanged; stats
  always hold "zero_frac" (scalar) and "baseline" [B, G] (what was subtracted from each reward);
  js_shrinkage and ebpo add "shrinkage" [B]. hparams: grpo and js_shrinkage take `eps`; ebpo
  takes `mode`, `decay`, `normalize`, `eps`.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ESTIMATORS)}")
  return _REGISTRY[name]
