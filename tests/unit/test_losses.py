"""Tests for ebpo_jax.losses: golden values by hand, a NumPy reference, micro-batch invariance."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses
from tests.helpers.rollout_is import np_rollout_is

MODES = losses.AGG_MODES


# ---------------------------------------------------------------------------------------------
# token_logprobs / entropy against NumPy in float64


def _np_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_token_logprobs_and_entropy_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 17)).astype(np.float32) * 4.0
  targets = rng.integers(0, 17, size=(3, 5))
  logp_np = _np_log_softmax(logits)
  want_logps = np.take_along_axis(logp_np, targets[..., None], -1)[..., 0]
  want_ent = -(np.exp(logp_np) * logp_np).sum(-1)

  got_logps = losses.token_logprobs(jnp.asarray(logits), jnp.asarray(targets))
  got_ent = losses.entropy(jnp.asarray(logits))
  assert got_logps.dtype == jnp.float32 and got_ent.dtype == jnp.float32
  np.testing.assert_allclose(got_logps, want_logps, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_ent, want_ent, rtol=1e-5, atol=1e-5)


def test_token_logprobs_upcasts_bfloat16_logits():
  # Uniform over 4 tokens: log(1/4) = -1.386294, entropy = log 4 = 1.386294. In bf16 the
  # logsumexp would round to -1.3828125 (bf16 keeps 8 bits of mantissa).
  logits = jnp.zeros((1, 1, 4), jnp.bfloat16)
  logps = losses.token_logprobs(logits, jnp.zeros((1, 1), jnp.int32))
  assert logps.dtype == jnp.float32
  np.testing.assert_allclose(logps, [[-math.log(4)]], rtol=1e-6)
  np.testing.assert_allclose(losses.entropy(logits), [[math.log(4)]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_golden_values():
  # Token 0: pi = 0.5, pi_ref = 0.25 -> log r = log(0.25/0.5) = -log 2 = -0.693147
  #   k1 = -log r = 0.693147;  k2 = (log 2)^2 / 2 = 0.240227;  k3 = (0.5 - 1) + log 2 = 0.193147
  # Token 1: pi = 0.25, pi_ref = 0.5 -> log r = +log 2
  #   k1 = -0.693147;          k2 = 0.240227;                   k3 = (2 - 1) - log 2 = 0.306853
  # A k3 with r inverted (pi / pi_ref) would swap the two k3 values: 0.306853, 0.193147.
  logps = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.5]]))
  ln2 = math.log(2.0)
  np.testing.assert_allclose(losses.kl_penalty(logps, ref, "k1"), [[ln2, -ln2]], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logps, ref, "k2"), [[ln2**2 / 2] * 2], rtol=1e-6)
  np.testing.assert_allclose(
    losses.kl_penalty(logps, ref, "k3"), [[ln2 - 0.5, 1.0 - ln2]], rtol=1e-6
  )


def test_kl_estimators_are_zero_at_equal_policies_and_k3_nonnegative():
  rng = np.random.default_rng(1)
  logps = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
  ref = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
  for kind in losses.KL_KINDS:
    np.testing.assert_array_equal(losses.kl_penalty(logps, logps, kind), 0.0)
  assert bool(jnp.all(losses.kl_penalty(logps, ref, "k3") >= 0.0))


def test_kl_unknown_kind_raises():
  with pytest.raises(ValueError, match="k4"):
    losses.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k4")


# ---------------------------------------------------------------------------------------------
# aggregation


def test_aggregate_golden_values():
  # values [[1, 2, 3], [4, x, x]], the second sequence has one valid token.
  #   token-mean:              (1 + 2 + 3 + 4) / 4            = 2.5
  #   seq-mean-token-mean:     (6/3 + 4/1) / 2 = (2 + 4) / 2  = 3.0
  #   seq-mean-token-sum-norm: (6 + 4) / (2 seqs * 3 max_len) = 1.666667
  # Forgetting the mask (x = 100) would give 51.5 for token-mean.
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
  assert float(losses.aggregate(values, mask, "token-mean")) == pytest.approx(2.5)
  assert float(losses.aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
  assert float(losses.aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 6)
  # An explicit (global) normaliser replaces the local count: 10 / 8 = 1.25.
  assert float(losses.aggregate(values, mask, "token-mean", norm=8)) == pytest.approx(1.25)


def test_aggregate_ignores_empty_sequences_in_counts():
  # An all-padding row counts neither as a sequence nor as tokens: seq-mean = (2 + 4) / 2 = 3,
  # not (2 + 4 + 0) / 3 = 2.
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  assert float(losses.aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
  assert float(losses.aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 6)


def test_aggregate_unknown_mode_raises():
  with pytest.raises(ValueError, match="seq-sum"):
    losses.aggregate(jnp.zeros((1, 1)), jnp.ones((1, 1), bool), "seq-sum")


# ---------------------------------------------------------------------------------------------
# policy loss: golden values

# Four tokens of one sequence, per-token advantages:
#   t0: r = 1.5, A = +1   unclipped -1.5, clipped -1.2          -> max = -1.2 (clipped high)
#   t1: r = 0.5, A = +1   unclipped -0.5, clipped -0.8          -> max = -0.5 (not clipped)
#   t2: r = 0.6, A = -2   unclipped  1.2, clipped 2*0.8 = 1.6   -> max =  1.6 (clipped low)
#   t3: r = 4.0, A = -1   unclipped  4.0, clipped 1.2           -> max =  4.0, dual c|A| = 3 -> 3.0
_RATIOS = np.array([[1.5, 0.5, 0.6, 4.0]])
_ADV = jnp.array([[1.0, 1.0, -2.0, -1.0]])
_OLD = jnp.log(jnp.array([[0.2, 0.3, 0.1, 0.05]]))
_LOGPS = _OLD + jnp.log(jnp.asarray(_RATIOS, jnp.float32))
_MASK = jnp.ones((1, 4), bool)


def test_policy_loss_clip_both_sides_and_dual_clip():
  # token-mean = (-1.2 - 0.5 + 1.6 + 3.0) / 4 = 2.9 / 4 = 0.725.
  # Plausible bugs: min instead of max -> (-1.5 - 0.8 + 1.2 + 1.2) / 4 = 0.025; dual clip on
  # positive advantages too -> (-3 - 3 + 1.6 + 3) / 4 = -0.35.
  loss, m = losses.policy_loss(_LOGPS, _OLD, _ADV, _MASK)
  assert float(loss) == pytest.approx(0.725, abs=1e-5)
  assert float(m["pg_loss"]) == pytest.approx(0.725, abs=1e-5)
  # Clip active on t0 (high side) and t2 (low side); dual clip on t3.
  assert float(m["clipfrac"]) == pytest.approx(0.5)
  assert float(m["clipfrac_high"]) == pytest.approx(0.25)
  assert float(m["clipfrac_low"]) == pytest.approx(0.25)
  assert float(m["dual_clipfrac"]) == pytest.approx(0.25)
  # ratio_mean = (1.5 + 0.5 + 0.6 + 4.0) / 4 = 1.65.
  assert float(m["ratio_mean"]) == pytest.approx(1.65, abs=1e-5)
  # approx_kl = mean of (r - 1) - log r = (0.094535 + 0.193147 + 0.110826 + 1.613706) / 4.
  want = np.mean(_RATIOS - 1 - np.log(_RATIOS))
  assert float(m["approx_kl"]) == pytest.approx(want, abs=1e-5)
  assert float(m["kl"]) == 0.0 and "entropy" not in m


def test_policy_loss_without_dual_clip():
  # t3 keeps its unclipped 4.0: (-1.2 - 0.5 + 1.6 + 4.0) / 4 = 3.9 / 4 = 0.975.
  loss, m = losses.policy_loss(
    _LOGPS,
    _OLD,
    _ADV,
    _MASK,
    options=losses.LossOptions(dual_clip=None),
  )
  assert float(loss) == pytest.approx(0.975, abs=1e-5)
  assert float(m["dual_clipfrac"]) == 0.0


def test_policy_loss_clip_higher():
  # clip_low 0.2, clip_high 0.28: t0 -> -1.28, t2 -> 2 * 0.8 = 1.6:
  #   (-1.28 - 0.5 + 1.6 + 3.0) / 4 = 2.82 / 4 = 0.705.
  # Swapping the bounds gives t0 -> -1.2, t2 -> 2 * 0.72 = 1.44: 2.74 / 4 = 0.685.
  loss, _ = losses.policy_loss(
    _LOGPS,
    _OLD,
    _ADV,
    _MASK,
    options=losses.LossOptions(clip_low=0.2, clip_high=0.28),
  )
  assert float(loss) == pytest.approx(0.705, abs=1e-5)


def test_policy_loss_gradient_flows_only_through_unclipped_tokens():
  # d loss / d logp_t = -A_t r_t / 4 where not clipped: only t1 -> -1 * 0.5 / 4 = -0.125.
  grad = jax.grad(lambda lp: losses.policy_loss(lp, _OLD, _ADV, _MASK)[0])(_LOGPS)
  np.testing.assert_allclose(grad, [[0.0, -0.125, 0.0, 0.0]], atol=1e-6)


def test_policy_loss_sequence_advantage_broadcasts():
  # A per sequence [B] equals the same A repeated on every token [B, T].
  logps, old, _, mask = _random_inputs(np.random.default_rng(2), b=4, t=5)
  adv_b = jnp.array([1.0, -0.5, 0.0, 2.0])
  got, _ = losses.policy_loss(logps, old, adv_b, mask)
  want, _ = losses.policy_loss(logps, old, jnp.repeat(adv_b[:, None], 5, axis=1), mask)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_policy_loss_kl_and_entropy_terms():
  # r = 1 everywhere and A = 0 -> pg = 0, so loss = kl_coef * k3 - entropy_coef * H.
  # pi = 0.5, pi_ref = 0.25 on both tokens: k3 = log 2 - 0.5 = 0.193147; H = 2.0 on both.
  #   loss = 0.1 * 0.193147 - 0.01 * 2.0 = -0.000685 (a sign slip on H gives +0.039315).
  logps = jnp.log(jnp.full((1, 2), 0.5))
  ref = jnp.log(jnp.full((1, 2), 0.25))
  ent = jnp.full((1, 2), 2.0)
  mask = jnp.ones((1, 2), bool)
  loss, m = losses.policy_loss(
    logps,
    logps,
    jnp.zeros((1,)),
    mask,
    ref_logps_bt=ref,
    options=losses.LossOptions(kl_coef=0.1, entropy_coef=0.01),
    entropy_bt=ent,
  )
  k3 = math.log(2) - 0.5
  assert float(loss) == pytest.approx(0.1 * k3 - 0.02, abs=1e-6)
  assert float(m["kl"]) == pytest.approx(k3, abs=1e-6)
  assert float(m["entropy"]) == pytest.approx(2.0)
  # With coefficient 0 the terms are still reported but do not enter the loss.
  loss0, m0 = losses.policy_loss(
    logps, logps, jnp.zeros((1,)), mask, ref_logps_bt=ref, entropy_bt=ent
  )
  assert float(loss0) == 0.0 and float(m0["kl"]) == pytest.approx(k3, abs=1e-6)


@pytest.mark.parametrize(
  "options, match", [({"kl_coef": 0.001}, "ref_logps_bt"), ({"entropy_coef": 0.01}, "entropy_bt")]
)
def test_policy_loss_asks_for_the_arrays_its_terms_need(options, match):
  with pytest.raises(ValueError, match=match):
    losses.policy_loss(_LOGPS, _OLD, _ADV, _MASK, losses.LossOptions(**options))


@pytest.mark.parametrize(
  "options, message",
  [
    ({"dual_clip": 1.0}, "dual_clip=1.0: must be > 1"),
    ({"clip_low": 1.0}, "clip_low=1.0: must lie in [0, 1)"),
    ({"clip_high": -0.1}, "clip_high=-0.1: must be >= 0"),
    ({"aggregation": "sum"}, "aggregation='sum': must be one of " + ", ".join(losses.AGG_MODES)),
    ({"kl_kind": "k5"}, "kl_kind='k5': must be one of k1, k2, k3"),
    ({"entropy_coef": -1.0}, "entropy_coef=-1.0: must be >= 0"),
    ({"rollout_is_cap": math.inf}, "rollout_is_cap=inf: must be finite, > 1"),
  ],
)
def test_loss_options_refuse_a_bad_value_where_they_are_built(options, message):
  with pytest.raises(losses.InvalidLossOption) as built:
    losses.LossOptions(**options)
  assert str(built.value) == message
  section = dataclasses.asdict(losses.LossOptions()) | options  # a config's rl.loss
  with pytest.raises(ValueError) as read:
    losses.LossOptions.from_config(section)
  assert str(read.value) == f"config.rl.loss.{message}"


def test_policy_loss_ignores_nonfinite_padding_in_value_and_grad():
  # Padding positions hold -inf / NaN (as a sampler may leave them): loss and grads stay finite
  # and equal the loss on the valid tokens alone.
  logps, old, adv, mask = _random_inputs(np.random.default_rng(3), b=3, t=6)
  pad = ~mask
  bad_logps = jnp.where(pad, -jnp.inf, logps)
  bad_old = jnp.where(pad, jnp.nan, old)
  bad_ref = jnp.where(pad, jnp.inf, old - 0.1)
  bad_ent = jnp.where(pad, jnp.nan, 1.0)

  def loss_fn(lp, ref, ent):
    return losses.policy_loss(
      lp,
      bad_old,
      adv,
      mask,
      ref_logps_bt=ref,
      options=losses.LossOptions(kl_coef=0.1, entropy_coef=0.01),
      entropy_bt=ent,
    )[0]

  value_and_grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))
  loss, grads = value_and_grad(bad_logps, bad_ref, bad_ent)
  (clean, _) = value_and_grad(logps, old - 0.1, jnp.ones_like(logps))
  assert np.isfinite(float(loss)) and float(loss) == pytest.approx(float(clean), rel=1e-6)
  for g in grads:
    assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(jnp.where(pad, g, 0.0) == 0.0))


# ---------------------------------------------------------------------------------------------
# policy loss against an independent NumPy reference (float64, token by token)


def _np_policy_loss(
  logps, old, adv_b, mask, *, clip_low, clip_high, dual_clip, agg, ref, kl_coef, max_len
):
  b, t = logps.shape
  per_token = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      if not mask[i, j]:
        continue
      r = math.exp(logps[i, j] - old[i, j])
      a = adv_b[i]
      loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
      if a < 0:
        loss = min(loss, -a * dual_clip)
      ref_over_pi = math.exp(ref[i, j] - logps[i, j])
      loss += kl_coef * (ref_over_pi - 1 - math.log(ref_over_pi))
      per_token[i, j] = loss
  lengths = mask.sum(1)
  if agg == "token-mean":
    return per_token.sum() / lengths.sum()
  seqs = [i for i in range(b) if lengths[i] > 0]
  if agg == "seq-mean-token-mean":
    return sum(per_token[i].sum() / lengths[i] for i in seqs) / len(seqs)
  return sum(per_token[i].sum() / max_len for i in seqs) / len(seqs)


def _random_inputs(rng, *, b, t):
  old = np.log(rng.uniform(0.05, 0.95, size=(b, t)))
  logps = old + rng.normal(scale=0.3, size=(b, t))
  adv = rng.normal(size=(b,))
  lengths = rng.integers(1, t + 1, size=(b,))
  mask = np.arange(t)[None, :] < lengths[:, None]
  return (
    jnp.asarray(logps, jnp.float32),
    jnp.asarray(old, jnp.float32),
    jnp.asarray(adv, jnp.float32),
    jnp.asarray(mask),
  )


@pytest.mark.parametrize("agg", MODES)
def test_policy_loss_matches_numpy_reference(agg):
  rng = np.random.default_rng(4)
  logps, old, adv, mask = _random_inputs(rng, b=6, t=9)
  ref = logps + jnp.asarray(rng.normal(scale=0.2, size=logps.shape), jnp.float32)
  hp = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, "agg": agg, "kl_coef": 0.05}
  options = losses.LossOptions(**{("aggregation" if k == "agg" else k): v for k, v in hp.items()})
  got, _ = losses.policy_loss(logps, old, adv, mask, options, ref_logps_bt=ref, max_len=12)
  want = _np_policy_loss(
    *map(np.asarray, (logps, old, adv, mask)), ref=np.asarray(ref), max_len=12, **hp
  )
  assert float(got) == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# gradient accumulation: summed micro-batch losses equal the full-batch loss


def _accumulation_problem():
  """A tiny softmax policy logits = emb[x] @ w over a ragged batch (one row all padding)."""
  b, t, v, d = 8, 6, 11, 5
  rng = np.random.default_rng(5)
  emb = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  inputs = jnp.asarray(rng.integers(0, v, size=(b, t)))
  targets = jnp.asarray(rng.integers(0, v, size=(b, t)))
  lengths = np.array([6, 1, 3, 0, 5, 2, 6, 4])
  mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
  adv = jnp.asarray(rng.normal(size=(b,)), jnp.float32)
  old = losses.token_logprobs(
    emb[inputs] @ (w + 0.3 * jnp.asarray(rng.normal(size=(d, v)))), targets
  )
  ref = losses.token_logprobs(emb[inputs] @ (w - 0.2), targets)
  batch = {"inputs": inputs, "targets": targets, "mask": mask, "adv": adv, "old": old, "ref": ref}
  return emb, w, batch


def _loss_fn(w, emb, batch, agg, num_tokens, num_seqs):
  logits = emb[batch["inputs"]] @ w
  return losses.policy_loss(
    losses.token_logprobs(logits, batch["targets"]),
    batch["old"],
    batch["adv"],
    batch["mask"],
    options=losses.LossOptions(
      clip_low=0.2, clip_high=0.28, aggregation=agg, kl_coef=0.1, entropy_coef=0.01
    ),
    ref_logps_bt=batch["ref"],
    entropy_bt=losses.entropy(logits),
    num_tokens=num_tokens,
    num_seqs=num_seqs,
    max_len=batch["mask"].shape[1],
  )


_GRAD_FN = jax.jit(jax.value_and_grad(_loss_fn, has_aux=True), static_argnums=(3,))


@pytest.mark.parametrize("agg", MODES)
def test_gradient_accumulation_is_invariant_to_micro_batch_size(agg):
  emb, w, batch = _accumulation_problem()
  num_tokens = jnp.sum(batch["mask"])
  num_seqs = jnp.sum(jnp.any(batch["mask"], axis=1))
  (full_loss, full_metrics), full_grad = _GRAD_FN(w, emb, batch, agg, None, None)
  for micro in (1, 4):
    loss_sum, grad_sum = 0.0, jnp.zeros_like(w)
    metric_sums = dict.fromkeys(full_metrics, 0.0)
    for start in range(0, 8, micro):
      part = jax.tree.map(lambda x, s=start, n=micro: x[s : s + n], batch)
      (loss, metrics), grad = _GRAD_FN(w, emb, part, agg, num_tokens, num_seqs)
      loss_sum, grad_sum = loss_sum + loss, grad_sum + grad
      metric_sums = {k: metric_sums[k] + metrics[k] for k in metric_sums}
    assert float(loss_sum) == pytest.approx(float(full_loss), rel=1e-5), (agg, micro)
    np.testing.assert_allclose(grad_sum, full_grad, rtol=1e-4, atol=1e-6, err_msg=f"{agg} {micro}")
    for key, value in metric_sums.items():
      assert float(value) == pytest.approx(float(full_metrics[key]), rel=1e-5, abs=1e-7), key


def test_local_normalisation_would_break_accumulation():
  # The invariance above needs the global counts: with per-micro-batch counts the summed loss
  # differs (guards against the test passing vacuously).
  emb, w, batch = _accumulation_problem()
  (full, _), _ = _GRAD_FN(w, emb, batch, "token-mean", None, None)
  halves = [jax.tree.map(lambda x, s=s: x[s : s + 4], batch) for s in (0, 4)]
  local = sum(_GRAD_FN(w, emb, half, "token-mean", None, None)[0][0] for half in halves)
  assert abs(float(local) - float(full)) > 1e-3


def test_policy_loss_jits_with_static_settings():
  options = losses.LossOptions(clip_high=0.28, aggregation="seq-mean-token-mean")
  fn = jax.jit(losses.policy_loss, static_argnums=4)  # frozen options: hashable, so static
  got, _ = fn(_LOGPS, _OLD, _ADV, _MASK, options)
  want, _ = losses.policy_loss(_LOGPS, _OLD, _ADV, _MASK, options)
  assert float(got) == pytest.approx(float(want), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# sampler-trainer mismatch and the rollout correction


def test_sampler_mismatch_by_hand():
  # d = trainer - sampler at the masked tokens: 0.1, -0.2, log 3 (r = 3: outside [0.5, 2]); the
  # fourth token is padding, its values inf/NaN, and counts nowhere.
  trainer = np.array([[-1.0, -2.0], [np.log(3.0) - 1.0, np.nan]], np.float32)
  sampler = np.array([[-1.1, -1.8], [-1.0, np.inf]], np.float32)
  mask = np.array([[True, True], [True, False]])
  m = losses.sampler_mismatch(trainer, sampler, mask)
  # k3 = r - 1 - d: 0.105171 - 0.1 = 0.005171; 0.818731 - 1 + 0.2 = 0.018731; 2 - 1.098612.
  want = (0.0051709 + 0.0187308 + (2.0 - np.log(3.0))) / 3
  assert float(m["mismatch/kl"]) == pytest.approx(want, rel=1e-5)
  assert float(m["mismatch/max_abs"]) == pytest.approx(np.log(3.0), rel=1e-6)
  assert float(m["mismatch/ratio_out_frac"]) == pytest.approx(1 / 3)
  # The sampler's own log-probs: no mismatch at all (a sign error would make k3 negative).
  same = losses.sampler_mismatch(trainer, np.where(mask, trainer, 0.0), mask)
  assert [float(v) for v in same.values()] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", losses.ROLLOUT_IS_MODES)
def test_rollout_is_weights_match_numpy_reference(mode):
  rng = np.random.default_rng(3)
  b, t, cap = 64, 7, 1.5
  logps = np.log(rng.uniform(0.05, 1.0, (b, t))).astype(np.float32)
  # Per-token log-ratios of up to +-1, and per-sequence offsets, so both modes cut some but not all.
  offsets = rng.normal(0.0, 0.4, (b, 1))
  sampler = (logps - rng.uniform(-1.0, 1.0, (b, t)) * 0.5 - offsets).astype(np.float32)
  mask = rng.uniform(size=(b, t)) < 0.8
  mask[0] = False  # an empty row
  sampler[~mask] = np.nan  # padding never counts
  weights, metrics = losses.rollout_is_weights(logps, sampler, mask, mode=mode, cap=cap)
  want, clipped = np_rollout_is(logps, sampler, mask, mode, cap)
  np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5, atol=1e-6)
  assert float(metrics["rollout_is/mean_weight"]) == pytest.approx(want[mask].mean(), rel=1e-5)
  assert float(metrics["rollout_is/clipped_frac"]) == pytest.approx(clipped[mask].mean(), abs=1e-7)
  if mode != "none":
    assert 0.05 < clipped[mask].mean() < 0.95  # the reference is exercised on both sides


def test_rollout_is_weights_check_their_arguments():
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="rollout_is must be one of"):
    losses.rollout_is_weights(x, x, x > -1, mode="token", cap=2.0)
  with pytest.raises(ValueError, match="rollout_is_cap must be > 1"):
    losses.rollout_is_weights(x, x, x > -1, mode="token_tis", cap=1.0)


def test_is_weights_scale_the_policy_gradient_terms_only():
  rng = np.random.default_rng(4)
  logps = jnp.asarray(np.log(rng.uniform(0.1, 0.9, (4, 5))), jnp.float32)
  old = logps - 0.05
  adv = jnp.array([1.0, -1.0, 0.5, -2.0])
  mask = np.ones((4, 5), bool)
  mask[2, 3:] = False
  w = jnp.asarray(rng.uniform(0.0, 2.0, (4, 5)), jnp.float32)
  options = losses.LossOptions(kl_coef=0.1, entropy_coef=0.01)
  kw = dict(options=options, ref_logps_bt=logps + 0.1, entropy_bt=-logps)

  def loss(lp, weights):
    return losses.policy_loss(lp, old, adv, mask, is_weights_bt=weights, **kw)

  plain, m_plain = losses.policy_loss(logps, old, adv, mask, **kw)
  ones, _ = loss(logps, jnp.ones_like(w))
  assert float(ones) == pytest.approx(float(plain), rel=1e-6)
  weighted, m = loss(logps, w)
  # pg = token-mean of w * pg_t: the pg term reweighted, the KL and entropy terms unchanged.
  ratio = np.exp(np.asarray(logps - old))
  pg_t = np.maximum(
    -np.asarray(adv)[:, None] * ratio, -np.asarray(adv)[:, None] * np.clip(ratio, 0.8, 1.2)
  )
  assert float(m["pg_loss"]) == pytest.approx((np.asarray(w) * pg_t)[mask].mean(), rel=1e-5)
  assert float(m["kl"]) == pytest.approx(float(m_plain["kl"]), rel=1e-6)
  assert float(m["entropy"]) == pytest.approx(float(m_plain["entropy"]), rel=1e-6)
  # The weights are constants: no gradient flows into them.
  grad_w = jax.grad(lambda weights: loss(logps, weights)[0])(w)
  assert not np.asarray(grad_w).any()
