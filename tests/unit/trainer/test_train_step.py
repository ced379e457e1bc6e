"""train_step in process: gradient accumulation, the prior in the carry, the non-finite policy;
the sampler-trainer mismatch metrics, the rollout correction and rl.recompute_old_logps;
LoRA: only adapters train; adapter dropout in the training forward only (8 sharded devices equal
1: e2e/test_train_step.py)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses, models, sampling
from ebpo_jax.models import Decoder, ModelConfig, lora
from ebpo_jax.sampling import sequences
from ebpo_jax.trainer import optimizer as optimizer_lib
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import step as step_lib
from tests.helpers import tiny_step as tiny_step_lib
from tests.helpers.configs import TINY_LORA
from tests.helpers.lora import trained_lora
from tests.helpers.rollout_is import np_rollout_is

# On one device: these tests are about the step's arithmetic, not its sharding (the step on 8
# devices equals it on 1: e2e/test_train_step.py); an 8-device program
# compiles several times slower.
tiny_steps = functools.partial(tiny_step_lib.tiny_steps, num_devices=1)


def test_gradient_accumulation_does_not_change_the_update():
  tiny_step = tiny_steps()
  batch = tiny_step.batch()
  state = tiny_step.fresh_state()  # the same init for both: params are not donated
  whole, m_whole, _ = tiny_step(batch, state)
  chunked, m_chunked, _ = tiny_steps({"train.micro_batch_size": 8})(batch, state)
  # Adam's first step is scale-invariant, so the loss and the pre-clip gradient norm are what
  # expose a per-micro-batch normalisation (it would scale both by the number of chunks, 4).
  assert float(m_whole["loss"]) == pytest.approx(float(m_chunked["loss"]), rel=1e-5, abs=1e-7)
  assert float(m_whole["grad_norm"]) == pytest.approx(float(m_chunked["grad_norm"]), rel=1e-5)
  assert float(m_whole["grad_norm"]) > 0
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(chunked.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # updates are ~lr = 1e-4


def test_prior_is_threaded_through_the_carry():
  tiny_step = tiny_steps()
  batch = tiny_step.batch()
  batch["rewards"][0], batch["rewards"][5] = 1.0, 0.0  # two all-equal groups, one per cluster
  g = tiny_step.G
  new_state, metrics, _ = tiny_step(batch)
  # Cluster 0 holds prompts 0-3: 4 * G rewards and 4 group means were merged (not 8 * G: a
  # prior that ignores cluster ids would count every reward in both clusters).
  np.testing.assert_array_equal(new_state.prior.rewards.count, [4 * g, 4 * g])
  np.testing.assert_array_equal(new_state.prior.group_means.count, [4, 4])
  expected = batch["rewards"][:4].mean(), batch["rewards"][4:].mean()
  np.testing.assert_allclose(new_state.prior.rewards.mean, expected, rtol=1e-6)
  assert int(new_state.step) == 1
  assert 0.0 <= float(metrics["ebpo/shrinkage_mean"]) <= 1.0
  # The plots' per-cluster metrics come out as [K] vectors: the prior's mean and std per cluster.
  np.testing.assert_allclose(metrics["ebpo/prior_mean"], expected, rtol=1e-6)
  group_means = batch["rewards"].mean(-1)
  tau = [group_means[:4].std(), group_means[4:].std()]  # population std of the group means
  np.testing.assert_allclose(metrics["ebpo/prior_std"], tau, rtol=1e-5, atol=1e-7)
  assert np.shape(metrics["ebpo/shrinkage"]) == (2,)
  # Every estimator: the share of prompts whose G rewards are all equal.
  assert float(metrics["adv/all_equal_frac"]) == pytest.approx(2 / 8)  # the rest are mixed


def test_non_finite_loss_skips_the_update_and_counts_it():
  tiny_step = tiny_steps()
  batch = tiny_step.batch()
  batch["old_logps"][1, 0] = np.nan  # a valid token: the loss becomes NaN
  state = tiny_step.fresh_state()
  before = jax.tree.map(np.asarray, state.params)
  new_state, metrics, _ = tiny_step(batch, state)
  assert float(metrics["bad_updates"]) == 1.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state.params), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_second_step_does_not_retrace():
  tiny_step = tiny_steps()
  state, _, _ = tiny_step(tiny_step.batch(0))
  size = tiny_step.step.jitted._cache_size()
  tiny_step(tiny_step.batch(1), state)
  assert tiny_step.step.jitted._cache_size() == size


def test_sequences_put_completions_after_left_padded_prompts():
  ids = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]])
  mask = ids > 0
  tokens = jnp.array([[11, 12], [13, 2], [14, 15], [16, 17]])
  seqs = sequences.build_sequences(ids, mask, tokens, tokens > 0, group_size=2)
  # Prompt 0 has 2 real tokens at positions 0, 1; its completions continue at 2, 3.
  np.testing.assert_array_equal(seqs["positions"][0], [0, 0, 0, 1, 2, 3])
  np.testing.assert_array_equal(seqs["positions"][3], [0, 1, 2, 3, 4, 5])
  np.testing.assert_array_equal(seqs["input_ids"][1], [0, 0, 5, 6, 13, 2])


def test_bad_steps_in_a_row_are_counted_in_the_state():
  # The counter of consecutive bad steps lives in the TrainState (so it is checkpointed and
  # survives a restart) and a good step resets it.
  tiny_step = tiny_steps()
  good, nan = tiny_step.batch(0), tiny_step.batch(1)
  nan["old_logps"][1, 0] = np.nan
  state = tiny_step.fresh_state()
  assert int(state.bad_steps) == 0
  state, _, _ = tiny_step(nan, state)
  state, _, _ = tiny_step(nan, state)
  assert int(state.bad_steps) == 2
  state, _, _ = tiny_step(good, state)
  assert int(state.bad_steps) == 0


def test_a_rollout_with_non_finite_logits_is_a_bad_step():
  # The sampler flags rows that met NaN/inf logits (their tokens are not the policy's): the step
  # skips its update and its prior update, and counts as bad.
  tiny_step = tiny_steps()
  batch = tiny_step.batch()
  batch["nonfinite"][5] = True
  state = tiny_step.fresh_state()
  new_state, metrics, _ = tiny_step(batch, state)
  assert float(metrics["bad_updates"]) >= 1.0 and int(new_state.bad_steps) == 1
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(new_state.params), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(new_state.prior.rewards.count, state.prior.rewards.count)
  assert int(new_state.step) == 1


def test_a_lora_step_trains_only_the_adapters():
  step = tiny_steps(TINY_LORA)
  state = step.fresh_state()
  assert state.ref_params is None  # the reference is the base: no second copy
  # The trained params are the adapters (A and B of q, k, v, o, gate, up, down; one scanned
  # layer), and so is the optimizer state; the base is apart and has none.
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
  assert len(paths) == 14 and all(lora.is_adapter(p) for p in paths)
  assert not any(lora.is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.base)[0])
  mu = state.opt_state[1][0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(state.params)
  base_before = jax.tree.map(np.asarray, state.base)
  new_state, metrics, _ = step(step.batch(), state)
  assert np.isfinite(float(metrics["loss"])) and int(new_state.bad_steps) == 0
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(new_state.base), strict=True):
    np.testing.assert_array_equal(a, b)  # the base: bit-identical
  # Every B moved; A's gradient is zero on the first step (its output is multiplied by B = 0).
  old, new = jax.tree.leaves(state.params), jax.tree.leaves(new_state.params)
  moved_b = [not np.array_equal(a, b) for p, a, b in zip(paths, old, new, strict=True)
             if p[-1].key == lora.B_NAME]  # fmt: skip
  assert len(moved_b) == 7 and all(moved_b)
  # The KL is to the base (adapters off), not to the step's start: 0 on the first step (B = 0),
  # > 0 on the second, whose policy has moved.
  assert abs(float(metrics["kl"])) < 1e-7
  _, metrics2, _ = step(step.batch(seed=1), new_state)
  assert float(metrics2["kl"]) > 1e-9


def test_lora_optimizer_state_is_small_on_the_smollm2_shape():
  config = tiny_steps({"model.lora.rank": 8}).config
  smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                        tie_word_embeddings=True)  # fmt: skip
  ids = jnp.zeros((1, 4), jnp.int32)

  def opt_bytes(model_config, optimizer) -> int:
    params = jax.eval_shape(Decoder(model_config).init, jax.random.key(0), ids)["params"]
    trained = lora.split(nn.meta.unbox(params))[0] if model_config.lora_rank else params
    state = jax.eval_shape(optimizer.init, nn.meta.unbox(trained))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

  full = opt_bytes(smollm2, optimizer_lib.make_optimizer(tiny_steps().config))
  rank8 = dataclasses.replace(smollm2, lora_rank=8)
  adapters = opt_bytes(rank8, optimizer_lib.make_optimizer(config))
  assert full > 8 * 134e6  # Adam's two float32 moments of ~135M params
  assert adapters < 0.02 * full


@functools.cache  # one compile per model in a process (the tests' batches share a shape)
def _policy_logprobs(model):
  """`completion_logprobs(model, params, seqs)` of the full layout, jitted."""
  return jax.jit(functools.partial(step_lib.completion_logprobs, model, packed_group_size=None))


def _on_policy(step, state, batch: dict) -> dict:
  """`batch` with old_logps the policy's own (as the sampler computes them: no dropout)."""
  seqs = sequences.build_sequences(
    batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["completion_mask"], step.G
  )
  logps = _policy_logprobs(step.model)(state_lib.policy_params(state), seqs)
  return {**batch, "old_logps": np.asarray(logps)}


