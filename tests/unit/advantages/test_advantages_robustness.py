"""Tests for ebpo_jax.advantages: robustness, jit, the registry's calling convention and checks,
and groups whose rewards are all equal at values float32 cannot represent."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import advantages as adv_lib
from tests.helpers.advantages import ONE_CLUSTER, REWARDS, random_batch, run_ebpo

# ---------------------------------------------------------------------------------------------
# Robustness and jit.


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_no_nan_when_every_reward_is_equal(value):
  rewards = np.full((4, 4), value, np.float32)
  for name in adv_lib.ESTIMATORS:
    estimator = adv_lib.Estimator(name)
    args = dict(cluster_ids_b=np.zeros(4, np.int32), prior=estimator.init_prior(2))
    adv, _, stats = estimator.with_stats(rewards, **args)
    metrics = estimator(rewards, **args)[2]
    for value in (adv, *stats.values(), *metrics.values()):
      assert np.all(np.isfinite(value)), name
  for normalize in adv_lib.NORMALIZATIONS:
    adv, prior, stats = run_ebpo(rewards, normalize=normalize)
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
    return estimator(rewards, cluster_ids_b=clusters, prior=prior, mask_bg=mask)

  step_jit = jax.jit(step)
  rng = np.random.default_rng(7)
  prior = estimator.init_prior(3)
  for _ in range(3):
    rewards, mask, clusters = random_batch(rng, 8, 4, 3)
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
      rewards[:5], cluster_ids_b=clusters[:5], prior=prior, mask_bg=mask[:5]
    )
  assert adv_lib.registry._run._cache_size() == before + 2


def test_every_estimator_has_one_calling_convention():
  for name in adv_lib.ESTIMATORS:
    estimator = adv_lib.Estimator(name)
    prior = estimator.init_prior(1)
    adv, new_prior, metrics = estimator(REWARDS, cluster_ids_b=ONE_CLUSTER, prior=prior)
    _, _, stats = estimator.with_stats(REWARDS, cluster_ids_b=ONE_CLUSTER, prior=prior)
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
    "ebpo": run_ebpo(REWARDS, mask=mask, normalize="group", eps=1e-3)[0],
  }
  params = {
    "grpo": adv_lib.GRPOParams(eps=1e-3),
    "js_shrinkage": adv_lib.JSShrinkageParams(eps=1e-3),
  }
  params["ebpo"] = adv_lib.EBPOParams(normalize="group", eps=1e-3)
  for name, expected in same.items():
    estimator = adv_lib.Estimator(name, params.get(name))
    adv, _, _ = estimator(
      REWARDS, cluster_ids_b=ONE_CLUSTER, prior=estimator.init_prior(1), mask_bg=mask
    )
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
  adv, new_prior, metrics = per_cluster(rewards, cluster_ids_b=clusters, prior=prior, mask_bg=mask)
  _, _, stats = per_cluster.with_stats(rewards, cluster_ids_b=clusters, prior=prior, mask_bg=mask)
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
  adv, new_prior, metrics = global_prior(rewards, cluster_ids_b=clusters, prior=prior, mask_bg=mask)
  assert {
    np.shape(metrics[k]) for k in ("ebpo/prior_mean", "ebpo/prior_std", "ebpo/shrinkage")
  } == {()}
  np.testing.assert_allclose(metrics["ebpo/prior_mean"], 8 / 12, rtol=1e-6)
  # Group means 1/4, 3/4, 1 around 2/3: tau2 = (25 + 1 + 16) / 144 / 3 = 7/72; sigma2 = 2/3 * 1/3
  # = 2/9, noise 2/9 / 4 = 1/18 = 4/72, S = 4 / (4 + 7) = 4/11.
  np.testing.assert_allclose(metrics["ebpo/prior_std"], np.sqrt(7 / 72), rtol=1e-6)
  np.testing.assert_allclose(metrics["ebpo/shrinkage"], 4 / 11, rtol=1e-6)
  expected, expected_prior, _ = run_ebpo(rewards, mask=mask)  # cluster ids all 0, K = 1
  np.testing.assert_allclose(adv, expected, rtol=1e-6)  # eps, decay: constants vs traced
  jax.tree.map(np.testing.assert_array_equal, new_prior, expected_prior)
  js = adv_lib.Estimator("js_shrinkage")
  _, _, metrics = js(rewards, cluster_ids_b=clusters, prior=js.init_prior(3), mask_bg=mask)
  _, _, stats = js.with_stats(rewards, cluster_ids_b=clusters, prior=js.init_prior(3), mask_bg=mask)
  assert list(metrics) == ["js/shrinkage_mean"]
  np.testing.assert_allclose(metrics["js/shrinkage_mean"], np.mean(stats["shrinkage"][:3]))
  for name in ("grpo", "dr_grpo", "rloo"):
    estimator = adv_lib.Estimator(name)
    assert estimator.init_prior(3).rewards.count.shape == (1,)  # a placeholder
    assert (
      estimator(rewards, cluster_ids_b=clusters, prior=estimator.init_prior(3), mask_bg=mask)[2]
      == {}
    )


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
    run_ebpo(REWARDS, **kwargs)


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
  adv, _, _ = run_ebpo(rewards, mask=mask_arg, normalize="group")
  raw, _, _ = run_ebpo(rewards, mask=mask_arg, normalize="none")
  cluster_std = np.sqrt(np.var(rewards[mask].astype(np.float64)))
  np.testing.assert_allclose(adv[:2], raw[:2] / cluster_std, rtol=1e-4, atol=1e-6)
  # A cluster whose every reward is the value: V = r exactly, whatever the scaling.
  for normalize in adv_lib.NORMALIZATIONS:
    adv, _, _ = run_ebpo(np.full((3, g), value, np.float32), normalize=normalize, decay=0.9)
    np.testing.assert_array_equal(adv, 0.0, err_msg=normalize)
