"""Tests for ebpo_jax.advantages: golden values, NumPy references, Welford merges, paper claims."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ebpo_jax import advantages as adv_lib
from tests.helpers.advantages import ONE_CLUSTER, REWARDS, random_batch, run_ebpo

# ---------------------------------------------------------------------------------------------
# Golden values, worked by hand.


def test_ebpo_golden_raw_advantages():
  # 12 rewards, 6 ones: mu_glob = 0.5, sigma2 = 0.25 (population).
  # Group means 0, 0.75, 0.75 (mean 0.5): tau2 = (0.25 + 0.0625 + 0.0625) / 3 = 0.125.
  # S = (0.25 / 4) / (0.0625 + 0.125) = 1/3 for every prompt.
  # All-zero group: V = (2/3) * 0 + (1/3) * 0.5 = 1/6, raw = -1/6.
  # [1,1,0,1]: V = (2/3) * 0.75 + (1/3) * 0.5 = 2/3, raw = +1/3 and -2/3.
  # (Unbiased tau2 = 0.1875 would give S = 1/4, raw -1/8; GRPO gives 0 for the all-zero group.)
  adv, prior, stats = run_ebpo(REWARDS, normalize=False)
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
  adv, _, _ = run_ebpo(REWARDS, normalize=True)
  np.testing.assert_allclose(adv[0], [-0.428174] * 4, rtol=1e-5)
  np.testing.assert_allclose(adv[1, 2], -2 / 3 / 0.389249, rtol=1e-5)
  same, _, _ = run_ebpo(REWARDS, normalize="batch")
  np.testing.assert_array_equal(adv, same)


def test_ebpo_golden_group_and_cluster_normalisation():
  # "group": [1,1,0,1] has unbiased std 0.5: 1/3 / 0.5 = 2/3, -2/3 / 0.5 = -4/3.
  # The all-zero group has std 0, so it uses its cluster's sqrt(sigma2) = 0.5: -1/6 / 0.5 = -1/3
  # (dividing by std + eps instead would give -1.7e5).
  adv, _, _ = run_ebpo(REWARDS, normalize="group")
  np.testing.assert_allclose(adv[0], [-1 / 3] * 4, rtol=1e-5)
  np.testing.assert_allclose(adv[1], [2 / 3, 2 / 3, -4 / 3, 2 / 3], rtol=1e-5)
  # "cluster": everything divided by sqrt(sigma2) = 0.5.
  adv, _, _ = run_ebpo(REWARDS, normalize="cluster")
  np.testing.assert_allclose(adv[1], [2 / 3, 2 / 3, -4 / 3, 2 / 3], rtol=1e-5)
  np.testing.assert_allclose(adv[0], [-1 / 3] * 4, rtol=1e-5)
  raw, _, _ = run_ebpo(REWARDS, normalize="none")
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
  _, _, stats = js.with_stats(REWARDS, cluster_ids_b=ONE_CLUSTER, prior=js.init_prior(1))
  np.testing.assert_allclose(stats["shrinkage"][1], 2 / 11, rtol=1e-5)


def test_masked_entries_get_zero_and_enter_no_statistic():
  # Masking the 0 out of [1, 1, 0, 1] leaves [1, 1, 1]: GRPO 0 everywhere, RLOO 0.
  mask = np.array([[True, True, False, True]])
  for fn in (adv_lib.grpo, adv_lib.dr_grpo, adv_lib.rloo, adv_lib.js_shrinkage):
    np.testing.assert_array_equal(fn(REWARDS[1:2], mask), np.zeros((1, 4)))
  # EBPO with a masked entry equals EBPO on the batch without that entry.
  rewards = np.array([[0, 0, 0, 5], [1, 1, 0, 1], [1, 0, 1, 1]], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
  adv, prior, stats = run_ebpo(rewards, mask=mask, normalize=True)
  assert adv[0, 3] == 0.0
  np.testing.assert_allclose(prior.rewards.count, [11.0])
  assert float(prior.rewards.mean[0]) == pytest.approx(6 / 11, rel=1e-6)  # the 5 is not in it
  assert float(stats["zero_frac"]) == 0.0  # the masked zero is not counted
  # A masked NaN reward (a failed verifier) changes nothing either.
  nan_rewards = np.where(mask, rewards, np.nan).astype(np.float32)
  for name in adv_lib.ESTIMATORS:
    fn = adv_lib.Estimator(name)
    kw = dict(cluster_ids_b=ONE_CLUSTER, prior=adv_lib.init_prior(1), mask_bg=mask)
    nan_adv, nan_prior, _ = fn(nan_rewards, **kw)
    clean_adv, clean_prior, _ = fn(rewards, **kw)
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


def _nprun_ebpo(rewards, mask, cluster_ids, np_prior, normalize="batch", eps=1e-6):
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


@pytest.mark.parametrize("binary", [True, False])
def test_stateless_estimators_match_numpy(binary):
  rewards, mask, _ = random_batch(np.random.default_rng(0), 16, 6, 1, binary)
  np.testing.assert_allclose(adv_lib.grpo(rewards, mask), _np_grpo(rewards, mask), atol=2e-4)
  np.testing.assert_allclose(adv_lib.rloo(rewards, mask), _np_rloo(rewards, mask), atol=1e-5)
  np.testing.assert_allclose(adv_lib.js_shrinkage(rewards, mask), _np_js(rewards, mask), atol=1e-4)


@pytest.mark.parametrize("normalize", ["batch", "none", "group", "cluster"])
def test_ebpo_running_matches_numpy_over_steps(normalize):
  rng, k, decay = np.random.default_rng(1), 3, 0.8
  prior, np_prior = adv_lib.init_prior(k), _NpPrior(k)
  for _ in range(4):
    rewards, mask, clusters = random_batch(rng, 12, 4, k)
    clusters[:3] = [0, 1, 2]  # every cluster has data, so every prompt reads a non-empty prior
    adv, prior, _ = adv_lib.ebpo(rewards, clusters, prior, mask, decay=decay, normalize=normalize)
    np_prior.update(rewards, mask, clusters, decay)
    expected = _nprun_ebpo(rewards, mask, clusters, np_prior, normalize)
    np.testing.assert_allclose(adv, expected, atol=2e-4, rtol=1e-4)


def test_ebpo_batch_mode_reads_the_batch_and_returns_the_running_prior():
  rng = np.random.default_rng(2)
  history, mask0, clusters0 = random_batch(rng, 12, 4, 2)
  prior = adv_lib.update_prior(adv_lib.init_prior(2), history, clusters0, mask0)
  rewards, mask, clusters = random_batch(rng, 12, 4, 2)
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
  rewards, mask, clusters = random_batch(rng, 12, 4, 3)
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
  adv, _, stats = run_ebpo(rewards, normalize=False)
  shrink, mu = np.asarray(stats["shrinkage"]), np.asarray(stats["mu_glob"])
  assert 0 < shrink[0] < 1 and 0 < mu[0] < 1
  np.testing.assert_allclose(adv[0], -shrink[0] * mu[0], rtol=1e-6)
  np.testing.assert_allclose(adv[1], shrink[1] * (1 - mu[1]), rtol=1e-6)
  assert float(adv_lib.zero_fraction(adv_lib.grpo(rewards))) == pytest.approx(8 / 12)
  for normalize in adv_lib.NORMALIZATIONS:
    adv, _, stats = run_ebpo(rewards, normalize=normalize)
    assert np.all(np.asarray(adv)[:2] != 0), normalize
    assert float(stats["zero_frac"]) == 0.0


@pytest.mark.parametrize("g", [2, 4, 8])
def test_eb_baseline_mse_below_group_mean_in_the_gaussian_model(g):
  # Theorem 3.3: theta_q ~ N(0.5, 0.1^2), r ~ N(theta_q, 0.5^2). The group mean's MSE is
  # sigma^2 / G; the EB baseline's is lower whenever tau^2 > 0.
  rng = np.random.default_rng(4)
  theta = rng.normal(0.5, 0.1, 10_000)
  rewards = (theta[:, None] + rng.normal(0.0, 0.5, (10_000, g))).astype(np.float32)
  _, _, stats = run_ebpo(rewards, normalize=False)
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
    means.append(float(jnp.mean(run_ebpo(rewards)[2]["shrinkage"])))
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