def test_lora_dropout_is_in_the_training_forward_only():
  plain = tiny_steps(TINY_LORA)
  dropped = tiny_steps({**TINY_LORA, "model.lora.dropout": 0.5})
  state = plain.fresh_state()
  # B = 0.1 noise, as after training: the adapters act, so dropping their inputs shows.
  state = state.replace(params=trained_lora(state.params, seed=2))
  batch = _on_policy(plain, state, plain.batch(1))  # as the sampler (no dropout) computes
  # On-policy old_logps: the plain step's first PPO iteration has ratio 1; with dropout it does
  # not (the training forward drops adapter inputs), and its update differs.
  _, m_plain, _ = plain(batch, state)
  new_dropped, m_dropped, _ = dropped(batch, state)
  assert float(m_plain["approx_kl"]) < 1e-9
  assert float(m_dropped["approx_kl"]) > 1e-6
  assert float(m_dropped["loss"]) != float(m_plain["loss"])
  # The masks come from the step's own key (state.rng, state.step): the same step again, as a
  # resumed run would make it, is bit-identical.
  again, m_again, _ = dropped(batch, state)
  for a, b in zip(jax.tree.leaves(new_dropped), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(a, b)
  assert float(m_again["loss"]) == float(m_dropped["loss"])
  _, m_next, _ = dropped(batch, state.replace(step=state.step + 1))  # the next step: other masks
  assert float(m_next["loss"]) != float(m_dropped["loss"])


def test_observation_tokens_are_out_of_the_loss_and_their_gradient_is_zero():
  # Per token: d loss / d logp is exactly 0 where the loss mask is 0 (an observation's tokens),
  # under every aggregation, with KL and entropy terms on.
  rng = np.random.default_rng(0)
  logps = jnp.asarray(np.log(rng.uniform(0.1, 0.9, (4, 6))), jnp.float32)
  loss_mask = np.ones((4, 6), bool)
  loss_mask[:, 2:4] = False  # a tool response in the middle of each trajectory
  for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
    grad = jax.grad(
      lambda lp, agg=agg: step_lib.losses.policy_loss(
        lp, logps - 0.1, jnp.array([1.0, -1.0, 0.5, -0.5]), loss_mask,
        losses.LossOptions(aggregation=agg, kl_coef=0.1, entropy_coef=0.01),
        ref_logps_bt=logps + 0.2, entropy_bt=-lp,
      )[0]
    )(logps)  # fmt: skip
    assert (np.asarray(grad)[~loss_mask] == 0).all()
    assert (np.abs(np.asarray(grad)[loss_mask]) > 0).all()
  # The step: the old log-probs at masked tokens change nothing (the tokens themselves stay the
  # later tokens' context); training them too changes the update.
  tiny_step = tiny_steps()
  batch = tiny_step.batch()
  loss_mask = batch["completion_mask"].copy()
  loss_mask[:, 1:3] = False
  masked = {**batch, "loss_mask": loss_mask}
  state = tiny_step.fresh_state()
  first, m_first, _ = tiny_step(masked, state)
  old_logps = batch["old_logps"].copy()
  old_logps[~loss_mask] -= 3.0
  second, m_second, _ = tiny_step({**masked, "old_logps": old_logps}, state)
  assert float(m_first["loss"]) == float(m_second["loss"])
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params), strict=True):
    np.testing.assert_array_equal(a, b)
  unmasked, m_unmasked, _ = tiny_step(batch, state)
  assert float(m_unmasked["loss"]) != float(m_first["loss"])


