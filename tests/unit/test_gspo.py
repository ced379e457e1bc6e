"""GSPO's sequence-level ratio (`rl.loss.ratio_level`): the loss and its gradient against an
independent NumPy reference (float64, sequence by sequence, the gradient derived by hand), and the
train step with every advantage estimator and the rollout correction."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import advantages, losses
from tests.helpers import tiny_step as tiny_step_lib

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLIP = {"seq_clip_low": 3e-3, "seq_clip_high": 4e-3}  # wider than GSPO's: both sides clip some


def _np_weights(mask, agg, max_len):
  """Each token's weight in the aggregated loss (`losses.aggregate`), float64."""
  lengths = mask.sum(1)
  seqs = (lengths > 0).sum()
  if agg == "token-mean":
    return mask / lengths.sum()
  if agg == "seq-mean-token-mean":
    return mask / np.maximum(lengths, 1)[:, None] / seqs
  return mask / (seqs * max_len)


def _np_surrogate(a, s, lo, hi, dual):
  """PPO's pessimistic surrogate of one ratio `s` and advantage `a`, and d(surrogate)/ds."""
  clipped = min(max(s, 1 - lo), 1 + hi)
  value, slope = (-a * s, -a) if -a * s >= -a * clipped else (-a * clipped, 0.0)
  if dual is not None and a < 0 and value > -a * dual:
    value, slope = -a * dual, 0.0
  return value, slope


def np_gspo(logps, old, adv_bt, mask, *, level, agg, max_len, lo, hi, dual, w=None):
  """(loss, d loss / d logps) of the sequence-level surrogate, by hand. Sequence i's ratio is
  s_i = exp(mean over its tokens of logp - old). `sequence`: every token's term is the surrogate
  of s_i with the token's advantage, its gradient through s_i (ds_i/dlogp_t = s_i / |y_i|);
  `sequence_token`: the same values, each term's gradient through its own token only
  (d s_it / d logp_t = s_i)."""
  weights = _np_weights(mask, agg, max_len) * (1.0 if w is None else w)
  loss, grad = 0.0, np.zeros_like(logps)
  for i in range(logps.shape[0]):
    n = mask[i].sum()
    if n == 0:
      continue
    s = math.exp(sum(logps[i, t] - old[i, t] for t in range(logps.shape[1]) if mask[i, t]) / n)
    for t in range(logps.shape[1]):
      if not mask[i, t]:
        continue
      value, slope = _np_surrogate(adv_bt[i, t], s, lo, hi, dual)
      loss += weights[i, t] * value
      if level == "sequence":
        grad[i] += weights[i, t] * slope * s / n * mask[i]
      else:
        grad[i, t] += weights[i, t] * slope * s
  return loss, grad


def _inputs(seed, *, b=10, t=7, per_token=False):
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.95, size=(b, t)))
  logps = old + rng.normal(scale=0.015, size=(b, t))  # sequence ratios 1 +- several 1e-3
  adv = rng.normal(size=(b, t) if per_token else (b,))
  lengths = rng.integers(1, t + 1, size=(b,))
  lengths[-1] = 0  # an empty sequence counts nowhere
  mask = np.arange(t)[None, :] < lengths[:, None]
  return logps, old, adv, mask


def _jax_loss_and_grad(logps, old, adv, mask, options, max_len, w=None):
  def loss(lp):
    value, _ = losses.policy_loss(
      lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask),
      options, max_len=max_len,
      is_weights_bt=None if w is None else jnp.asarray(w, jnp.float32),
    )  # fmt: skip
    return value

  return jax.value_and_grad(loss)(jnp.asarray(logps, jnp.float32))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("level", ("sequence", "sequence_token"))
