"""The one JSON encoder of the project's files: config.json, a checkpoint's config, eval.json.

`to_data(value)` is `value` as the JSON data that reading the file back gives: mappings
(ConfigDicts included) as dicts, tuples as lists, numpy and jax scalars and arrays as numbers and
nested lists; anything else is a TypeError naming it, raised here rather than in a save thread or
half-way through a file. `nan_as_null`: non-finite floats as null (eval.json's metrics of an empty
subset), else JSON's NaN and Infinity. A base-layer module: it imports nothing of the project.
"""

import json
import math
from typing import Any

import jax
import ml_collections
import numpy as np


def _default(value: Any) -> Any:
  if isinstance(value, ml_collections.ConfigDict):
    return value.to_dict()
  if isinstance(value, np.generic | np.ndarray | jax.Array):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} {value!r} is not JSON-able")


def _nulls(data: Any) -> Any:
  if isinstance(data, float) and not math.isfinite(data):
    return None
  if isinstance(data, dict):
    return {k: _nulls(v) for k, v in data.items()}
  if isinstance(data, list):
    return [_nulls(v) for v in data]
  return data


def to_data(value: Any, *, nan_as_null: bool = False) -> Any:
  """`value` as plain JSON data (dicts, lists, str, int, float, bool, None); TypeError naming a
  value that is none of those, a mapping, a tuple or a numpy/jax scalar or array."""
  data = json.loads(json.dumps(value, default=_default))
  return _nulls(data) if nan_as_null else data


def dumps(value: Any, *, nan_as_null: bool = False, **kwargs: Any) -> str:
  """The JSON text of `to_data(value, nan_as_null=...)`; `kwargs` go to `json.dumps` (indent,
  sort_keys)."""
  return json.dumps(to_data(value, nan_as_null=nan_as_null), **kwargs)
