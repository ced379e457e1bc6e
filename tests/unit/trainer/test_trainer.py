"""The trainer's host loop on its parts: named PRNG streams, explicit transfers, resume first."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import data
from ebpo_jax import keys as keys_lib
from ebpo_jax.models import lora
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import worker as worker_lib
from ebpo_jax.sampling import sequences
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import step as step_lib
from ebpo_jax.trainer import task_rows
from tests.helpers import tiny_step as tiny_step_lib
from tests.helpers.lora import trained_lora

# On one device: these tests are about the host loop's parts, not its sharding (the step on 8
# devices equals it on 1: e2e/test_train_step.py); an 8-device program
# compiles several times slower.
tiny_steps = functools.partial(tiny_step_lib.tiny_steps, num_devices=1)


# ----------------------------------------------------------------------------- PRNG streams


def _key_bytes(key: jax.Array) -> bytes:
  return np.asarray(key).tobytes()


def test_no_two_uses_share_a_key():
  """Every key a run uses in its first steps (rollout, each refill round, the PPO shuffle, the
  evaluation of each step, LoRA dropout, the sampler calls of a chunked rollout) is distinct. The
  old code's first refill round reused the step's shuffle key, and its second the previous step's
  eval key."""
  rng = jax.random.PRNGKey(0)
  used = {}
  for step in range(6):
    keys = keys_lib.step_keys(rng, jnp.asarray(step, jnp.int32), 3)
    named = {"rollout": keys.rollout, "shuffle": keys.shuffle, "eval": keys.eval}
    named["lora_dropout"] = keys.lora_dropout
    named.update({f"refill{r}": k for r, k in enumerate(keys.refill)})
    named.update({f"call{c}": k for c, k in enumerate(keys_lib.split_keys(keys.rollout, 4))})
    for name, key in named.items():
      used.setdefault(_key_bytes(key), []).append(f"step {step} {name}")
  shared = [uses for uses in used.values() if len(uses) > 1]
  assert not shared, f"keys used twice: {shared}"


def test_step_keys_are_the_same_on_the_host_and_under_jit():
  rng = jax.random.PRNGKey(3)
  step = jnp.asarray(7, jnp.int32)
  host = keys_lib.step_keys(rng, step, 2)
  traced = jax.jit(lambda r, s: keys_lib.step_keys(r, s, 2))(rng, step)
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(traced), strict=True):
    np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- transfers


def _rollout_parts(tiny):
  """(rows, cluster_names, eval_rows, sampler, batches) of a TinyStep's config, built as the
  trainer builds them."""
  config = tiny.config
  inputs = task_rows.load_task_and_rows(config)
  sampler = worker_lib.make_worker(tiny.model, inputs.task, inputs.tokenizer, config, tiny.mesh)
  batches = data.make_batches(
    inputs.rows, batch_size=config.train.batch_size, order="shuffle", seed=0
  )
  return inputs.rows, inputs.cluster_names, inputs.eval_rows, sampler, batches


def test_the_step_loop_makes_no_implicit_transfer():
  """Rollouts, the train step and the evaluation, as the trainer's loop runs them, under
  jax.transfer_guard("disallow"): an implicit host<->device transfer anywhere would raise. Every
  optional path at once (one compile): DAPO refill rounds and fill, the overlong penalty, chunked
  sampler calls with a padded last call, and a KL reference."""
  overrides = {
    "rl.dynamic_sampling": True,
    "rl.max_refill_rounds": 2,
    "rl.overlong_buffer": 2,
    "sampling.prompts_per_call": 3,
    "rl.loss.kl_coef": 0.01,
  }
  tiny = tiny_steps({"sampling.max_new_tokens": 4, **overrides})
  config = tiny.config
  rows, cluster_names, eval_rows, sampler, batches = _rollout_parts(tiny)
  state = tiny.fresh_state()
  with jax.transfer_guard("disallow"):
    keys = keys_lib.step_keys(state.rng, state.step, config.rl.max_refill_rounds)
    batch, rollout, logs = rollout_batch.collect_batch(sampler, state.params, keys, rows, batches)
    state, metrics, aux = tiny.step(state, batch)
    metrics, advantages_bg = jax.device_get((metrics, aux.advantages))
    eval_key = keys_lib.step_keys(state.rng, state.step).eval
    accuracy = rollout_batch.evaluate_accuracy(
      sampler, state.params, eval_rows, cluster_names, eval_key
    )
    with pytest.raises(Exception, match="[Dd]isallowed"):  # the guard is on: a NumPy operand
      _ = state.step + np.ones((), np.int32)
  sampler.scorer.pool.close()
  assert len(rollout.rows) == config.train.batch_size
  assert np.isfinite(metrics["loss"]) and 0.0 <= accuracy["eval/accuracy"] <= 1.0
  assert logs["rollout/tokens"] > 0 and logs["dapo/rounds"] >= 1
  assert metrics["lr"] == pytest.approx(1e-4)  # constant: the learning rate of every update
  # The step's advantages [B, G] beside the rollout: the sample completions table of the step.
  samples = rollout_batch.sample_rows(rollout, advantages_bg, cluster_names, 6)
  assert [s["completion"] for s in samples] == rollout.texts[:6]
  assert [s["advantage"] for s in samples] == pytest.approx(advantages_bg.reshape(-1)[:6])


def _logprobs(model, params, seqs):
  """The train step's `completion_logprobs` of the full layout, jitted (eagerly, each operation
  compiles apart: about 4x the time)."""
  logprobs = functools.partial(step_lib.completion_logprobs, model, packed_group_size=None)
  return jax.jit(logprobs)(params, seqs)


def test_lora_sampler_logps_equal_the_trainers_on_the_first_ppo_iteration():
  """Under LoRA the rollout's log-probs (old_logps: the sampler runs the adapted policy on the
  fly, `policy_params`) equal the train step's of the same tokens (adapters + base) to 1e-4 with
  trained adapters (B != 0): the first PPO iteration's ratio is 1 and nothing is clipped."""
  tiny = tiny_steps({"model.lora.rank": 4, "rl.loss.kl_coef": 0.1})  # as test_train_step's
  rows, _, _, sampler, batches = _rollout_parts(tiny)
  state = tiny.fresh_state()
  state = state.replace(params=trained_lora(state.params, seed=5, scale=0.3))
  policy = state_lib.policy_params(state)
  keys = keys_lib.step_keys(state.rng, state.step)
  batch, _, _ = rollout_batch.collect_batch(sampler, policy, keys, rows, batches)
  sampler.scorer.pool.close()
  mask = np.asarray(batch["completion_mask"])
  seqs = sequences.build_sequences(
    batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["completion_mask"], tiny.G
  )
  trainer = np.asarray(_logprobs(tiny.model, policy, seqs))
  old = np.asarray(batch["old_logps"])
  np.testing.assert_allclose(np.where(mask, old, 0), np.where(mask, trainer, 0), atol=1e-4)
  # The adapters act: the base alone gives other log-probs (a sampler without them would fail).
  base = _logprobs(lora.base_model(tiny.model), state.base, seqs)
  assert np.abs(np.where(mask, np.asarray(base) - old, 0)).max() > 1e-2
  _, metrics, _ = tiny.step(state, batch)  # the first (only) PPO iteration on these old_logps
  assert float(metrics["ratio_mean"]) == pytest.approx(1.0, abs=1e-4)
  assert float(metrics["clipfrac"]) == 0.0


