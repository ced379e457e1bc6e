"""Every metric name the trainer writes, the one copy (contracts: DESIGN.md), and the rules for
per-cluster and per-reward-function keys."""

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"
SAMPLES_FILE = "samples.jsonl"  # sample completions, one JSON object per line (write_samples)
WANDB_RUN_ID_FILE = "wandb_run_id"  # the workdir's wandb run id: a resumed run continues it
# MetricsWriter's resume_step when nothing was restored: every line of an earlier start is dropped
# (the warm start's, at negative steps, too).
FRESH_START = -(2**31)
# How often a writer on an object store uploads (each upload sends the whole files again).
REMOTE_FLUSH_S = 60.0

# ----------------------------------------------------------------------------- metric names
# The one copy of every key the trainer writes to metrics.jsonl (contracts: see DESIGN.md).

STEP = "step"  # the integer step of every line; not a metric (MetricsWriter.write's argument)

# Rollouts: rewards, advantages, responses (the train step and the host).
REWARD_MEAN = "reward/mean"  # mean total reward over the batch's responses (weighted sum of fns)
REWARD_ERRORS = "reward/errors"  # verifier calls that raised or timed out
REWARD_OVERLONG_PENALTY = "reward/overlong_penalty"  # DAPO's soft overlong punishment, mean
ADV_ZERO_FRAC = "adv/zero_frac"  # share of valid responses whose advantage is exactly 0
# Share of prompts whose rewards are all equal: the groups GRPO zeroes, whatever estimator runs.
ADV_ALL_EQUAL_FRAC = "adv/all_equal_frac"
ADV_ABS_MEAN = "adv/abs_mean"
EBPO_SHRINKAGE_MEAN = "ebpo/shrinkage_mean"  # mean shrinkage S over the batch's prompts (EBPO)
# EBPO's prior after the step's update, per cluster (per_cluster(KEY, name)); the bare key only
# with one global prior (rl.ebpo.per_cluster=False).
EBPO_PRIOR_MEAN = "ebpo/prior_mean"  # mu_glob, the prior mean reward
EBPO_PRIOR_STD = "ebpo/prior_std"  # sqrt(tau^2): the spread of the prompts' mean rewards
EBPO_SHRINKAGE = "ebpo/shrinkage"  # S of a full group: the baseline's weight on the prior mean
RESPONSE_LEN_MEAN = "response_len/mean"
TRUNCATED_FRAC = "truncated_frac"  # responses cut at the generation length
ROLLOUT_TOKENS = "rollout/tokens"  # tokens sampled this step (all refill rounds)
# Multi-turn episodes (config.env): per trajectory, averaged over the step's (all refill rounds).
TURNS_MEAN = "turns/mean"  # model turns
TOOL_CALLS_MEAN = "tool_calls/mean"  # tool calls the environment counted
TOOL_ERRORS = "tool_errors"  # failed tool calls and environment steps, summed over the step
MASKED_FRAC = "masked_frac"  # share of trajectory tokens out of the loss (observations)
ENV_TIME_S = "env/time_s"  # wall time of the environment steps
DAPO_KEPT_FRAC = "dapo/kept_frac"  # dynamic sampling: first-round groups with varied rewards
DAPO_ROUNDS = "dapo/rounds"
DAPO_FILLED_GROUPS = "dapo/filled_groups"  # groups without signal that filled a short batch

# The update: losses.policy_loss's metrics, averaged over the step's updates, and the optimizer's.
LOSS = "loss"
PG_LOSS = "pg_loss"
KL = "kl"  # to the reference policy; 0 without one (rl.loss.kl_coef == 0)
ENTROPY = "entropy"
CLIPFRAC = "clipfrac"
CLIPFRAC_LOW = "clipfrac_low"
CLIPFRAC_HIGH = "clipfrac_high"
DUAL_CLIPFRAC = "dual_clipfrac"
RATIO_MEAN = "ratio_mean"
APPROX_KL = "approx_kl"  # k3 of the old policy from the new one: how far the update moved
GRAD_NORM = "grad_norm"
LEARNING_RATE = "lr"  # the schedule's value, mean over the step's updates (one: its value)
BAD_UPDATES = "bad_updates"  # updates skipped for a non-finite loss or grad norm
# The sampler-trainer mismatch at the loss-mask tokens, first pass (the step's params before any
# update) against the sampler's log-probs: losses.sampler_mismatch; r = pi_train / pi_sampler.
MISMATCH_KL = "mismatch/kl"  # k3 = r - 1 - log r: KL(pi_sampler || pi_train), token mean
MISMATCH_MAX_ABS = "mismatch/max_abs"  # max |log r|
MISMATCH_RATIO_OUT_FRAC = "mismatch/ratio_out_frac"  # share of tokens with r outside [0.5, 2]
# The rollout correction's weights (rl.loss.rollout_is != none): losses.rollout_is_weights.
ROLLOUT_IS_MEAN_WEIGHT = "rollout_is/mean_weight"  # token mean of the weights
ROLLOUT_IS_CLIPPED_FRAC = "rollout_is/clipped_frac"  # tokens capped (token_tis), masked (seq_mask)
# Mixture-of-experts policies (models.moe), over the tokens of the update's forward, mean of the
# step's updates: the router's load-balancing loss (HF's; k of top-k when balanced), the most loaded
# expert's load over the mean load at the most unbalanced layer (1: balanced).
MOE_AUX_LOSS = "moe/aux_loss"
MOE_LOAD_MAX = "moe/load_max"
# Asynchronous RL (rl.max_staleness = k > 0, rollouts.pipeline): the batch's staleness, steps
# between the policy that sampled it and the one it trains (batch t: min(t, k) for every row, on
# the line of step t + 1), and where the step's time went.
ASYNC_STALENESS_MEAN = "async/staleness_mean"
ASYNC_STALENESS_MAX = "async/staleness_max"
ASYNC_TRAINER_WAIT_S = "async/trainer_wait_s"  # the trainer waiting for the next batch
ASYNC_ROLLOUT_WAIT_S = "async/rollout_wait_s"  # the producer idle beside the train step
ASYNC_TRANSFER_S = "async/transfer_s"  # copying the params the producer samples with

