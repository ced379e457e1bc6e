"""Loading a config file and checking every value before anything compiles."""

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
from absl import logging

from ebpo_jax import advantages, data, losses, models, sharding


class ConfigError(ValueError):
  """An invalid config value; the message names the key and the value."""


class PolicyError(ValueError):
  """Nothing to load a policy from, or a checkpoint that does not fit; the message says what to
  pass."""


# Bad input of an entry point: each exits with one line (never a traceback).
USER_ERRORS = (ConfigError, PolicyError, data.DataError)


@contextlib.contextmanager
def entry_point(verbosity: int = logging.WARNING) -> Iterator[None]:
  """The frame of every command-line entry point: absl logging at `verbosity` (orbax logs each
  save at INFO), `jax.distributed` joined when the environment asks for it, and a bad input
  (USER_ERRORS) turned into `error: <message>` and exit status 1."""
  logging.set_verbosity(verbosity)
  try:
    sharding.init_distributed()
    yield
  except USER_ERRORS as e:
    sys.exit(f"error: {e}")


def load_module(path: str | os.PathLike) -> types.ModuleType:
  """The Python module of a config file (its `get_config` and any tables it defines)."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(spec: str | os.PathLike, overrides: Mapping[str, Any] | None = None):
  """The ConfigDict of `configs/NAME.py[:ARG]` (what `--config=` takes), with `overrides`
  (dotted keys, e.g. {"rl.group_size": 4}) applied as `--config.KEY=VALUE` would."""
  path, _, arg = os.fspath(spec).partition(":")
  module = load_module(path)
  config = module.get_config(arg or None)
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  return config


def _choice(config, key: str, allowed: Sequence[str]) -> None:
  value = _get(config, key)
  if value not in allowed:
    raise ConfigError(f"config.{key}={value!r}: must be one of {', '.join(map(str, allowed))}")


def _get(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _require(ok: bool, config, key: str, rule: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}={_get(config, key)!r}: {rule}")


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Validates every value before anything compiles; raises ConfigError naming key and value."""
  try:
    advantages.from_config(config.rl)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _choice(config, "rl.loss.aggregation", losses.AGG_MODES)
  _choice(config, "rl.loss.kl_kind", losses.KL_KINDS)
  _choice(config, "data.order", data.ORDERS)
  _choice(config, "train.schedule", ("constant", "cosine"))
  _choice(config, "train.transfer_guard", ("disallow", "log", "allow"))
  _choice(config, "model.remat", tuple(models.decoder.REMAT_POLICIES))
  rl, tc = config.rl, config.train
  _require(rl.group_size >= 2, config, "rl.group_size", "must be >= 2")
  _require(rl.num_iterations >= 1, config, "rl.num_iterations", "must be >= 1")
  _require(tc.num_steps >= 0, config, "train.num_steps", "must be >= 0")
  _require(tc.batch_size >= 1, config, "train.batch_size", "must be >= 1")
  _require(tc.learning_rate > 0, config, "train.learning_rate", "must be > 0")
  _require(tc.max_bad_steps >= 1, config, "train.max_bad_steps", "must be >= 1")
  _require(config.sampling.temperature > 0, config, "sampling.temperature", "must be > 0")
  _require(0 < config.sampling.top_p <= 1, config, "sampling.top_p", "must lie in (0, 1]")
  _require(config.sampling.max_new_tokens >= 1, config, "sampling.max_new_tokens", "must be >= 1")
  _require(
    config.sampling.prompts_per_call >= 0,
    config,
    "sampling.prompts_per_call",
    "must be >= 0 (0: all prompts in one sampler call)",
  )
  _choice(config, "rl.dynamic_sampling", (True, False))
  _require(rl.max_refill_rounds >= 0, config, "rl.max_refill_rounds", "must be >= 0")
  _require(
    0 <= rl.overlong_buffer <= config.sampling.max_new_tokens,
    config,
    "rl.overlong_buffer",
    f"must lie in [0, sampling.max_new_tokens={config.sampling.max_new_tokens}]",
  )
  _require(rl.overlong_penalty >= 0, config, "rl.overlong_penalty", "must be >= 0")
  _require(config.rl.loss.clip_low >= 0, config, "rl.loss.clip_low", "must be >= 0")
  _require(config.rl.loss.clip_high >= 0, config, "rl.loss.clip_high", "must be >= 0")
  _require(
    tc.batch_size % tc.mini_batch_size == 0,
    config,
    "train.mini_batch_size",
    f"must divide train.batch_size={tc.batch_size}",
  )
  mini_rows = tc.mini_batch_size * rl.group_size
  micro = tc.micro_batch_size or mini_rows
  _require(
    mini_rows % micro == 0,
    config,
    "train.micro_batch_size",
    f"must divide mini_batch_size * group_size = {mini_rows}",
  )
  data_shards = _data_shards(config, num_devices)
  _require(
    micro % data_shards == 0 and tc.batch_size % data_shards == 0,
    config,
    "train.batch_size",
    f"prompts per step and rows per micro-batch ({micro}) must be divisible by the mesh's "
    f"data x fsdp = {data_shards} devices",
  )


def _data_shards(config, num_devices: int) -> int:
  try:
    sizes = sharding.mesh_shape(dict(config.mesh), num_devices)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  return sizes["data"] * sizes["fsdp"]
