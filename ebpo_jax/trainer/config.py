"""Loading a config file and checking every value before anything compiles."""

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import ml_collections


class ConfigError(ValueError):
  """An invalid config value; the message names the key and the value."""


def load_config(spec: str | os.PathLike, overrides: Mapping[str, Any] | None = None):
  """The ConfigDict of `configs/NAME.py[:ARG]` (what `--config=` takes), with `overrides`
  (dotted keys, e.g. {"rl.group_size": 4}) applied as `--config.KEY=VALUE` would."""
  path, _, arg = os.fspath(spec).partition(":")
  module_spec = importlib.util.spec_from_file_location(
    os.path.splitext(os.path.basename(path))[0], path
  )
  if module_spec is None or not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  return config