# Bookkeeping and wall-clock time.
COMPILES_TRAIN_STEP = "compiles/train_step"  # times the train step was traced (1 = no retrace)
TIME_STEP_S = "time/step_s"
TIME_SAMPLE_S = "time/sample_s"
TIME_UPDATE_S = "time/update_s"
TIME_TOKENS_PER_S = "time/tokens_per_s"  # ROLLOUT_TOKENS / TIME_STEP_S
TIME_ELAPSED_S = "time/elapsed_s"  # wall time since this start of the run (compiles, evals too)

# The supervised warm start's lines: SFT step k of N is logged at step k - N - 1 (-N .. -1), before
# RL's step 0, so that one step axis holds both phases (wandb, whose steps start at 0, has RL's).
SFT_LOSS = "sft/loss"  # mean cross-entropy per answer token of the step's batch

# Evaluation lines.
EVAL_ACCURACY = "eval/accuracy"
EVAL_VERIFIER_ERRORS = "eval/verifier_errors"  # evaluation verifier calls that raised or timed out

# Keys that measure wall-clock time: they differ between an interrupted and a straight run.
ASYNC_TIMING_KEYS = (ASYNC_TRAINER_WAIT_S, ASYNC_ROLLOUT_WAIT_S, ASYNC_TRANSFER_S)  # k > 0 only
TIMING_KEYS = (
  TIME_STEP_S, TIME_TOKENS_PER_S, TIME_SAMPLE_S, TIME_UPDATE_S, TIME_ELAPSED_S, ENV_TIME_S,
  *ASYNC_TIMING_KEYS,
)  # fmt: skip
# Keys that are also logged per cluster, as per_cluster(key, name).
PER_CLUSTER_KEYS = (REWARD_MEAN, EVAL_ACCURACY, EBPO_PRIOR_MEAN, EBPO_PRIOR_STD, EBPO_SHRINKAGE)
# Every metric name above (not STEP).
KEYS = frozenset(
  {REWARD_MEAN, REWARD_ERRORS, REWARD_OVERLONG_PENALTY, ADV_ZERO_FRAC, ADV_ALL_EQUAL_FRAC}
  | {ADV_ABS_MEAN, EBPO_SHRINKAGE_MEAN, EBPO_PRIOR_MEAN, EBPO_PRIOR_STD, EBPO_SHRINKAGE}
  | {RESPONSE_LEN_MEAN, TRUNCATED_FRAC, ROLLOUT_TOKENS}
  | {DAPO_KEPT_FRAC, DAPO_ROUNDS, DAPO_FILLED_GROUPS}
  | {TURNS_MEAN, TOOL_CALLS_MEAN, TOOL_ERRORS, MASKED_FRAC, ENV_TIME_S}
  | {LOSS, PG_LOSS, KL, ENTROPY, CLIPFRAC, CLIPFRAC_LOW, CLIPFRAC_HIGH, DUAL_CLIPFRAC}
  | {
    RATIO_MEAN,
    APPROX_KL,
    GRAD_NORM,
    LEARNING_RATE,
    BAD_UPDATES,
    COMPILES_TRAIN_STEP,
    *TIMING_KEYS,
  }
  | {MISMATCH_KL, MISMATCH_MAX_ABS, MISMATCH_RATIO_OUT_FRAC}
  | {ROLLOUT_IS_MEAN_WEIGHT, ROLLOUT_IS_CLIPPED_FRAC}
  | {MOE_AUX_LOSS, MOE_LOAD_MAX}
  | {ASYNC_STALENESS_MEAN, ASYNC_STALENESS_MAX}
  | {EVAL_ACCURACY, EVAL_VERIFIER_ERRORS, SFT_LOSS}
)


def cluster_prefix(key: str) -> str:
  """The prefix that all per-cluster keys of `key` share: "eval/accuracy" -> "eval/accuracy/"."""
  return f"{key}/"


def per_cluster(key: str, cluster_name: str) -> str:
  """The one rule for per-cluster keys: ("reward/mean", "add_2d") -> "reward/mean/add_2d"."""
  return cluster_prefix(key) + cluster_name


def sft_step(step: int, num_steps: int) -> int:
  """The metrics step of supervised step `step` (1-based) of `num_steps`: -num_steps .. -1."""
  return step - num_steps - 1


def reward_fn_key(name: str) -> str:
  """The one rule for a reward function's key (config.rewards.fns): "brevity" -> "reward/brevity",
  its mean value over the batch beside REWARD_MEAN. A ValueError for a name whose key is taken
  ("mean", "errors", ...)."""
  key = f"reward/{name}"
  if key in KEYS:
    taken = sorted(k.removeprefix("reward/") for k in KEYS if k.startswith("reward/"))
    raise ValueError(f"reward name {name!r} is taken by a metric; not one of {', '.join(taken)}")
  return key
