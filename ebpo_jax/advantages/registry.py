"""The typed registry: one frozen hyperparameter dataclass per estimator, `Estimator` (a name and
its hyperparameters, one calling convention, ready-to-log metrics) and `from_config`."""

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax.advantages.empirical_bayes import (
  MODES,
  NORMALIZATIONS,
  PriorState,
  _ebpo,
  init_prior,
  prior_moments,
  shrinkage_weight,
)
from ebpo_jax.advantages.estimators import (
  Array,
  Stats,
  _check_cluster_ids,
  _dr_grpo,
  _grpo,
  _js_shrinkage,
  _masked_mean,
  _prepare,
  _rloo,
)

# ---------------------------------------------------------------------------------------------
# Hyperparameters, one frozen (hashable, hence static under jit) dataclass per estimator.


class _InvalidParam(ValueError):
  """A hyperparameter outside its range; `field`, `value` and `rule` let callers name their key."""

  def __init__(self, params: object, field: str, rule: str):
    self.field, self.value, self.rule = field, getattr(params, field), rule
    super().__init__(f"{type(params).__name__}.{field}={self.value!r}: {rule}")


def _check_eps(params: object) -> None:
  eps = params.eps
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
    raise _InvalidParam(params, "eps", "must be a finite number >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOParams:
  """Hyperparameters of `grpo`."""

  eps: float = 1e-6  # added to the group std

  def __post_init__(self):
    _check_eps(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrGRPOParams:
  """`dr_grpo` has no hyperparameters."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLOOParams:
  """`rloo` has no hyperparameters."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JSShrinkageParams:
  """Hyperparameters of `js_shrinkage`."""

  eps: float = 1e-6  # added to the denominator of lam

  def __post_init__(self):
    _check_eps(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EBPOParams:
  """Hyperparameters of `ebpo`, plus `per_cluster` (one prior per cluster, or one for all)."""

  mode: str = "running"  # one of MODES; see `ebpo`
  decay: float = 1.0  # in (0, 1]; 1 is the paper
  normalize: str = "batch"  # one of NORMALIZATIONS; "batch" is the paper
  per_cluster: bool = True  # False: one global prior (every cluster id read as 0)
  eps: float = 1e-6  # added to the std that `normalize` divides by

  def __post_init__(self):
    if self.mode not in MODES:
      raise _InvalidParam(self, "mode", f"must be one of {', '.join(MODES)}")
    if self.normalize not in NORMALIZATIONS:
      raise _InvalidParam(self, "normalize", f"must be one of {', '.join(NORMALIZATIONS)}")
    decay = self.decay
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay <= 1:
      raise _InvalidParam(self, "decay", "must lie in (0, 1]")
    if not isinstance(self.per_cluster, bool):
      raise _InvalidParam(self, "per_cluster", "must be True or False")
    _check_eps(self)


Params = GRPOParams | DrGRPOParams | RLOOParams | JSShrinkageParams | EBPOParams


# ---------------------------------------------------------------------------------------------
# Estimator entries: one calling convention and ready-to-log metrics for the trainer.


def _stateless(core: Callable[..., tuple[Array, Stats]]) -> Callable[..., tuple[Array, Any, Stats]]:
  """Apply for an estimator without state: the prior passes through unchanged."""

  def apply(params, rewards_bg, mask_bg, cluster_ids_b, prior):
    del cluster_ids_b
    adv_bg, stats = core(rewards_bg, mask_bg, **dataclasses.asdict(params))
    return adv_bg, prior, stats

  return apply


def _ebpo_apply(params: EBPOParams, rewards_bg, mask_bg, cluster_ids_b, prior):
  if not params.per_cluster:
    cluster_ids_b = jnp.zeros_like(cluster_ids_b)  # one global prior, in slot 0 (authors' code)
  return _ebpo(
    rewards_bg,
    mask_bg,
    cluster_ids_b,
    prior,
    params.decay,
    params.eps,
    mode=params.mode,
    normalize=params.normalize,
  )


def _no_metrics(params, stats, has_data_b, new_prior, group_size) -> Stats:
  del params, stats, has_data_b, new_prior, group_size
  return {}


def _js_metrics(params, stats, has_data_b, new_prior, group_size) -> Stats:
  del params, new_prior, group_size
  return {"js/shrinkage_mean": _masked_mean(stats["shrinkage"], has_data_b)}


def _ebpo_metrics(params: EBPOParams, stats, has_data_b, new_prior, group_size: int) -> Stats:
  mu_glob, sigma2, tau2 = prior_moments(new_prior)  # [K] each
  # The S a full group of G responses gets from each cluster's updated prior (paper Eq. 3): what
  # every group of the step got in running mode without masked responses, and defined for a
  # cluster absent from the batch (a mean over its prompts would be NaN there).
  shrinkage = shrinkage_weight(sigma2, tau2, jnp.float32(group_size))
  per_cluster = {"ebpo/prior_mean": mu_glob, "ebpo/prior_std": jnp.sqrt(tau2)}
  per_cluster["ebpo/shrinkage"] = shrinkage
  if not params.per_cluster:  # one global prior: scalars
    per_cluster = {key: value[0] for key, value in per_cluster.items()}
  return {"ebpo/shrinkage_mean": _masked_mean(stats["shrinkage"], has_data_b), **per_cluster}


class _Spec(NamedTuple):
  params_type: type
  config_keys: dict[str, str]  # hyperparameter -> its key under `config.rl`
  apply: Callable[..., tuple[Array, PriorState, Stats]]
  metrics: Callable[..., Stats]
  prior_size: Callable[[Any, int], int]  # (params, num_clusters) -> K of the prior it threads


def _placeholder_prior(params, num_clusters: int) -> int:
  del params, num_clusters
  return 1


_SPECS: dict[str, _Spec] = {
  "grpo": _Spec(GRPOParams, {"eps": "eps"}, _stateless(_grpo), _no_metrics, _placeholder_prior),
  "dr_grpo": _Spec(DrGRPOParams, {}, _stateless(_dr_grpo), _no_metrics, _placeholder_prior),
  "rloo": _Spec(RLOOParams, {}, _stateless(_rloo), _no_metrics, _placeholder_prior),
  "js_shrinkage": _Spec(
    JSShrinkageParams,
    {"eps": "eps"},
    _stateless(_js_shrinkage),
    _js_metrics,
    _placeholder_prior,
  ),
  "ebpo": _Spec(
    EBPOParams,
    {f: f"ebpo.{f}" for f in ("mode", "decay", "normalize", "per_cluster")} | {"eps": "eps"},
    _ebpo_apply,
    _ebpo_metrics,
    lambda params, num_clusters: num_clusters if params.per_cluster else 1,
  ),
}
ESTIMATORS = tuple(_SPECS)


@dataclasses.dataclass(frozen=True)
class Estimator:
  """One advantage estimator with its hyperparameters; hashable, so static under jit.

  `Estimator("grpo")` takes the default hyperparameters; `from_config` builds one from a config.

  Metrics rule: every value is ready to log under its key. An array of shape [K] (K = number of
  clusters) is per-cluster (the trainer logs it as `<key>/<cluster name>`); a scalar is global.
  - grpo, dr_grpo, rloo: none.
  - js_shrinkage: "js/shrinkage_mean", mean lam over prompts with a valid response.
  - ebpo: "ebpo/shrinkage_mean", mean S over prompts with a valid response; from the updated
    prior, [K] with per_cluster, a scalar without: "ebpo/prior_mean" (mu_glob), "ebpo/prior_std"
    (sqrt(tau2), the spread of prompts' success rates around it) and "ebpo/shrinkage" (the S that
    a full group of G responses gets: the weight of the baseline on the prior mean, 1 - S on the
    group's own mean).
  The trainer computes `adv/zero_frac` and `adv/all_equal_frac` itself (`zero_fraction`,
  `all_equal_fraction`).
  """

  name: str
  params: Params | None = None  # None: the estimator's default hyperparameters

  def __post_init__(self):
    if self.name not in _SPECS:
      raise ValueError(f"unknown advantage estimator {self.name!r}; known: {', '.join(ESTIMATORS)}")
    params_type = _SPECS[self.name].params_type
    if self.params is None:
      object.__setattr__(self, "params", params_type())
    elif type(self.params) is not params_type:
      raise TypeError(f"{self.name} takes {params_type.__name__}, got {self.params!r}")

  def init_prior(self, num_clusters: int) -> PriorState:
    """The prior this estimator threads: K = num_clusters for per-cluster EBPO, else K = 1.

    Stateless estimators get `init_prior(1)`, a 6-float placeholder they return unchanged, so
    every estimator's train state has the same structure.
    """
    return init_prior(_SPECS[self.name].prior_size(self.params, num_clusters))

  def __call__(
    self,
    rewards_bg: Array,
    *,
    cluster_ids_b: Array,
    prior: PriorState,
    mask_bg: Array | None = None,
  ) -> tuple[Array, PriorState, Stats]:
    """(adv_bg [B, G], new_prior, metrics) of rewards [B, G] in clusters [B] under `prior` (mask
    [B, G]: the valid responses, default all); see the class docstring for the metrics."""
    adv_bg, new_prior, _, metrics = _run(
      self, rewards_bg, cluster_ids_b=cluster_ids_b, prior=prior, mask_bg=mask_bg
    )
    return adv_bg, new_prior, metrics

  def with_stats(self, rewards_bg: Array, **inputs: Any) -> tuple[Array, PriorState, Stats]:
    """(adv_bg, new_prior, stats) of the inputs of `__call__` (keywords `cluster_ids_b`, `prior`,
    `mask_bg`), stats per prompt instead of metrics (for analysis).

    stats: "baseline" [B, G] (what is subtracted from each reward); js_shrinkage and ebpo add
    "shrinkage" [B]; ebpo adds "mu_glob", "sigma2", "tau2" [B] and "zero_frac".
    """
    adv_bg, new_prior, stats, _ = _run(self, rewards_bg, **inputs)
    return adv_bg, new_prior, stats


@jax.jit(static_argnums=0)
def _run(estimator: Estimator, rewards_bg, *, cluster_ids_b, prior, mask_bg=None):
  spec = _SPECS[estimator.name]
  rewards_bg, mask_bg = _prepare(rewards_bg, mask_bg)
  cluster_ids_b = _check_cluster_ids(cluster_ids_b, rewards_bg.shape[0])
  adv_bg, new_prior, stats = spec.apply(estimator.params, rewards_bg, mask_bg, cluster_ids_b, prior)
  has_data_b = mask_bg.any(-1).astype(jnp.float32)
  metrics = spec.metrics(estimator.params, stats, has_data_b, new_prior, rewards_bg.shape[1])
  return adv_bg, new_prior, stats, metrics


def _lookup(rl: Mapping[str, Any], key: str, why: str = "") -> Any:
  node = rl
  try:
    for part in key.split("."):
      node = node[part]
  except (KeyError, AttributeError, TypeError):
    raise ValueError(f"config.rl.{key} is missing{why}") from None
  return node


def from_config(rl: Mapping[str, Any]) -> Estimator:
  """The estimator `rl["advantage"]` with its hyperparameters from `config.rl`.

  Keys read: `advantage` (one of ESTIMATORS); `eps` (grpo, js_shrinkage, ebpo); ebpo also reads
  `ebpo.mode`, `ebpo.decay`, `ebpo.normalize`, `ebpo.per_cluster`. Any mapping works (an
  ml_collections ConfigDict, a dict). Raises ValueError naming the config key and its value.
  """
  name = _lookup(rl, "advantage")
  if name not in _SPECS:
    raise ValueError(
      f"config.rl.advantage={name!r}: unknown advantage estimator; known: {', '.join(ESTIMATORS)}"
    )
  spec = _SPECS[name]
  why = f" (needed by rl.advantage={name!r})"
  hparams = {field: _lookup(rl, key, why) for field, key in spec.config_keys.items()}
  try:
    params = spec.params_type(**hparams)
  except _InvalidParam as error:
    key = spec.config_keys[error.field]
    raise ValueError(f"config.rl.{key}={error.value!r}: {error.rule}") from None
  return Estimator(name, params)
