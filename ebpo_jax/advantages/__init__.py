"""Advantage estimators for RLVR: GRPO, Dr.GRPO, RLOO, James-Stein shrinkage and EBPO.

Pure, jittable functions over arrays. Shapes: `rewards` [B, G] (B prompts, G responses each),
`mask` [B, G] bool (True = valid response; default all valid), `cluster_ids` [B] int in [0, K).
Groups may be ragged through `mask`: masked entries get advantage 0 and enter no statistic. A group
whose valid rewards are all equal (also at values float32 cannot hold, 2/3 or 0.2) has mean
exactly that value and deviations exactly 0, so GRPO, Dr.GRPO and RLOO give it exactly 0.

EBPO (Han et al., "EBPO: Empirical Bayes Shrinkage for Stabilizing Group-Relative Policy
Optimization", arXiv 2602.05165) keeps a per-cluster prior, `PriorState`, that the caller threads
through its train-step carry: `init_prior` builds it, `ebpo` returns the updated one (optax style).

For a trainer, `from_config(config.rl)` builds an `Estimator`: the estimator's name and its frozen
hyperparameters (`GRPOParams`, ..., `EBPOParams`), with `init_prior(num_clusters)` and
`__call__(rewards_bg, mask_bg, cluster_ids_b, prior) -> (adv_bg, new_prior, metrics)`, so nothing
outside this package branches on an estimator's name.

Layout: `estimators` (the stateless group-relative estimators and the helpers all share),
`empirical_bayes` (the prior and EBPO), `registry` (hyperparameters, `Estimator`, `from_config`).
"""

from ebpo_jax.advantages.empirical_bayes import (
  MIN_PRIOR_VARIANCE,
  MODES,
  NORMALIZATIONS,
  PriorState,
  Welford,
  ebpo,
  init_prior,
  prior_moments,
  update_prior,
)
from ebpo_jax.advantages.estimators import (
  Array,
  Stats,
  all_equal_fraction,
  dr_grpo,
  grpo,
  js_shrinkage,
  rloo,
  signal_fraction,
  zero_fraction,
)
from ebpo_jax.advantages.registry import (
  ESTIMATORS,
  DrGRPOParams,
  EBPOParams,
  Estimator,
  GRPOParams,
  JSShrinkageParams,
  Params,
  RLOOParams,
  from_config,
)

__all__ = [
  "ESTIMATORS",
  "MIN_PRIOR_VARIANCE",
  "MODES",
  "NORMALIZATIONS",
  "Array",
  "DrGRPOParams",
  "EBPOParams",
  "Estimator",
  "GRPOParams",
  "JSShrinkageParams",
  "Params",
  "PriorState",
  "RLOOParams",
  "Stats",
  "Welford",
  "all_equal_fraction",
  "dr_grpo",
  "ebpo",
  "from_config",
  "grpo",
  "init_prior",
  "js_shrinkage",
  "prior_moments",
  "rloo",
  "signal_fraction",
  "update_prior",
  "zero_fraction",
]
