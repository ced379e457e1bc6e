"""What the rollouts read of a run's config, frozen once (`RolloutOptions.from_config`, called by
`rollouts.make_worker`): how the sampler draws (`sampling.DecodeOptions`), how a training batch is
collected (DAPO), how the in-training evaluation samples, and the multi-turn episodes' limits."""

import dataclasses
from collections.abc import Callable

import ml_collections

from ebpo_jax import envs
from ebpo_jax.sampling import DecodeOptions


@dataclasses.dataclass(frozen=True)
class BatchOptions:
  """How `batch.collect_batch` makes a training batch (`config.rl`): G, DAPO's dynamic sampling and
  soft overlong penalty."""

  group_size: int  # G
  dynamic_sampling: bool
  max_refill_rounds: int
  overlong_buffer: int  # 0: no overlong penalty
  overlong_penalty: float

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "BatchOptions":
    return _from_keys(cls, config.rl)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """The in-training evaluation's sampling (`config.eval`)."""

  num_samples: int  # k responses per problem
  greedy: bool

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "EvalOptions":
    """`eval.num_samples` responses per problem, greedy only when k == 1."""
    k = config.eval.num_samples
    return cls(num_samples=k, greedy=bool(config.eval.greedy and k == 1))


@dataclasses.dataclass(frozen=True)
class EnvOptions:
  """Multi-turn episodes (`config.env`): the environments' factory and the trajectory limits."""

  factory: Callable[[], envs.Environment]  # a fresh environment per trajectory
  max_turns: int  # model turns per trajectory
  max_tokens: int  # trajectory tokens after the prompt: model and observation tokens
  max_observation_tokens: int  # an observation's tokens beyond this are cut
  tool_latency_s: float = 0.0  # each turn that steps environments waits this long (env.*)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "EnvOptions | None":
    """None when `env.name` is "" (single-turn rollouts)."""
    factory = envs.from_config(config.env)
    if factory is None:
      return None
    e = config.env
    return cls(factory, e.max_turns, e.max_tokens, e.max_observation_tokens, e.tool_latency_s)


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
  """All that the rollouts read of a run's config, read once (`from_config`)."""

  seed: int  # the key of `batch.sample_and_score_batches`
  sampling: DecodeOptions
  batch: BatchOptions
  eval: EvalOptions
  env: EnvOptions | None = None  # None: single-turn

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "RolloutOptions":
    return cls(
      seed=config.seed,
      sampling=DecodeOptions.from_config(config),
      batch=BatchOptions.from_config(config),
      eval=EvalOptions.from_config(config),
      env=EnvOptions.from_config(config),
    )

  @property
  def completion_width(self) -> int:
    """Tokens after the prompt in a training row (`completion_width`)."""
    return self.sampling.max_new_tokens if self.env is None else self.env.max_tokens


def completion_width(config: ml_collections.ConfigDict) -> int:
  """Tokens after the prompt in a training row: a completion (`sampling.max_new_tokens`), or a
  whole multi-turn trajectory (`env.max_tokens`, when `env.name` is set)."""
  return config.env.max_tokens if config.env.name else config.sampling.max_new_tokens


def _from_keys(cls, section: ml_collections.ConfigDict):
  """`cls` from the keys of a config section named as its fields (`sampling.top_k` -> `top_k`)."""
  return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})
