"""DAPO's pieces in the trainer: the soft overlong penalty and dynamic sampling (drop groups whose
rewards are all equal, refill from further prompts, bounded)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ebpo_jax import keys as keys_lib
from ebpo_jax import losses, sampling, sharding
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import options as rollout_options
from ebpo_jax.rollouts import worker as worker_lib


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


class FakeSampler:
  """A sampler whose tokens name (prompt id, sample) and whose rewards are given per round."""

  def __init__(self, config, rewards_per_round):
    self._rewards = iter(rewards_per_round)
    self.options = rollout_options.RolloutOptions(
      seed=0,
      sampling=sampling.DecodeOptions(
        max_new_tokens=config.sampling.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        compact=False,
        prompts_per_call=0,
      ),
      batch=rollout_options.BatchOptions.from_config(config),
      eval=rollout_options.EvalOptions(num_samples=1, greedy=True),
    )
    self.mesh = sharding.make_mesh({"fsdp": -1}, jax.devices()[:1])

  def rollout(self, params, rows, key, *, group_size, greedy, training) -> worker_lib.Rollout:
    del params, key, greedy, training
    width = 2 + rows[0]["id"] // 4  # rounds differ in prompt width: 2, 3, 4
    ids = np.array([[row["id"]] * width for row in rows], np.int32)
    tokens = np.array([[row["id"] * 10 + g, 0] for row in rows for g in range(group_size)])
    return worker_lib.Rollout(
      rows=list(rows),
      texts=[str(t) for t in tokens[:, 0]],
      rewards=np.asarray(next(self._rewards), np.float32),
      lengths=np.ones(len(tokens), np.int32),
      errors=0,
      prompt_ids=jnp.asarray(ids),
      prompt_mask=jnp.ones(ids.shape, bool),
      tokens=jnp.asarray(tokens, jnp.int32),
      mask=jnp.ones(tokens.shape, bool).at[:, 1].set(False),
      loss_mask=jnp.ones(tokens.shape, bool).at[:, 1].set(False),
      old_logps=jnp.asarray(-tokens, jnp.float32),
      truncated=jnp.zeros(len(tokens), bool),
      nonfinite=jnp.zeros(len(tokens), bool),
    )


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


ROWS = [{"id": i, "cluster": i % 2, "prompt": f"p{i}", "answer": "0"} for i in range(12)]
ROUND_1 = [[1, 1], [0, 1], [0, 0], [1, 0]]  # prompts 0-3: groups 1 and 3 carry a signal
ROUND_2 = [[0, 0], [1, 0], [0, 1], [1, 1]]  # prompts 4-7: groups 5 and 6


def batches():
  return iter([np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)])


def collect(sampler):
  """(batch as NumPy, its rollout, logs) of `rollout_batch.collect_batch` on ROWS."""
  keys = keys_lib.step_keys(jax.random.PRNGKey(0), 0, sampler.options.batch.max_refill_rounds)
  batch, rollout, logs = rollout_batch.collect_batch(sampler, None, keys, ROWS, batches())
  return jax.tree.map(np.asarray, batch), rollout, logs


def test_dynamic_sampling_refills_with_varied_groups_in_order():
  batch, rollout, logs = collect(FakeSampler(make_config(True, 3), [ROUND_1, ROUND_2]))
  assert [r["id"] for r in rollout.rows] == [1, 3, 5, 6]
  np.testing.assert_array_equal(batch["rewards"], [[0, 1], [1, 0], [1, 0], [0, 1]])
  np.testing.assert_array_equal(batch["cluster_ids"], [1, 1, 1, 0])
  # Responses stay with their prompts: token = prompt id * 10 + sample.
  np.testing.assert_array_equal(batch["tokens"][:, 0], [10, 11, 30, 31, 50, 51, 60, 61])
  np.testing.assert_array_equal(batch["old_logps"][:, 0], -batch["tokens"][:, 0])
  # The host fields follow the same groups.
  assert rollout.texts == ["10", "11", "30", "31", "50", "51", "60", "61"]
  np.testing.assert_array_equal(rollout.rewards, batch["rewards"])
  # Prompts of different widths are left-padded to the widest; the pad is masked.
  assert batch["prompt_ids"].shape == batch["prompt_mask"].shape == (4, 3)
  np.testing.assert_array_equal(batch["prompt_mask"].sum(1), [2, 2, 3, 3])
  np.testing.assert_array_equal(
    batch["prompt_ids"][batch["prompt_mask"]], [1, 1, 3, 3, 5, 5, 5, 6, 6, 6]
  )
  assert logs["dapo/kept_frac"] == 0.5 and logs["dapo/rounds"] == 2
  assert logs["dapo/filled_groups"] == 0 and logs["rollout/tokens"] == 16


def test_dynamic_sampling_is_bounded_and_fills_with_dropped_groups():
  batch, rollout, logs = collect(FakeSampler(make_config(True, 0), [ROUND_1]))
  assert [r["id"] for r in rollout.rows] == [1, 3, 0, 2]
  assert logs["dapo/rounds"] == 1 and logs["dapo/filled_groups"] == 2
  np.testing.assert_array_equal(batch["tokens"][:, 0], [10, 11, 30, 31, 0, 1, 20, 21])


def test_without_dynamic_sampling_the_first_batch_is_used_as_sampled():
  batch, rollout, logs = collect(FakeSampler(make_config(False, 3), [ROUND_1]))
  assert [r["id"] for r in rollout.rows] == [0, 1, 2, 3]
  np.testing.assert_array_equal(batch["rewards"], ROUND_1)
  assert "dapo/kept_frac" not in logs


def test_overlong_penalty_is_added_to_the_rewards():
  config = make_config(False, 0)
  config.rl.overlong_buffer = 1  # max 2 tokens: length 1 is free, 2 would cost the penalty
  batch, _, logs = collect(FakeSampler(config, [ROUND_1]))
  np.testing.assert_array_equal(batch["rewards"], ROUND_1)  # every fake response has length 1
  assert logs["reward/overlong_penalty"] == 0.0
