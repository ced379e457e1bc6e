"""Policy-gradient loss for RLVR: PPO clip (token or sequence ratios: GSPO), clip-higher, dual
clip, KL to a reference, entropy.

Pure functions over arrays (jittable, no project imports). Shapes: `b` batch (sequences),
`t` response tokens, `v` vocabulary. Every mean is a masked mean; padded tokens (mask 0) contribute
nothing to the loss, the metrics or the gradients, even when their log-probs are inf or NaN.

Gradient accumulation: pass the GLOBAL counts of the whole mini-batch (`num_tokens`, `num_seqs`)
and the fixed generation length `max_len`; then the loss and every metric of a micro-batch is its
exact share of the mini-batch value, so summing over micro-batches gives the full-batch value
whatever the micro-batch size.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
KLKind = Literal["k1", "k2", "k3"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
ROLLOUT_IS_MODES: tuple[str, ...] = ("none", "token_tis", "seq_mask")
# The importance ratio of PPO's clipped surrogate (`policy_loss`): per token (PPO, GRPO), per
# sequence (GSPO, Zheng et al. 2025: the length-normalised sequence ratio), or GSPO-token (the
# sequence ratio's value with each token's own gradient).
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence", "sequence_token")
# A token's trainer/sampler probability ratio outside these bounds counts in `ratio_out_frac`.
MISMATCH_RATIO_BOUNDS = (0.5, 2.0)

# exp() of a log-ratio beyond this overflows float32 soon after; such tokens are pathological and
# clamping keeps one of them from turning the whole loss into inf.
_MAX_LOG_RATIO = 20.0


def token_logprobs(logits_btv: Array, targets_bt: Array) -> Array:
  """log softmax(logits)[target] per token, computed in float32: `[B, T, V], [B, T] -> [B, T]`."""
  logits_btv = logits_btv.astype(jnp.float32)
  logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  target_logits_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  return target_logits_bt - logz_bt


def entropy(logits_btv: Array) -> Array:
  """Entropy of the next-token distribution, H = logsumexp(z) - sum_v p_v z_v, in float32."""
  logits_btv = logits_btv.astype(jnp.float32)
  logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  probs_btv = jax.nn.softmax(logits_btv, axis=-1)
  return logz_bt - jnp.sum(probs_btv * logits_btv, axis=-1)


def kl_penalty(logps_bt: Array, ref_logps_bt: Array, kind: KLKind = "k3") -> Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
  divergence", 2020). With log r = log pi_ref - log pi:

    k1 = -log r                 (unbiased, high variance, can be negative)
    k2 = (log r)^2 / 2          (biased, low variance)
    k3 = (r - 1) - log r        (unbiased, low variance, >= 0; GRPO's / EBPO's choice)
  """
  log_r_bt = ref_logps_bt.astype(jnp.float32) - logps_bt.astype(jnp.float32)
  if kind == "k1":
    return -log_r_bt
  if kind == "k2":
    return 0.5 * jnp.square(log_r_bt)
  if kind == "k3":
    log_r_bt = jnp.clip(log_r_bt, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.expm1(log_r_bt) - log_r_bt
  raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {kind!r}")


def aggregate(
  values_bt: Array, mask_bt: Array, mode: AggMode, *, norm: Array | float | None = None
) -> Array:
  """Reduce per-token values to a scalar.

    token-mean:               sum_{i,t} m v / N_tok                   (DAPO; the EBPO paper)
    seq-mean-token-mean:      sum_i (sum_t m v / sum_t m) / N_seq     (GRPO as written)
    seq-mean-token-sum-norm:  sum_i (sum_t m v) / (N_seq * max_len)   (Dr.GRPO, Liu et al. 2025)

  `norm` is the whole denominator (N_tok, N_seq or N_seq * max_len); by default it is counted
  on this batch (N_seq = sequences with at least one valid token, max_len = T). Pass the global
  value under gradient accumulation.
  """
  mask_bt = mask_bt.astype(bool)
  masked_bt = jnp.where(mask_bt, values_bt.astype(jnp.float32), 0.0)
  if mode == "token-mean":
    total = jnp.sum(masked_bt)
    default_norm = jnp.sum(mask_bt)
  elif mode == "seq-mean-token-mean":
    tokens_b = jnp.sum(mask_bt, axis=-1)
    total = jnp.sum(jnp.sum(masked_bt, axis=-1) / jnp.maximum(tokens_b, 1))
    default_norm = jnp.sum(tokens_b > 0)
  elif mode == "seq-mean-token-sum-norm":
    total = jnp.sum(masked_bt)
    default_norm = jnp.sum(jnp.any(mask_bt, axis=-1)) * mask_bt.shape[-1]
  else:
    raise ValueError(f"agg must be one of {AGG_MODES}, got {mode!r}")
  norm = default_norm if norm is None else norm
  return total / jnp.maximum(jnp.asarray(norm, jnp.float32), 1.0)


def _agg_norm(
  mode: str,
  mask_bt: Array,
  num_tokens: Array | int | None,
  num_seqs: Array | int | None,
  max_len: int | None,
) -> Array:
  """The denominator of `aggregate` for `mode`, from global counts where given."""
  mask_bt = mask_bt.astype(bool)
  if num_tokens is None:
    num_tokens = jnp.sum(mask_bt)
  if num_seqs is None:
    num_seqs = jnp.sum(jnp.any(mask_bt, axis=-1))
  if max_len is None:
    max_len = mask_bt.shape[-1]
  if mode == "token-mean":
    return jnp.asarray(num_tokens, jnp.float32)
  if mode == "seq-mean-token-mean":
    return jnp.asarray(num_seqs, jnp.float32)
  if mode == "seq-mean-token-sum-norm":
    return jnp.asarray(num_seqs, jnp.float32) * max_len
  raise ValueError(f"agg must be one of {AGG_MODES}, got {mode!r}")


def _zero_padding(values_bt: Array, mask_bt: Array) -> Array:
  return jnp.where(mask_bt, values_bt.astype(jnp.float32), 0.0)


class InvalidLossOption(ValueError):
  """A `LossOptions` field outside its range; `field`, `value` and `rule` let a caller name its
  config key (`LossOptions.from_config`)."""

  def __init__(self, field: str, value: Any, rule: str):
    self.field, self.value, self.rule = field, value, rule
    super().__init__(f"{field}={value!r}: {rule}")


def _one_of(options: tuple[str, ...]) -> str:
  return f"must be one of {', '.join(options)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossOptions:
  """The policy loss's hyperparameters (`config.rl.loss`), frozen (static under jit) and checked
  where they are built: an invalid one raises `InvalidLossOption`. `policy_loss` takes them whole;
  `rollout_is` and `rollout_is_cap` are the rollout correction's (`rollout_is_weights`)."""

  clip_low: float = 0.2  # PPO's lower clip: the ratio's bound is 1 - clip_low, in [0, 1)
  clip_high: float = 0.2  # the upper clip, 1 + clip_high (clip-higher: DAPO's 0.28)
  dual_clip: float | None = 3.0  # > 1, or None: no dual clip (Ye et al. 2020)
  aggregation: AggMode = "token-mean"  # one of AGG_MODES (`aggregate`)
  kl_coef: float = 0.0  # >= 0; 0: no KL term (no reference log-probs needed)
  kl_kind: KLKind = "k3"  # one of KL_KINDS (`kl_penalty`)
  entropy_coef: float = 0.0  # >= 0; 0: no entropy bonus
  rollout_is: str = "none"  # one of ROLLOUT_IS_MODES
  rollout_is_cap: float = 2.0  # finite, > 1
  ratio_level: str = "token"  # one of RATIO_LEVELS
  # The clip of a sequence-level ratio (ratio_level sequence or sequence_token; clip_low and
  # clip_high are the token level's): GSPO's 3e-4 and 4e-4, a sequence ratio being a geometric
  # mean over its tokens, much closer to 1 than a token's.
  seq_clip_low: float = 3e-4
  seq_clip_high: float = 4e-4

  def __post_init__(self):
    _check(0.0 <= self.clip_low < 1.0, self, "clip_low", "must lie in [0, 1)")
    _check(self.clip_high >= 0.0, self, "clip_high", "must be >= 0")
    _check(self.dual_clip is None or self.dual_clip > 1.0, self, "dual_clip", "must be > 1")
    _check(self.aggregation in AGG_MODES, self, "aggregation", _one_of(AGG_MODES))
    _check(self.kl_kind in KL_KINDS, self, "kl_kind", _one_of(KL_KINDS))
    _check(self.kl_coef >= 0.0, self, "kl_coef", "must be >= 0")
    _check(self.entropy_coef >= 0.0, self, "entropy_coef", "must be >= 0")
    _check(self.rollout_is in ROLLOUT_IS_MODES, self, "rollout_is", _one_of(ROLLOUT_IS_MODES))
    cap = self.rollout_is_cap
    _check(math.isfinite(cap) and cap > 1, self, "rollout_is_cap", "must be finite, > 1")
    _check(self.ratio_level in RATIO_LEVELS, self, "ratio_level", _one_of(RATIO_LEVELS))
    _check(0.0 <= self.seq_clip_low < 1.0, self, "seq_clip_low", "must lie in [0, 1)")
    _check(self.seq_clip_high >= 0.0, self, "seq_clip_high", "must be >= 0")

  def clip_range(self) -> tuple[float, float]:
    """(clip_low, clip_high) of the ratio at `ratio_level`."""
    if self.ratio_level == "token":
      return self.clip_low, self.clip_high
    return self.seq_clip_low, self.seq_clip_high

  @classmethod
  def from_config(cls, loss: Mapping[str, Any]) -> "LossOptions":
    """The options of `config.rl.loss` (any mapping); ValueError naming the key and its value."""
    try:
      return cls(**{f.name: loss[f.name] for f in dataclasses.fields(cls)})
    except InvalidLossOption as e:
      raise ValueError(f"config.rl.loss.{e}") from None


def _check(ok: bool, options: LossOptions, field: str, rule: str) -> None:
  if not ok:
    raise InvalidLossOption(field, getattr(options, field), rule)


def _clipped_surrogate(
  adv_bt: Array, ratio_bt: Array, *, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Array, Array, Array]:
  """PPO's pessimistic surrogate per token, with clip-higher and the dual clip: (pg [B, T], where
  the clip is active, where the dual clip is active)."""
  unclipped_bt = -adv_bt * ratio_bt
  clipped_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high)
  pg_bt = jnp.maximum(unclipped_bt, clipped_bt)
  is_clipped_bt = clipped_bt > unclipped_bt
  dual_clipped_bt = jnp.zeros_like(is_clipped_bt)
  if dual_clip is not None:
    dual_bound_bt = -adv_bt * dual_clip
    dual_clipped_bt = (adv_bt < 0) & (pg_bt > dual_bound_bt)
    pg_bt = jnp.where(dual_clipped_bt, dual_bound_bt, pg_bt)
  return pg_bt, is_clipped_bt, dual_clipped_bt


