"""The estimators' shared golden example and a one-call EBPO and a random
masked batch for the advantage tests."""

import numpy as np

from ebpo_jax import advantages as adv_lib

# Three prompts in one cluster (the golden example).
REWARDS = np.array([[0, 0, 0, 0], [1, 1, 0, 1], [1, 0, 1, 1]], np.float32)
ONE_CLUSTER = np.zeros(3, np.int32)


def run_ebpo(rewards, cluster_ids=None, prior=None, mask=None, **hparams):
  rewards = np.asarray(rewards, np.float32)
  cluster_ids = np.zeros(len(rewards), np.int32) if cluster_ids is None else cluster_ids
  prior = adv_lib.init_prior(1) if prior is None else prior
  return adv_lib.ebpo(rewards, cluster_ids, prior, mask, **hparams)


def random_batch(rng, b, g, k, binary=True):
  rewards = rng.integers(0, 2, (b, g)) if binary else rng.normal(0.5, 1.0, (b, g))
  mask = rng.random((b, g)) > 0.25
  mask[0] = False  # one prompt without any valid response
  mask[1, 1:] = False  # one prompt with a single valid response
  return rewards.astype(np.float32), mask, rng.integers(0, k, b).astype(np.int32)
