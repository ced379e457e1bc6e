"""Data pipelines: validated rows from files or `datasets` directories, and resumable grain
iterators of row-index batches."""

import importlib

from ebpo_jax.data.rows import (
  Columns,
  load_checked_rows,
  load_rows,
  load_rows_and_clusters,
)
from ebpo_jax.errors import DataError

# The batches (grain, and JAX with it) load on first use: a verifier worker that unpickles a
# task's scorer imports its module, which reads rows from here, and needs neither.
_BATCHES = ("ORDERS", "BatchIndexer", "make_batches")


def __getattr__(name: str):
  if name in _BATCHES:
    return getattr(importlib.import_module("ebpo_jax.data.batches"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
  "ORDERS",
  "BatchIndexer",
  "Columns",
  "DataError",
  "load_checked_rows",
  "load_rows",
  "load_rows_and_clusters",
  "make_batches",
]