# ----------------------------------------------------------------------------- sampler mismatch


def _sampled_batch(step, state, dtype: str) -> dict:
  """`step.batch()` with completions, masks and log-probs from the sampler, computing in `dtype`
  with `state`'s params."""
  batch = step.batch()
  model = models.build.with_compute_dtype(step.model, dtype)
  out = sampling.generate(
    model, state_lib.policy_params(state), batch["prompt_ids"], batch["prompt_mask"],
    jax.random.key(0), group_size=step.G, max_new_tokens=step.N, stop_ids=(2,),
  )  # fmt: skip
  mask = np.asarray(out.mask)
  fields = {"tokens": out.tokens, "old_logps": out.logprobs}
  return (
    batch
    | {k: np.asarray(v) for k, v in fields.items()}
    | {
      "completion_mask": mask,
      "loss_mask": mask,
    }
  )


def test_mismatch_metrics_are_zero_for_a_float32_sampler_and_not_for_bfloat16():
  # A sharper policy than the random init (logits x ~4, as after training), where bfloat16's
  # rounding of the logits shows in the log-probs of the sampled tokens.
  tiny_step = tiny_steps()
  state = tiny_step.fresh_state()
  state = state.replace(params=jax.tree.map(lambda x: 4.0 * x, state.params))
  _, m32, _ = tiny_step(_sampled_batch(tiny_step, state, "float32"), state)
  _, m16, _ = tiny_step(_sampled_batch(tiny_step, state, "bfloat16"), state)
  # float32: the KV-cached decode and the training forward agree to rounding (seen: k3 ~ 4e-13,
  # max |d| ~ 4e-6); a bfloat16 sampler: k3 ~ 2e-4, max |d| ~ 0.16.
  assert float(m32["mismatch/kl"]) < 1e-5 and float(m32["mismatch/max_abs"]) < 1e-5
  assert float(m16["mismatch/kl"]) > 1e-5 and float(m16["mismatch/max_abs"]) > 1e-2
  assert float(m32["mismatch/ratio_out_frac"]) == 0.0