def policy_loss(
  logps_bt: Array,
  old_logps_bt: Array,
  adv_b_or_bt: Array,
  mask_bt: Array,
  options: LossOptions = LossOptions(),
  *,
  ref_logps_bt: Array | None = None,
  entropy_bt: Array | None = None,
  num_tokens: Array | int | None = None,
  num_seqs: Array | int | None = None,
  max_len: int | None = None,
  is_weights_bt: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """PPO-clip loss with clip-higher, dual clip, KL and entropy terms; token or sequence ratios.

  With r the ratio at `options.ratio_level` (`surrogate_ratio`: exp(logp - old_logp) per token,
  or GSPO's length-normalised sequence ratio), advantage A (per sequence or per token) and the
  level's clip bounds (`LossOptions.clip_range`):

    pg    = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))   (Schulman et al. 2017;
                                                                  clip-higher: DAPO, Yu et al. 2025)
    pg    = min(pg, -A c)  where A < 0                            (dual clip, Ye et al. 2020)
    pg    = w pg   with `is_weights_bt` w (the rollout correction, `rollout_is_weights`)
    loss  = agg(pg) + kl_coef * agg(kl_k(pi || pi_ref)) - entropy_coef * agg(H)

  The hyperparameters are `options` (`LossOptions`, taken whole): `agg` is its `aggregation`, one
  of `aggregate`'s modes, normalised by the global counts `num_tokens` / `num_seqs` and the
  generation length `max_len` (defaults: counted on this batch); with `kl_coef` or `entropy_coef`
  0 the term is dropped, and no reference log-probs are needed. Returns (loss, metrics); every
  metric uses the same global normaliser as the loss, so summing micro-batch metrics gives the
  mini-batch value. `is_weights_bt` (constants: no gradient flows through them) scale each token's
  policy-gradient term only, not the KL or entropy terms, and leave the normaliser as it is (a
  weight-0 token still counts in N_tok). Metrics: `pg_loss`, `kl` (0 without reference log-probs),
  `entropy` (only with `entropy_bt`), `clipfrac` (tokens where the clip is active, `clipfrac_low`
  / `clipfrac_high` by side), `dual_clipfrac`,
  `ratio_mean` (of r), `approx_kl` (k3 of the old policy from the new one, per token: how far the
  update has moved).
  """
  o, agg = options, options.aggregation
  if o.kl_coef > 0.0 and ref_logps_bt is None:
    raise ValueError(f"kl_coef={o.kl_coef} > 0 needs ref_logps_bt (reference policy log-probs)")
  if o.entropy_coef > 0.0 and entropy_bt is None:
    raise ValueError(f"entropy_coef={o.entropy_coef} > 0 needs entropy_bt")
  mask_bt = mask_bt.astype(bool)
  adv_bt = adv_b_or_bt.astype(jnp.float32)
  adv_bt = jnp.broadcast_to(adv_bt[:, None] if adv_bt.ndim == 1 else adv_bt, mask_bt.shape)
  agg_norm = _agg_norm(agg, mask_bt, num_tokens, num_seqs, max_len)
  tok_norm = _agg_norm("token-mean", mask_bt, num_tokens, num_seqs, max_len)

  def agg_loss(values_bt):
    return aggregate(values_bt, mask_bt, agg, norm=agg_norm)

  def tok_mean(values_bt):
    return aggregate(values_bt, mask_bt, "token-mean", norm=tok_norm)

  # Padding is zeroed first: inf/NaN there would otherwise leak into gradients (0 * inf = NaN).
  logps_bt = _zero_padding(logps_bt, mask_bt)
  log_ratio_bt = logps_bt - _zero_padding(old_logps_bt, mask_bt)
  ratio_bt = surrogate_ratio(logps_bt, log_ratio_bt, mask_bt, o.ratio_level)
  clip_low, clip_high = o.clip_range()
  pg_bt, is_clipped_bt, dual_clipped_bt = _clipped_surrogate(
    adv_bt, ratio_bt, clip_low=clip_low, clip_high=clip_high, dual_clip=o.dual_clip
  )
  if is_weights_bt is not None:
    pg_bt = pg_bt * _zero_padding(jax.lax.stop_gradient(is_weights_bt), mask_bt)
  loss = agg_loss(pg_bt)
  ratio_metrics = _ratio_metrics(tok_mean, ratio_bt, log_ratio_bt, is_clipped_bt, dual_clipped_bt)
  metrics = {"pg_loss": loss, **ratio_metrics}
  metrics["kl"] = jnp.zeros((), jnp.float32)
  if ref_logps_bt is not None:
    metrics["kl"] = agg_loss(kl_penalty(logps_bt, _zero_padding(ref_logps_bt, mask_bt), o.kl_kind))
    if o.kl_coef > 0.0:
      loss = loss + o.kl_coef * metrics["kl"]
  if entropy_bt is not None:
    metrics["entropy"] = agg_loss(_zero_padding(entropy_bt, mask_bt))
    if o.entropy_coef > 0.0:
      loss = loss - o.entropy_coef * metrics["entropy"]
  metrics["loss"] = loss
  return loss, metrics


def surrogate_ratio(logps_bt: Array, log_ratio_bt: Array, mask_bt: Array, level: str) -> Array:
  """The ratio [B, T] PPO's surrogate clips, at `level` (one of RATIO_LEVELS), from the tokens'
  log-ratios log(pi / pi_old) (padding zeroed):

    token:           r_t = exp(log_ratio_t)
    sequence:        s   = exp(sum_t m log_ratio_t / sum_t m), the same s at every token of the
                     sequence, its gradient through all of them (GSPO)
    sequence_token:  s_t = sg(s) pi_t / sg(pi_t): s's value, each token's own gradient
                     (GSPO-token: per-token advantages with sequence-level clipping)

  With a per-sequence advantage and `seq-mean-token-mean` aggregation, sequence and
  sequence_token give GSPO's objective and the same gradient."""
  if level == "token":
    return jnp.exp(jnp.clip(log_ratio_bt, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
  if level not in RATIO_LEVELS:
    raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {level!r}")
  lengths_b = jnp.maximum(jnp.sum(mask_bt, axis=-1), 1)
  seq_log_ratio_b1 = (jnp.sum(log_ratio_bt, axis=-1) / lengths_b)[:, None]
  if level == "sequence":
    log_s_bt = jnp.broadcast_to(seq_log_ratio_b1, log_ratio_bt.shape)
  else:
    log_s_bt = jax.lax.stop_gradient(seq_log_ratio_b1) + logps_bt - jax.lax.stop_gradient(logps_bt)
  return jnp.exp(jnp.clip(log_s_bt, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _ratio_metrics(tok_mean, ratio_bt, log_ratio_bt, is_clipped_bt, dual_clipped_bt) -> dict:
  """`policy_loss`'s token means of where the clip acted and how far the ratio moved."""
  return {
    "clipfrac": tok_mean(is_clipped_bt),
    "clipfrac_low": tok_mean(is_clipped_bt & (ratio_bt < 1.0)),
    "clipfrac_high": tok_mean(is_clipped_bt & (ratio_bt > 1.0)),
    "dual_clipfrac": tok_mean(dual_clipped_bt),
    "ratio_mean": tok_mean(ratio_bt),
    "approx_kl": tok_mean(kl_penalty(jnp.zeros_like(log_ratio_bt), log_ratio_bt, "k3")),
  }


def sampler_mismatch(logps_bt: Array, sampler_logps_bt: Array, mask_bt: Array) -> dict[str, Array]:
  """How far the trainer's log-probs of the sampled tokens are from the sampler's, at the masked
  (model) tokens: `mismatch/kl`, `mismatch/max_abs`, `mismatch/ratio_out_frac`.

  With d = logps - sampler_logps and r = exp(d) = pi_train / pi_sampler per token:

    kl              = mean(r - 1 - d)    k3 (`kl_penalty`) on the sampler's samples: an estimate of
                                         KL(pi_sampler || pi_train), >= 0 (verl's convention)
    max_abs         = max |d|
    ratio_out_frac  = share of tokens whose r lies outside MISMATCH_RATIO_BOUNDS = [0.5, 2]

  Means over the batch's masked tokens (0 when there are none); padding never counts, whatever
  its values (inf, NaN).
  """
  mask_bt = mask_bt.astype(bool)
  d_bt = _zero_padding(logps_bt, mask_bt) - _zero_padding(sampler_logps_bt, mask_bt)
  low, high = np.log(MISMATCH_RATIO_BOUNDS[0]), np.log(MISMATCH_RATIO_BOUNDS[1])

  def mean(values_bt):
    return aggregate(values_bt, mask_bt, "token-mean")

  return {
    "mismatch/kl": mean(kl_penalty(jnp.zeros_like(d_bt), d_bt, "k3")),
    "mismatch/max_abs": jnp.max(jnp.abs(d_bt)),
    "mismatch/ratio_out_frac": mean((d_bt < low) | (d_bt > high)),
  }


def rollout_is_weights(
  logps_bt: Array, sampler_logps_bt: Array, mask_bt: Array, *, mode: str, cap: float
) -> tuple[Array, dict[str, Array]]:
  """The rollout correction's per-token weights [B, T] (0 at padding, no gradient), and their
  metrics `rollout_is/mean_weight`, `rollout_is/clipped_frac` (means over the masked tokens).

  `logps_bt` are the trainer's log-probs of the sampled tokens under the step's params before any
  update (the first pass), `sampler_logps_bt` the sampler's; r_t = exp(logps - sampler_logps):

    none       w_t = 1
    token_tis  w_t = min(r_t, cap)       truncated importance sampling per token (verl's
                                         `rollout_is: token`, TRL's `token_truncate`); clipped:
                                         the tokens with r_t > cap
    seq_mask   w_t = 1[1/cap <= g <= cap] with g = exp(mean_t log r_t) the sequence's geometric-
                                         mean ratio (verl's `rollout_rs: geometric` with its lower
                                         bound 1/upper): a sequence outside weighs 0; clipped: the
                                         tokens of those sequences

  The geometric mean does not grow with the length, as the product would (verl's `sequence`), so
  one cap means the same for short and long responses; verl's typical geometric thresholds are
  1.0002 - 1.001, far tighter than a per-token cap of about 2.
  """
  if mode not in ROLLOUT_IS_MODES:
    raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
  if not cap > 1.0:
    raise ValueError(f"rollout_is_cap must be > 1, got {cap!r}")
  mask_bt = mask_bt.astype(bool)
  d_bt = _zero_padding(logps_bt, mask_bt) - _zero_padding(sampler_logps_bt, mask_bt)
  d_bt = jax.lax.stop_gradient(jnp.clip(d_bt, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
  if mode == "none":
    weights_bt, clipped_bt = jnp.ones_like(d_bt), jnp.zeros_like(mask_bt)
  elif mode == "token_tis":
    ratio_bt = jnp.exp(d_bt)
    weights_bt, clipped_bt = jnp.minimum(ratio_bt, cap), ratio_bt > cap
  else:
    log_geo_b = jnp.sum(d_bt, axis=-1) / jnp.maximum(jnp.sum(mask_bt, axis=-1), 1)
    kept_b = jnp.abs(log_geo_b) <= np.log(cap)
    weights_bt = jnp.broadcast_to(kept_b[:, None], mask_bt.shape).astype(jnp.float32)
    clipped_bt = ~jnp.broadcast_to(kept_b[:, None], mask_bt.shape)
  weights_bt = _zero_padding(weights_bt, mask_bt)
  metrics = {
    "rollout_is/mean_weight": aggregate(weights_bt, mask_bt, "token-mean"),
    "rollout_is/clipped_frac": aggregate(clipped_bt, mask_bt, "token-mean"),
  }
  return weights_bt, metrics


def overlong_penalty(
  lengths_b: np.ndarray, *, max_len: int, buffer: int, penalty: float = 1.0
) -> np.ndarray:
  """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to the task reward.

  0 for lengths up to max_len - buffer, then falling linearly to -penalty at max_len (a truncated
  response has length max_len): -penalty * (len - (max_len - buffer)) / buffer. buffer = 0: off.
  NumPy: it shapes rewards on the host, where the lengths already are.
  """
  if buffer < 0 or buffer > max_len:
    raise ValueError(f"overlong buffer must lie in [0, max_len={max_len}], got {buffer}")
  if buffer == 0:
    return np.zeros(np.shape(lengths_b), np.float32)
  over = np.clip(np.asarray(lengths_b, np.float32) - (max_len - buffer), 0.0, buffer)
  return (-penalty * over / buffer).astype(np.float32)