def test_sampling_dtype_is_the_samplers_alone_and_its_mismatch_is_logged():
  """sampling.dtype=bfloat16 under a float32 trainer: the trainer's own rollout (make_worker,
  collect_batch) then the step; its mismatch metrics show the bfloat16 sampler, float32's do not."""
  tiny = tiny_steps()
  state = tiny.fresh_state()
  state = state.replace(params=jax.tree.map(lambda x: 4.0 * x, state.params))  # a sharper policy
  found = {}
  for dtype in ("", "bfloat16"):
    config = tiny.config.copy_and_resolve_references()
    config.sampling.dtype = dtype
    inputs = task_rows.load_task_and_rows(config)
    worker = worker_lib.make_worker(tiny.model, inputs.task, inputs.tokenizer, config, tiny.mesh)
    rows = inputs.rows
    assert worker.model.config.dtype == (dtype or "float32")
    batches = data.make_batches(rows, batch_size=config.train.batch_size, order="shuffle", seed=0)
    keys = keys_lib.step_keys(state.rng, state.step, config.rl.max_refill_rounds)
    batch, _, _ = rollout_batch.collect_batch(worker, state.params, keys, rows, batches)
    worker.scorer.pool.close()
    found[dtype] = jax.device_get(tiny.step(state, batch)[1])
  assert found[""]["mismatch/max_abs"] < 1e-5 and found[""]["mismatch/kl"] < 1e-5
  assert found["bfloat16"]["mismatch/max_abs"] > 1e-3