def _off_policy(step, state, seed: int = 1) -> tuple[dict, np.ndarray]:
  """(a batch whose old_logps are the policy's own moved per token and per row, the policy's own
  log-probs [R, N]): the trainer's first pass and a sampler that disagrees with it."""
  batch = _on_policy(step, state, step.batch(seed))
  first = batch["old_logps"]
  rng = np.random.default_rng(seed)
  shift = rng.uniform(-0.6, 0.6, first.shape) + rng.normal(0.0, 0.3, (first.shape[0], 1))
  return {**batch, "old_logps": (first + shift).astype(np.float32)}, first


def _np_mismatch(first, sampler, mask):
  d = (first - sampler)[mask].astype(np.float64)
  out = (d < np.log(0.5)) | (d > np.log(2.0))
  return {"kl": np.mean(np.expm1(d) - d), "max_abs": np.abs(d).max(), "out": out.mean()}


@pytest.mark.parametrize(
  "mode, mini_batch_size", [("token_tis", 8), ("token_tis", 4), ("seq_mask", 8), ("none", 4)]
)
def test_the_rollout_correction_weights_the_steps_loss_as_numpy_does(mode, mini_batch_size):
  # One update (mini-batch = batch): the weights come from that update's forward; two updates:
  # from a first-pass forward before them. The same weights either way, NumPy's; without the
  # correction and two updates, the mismatch metrics cover the first update's rows only.
  cap = 1.5
  overrides = {"rl.loss.rollout_is": mode, "train.mini_batch_size": mini_batch_size}
  if mode != "none":  # no correction has no cap: the step is then test_recompute_old_logps'
    overrides["rl.loss.rollout_is_cap"] = cap
  step = tiny_steps(overrides)
  state = tiny_steps().fresh_state()  # its step-0 state (the correction is no part of it)
  batch, first = _off_policy(step, state)
  _, m, aux = step(batch, state)
  mask = batch["loss_mask"]
  rows = slice(None) if mode != "none" or mini_batch_size == 8 else slice(0, 4 * step.G)
  want = _np_mismatch(first[rows], batch["old_logps"][rows], mask[rows])
  assert float(m["mismatch/kl"]) == pytest.approx(want["kl"], rel=1e-4)
  assert float(m["mismatch/max_abs"]) == pytest.approx(want["max_abs"], rel=1e-4)
  assert float(m["mismatch/ratio_out_frac"]) == pytest.approx(want["out"], abs=1e-6)
  if mode == "none":
    assert "rollout_is/mean_weight" not in m
    return
  w, clipped = np_rollout_is(first, batch["old_logps"], mask, mode, cap)
  assert 0.05 < clipped[mask].mean() < 0.95
  assert float(m["rollout_is/mean_weight"]) == pytest.approx(w[mask].mean(), rel=1e-4)
  assert float(m["rollout_is/clipped_frac"]) == pytest.approx(clipped[mask].mean(), abs=1e-6)
  # PPO's old log-probs are the first pass (ratio 1 at the first update), the weights NumPy's.
  assert float(m["approx_kl"]) < 1e-9 if mini_batch_size == 8 else float(m["approx_kl"]) > 0
  if mini_batch_size == 8:  # one update: its pg loss is the weighted one
    pg, _ = losses.policy_loss(
      jnp.asarray(first), first, np.asarray(aux.advantages).reshape(-1), mask,
      is_weights_bt=jnp.asarray(w, jnp.float32),
    )  # fmt: skip
    assert float(m["pg_loss"]) == pytest.approx(float(pg), rel=1e-4, abs=1e-6)
    unweighted = losses.policy_loss(first, first, np.asarray(aux.advantages).reshape(-1), mask)
    assert float(m["pg_loss"]) != pytest.approx(float(unweighted[0]), rel=1e-3)


