"""Data pipelines: validated rows from files or `datasets` directories, and resumable grain
iterators of row-index batches."""

from ebpo_jax.data.batches import ORDERS, BatchIndexer, make_batches
from ebpo_jax.data.rows import (
  Columns,
  DataError,
  load_checked_rows,
  load_rows,
  load_rows_and_clusters,
)

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
