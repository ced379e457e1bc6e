"""`DecodeOptions`: what the sampler reads of `config.sampling`, frozen and validated once."""

import dataclasses
import math

import ml_collections

from ebpo_jax import sharding
from ebpo_jax.errors import ConfigError
from ebpo_jax.sampling import engine

_DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """How the sampler draws (`config.sampling`); each set of the static ones compiles once. Built
  by `from_config`, which refuses a bad value with one line naming its key."""

  max_new_tokens: int  # >= 1
  temperature: float  # > 0
  top_p: float  # nucleus mass in (0, 1]; 1: off
  top_k: int  # 0: off
  compact: bool  # decode in halving batches of the running rows
  prompts_per_call: int  # prompts per sampler call; 0: all at once
  replicate_weights: bool = True  # decode with weights replicated over the rows' mesh axes
  dtype: str = ""  # the sampler's compute dtype; "": the model's
  concurrent_calls: int = 1  # a round's sampler calls in flight at once (host work overlapped)

  def __post_init__(self):
    _require(self.max_new_tokens >= 1, self, "max_new_tokens", "must be >= 1")
    finite = isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
    _require(finite and self.temperature > 0, self, "temperature", "must be > 0")
    _require(0 < self.top_p <= 1, self, "top_p", "must lie in (0, 1]")
    _require(self.top_k >= 0, self, "top_k", "must be >= 0")
    _require(self.compact in (True, False), self, "compact", "must be one of True, False")
    rule = "must be >= 0 (0: all prompts in one sampler call)"
    _require(self.prompts_per_call >= 0, self, "prompts_per_call", rule)
    _require(self.replicate_weights in (True, False), self, "replicate_weights", "must be a bool")
    rule = "must be '' (model.dtype), float32 or bfloat16"
    _require(self.dtype in _DTYPES, self, "dtype", rule)
    rule = "must be >= 1 (1: a round's sampler calls one after the other)"
    ok = isinstance(self.concurrent_calls, int) and self.concurrent_calls >= 1
    _require(ok, self, "concurrent_calls", rule)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "DecodeOptions":
    section = config.sampling
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})

  def decode_params(self, params, model_config):
    """The round's weights in the sampler's layout (`engine.decode_params`): the compute dtype,
    and with `replicate_weights` split over 'tensor' only."""
    rows = sharding.ROW_AXES if self.replicate_weights else ()
    return engine.decode_params(params, model_config, dtype=model_config.dtype, replicate_over=rows)

  def generate_kwargs(self, tokenizer, *, group_size: int, greedy: bool) -> dict:
    """`engine.generate`'s static options for one call (one compile per set; aot's too)."""
    return {
      "group_size": group_size,
      "max_new_tokens": self.max_new_tokens,
      "top_k": self.top_k,
      "greedy": greedy,
      "stop_ids": tokenizer.stop_ids,
      "pad_id": tokenizer.pad_id,
      "compact": self.compact,
    }


def _require(ok: bool, options: DecodeOptions, field: str, rule: str) -> None:
  if not ok:
    raise ConfigError(f"config.sampling.{field}={getattr(options, field)!r}: {rule}")