@pytest.mark.parametrize("mini_batch_size", [8, 4])
def test_recompute_old_logps_makes_the_step_on_policy(mini_batch_size):
  # With rl.recompute_old_logps the step's own first pass is PPO's old log-probs: an off-policy
  # batch trains as its on-policy copy does without it (ratio 1 at the first update), and the
  # mismatch metrics still compare the first pass with the sampler's. One update: that update's
  # forward is the first pass; two: a forward before them.
  layout = {"train.mini_batch_size": mini_batch_size}
  plain, recompute = tiny_steps(layout), tiny_steps(layout | {"rl.recompute_old_logps": True})
  state = tiny_steps().fresh_state()  # its step-0 state (the layouts are no part of it)
  batch, first = _off_policy(plain, state)
  new_recomputed, m_recomputed, _ = recompute(batch, state)
  new_on_policy, m_on_policy, _ = plain({**batch, "old_logps": first}, state)
  assert float(m_recomputed["approx_kl"]) == pytest.approx(
    float(m_on_policy["approx_kl"]), abs=1e-9
  )
  assert float(m_recomputed["loss"]) == pytest.approx(float(m_on_policy["loss"]), rel=1e-5)
  for a, b in zip(
    jax.tree.leaves(new_recomputed.params), jax.tree.leaves(new_on_policy.params), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  _, m_plain, _ = plain(batch, state)  # the sampler's old log-probs: off policy
  assert float(m_plain["approx_kl"]) > 1e-2
  rows = slice(None) if mini_batch_size == 8 else slice(0, mini_batch_size * plain.G)
  want = _np_mismatch(first, batch["old_logps"], batch["loss_mask"])
  assert float(m_recomputed["mismatch/kl"]) == pytest.approx(want["kl"], rel=1e-4)
  want = _np_mismatch(first[rows], batch["old_logps"][rows], batch["loss_mask"][rows])
  assert float(m_plain["mismatch/kl"]) == pytest.approx(want["kl"], rel=1e-4)
