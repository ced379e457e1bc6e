"""Tests for ebpo_jax.advantages: golden values, NumPy references, Welford merges, paper claims."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ebpo_jax import advantages as adv_lib

# Three prompts in one cluster (the golden example).
REWARDS = np.array([[0, 0, 0, 0], [1, 1, 0, 1], [1, 0, 1, 1]], np.float32)
ONE_CLUSTER = np.zeros(3, np.int32)


def _ebpo(rewards, cluster_ids=None, prior=None, mask=None, **hparams):
  rewards = np.asarray(rewards, np.float32)
  cluster_ids = np.zeros(len(rewards), np.int32) if cluster_ids is None else cluster_ids
  prior = adv_lib.init_prior(1) if prior is None else prior
  return adv_lib.ebpo(rewards, cluster_ids, prior, mask, **hparams)


# ---------------------------------------------------------------------------------------------
# Golden values, worked by hand.


def test_ebpo_golden_raw_advantages():
  # 12 rewards, 6 ones: mu_glob = 0.5, sigma2 = 0.25 (population).
  # Group means 0, 0.75, 0.75 (mean 0.5): tau2 = (0.25 + 0.0625 + 0.0625) / 3 = 0.125.
  # S = (0.25 / 4) / (0.0625 + 0.125) = 1/3 for every prompt.
  # All-zero group: V = (2/3) * 0 + (1/3) * 0.5 = 1/6, raw = -1/6.
  # [1,1,0,1]: V = (2/3) * 0.75 + (1/3) * 0.5 = 2/3, raw = +1/3 and -2/3.
  # (Unbiased tau2 = 0.1875 would give S = 1/4, raw -1/8; GRPO gives 0 for the all-zero group.)
  adv, prior, stats = _ebpo(REWARDS, normalize=False)
  np.testing.assert_allclose(stats["shrinkage"], [1 / 3] * 3, rtol=1e-6)
  np.testing.assert_allclose(stats["mu_glob"], [0.5] * 3, rtol=1e-6)
  np.testing.assert_allclose(stats["sigma2"], [0.25] * 3, rtol=1e-6)
  np.testing.assert_allclose(stats["tau2"], [0.125] * 3, rtol=1e-6)
  np.testing.assert_allclose(stats["baseline"][:, 0], [1 / 6, 2 / 3, 2 / 3], rtol=1e-6)
  np.testing.assert_allclose(adv[0], [-1 / 6] * 4, rtol=1e-6)
  np.testing.assert_allclose(adv[1], [1 / 3, 1 / 3, -2 / 3, 1 / 3], rtol=1e-5)
  assert float(stats["zero_frac"]) == 0.0
  # The prior now holds the batch: 12 rewards (M2 = 12 * 0.25 = 3), 3 group means (M2 = 0.375).
  np.testing.assert_allclose(prior.rewards.count, [12.0])
  np.testing.assert_allclose(prior.rewards.m2, [3.0], rtol=1e-6)
  np.testing.assert_allclose(prior.group_means.m2, [0.375], rtol=1e-6)


def test_ebpo_golden_batch_normalisation():
  # raw: four -1/6, six +1/3, two -2/3; sum 0, so the batch mean is 0.
  # Unbiased var = (4/36 + 6/9 + 2 * 4/9) / 11 = (5/3) / 11, std = 0.389249.
  # -1/6 / 0.389249 = -0.428174 (population std 0.372678 would give -0.447214).
  adv, _, _ = _ebpo(REWARDS, normalize=True)
  np.testing.assert_allclose(adv[0], [-0.428174] * 4, rtol=1e-5)
  np.testing.assert_allclose(adv[1, 2], -2 / 3 / 0.389249, rtol=1e-5)
  same, _, _ = _ebpo(REWARDS, normalize="batch")
  np.testing.assert_array_equal(adv, same)


def test_ebpo_golden_group_and_cluster_normalisation():
  # "group": [1,1,0,1] has unbiased std 0.5: 1/3 / 0.5 = 2/3, -2/3 / 0.5 = -4/3.
  # The all-zero group has std 0, so it uses its cluster's sqrt(sigma2) = 0.5: -1/6 / 0.5 = -1/3
  # (dividing by std + eps instead would give -1.7e5).
  adv, _, _ = _ebpo(REWARDS, normalize="group")
  np.testing.assert_allclose(adv[0], [-1 / 3] * 4, rtol=1e-5)
  np.testing.assert_allclose(adv[1], [2 / 3, 2 / 3, -4 / 3, 2 / 3], rtol=1e-5)
  # "cluster": everything divided by sqrt(sigma2) = 0.5.
  adv, _, _ = _ebpo(REWARDS, normalize="cluster")
  np.testing.assert_allclose(adv[1], [2 / 3, 2 / 3, -4 / 3, 2 / 3], rtol=1e-5)
  np.testing.assert_allclose(adv[0], [-1 / 3] * 4, rtol=1e-5)
  raw, _, _ = _ebpo(REWARDS, normalize="none")
  np.testing.assert_allclose(raw[2], [1 / 3, -2 / 3, 1 / 3, 1 / 3], rtol=1e-5)


def test_group_relative_golden_values():
  rewards = REWARDS[1:2]  # [1, 1, 0, 1]: mean 0.75, unbiased std 0.5 (population: 0.433)
  # GRPO: (1 - 0.75) / 0.5 = 0.5, (0 - 0.75) / 0.5 = -1.5 (population std: 0.577, -1.732).
  np.testing.assert_allclose(adv_lib.grpo(rewards), [[0.5, 0.5, -1.5, 0.5]], rtol=1e-5)
  # Dr.GRPO: 1 - 0.75 = 0.25, 0 - 0.75 = -0.75.
  np.testing.assert_allclose(adv_lib.dr_grpo(rewards), [[0.25, 0.25, -0.75, 0.25]], rtol=1e-6)
  # RLOO: 1 - mean(1, 0, 1) = 1/3, 0 - mean(1, 1, 1) = -1 (the group mean would give 0.25).
  np.testing.assert_allclose(adv_lib.rloo(rewards), [[1 / 3, 1 / 3, -1.0, 1 / 3]], rtol=1e-6)
  # Saturated groups are exactly zero for all three.
  for fn in (adv_lib.grpo, adv_lib.dr_grpo, adv_lib.rloo):
    assert np.all(np.asarray(fn(REWARDS[:1])) == 0.0)


def test_js_shrinkage_golden_values():
  # Prompt 0 (all zeros): the other prompts' group means are 0.75, 0.75: mu = 0.75, s2 = 0.
  # v2 = mean of var_unbiased / G over them = 0.25 / 4 = 0.0625, so lam = 0.0625 / (0.0625 + eps)
  # ~ 1 and A = 0 - 0.75 = -0.75 (RLOO gives 0 here).
  # Prompt 1: others' means 0, 0.75: mu = 0.375, s2 = 0.140625; v2 = (0 + 0.0625) / 2 = 0.03125;
  # lam = 0.03125 / 0.171875 = 2/11. For r = 1: LOO mean 2/3, b = (9/11)(2/3) + (2/11)(0.375)
  # = 0.613636, A = 0.386364. For r = 0: LOO mean 1, b = 9/11 + 0.75/11 = 0.886364.
  adv = adv_lib.js_shrinkage(REWARDS)
  np.testing.assert_allclose(adv[0], [-0.75] * 4, rtol=1e-4)
  np.testing.assert_allclose(adv[1], [0.386364, 0.386364, -0.886364, 0.386364], rtol=1e-5)
  js = adv_lib.Estimator("js_shrinkage")
  _, _, stats = js.with_stats(REWARDS, None, ONE_CLUSTER, js.init_prior(1))
  np.testing.assert_allclose(stats["shrinkage"][1], 2 / 11, rtol=1e-5)


def test_masked_entries_get_zero_and_enter_no_statistic():
  # Masking the 0 out of [1, 1, 0, 1] leaves [1, 1, 1]: GRPO 0 everywhere, RLOO 0.
  mask = np.array([[True, True, False, True]])
  for fn in (adv_lib.grpo, adv_lib.dr_grpo, adv_lib.rloo, adv_lib.js_shrinkage):
    np.testing.assert_array_equal(fn(REWARDS[1:2], mask), np.zeros((1, 4)))
  # EBPO with a masked entry equals EBPO on the batch without that entry.
  rewards = np.array([[0, 0, 0, 5], [1, 1, 0, 1], [1, 0, 1, 1]], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
  adv, prior, stats = _ebpo(rewards, mask=mask, normalize=True)
  assert adv[0, 3] == 0.0
  np.testing.assert_allclose(prior.rewards.count, [11.0])
  assert float(prior.rewards.mean[0]) == pytest.approx(6 / 11, rel=1e-6)  # the 5 is not in it
  assert float(stats["zero_frac"]) == 0.0  # the masked zero is not counted
  # A masked NaN reward (a failed verifier) changes nothing either.
  nan_rewards = np.where(mask, rewards, np.nan).astype(np.float32)
  for name in adv_lib.ESTIMATORS:
    fn = adv_lib.Estimator(name)
    nan_adv, nan_prior, _ = fn(nan_rewards, mask, ONE_CLUSTER, adv_lib.init_prior(1))
    clean_adv, clean_prior, _ = fn(rewards, mask, ONE_CLUSTER, adv_lib.init_prior(1))
    np.testing.assert_array_equal(nan_adv, clean_adv)
    jax.tree.map(np.testing.assert_array_equal, nan_prior, clean_prior)


# ---------------------------------------------------------------------------------------------
# Independent NumPy references (float64, loops over prompts).


def _np_group_stats(rewards, mask):
  values = [r[m] for r, m in zip(rewards, mask, strict=True)]
  means = [v.mean() if len(v) else 0.0 for v in values]
  stds = [v.std(ddof=1) if len(v) > 1 else 0.0 for v in values]
  return values, means, stds


def _np_grpo(rewards, mask, eps=1e-6):
  _, means, stds = _np_group_stats(rewards, mask)
  out = (rewards - np.array(means)[:, None]) / (np.array(stds)[:, None] + eps)
  return np.where(mask, out, 0.0)


def _np_rloo(rewards, mask):
  out = np.zeros_like(rewards, np.float64)
  for q in range(len(rewards)):
    idx = np.flatnonzero(mask[q])
    for i in idx if len(idx) > 1 else []:
      out[q, i] = rewards[q, i] - rewards[q, idx[idx != i]].mean()
  return out


def _np_js(rewards, mask, eps=1e-6):
  values, means, _ = _np_group_stats(rewards, mask)
  valid = [q for q in range(len(rewards)) if len(values[q])]
  out = np.zeros_like(rewards, np.float64)
  for q in valid:
    others = [p for p in valid if p != q]
    other_means = np.array([means[p] for p in others])
    noise = [values[p].var(ddof=1) / len(values[p]) for p in others if len(values[p]) > 1]
    mu = other_means.mean() if others else 0.0
    s2 = other_means.var() if others else 0.0
    v2 = np.mean(noise) if noise else 0.0
    lam = v2 / (v2 + s2 + eps) if others else 0.0
    idx = np.flatnonzero(mask[q])
    for i in idx:
      rest = rewards[q, idx[idx != i]]
      loo_mean = rest.mean() if len(rest) else rewards[q, i]
      weight = lam if len(rest) else float(bool(others))  # no other response: all on mu
      out[q, i] = rewards[q, i] - ((1 - weight) * loo_mean + weight * mu)
  return out


def _np_weighted_moments(values, weights):
  values, weights = np.asarray(values, np.float64), np.asarray(weights, np.float64)
  mean = np.sum(weights * values) / weights.sum()
  return mean, np.sum(weights * (values - mean) ** 2) / weights.sum()


class _NpPrior:
  """Keeps every value with its weight; decay multiplies the old weights of clusters with data."""

  def __init__(self, k):
    self.rewards = [([], []) for _ in range(k)]
    self.means = [([], []) for _ in range(k)]

  def update(self, rewards, mask, cluster_ids, decay):
    values, means, _ = _np_group_stats(rewards, mask)
    for c in set(cluster_ids[[len(v) > 0 for v in values]].tolist()):
      for store in (self.rewards[c], self.means[c]):
        store[1][:] = [w * decay for w in store[1]]
    for q, c in enumerate(cluster_ids):
      if len(values[q]):
        self.rewards[c][0].extend(values[q])
        self.rewards[c][1].extend([1.0] * len(values[q]))
        self.means[c][0].append(means[q])
        self.means[c][1].append(1.0)

  def moments(self, c):
    mu, sigma2 = _np_weighted_moments(*self.rewards[c])
    _, tau2 = _np_weighted_moments(*self.means[c])
    return mu, sigma2, tau2


def _np_ebpo(rewards, mask, cluster_ids, np_prior, normalize="batch", eps=1e-6):
  values, means, stds = _np_group_stats(rewards, mask)
  raw = np.zeros_like(rewards, np.float64)
  scale = np.ones(len(rewards))
  for q, c in enumerate(cluster_ids):
    if not len(values[q]):
      continue
    mu, sigma2, tau2 = np_prior.moments(c)
    noise = sigma2 / len(values[q])
    shrink = 1.0 if noise + tau2 <= 1e-6 else noise / (noise + tau2)
    raw[q] = np.where(mask[q], rewards[q] - ((1 - shrink) * means[q] + shrink * mu), 0.0)
    if normalize == "cluster" or (normalize == "group" and stds[q] <= eps):
      scale[q] = np.sqrt(sigma2) + eps
    elif normalize == "group":
      scale[q] = stds[q] + eps
  if normalize == "batch":
    flat = raw[mask]
    return np.where(mask, (raw - flat.mean()) / (flat.std(ddof=1) + eps), 0.0)
  return raw / scale[:, None]


def _random_batch(rng, b, g, k, binary=True):
  rewards = rng.integers(0, 2, (b, g)) if binary else rng.normal(0.5, 1.0, (b, g))
  mask = rng.random((b, g)) > 0.25
  mask[0] = False  # one prompt without any valid response
  mask[1, 1:] = False  # one prompt with a single valid response
  return rewards.astype(np.float32), mask, rng.integers(0, k, b).astype(np.int32)


@pytest.mark.parametrize("binary", [True, False])
def test_stateless_estimators_match_numpy(binary):
  rewards, mask, _ = _random_batch(np.random.default_rng(0), 16, 6, 1, binary)
  np.testing.assert_allclose(adv_lib.grpo(rewards, mask), _np_grpo(rewards, mask), atol=2e-4)
  np.testing.assert_allclose(adv_lib.rloo(rewards, mask), _np_rloo(rewards, mask), atol=1e-5)
  np.testing.assert_allclose(adv_lib.js_shrinkage(rewards, mask), _np_js(rewards, mask), atol=1e-4)


@pytest.mark.parametrize("normalize", ["batch", "none", "group", "cluster"])
def test_ebpo_running_matches_numpy_over_steps(normalize):
  rng, k, decay = np.random.default_rng(1), 3, 0.8
  prior, np_prior = adv_lib.init_prior(k), _NpPrior(k)
  for _ in range(4):
    rewards, mask, clusters = _random_batch(rng, 12, 4, k)
    clusters[:3] = [0, 1, 2]  # every cluster has data, so every prompt reads a non-empty prior
    adv, prior, _ = adv_lib.ebpo(rewards, clusters, prior, mask, decay=decay, normalize=normalize)
    np_prior.update(rewards, mask, clusters, decay)
    expected = _np_ebpo(rewards, mask, clusters, np_prior, normalize)
    np.testing.assert_allclose(adv, expected, atol=2e-4, rtol=1e-4)


def test_ebpo_batch_mode_reads_the_batch_and_returns_the_running_prior():
  rng = np.random.default_rng(2)
  history, mask0, clusters0 = _random_batch(rng, 12, 4, 2)
  prior = adv_lib.update_prior(adv_lib.init_prior(2), history, clusters0, mask0)
  rewards, mask, clusters = _random_batch(rng, 12, 4, 2)
  clusters[:2] = [0, 1]
  batch_adv, batch_prior, _ = adv_lib.ebpo(rewards, clusters, prior, mask, mode="batch")
  fresh_adv, _, _ = adv_lib.ebpo(rewards, clusters, adv_lib.init_prior(2), mask)
  _, running_prior, _ = adv_lib.ebpo(rewards, clusters, prior, mask, mode="running")
  np.testing.assert_allclose(batch_adv, fresh_adv, rtol=1e-6, atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, batch_prior, running_prior)
  running_adv, _, _ = adv_lib.ebpo(rewards, clusters, prior, mask, mode="running")
  assert not np.allclose(running_adv, batch_adv)  # the history matters in running mode only


# ---------------------------------------------------------------------------------------------
# The prior: Chan's merge equals one-at-a-time Welford.


def _welford_push(state, x):
  n, mean, m2 = state
  n += 1
  delta = x - mean
  mean += delta / n
  return n, mean, m2 + delta * (x - mean)


@settings(max_examples=25, deadline=None)
@given(
  shape=st.sampled_from([(1, 1), (3, 2), (5, 4)]),
  k=st.sampled_from([1, 3]),
  steps=st.integers(1, 3),
  seed=st.integers(0, 2**31 - 1),
  binary=st.booleans(),
)
def test_chan_merge_equals_one_at_a_time_welford(shape, k, steps, seed, binary):
  rng = np.random.default_rng(seed)
  prior = adv_lib.init_prior(k)
  reward_states = [(0, 0.0, 0.0)] * k
  mean_states = [(0, 0.0, 0.0)] * k
  for _ in range(steps):
    rewards = rng.integers(0, 2, shape) if binary else rng.normal(0.0, 3.0, shape)
    rewards = rewards.astype(np.float32)
    mask = rng.random(shape) > 0.3
    clusters = rng.integers(0, k, shape[0]).astype(np.int32)
    prior = adv_lib.update_prior(prior, rewards, clusters, mask)
    for q, c in enumerate(clusters):
      values = rewards[q][mask[q]].astype(np.float64)
      for x in values:
        reward_states[c] = _welford_push(reward_states[c], x)
      if len(values):
        mean_states[c] = _welford_push(mean_states[c], values.mean())
  for acc, states in ((prior.rewards, reward_states), (prior.group_means, mean_states)):
    np.testing.assert_allclose(acc.count, [s[0] for s in states])
    np.testing.assert_allclose(acc.mean, [s[1] for s in states], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(acc.m2, [s[2] for s in states], atol=1e-4, rtol=1e-5)


def test_a_cluster_never_changes_from_other_clusters_rewards():
  rng = np.random.default_rng(3)
  rewards, mask, clusters = _random_batch(rng, 12, 4, 3)
  prior = adv_lib.update_prior(adv_lib.init_prior(3), rewards, clusters, mask)
  only_cluster_1 = np.ones(12, np.int32)
  new_rewards = rng.normal(10.0, 5.0, (12, 4)).astype(np.float32)
  for decay in (1.0, 0.5):
    updated = adv_lib.update_prior(prior, new_rewards, only_cluster_1, decay=decay)
    for before, after in zip(jax.tree.leaves(prior), jax.tree.leaves(updated), strict=True):
      np.testing.assert_array_equal(np.asarray(after)[[0, 2]], np.asarray(before)[[0, 2]])
      assert np.asarray(after)[1] != np.asarray(before)[1]


def test_decay_scales_old_count_and_m2():
  # One value 0 then one value 1 with decay 0.5: weights 0.5 and 1 -> count 1.5, mean 2/3,
  # M2 = 0.5 * (2/3)^2 + 1 * (1/3)^2 = 1/3 (no decay: count 2, mean 1/2, M2 1/2).
  prior = adv_lib.update_prior(adv_lib.init_prior(1), [[0.0]], np.zeros(1, np.int32))
  prior = adv_lib.update_prior(prior, [[1.0]], np.zeros(1, np.int32), decay=0.5)
  np.testing.assert_allclose(prior.rewards.count, [1.5])
  np.testing.assert_allclose(prior.rewards.mean, [2 / 3], rtol=1e-6)
  np.testing.assert_allclose(prior.rewards.m2, [1 / 3], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The paper's claims.


def test_saturated_groups_get_nonzero_advantages():
  # Theorem 3.2: with 0 < S and mu_glob in (0, 1), all-0 groups get -S * mu_glob < 0 and all-1
  # groups +S * (1 - mu_glob) > 0, where GRPO gives exactly 0.
  rewards = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]], np.float32)
  adv, _, stats = _ebpo(rewards, normalize=False)
  shrink, mu = np.asarray(stats["shrinkage"]), np.asarray(stats["mu_glob"])
  assert 0 < shrink[0] < 1 and 0 < mu[0] < 1
  np.testing.assert_allclose(adv[0], -shrink[0] * mu[0], rtol=1e-6)
  np.testing.assert_allclose(adv[1], shrink[1] * (1 - mu[1]), rtol=1e-6)
  assert float(adv_lib.zero_fraction(adv_lib.grpo(rewards))) == pytest.approx(8 / 12)
  for normalize in adv_lib.NORMALIZATIONS:
    adv, _, stats = _ebpo(rewards, normalize=normalize)
    assert np.all(np.asarray(adv)[:2] != 0), normalize
    assert float(stats["zero_frac"]) == 0.0


@pytest.mark.parametrize("g", [2, 4, 8])
def test_eb_baseline_mse_below_group_mean_in_the_gaussian_model(g):
  # Theorem 3.3: theta_q ~ N(0.5, 0.1^2), r ~ N(theta_q, 0.5^2). The group mean's MSE is
  # sigma^2 / G; the EB baseline's is lower whenever tau^2 > 0.
  rng = np.random.default_rng(4)
  theta = rng.normal(0.5, 0.1, 10_000)
  rewards = (theta[:, None] + rng.normal(0.0, 0.5, (10_000, g))).astype(np.float32)
  _, _, stats = _ebpo(rewards, normalize=False)
  eb_mse = np.mean((np.asarray(stats["baseline"])[:, 0] - theta) ** 2)
  group_mse = np.mean((rewards.mean(1) - theta) ** 2)
  assert group_mse == pytest.approx(0.25 / g, rel=0.05)
  assert eb_mse < 0.8 * group_mse


def test_shrinkage_falls_as_group_size_grows():
  rng = np.random.default_rng(5)
  p = rng.beta(1.0, 2.0, 2_000)
  means = []
  for g in (2, 4, 8, 16, 32):
    rewards = (rng.random((2_000, g)) < p[:, None]).astype(np.float32)
    means.append(float(jnp.mean(_ebpo(rewards)[2]["shrinkage"])))
  assert all(a > b for a, b in zip(means, means[1:], strict=False)), means
  assert means[-1] < 0.2 < means[0]


def test_decay_tracks_a_drifting_success_rate():
  # Success rate rises 0.2 -> 0.8 over 40 steps. Without decay mu_glob lags near the running
  # average (~0.5); decay 0.8 remembers about 5 steps.
  rng = np.random.default_rng(6)
  clusters = np.zeros(64, np.int32)
  priors = {1.0: adv_lib.init_prior(1), 0.8: adv_lib.init_prior(1)}
  for p in np.linspace(0.2, 0.8, 40):
    rewards = (rng.random((64, 4)) < p).astype(np.float32)
    for decay in priors:
      _, priors[decay], _ = adv_lib.ebpo(rewards, clusters, priors[decay], decay=decay)
  error = {d: abs(float(prior.rewards.mean[0]) - 0.8) for d, prior in priors.items()}
  assert error[0.8] < 0.1 < error[1.0]


# ---------------------------------------------------------------------------------------------
# Robustness and jit.


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_no_nan_when_every_reward_is_equal(value):
  rewards = np.full((4, 4), value, np.float32)
  for name in adv_lib.ESTIMATORS:
    estimator = adv_lib.Estimator(name)
    args = (rewards, None, np.zeros(4, np.int32), estimator.init_prior(2))
    adv, _, stats = estimator.with_stats(*args)
    metrics = estimator(*args)[2]
    for value in (adv, *stats.values(), *metrics.values()):
      assert np.all(np.isfinite(value)), name
  for normalize in adv_lib.NORMALIZATIONS:
    adv, prior, stats = _ebpo(rewards, normalize=normalize)
    np.testing.assert_array_equal(adv, 0.0)  # V = r exactly: no signal, and no NaN
    assert np.all(np.asarray(stats["shrinkage"]) == 1.0)


def test_no_nan_with_single_prompt_cluster_empty_prompt_and_huge_counts():
  rewards = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0], [1, 0, 0, 0]], np.float32)
  mask = np.ones((4, 4), bool)
  mask[3] = False  # a prompt without valid responses
  clusters = np.array([0, 0, 1, 2], np.int32)  # cluster 1 has one prompt, cluster 2 none valid
  big = jnp.full((3,), 3e7, jnp.float32)
  prior = adv_lib.PriorState(
    adv_lib.Welford(big, jnp.full((3,), 0.4), big * 0.24),
    adv_lib.Welford(big / 4, jnp.full((3,), 0.4), big / 4 * 0.05),
  )
  for normalize in adv_lib.NORMALIZATIONS:
    for p in (adv_lib.init_prior(3), prior):
      adv, new_prior, stats = adv_lib.ebpo(rewards, clusters, p, mask, normalize=normalize)
      leaves = [adv, *stats.values(), *jax.tree.leaves(new_prior)]
      assert all(np.all(np.isfinite(x)) for x in leaves), normalize
      np.testing.assert_array_equal(adv[3], 0.0)
  assert float(new_prior.rewards.count[0]) > 3e7


def test_out_of_range_cluster_ids_are_loud():
  adv, prior, _ = adv_lib.ebpo(REWARDS, np.array([0, 1, 2], np.int32), adv_lib.init_prior(2))
  assert np.all(np.isnan(adv))
  np.testing.assert_allclose(prior.rewards.count, [4.0, 4.0])  # the bad prompt is not merged


def test_no_retrace_on_second_call():
  traces = []
  estimator = adv_lib.Estimator("ebpo", adv_lib.EBPOParams(decay=0.9, normalize="group"))

  def step(rewards, mask, clusters, prior):
    traces.append(1)
    return estimator(rewards, mask, clusters, prior)

  step_jit = jax.jit(step)
  rng = np.random.default_rng(7)
  prior = estimator.init_prior(3)
  for _ in range(3):
    rewards, mask, clusters = _random_batch(rng, 8, 4, 3)
    _, prior, _ = step_jit(rewards, mask, clusters, prior)
  assert len(traces) == 1
  # Eager calls hit the jit caches too: same shapes and static settings, one compilation each.
  before = adv_lib.empirical_bayes._ebpo_jit._cache_size()
  for decay in (0.9, 0.5):
    adv_lib.ebpo(rewards, clusters, prior, mask, decay=decay, normalize="cluster")
  adv_lib.ebpo(rewards, clusters, prior, mask, decay=1.0, normalize="cluster")
  assert adv_lib.empirical_bayes._ebpo_jit._cache_size() == before + 1
  # Entries are static: equal hyperparameters share a compilation, other ones get their own.
  before = adv_lib.registry._run._cache_size()
  for eps in (1e-6, 1e-6, 1e-3):
    adv_lib.Estimator("grpo", adv_lib.GRPOParams(eps=eps))(
      rewards[:5], mask[:5], clusters[:5], prior
    )
  assert adv_lib.registry._run._cache_size() == before + 2


def test_every_estimator_has_one_calling_convention():
  for name in adv_lib.ESTIMATORS:
    estimator = adv_lib.Estimator(name)
    prior = estimator.init_prior(1)
    adv, new_prior, metrics = estimator(REWARDS, None, ONE_CLUSTER, prior)
    _, _, stats = estimator.with_stats(REWARDS, None, ONE_CLUSTER, prior)
    assert adv.shape == REWARDS.shape and stats["baseline"].shape == REWARDS.shape
    shapes = {key: np.shape(value) for key, value in metrics.items()}
    per_cluster_keys = {"ebpo/prior_mean", "ebpo/prior_std", "ebpo/shrinkage"}
    assert all(shape == () for key, shape in shapes.items() if key not in per_cluster_keys), shapes
    if name == "ebpo":
      assert {shapes[key] for key in per_cluster_keys} == {(1,)}  # per cluster, K = 1
    else:
      jax.tree.map(np.testing.assert_array_equal, new_prior, prior)
  mask = np.ones(REWARDS.shape, bool)
  mask[1, 2] = False
  # The entries compute what the public functions compute.
  same = {
    "grpo": adv_lib.grpo(REWARDS, mask, 1e-3),
    "dr_grpo": adv_lib.dr_grpo(REWARDS, mask),
    "rloo": adv_lib.rloo(REWARDS, mask),
    "js_shrinkage": adv_lib.js_shrinkage(REWARDS, mask, 1e-3),
    "ebpo": _ebpo(REWARDS, mask=mask, normalize="group", eps=1e-3)[0],
  }
  params = {
    "grpo": adv_lib.GRPOParams(eps=1e-3),
    "js_shrinkage": adv_lib.JSShrinkageParams(eps=1e-3),
  }
  params["ebpo"] = adv_lib.EBPOParams(normalize="group", eps=1e-3)
  for name, expected in same.items():
    estimator = adv_lib.Estimator(name, params.get(name))
    adv, _, _ = estimator(REWARDS, mask, ONE_CLUSTER, estimator.init_prior(1))
    np.testing.assert_allclose(adv, expected, rtol=1e-6, err_msg=name)
  with pytest.raises(ValueError, match="known: grpo, dr_grpo, rloo, js_shrinkage, ebpo"):
    adv_lib.Estimator("ppo")
  with pytest.raises(TypeError, match="grpo takes GRPOParams"):
    adv_lib.Estimator("grpo", adv_lib.EBPOParams())


def test_metrics_per_cluster_are_k_vectors_and_a_global_prior_is_a_scalar():
  rewards = np.array([[0, 0, 0, 1], [1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0]], np.float32)
  mask = np.ones(rewards.shape, bool)
  mask[3] = False  # no valid response: enters no mean
  clusters = np.array([0, 0, 2, 1], np.int32)
  per_cluster = adv_lib.Estimator("ebpo")
  prior = per_cluster.init_prior(3)
  assert prior.rewards.count.shape == (3,)
  adv, new_prior, metrics = per_cluster(rewards, mask, clusters, prior)
  _, _, stats = per_cluster.with_stats(rewards, mask, clusters, prior)
  assert sorted(metrics) == [
    "ebpo/prior_mean",
    "ebpo/prior_std",
    "ebpo/shrinkage",
    "ebpo/shrinkage_mean",
  ]
  # Clusters 0 and 2 got data: 4/8 and 4/4; cluster 1 has no valid response.
  np.testing.assert_allclose(metrics["ebpo/prior_mean"], [0.5, 0.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(metrics["ebpo/shrinkage_mean"], np.mean(stats["shrinkage"][:3]))
  # Cluster 0: group means 1/4 and 3/4 around 1/2 -> tau2 = 1/16, prior std 1/4 (a bug reading
  # the reward accumulator would give sigma = 1/2). sigma2 = 4/8 * 4/8 = 1/4, noise 1/4 / G = 1/16,
  # S = (1/16) / (1/16 + 1/16) = 1/2. Cluster 2 (all 1) and the empty cluster 1: a flat prior,
  # std 0 and S = 1 (all weight on the prior mean).
  np.testing.assert_allclose(metrics["ebpo/prior_std"], [0.25, 0.0, 0.0], rtol=1e-6)
  np.testing.assert_allclose(metrics["ebpo/shrinkage"], [0.5, 1.0, 1.0], rtol=1e-6)
  # Running mode, full groups: each prompt's S is its cluster's.
  np.testing.assert_allclose(
    stats["shrinkage"][:3], np.asarray(metrics["ebpo/shrinkage"])[clusters[:3]]
  )
  # One global prior: size 1, every cluster id read as 0, a scalar prior mean (8/12).
  global_prior = adv_lib.Estimator("ebpo", adv_lib.EBPOParams(per_cluster=False))
  prior = global_prior.init_prior(3)
  assert prior.rewards.count.shape == (1,)
  adv, new_prior, metrics = global_prior(rewards, mask, clusters, prior)
  assert {
    np.shape(metrics[k]) for k in ("ebpo/prior_mean", "ebpo/prior_std", "ebpo/shrinkage")
  } == {()}
  np.testing.assert_allclose(metrics["ebpo/prior_mean"], 8 / 12, rtol=1e-6)
  # Group means 1/4, 3/4, 1 around 2/3: tau2 = (25 + 1 + 16) / 144 / 3 = 7/72; sigma2 = 2/3 * 1/3
  # = 2/9, noise 2/9 / 4 = 1/18 = 4/72, S = 4 / (4 + 7) = 4/11.
  np.testing.assert_allclose(metrics["ebpo/prior_std"], np.sqrt(7 / 72), rtol=1e-6)
  np.testing.assert_allclose(metrics["ebpo/shrinkage"], 4 / 11, rtol=1e-6)
  expected, expected_prior, _ = _ebpo(rewards, mask=mask)  # cluster ids all 0, K = 1
  np.testing.assert_allclose(adv, expected, rtol=1e-6)  # eps, decay: constants vs traced
  jax.tree.map(np.testing.assert_array_equal, new_prior, expected_prior)
  js = adv_lib.Estimator("js_shrinkage")
  _, _, metrics = js(rewards, mask, clusters, js.init_prior(3))
  _, _, stats = js.with_stats(rewards, mask, clusters, js.init_prior(3))
  assert list(metrics) == ["js/shrinkage_mean"]
  np.testing.assert_allclose(metrics["js/shrinkage_mean"], np.mean(stats["shrinkage"][:3]))
  for name in ("grpo", "dr_grpo", "rloo"):
    estimator = adv_lib.Estimator(name)
    assert estimator.init_prior(3).rewards.count.shape == (1,)  # a placeholder
    assert estimator(rewards, mask, clusters, estimator.init_prior(3))[2] == {}


def test_from_config_builds_entries_from_any_mapping():
  ml_collections = pytest.importorskip("ml_collections")
  rl = ml_collections.ConfigDict(
    {
      "advantage": "ebpo",
      "eps": 1e-5,
      "ebpo": {"mode": "batch", "decay": 0.9, "normalize": "group", "per_cluster": False},
    }
  )
  estimator = adv_lib.from_config(rl)
  assert estimator == adv_lib.Estimator(
    "ebpo",
    adv_lib.EBPOParams(mode="batch", decay=0.9, normalize="group", per_cluster=False, eps=1e-5),
  )
  assert hash(estimator) == hash(adv_lib.from_config(rl.to_dict()))
  rl.advantage = "grpo"
  assert adv_lib.from_config(rl) == adv_lib.Estimator("grpo", adv_lib.GRPOParams(eps=1e-5))
  assert adv_lib.from_config({"advantage": "rloo"}) == adv_lib.Estimator("rloo")


@pytest.mark.parametrize(
  ("change", "message"),
  [
    ({"advantage": "ppo"}, "config.rl.advantage='ppo': unknown advantage estimator; known: grpo, "),
    ({"ebpo": {"decay": 1.5}}, r"config.rl.ebpo.decay=1.5: must lie in \(0, 1\]"),
    ({"ebpo": {"decay": 0.0}}, r"config.rl.ebpo.decay=0.0: must lie in \(0, 1\]"),
    ({"ebpo": {"mode": "online"}}, "config.rl.ebpo.mode='online': must be one of running, batch"),
    ({"ebpo": {"normalize": True}}, "config.rl.ebpo.normalize=True: must be one of batch, none"),
    ({"ebpo": {"per_cluster": "yes"}}, "config.rl.ebpo.per_cluster='yes': must be True or False"),
    ({"eps": -1e-6}, "config.rl.eps=-1e-06: must be a finite number >= 0"),
    ({"eps": None}, "config.rl.eps=None: must be a finite number >= 0"),
  ],
)
def test_from_config_names_the_bad_key_and_value(change, message):
  rl = {
    "advantage": "ebpo",
    "eps": 1e-6,
    "ebpo": {"mode": "running", "decay": 1.0, "normalize": "batch", "per_cluster": True},
  }
  rl = {**rl, **change, "ebpo": {**rl["ebpo"], **change.get("ebpo", {})}}
  with pytest.raises(ValueError, match=message):
    adv_lib.from_config(rl)


def test_from_config_names_a_missing_key():
  with pytest.raises(
    ValueError, match=r"config.rl.eps is missing \(needed by rl.advantage='grpo'\)"
  ):
    adv_lib.from_config({"advantage": "grpo"})


def test_hyperparameters_validate_and_name_field_and_value():
  with pytest.raises(ValueError, match=r"EBPOParams.decay=2: must lie in \(0, 1\]"):
    adv_lib.EBPOParams(decay=2)
  with pytest.raises(ValueError, match="GRPOParams.eps=nan: must be a finite number >= 0"):
    adv_lib.GRPOParams(eps=float("nan"))
  with pytest.raises(TypeError):
    adv_lib.GRPOParams(1e-6)  # keyword-only
  with pytest.raises(dataclasses.FrozenInstanceError):
    adv_lib.EBPOParams().decay = 0.5
  assert adv_lib.EBPOParams(eps=0) == adv_lib.EBPOParams(eps=0.0)


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"normalize": "std"}, "normalize must be True, False or one of"),
    ({"mode": "online"}, "mode must be one of"),
    ({"decay": 0.0}, r"decay must be in \(0, 1\]"),
    ({"decay": 1.5}, r"decay must be in \(0, 1\]"),
  ],
)
def test_bad_hyperparameters_fail_with_clear_messages(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _ebpo(REWARDS, **kwargs)


def test_bad_shapes_fail_with_clear_messages():
  with pytest.raises(ValueError, match=r"rewards must have shape \[B, G\]"):
    adv_lib.grpo(np.zeros(4, np.float32))
  with pytest.raises(ValueError, match="mask shape"):
    adv_lib.rloo(REWARDS, np.ones((3, 3), bool))
  with pytest.raises(ValueError, match=r"cluster_ids must be an int array of shape \[3\]"):
    adv_lib.ebpo(REWARDS, np.zeros(2, np.int32), adv_lib.init_prior(1))
  with pytest.raises(ValueError, match="num_clusters must be >= 1"):
    adv_lib.init_prior(0)


def test_all_equal_fraction_counts_the_groups_grpo_zeroes():
  rewards = np.array(
    [[1, 1, 1], [0, 1, 0], [2 / 3, 2 / 3, 2 / 3], [0, 5, 0], [7, 7, 7]], np.float32
  )
  mask = np.ones(rewards.shape, bool)
  mask[3, 1] = False  # all equal once the masked outlier is left out
  mask[4] = False  # no valid response: not a group
  # Groups 0, 2 and 3 of the 4 with a valid response are all equal: 3/4 (a bug counting the empty
  # group gives 4/5; one reading masked rewards gives 2/4).
  assert float(adv_lib.all_equal_fraction(rewards, mask)) == pytest.approx(3 / 4)
  assert float(adv_lib.all_equal_fraction(rewards)) == pytest.approx(3 / 5)
  # Exactly the share of GRPO's zero advantages for full groups of binary rewards.
  binary = np.array([[0, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]], np.float32)
  assert float(adv_lib.all_equal_fraction(binary)) == float(
    adv_lib.zero_fraction(adv_lib.grpo(binary))
  )
  assert float(adv_lib.all_equal_fraction(rewards, np.zeros(rewards.shape, bool))) == 0.0
  assert float(jax.jit(adv_lib.all_equal_fraction)(binary)) == pytest.approx(2 / 3)


def test_zero_and_signal_fractions():  # signal_fraction: the simulator's `signal` column
  adv = np.array([[0.0, 0.0], [0.5, 0.0], [0.0, 0.0]])
  mask = np.array([[True, True], [True, True], [False, False]])
  assert float(adv_lib.zero_fraction(adv, mask)) == pytest.approx(3 / 4)
  assert float(adv_lib.signal_fraction(adv, mask)) == pytest.approx(1 / 2)
  assert float(adv_lib.zero_fraction(adv)) == pytest.approx(5 / 6)
  assert float(adv_lib.zero_fraction(adv, np.zeros((3, 2), bool))) == 0.0


# ---------------------------------------------------------------------------------------------
# Groups whose rewards are all equal, at values float32 cannot represent.

UNREPRESENTABLE = (2 / 3, 0.2, 1.3)  # reasoning-gym partial credit
GROUP_SIZES = (3, 6, 7, 12)


def _equal_groups(value, g, masked):
  # Row 0: all equal; row 1: all equal but for one masked outlier (and a masked NaN when g > 3);
  # row 2 mixes values so the batch is not trivially constant.
  rewards = np.full((3, g), value, np.float32)
  mask = np.ones((3, g), bool)
  rewards[2, ::2] = 0.0
  if masked:
    rewards[1, 0], mask[1, 0] = 5.0, False
    if g > 3:
      rewards[1, -1], mask[1, -1] = np.nan, False
  return rewards, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("value", UNREPRESENTABLE)
def test_all_equal_groups_get_exactly_zero(value, g, masked):
  # float32 mean of 12 copies of 2/3 is not 2/3, so std ~ 1e-7 and GRPO's (r - mean) / (std + eps)
  # gave 0.06 there (1.3 at G = 12: 0.19) instead of 0.
  rewards, mask = _equal_groups(value, g, masked)
  mask_arg = mask if masked else None
  no_eps = functools.partial(adv_lib.grpo, eps=0.0)  # 0 / 0 would be NaN
  no_eps.__name__ = "grpo(eps=0)"
  for fn in (adv_lib.grpo, no_eps, adv_lib.dr_grpo, adv_lib.rloo):
    adv = np.asarray(fn(rewards, mask_arg))
    np.testing.assert_array_equal(adv[:2], 0.0, err_msg=fn.__name__)  # rows 0 and 1
    assert np.all(adv[2][mask[2]] != 0), fn.__name__
    expected = mask[:2].sum() / mask.sum()
    assert float(adv_lib.zero_fraction(adv, mask)) == pytest.approx(expected), fn.__name__
  # EBPO's "group" scaling falls back to the cluster std for such groups; never (r - V) / 1e-6.
  adv, _, _ = _ebpo(rewards, mask=mask_arg, normalize="group")
  raw, _, _ = _ebpo(rewards, mask=mask_arg, normalize="none")
  cluster_std = np.sqrt(np.var(rewards[mask].astype(np.float64)))
  np.testing.assert_allclose(adv[:2], raw[:2] / cluster_std, rtol=1e-4, atol=1e-6)
  # A cluster whose every reward is the value: V = r exactly, whatever the scaling.
  for normalize in adv_lib.NORMALIZATIONS:
    adv, _, _ = _ebpo(np.full((3, g), value, np.float32), normalize=normalize, decay=0.9)
    np.testing.assert_array_equal(adv, 0.0, err_msg=normalize)