@pytest.mark.parametrize("dual", (None, 3.0))
def test_sequence_ratio_loss_and_gradient_match_numpy(level, agg, dual):
  logps, old, adv, mask = _inputs(1)
  options = losses.LossOptions(ratio_level=level, aggregation=agg, dual_clip=dual, **CLIP)
  got, grad = _jax_loss_and_grad(logps, old, adv, mask, options, max_len=9)
  adv_bt = np.broadcast_to(adv[:, None], mask.shape)
  want, want_grad = np_gspo(
    logps, old, adv_bt, mask, level=level, agg=agg, max_len=9, lo=3e-3, hi=4e-3, dual=dual
  )
  assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-4, atol=1e-7)
  # At this spread the clip stops some sequences' gradient and not others': it is exercised.
  zero_rows = (want_grad[mask.any(1)] == 0).all(1)
  assert zero_rows.any() and not zero_rows.all()


def test_gspo_token_takes_per_token_advantages_and_correction_weights():
  logps, old, adv, mask = _inputs(2, per_token=True)
  w = np.random.default_rng(3).uniform(0.0, 2.0, size=mask.shape)
  agg = "seq-mean-token-mean"
  options = losses.LossOptions(ratio_level="sequence_token", aggregation=agg, **CLIP)
  got, grad = _jax_loss_and_grad(logps, old, adv, mask, options, max_len=7, w=w)
  want, want_grad = np_gspo(
    logps, old, adv, mask, level="sequence_token", agg=agg, max_len=7, lo=3e-3, hi=4e-3,
    dual=3.0, w=w,
  )  # fmt: skip
  assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-4, atol=1e-7)


def test_with_sequence_advantages_gspo_and_gspo_token_are_the_same_objective():
  logps, old, adv, mask = _inputs(4)
  options = lambda level: losses.LossOptions(
    ratio_level=level, aggregation="seq-mean-token-mean", **CLIP
  )
  (a, grad_a), (b, grad_b) = [
    _jax_loss_and_grad(logps, old, adv, mask, options(level), 7)
    for level in ("sequence", "sequence_token")
  ]
  assert float(a) == pytest.approx(float(b), rel=1e-6)
  np.testing.assert_allclose(np.asarray(grad_a), np.asarray(grad_b), rtol=1e-5, atol=1e-9)
  # ... and not the token-level objective (its gradient is per token, not through the mean).
  _, grad_token = _jax_loss_and_grad(
    logps, old, adv, mask, losses.LossOptions(aggregation="seq-mean-token-mean"), 7
  )
  assert not np.allclose(np.asarray(grad_token), np.asarray(grad_a), rtol=1e-3)


def test_each_level_clips_with_its_own_range_and_bad_levels_are_refused():
  assert losses.LossOptions(clip_high=0.28).clip_range() == (0.2, 0.28)
  assert losses.LossOptions(ratio_level="sequence").clip_range() == (3e-4, 4e-4)
  with pytest.raises(losses.InvalidLossOption, match="ratio_level='seq': must be one of token"):
    losses.LossOptions(ratio_level="seq")
  with pytest.raises(losses.InvalidLossOption, match="seq_clip_low=1.0: must lie in"):
    losses.LossOptions(seq_clip_low=1.0)


# ----------------------------------------------------------------------------- the train step

tiny_steps = functools.partial(tiny_step_lib.tiny_steps, num_devices=1)


@pytest.mark.parametrize(
  "overrides",
  [{"rl.advantage": name} for name in advantages.ESTIMATORS]
  + [{"rl.loss.rollout_is": "token_tis"}]
  # The tiny batch's sampler log-probs are random: a wide cap keeps its sequences in.
  + [{"rl.loss.rollout_is": "seq_mask", "rl.loss.rollout_is_cap": 1e3}]
  + [{"rl.loss.ratio_level": "sequence_token", "rl.loss.rollout_is": "token_tis"}],
  ids=lambda o: ",".join(f"{k.split('.')[-1]}={v}" for k, v in o.items()),
)
def test_the_train_step_trains_with_a_sequence_ratio(overrides):
  overrides = {"rl.loss.ratio_level": "sequence", **overrides}
  tiny = tiny_steps({**overrides, "rl.loss.aggregation": "seq-mean-token-mean"})
  batch = tiny.batch()
  state = tiny.fresh_state()
  new, metrics, _ = tiny(batch, state)
  assert np.isfinite(float(metrics["loss"])) and int(metrics["bad_updates"]) == 0
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new.params, state.params)
  assert max(jax.tree.leaves(moved)) > 0
