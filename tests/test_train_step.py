"""train_step in process: gradient accumulation, the prior in the carry, the non-finite policy."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import sharding, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, G, P, N, V = 8, 4, 6, 5, 18


def load_config(**overrides):
  spec = importlib.util.spec_from_file_location("arith_ebpo", ROOT / "configs" / "arith_ebpo.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("runlocal")
  config.rl.group_size = G
  config.train.batch_size = B
  config.train.mini_batch_size = B
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


class VocabOnly:
  vocab_size = V


def make_state(config):
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
  model, params = train.build_model(config, VocabOnly(), mesh)
  optimizer = train.make_optimizer(config.train, 10)
  state = train.create_state(config, params, optimizer, num_clusters=2)
  return model, optimizer, state, mesh


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt_mask = np.ones((B, P), bool)
  prompt_mask[0, :2] = False  # a left-padded prompt
  mask = np.ones((B * G, N), bool)
  mask[::3, 3:] = False  # some completions stopped early
  return {
    "prompt_ids": rng.integers(3, V, (B, P)).astype(np.int32),
    "prompt_mask": prompt_mask,
    "tokens": rng.integers(3, V, (B * G, N)).astype(np.int32),
    "completion_mask": mask,
    "old_logps": np.log(rng.uniform(0.05, 0.3, (B * G, N))).astype(np.float32),
    "truncated": np.zeros(B * G, bool),
    "rewards": rng.integers(0, 2, (B, G)).astype(np.float32),
    "cluster_ids": np.array([0] * 4 + [1] * 4, np.int32),
  }


def run_step(config, batch):
  model, optimizer, state, mesh = make_state(config)
  step = jax.jit(
    lambda s, b: train.train_step(s, b, model=model, optimizer=optimizer, config=config)
  )
  return step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))


def test_gradient_accumulation_does_not_change_the_update():
  batch = make_batch()
  whole, m_whole = run_step(load_config(**{"train.micro_batch_size": 0}), batch)
  chunked, m_chunked = run_step(load_config(**{"train.micro_batch_size": 8}), batch)
  # Adam's first step is scale-invariant, so the loss and the pre-clip gradient norm are what
  # expose a per-micro-batch normalisation (it would scale both by the number of chunks, 4).
  assert float(m_whole["loss"]) == pytest.approx(float(m_chunked["loss"]), rel=1e-5, abs=1e-7)
  assert float(m_whole["grad_norm"]) == pytest.approx(float(m_chunked["grad_norm"]), rel=1e-5)
  assert float(m_whole["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(chunked.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # updates are ~lr = 3e-4


def test_prior_is_threaded_through_the_carry():
  batch = make_batch()
  new_state, metrics = run_step(load_config(), batch)
  # Cluster 0 holds prompts 0-3: 4 * G rewards and 4 group means were merged (not 8 * G: a
  # prior that ignores cluster ids would count every reward in both clusters).
  np.testing.assert_array_equal(new_state.prior.rewards.count, [4 * G, 4 * G])
  np.testing.assert_array_equal(new_state.prior.group_means.count, [4, 4])
  expected = batch["rewards"][:4].mean(), batch["rewards"][4:].mean()
  np.testing.assert_allclose(new_state.prior.rewards.mean, expected, rtol=1e-6)
  assert int(new_state.step) == 1
  assert 0.0 <= float(metrics["ebpo/shrinkage_mean"]) <= 1.0


def test_non_finite_loss_skips_the_update_and_counts_it():
  batch = make_batch()
  batch["old_logps"][1, 0] = np.nan  # a valid token: the loss becomes NaN
  config = load_config()
  model, optimizer, state, mesh = make_state(config)
  before = jax.tree.map(np.asarray, state.params)
  step = jax.jit(
    lambda s, b: train.train_step(s, b, model=model, optimizer=optimizer, config=config)
  )
  new_state, metrics = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
  assert float(metrics["bad_updates"]) == 1.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state.params), strict=True):
    np.testing.assert_array_equal(a, b)


def test_sequences_put_completions_after_left_padded_prompts():
  ids = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]])
  mask = ids > 0
  tokens = jnp.array([[11, 12], [13, 2], [14, 15], [16, 17]])
  seqs = train.build_sequences(ids, mask, tokens, tokens > 0, group_size=2)
  # Prompt 0 has 2 real tokens at positions 0, 1; its completions continue at 2, 3.
  np.testing.assert_array_equal(seqs["positions"][0], [0, 0, 0, 1, 2, 3])
  np.testing.assert_array_equal(seqs["positions"][3], [0, 1, 2, 3, 4, 5])
  np.testing.assert_array_equal(seqs["input_ids"][1], [0, 0, 5, 6, 13, 2])
