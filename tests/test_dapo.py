"""DAPO's pieces in the trainer: the soft overlong penalty and dynamic sampling (drop groups whose
rewards are all equal, refill from further prompts, bounded)."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ebpo_jax import losses, train


def test_overlong_penalty_golden_values():
  # max_len 10, buffer 4: free up to 6 tokens, then -(len - 6) / 4 down to -1 at 10.
  got = losses.overlong_penalty(jnp.array([0, 6, 7, 8, 10]), max_len=10, buffer=4, penalty=1.0)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0])
  half = losses.overlong_penalty(jnp.array([10]), max_len=10, buffer=4, penalty=0.5)
  np.testing.assert_allclose(half, [-0.5])
  off = losses.overlong_penalty(jnp.array([10, 3]), max_len=10, buffer=0)
  np.testing.assert_array_equal(off, [0.0, 0.0])
  with pytest.raises(ValueError, match="overlong buffer"):
    losses.overlong_penalty(jnp.array([1]), max_len=10, buffer=11)


class FakeRollouts:
  """Rollouts whose tokens name (prompt id, sample) and whose rewards are given per round."""

  def __init__(self, config, rewards_per_round):
    self.config, self._rewards = config, iter(rewards_per_round)

  def sample(self, params, rows, rng, *, group_size, greedy):
    del params, rng, greedy
    width = 2 + rows[0]["id"] // 4  # rounds differ in prompt width: 2, 3, 4
    ids = np.array([[row["id"]] * width for row in rows], np.int32)
    tokens = np.array([[row["id"] * 10 + g, 0] for row in rows for g in range(group_size)])
    out = types.SimpleNamespace(
      tokens=jnp.asarray(tokens, jnp.int32),
      mask=jnp.ones(tokens.shape, bool).at[:, 1].set(False),
      logprobs=jnp.asarray(-tokens, jnp.float32),
      truncated=jnp.zeros(len(tokens), bool),
      lengths=jnp.ones(len(tokens), jnp.int32),
    )
    return ids, np.ones_like(ids, bool), out

  def score(self, out, rows, group_size):
    del out, rows, group_size
    return np.asarray(next(self._rewards), np.float32), 0


def make_config(dynamic: bool, refills: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "rl": {
        "group_size": 2,
        "dynamic_sampling": dynamic,
        "max_refill_rounds": refills,
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
      },
      "sampling": {"max_new_tokens": 2},
    }
  )


KEY = jax.random.key(0)
ROWS = [{"id": i, "cluster": i % 2, "prompt": f"p{i}", "answer": "0"} for i in range(12)]
ROUND_1 = [[1, 1], [0, 1], [0, 0], [1, 0]]  # prompts 0-3: groups 1 and 3 carry a signal
ROUND_2 = [[0, 0], [1, 0], [0, 1], [1, 1]]  # prompts 4-7: groups 5 and 6


def batches():
  return iter([np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)])


def test_dynamic_sampling_refills_with_varied_groups_in_order():
  rollouts = FakeRollouts(make_config(True, 3), [ROUND_1, ROUND_2])
  batch, rows, logs = train.collect_batch(rollouts, None, KEY, ROWS, batches())
  assert [r["id"] for r in rows] == [1, 3, 5, 6]
  np.testing.assert_array_equal(batch["rewards"], [[0, 1], [1, 0], [1, 0], [0, 1]])
  np.testing.assert_array_equal(batch["cluster_ids"], [1, 1, 1, 0])
  # Responses stay with their prompts: token = prompt id * 10 + sample.
  np.testing.assert_array_equal(batch["tokens"][:, 0], [10, 11, 30, 31, 50, 51, 60, 61])
  np.testing.assert_array_equal(batch["old_logps"][:, 0], -batch["tokens"][:, 0])
  # Prompts of different widths are left-padded to the widest; the pad is masked.
  assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (4, 3)
  np.testing.assert_array_equal(batch["prompt_mask"].sum(1), [2, 2, 3, 3])
  np.testing.assert_array_equal(
    batch["prompt_ids"][batch["prompt_mask"]], [1, 1, 3, 3, 5, 5, 5, 6, 6, 6]
  )
  assert logs["dapo/kept_frac"] == 0.5 and logs["dapo/rounds"] == 2
  assert logs["dapo/filled_groups"] == 0 and logs["rollout/tokens"] == 16


def test_dynamic_sampling_is_bounded_and_fills_with_dropped_groups():
  rollouts = FakeRollouts(make_config(True, 0), [ROUND_1])
  batch, rows, logs = train.collect_batch(rollouts, None, KEY, ROWS, batches())
  assert [r["id"] for r in rows] == [1, 3, 0, 2]
  assert logs["dapo/rounds"] == 1 and logs["dapo/filled_groups"] == 2
  np.testing.assert_array_equal(batch["tokens"][:, 0], [10, 11, 30, 31, 0, 1, 20, 21])


def test_without_dynamic_sampling_the_first_batch_is_used_as_sampled():
  rollouts = FakeRollouts(make_config(False, 3), [ROUND_1])
  batch, rows, logs = train.collect_batch(rollouts, None, KEY, ROWS, batches())
  assert [r["id"] for r in rows] == [0, 1, 2, 3]
  np.testing.assert_array_equal(batch["rewards"], ROUND_1)
  assert "dapo/kept_frac" not in logs


def test_overlong_penalty_is_added_to_the_rewards():
  config = make_config(False, 0)
  config.rl.overlong_buffer = 1  # max 2 tokens: length 1 is free, 2 would cost the penalty
  rollouts = FakeRollouts(config, [ROUND_1])
  batch, _, logs = train.collect_batch(rollouts, None, KEY, ROWS, batches())
  np.testing.assert_array_equal(batch["rewards"], ROUND_1)  # every fake response has length 1
  assert logs["reward/overlong_penalty"] == 0.0
