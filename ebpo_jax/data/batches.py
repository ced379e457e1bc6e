"""Infinite, resumable grain iterators over batches of row indices, in four orders.

Every batch is a pure function of (seed, batch number): the pipeline is
`grain.MapDataset.range(N).map(BatchIndexer)`, so the iterator state is one position and
`get_state()/set_state()` (or orbax via `grain.checkpoint.CheckpointSave/CheckpointRestore`)
resume exactly. Rows form an endless stream, epoch after epoch, each epoch reshuffled with a
generator seeded by (seed, epoch); batches are cut from the stream, so no row is dropped and a
batch may straddle two epochs.

Orders:
- `shuffle`: every epoch a fresh permutation of all rows.
- `clustered`: every batch comes from one cluster; the non-empty clusters take turns
  (`run_length` consecutive batches each, in increasing id order), so each cluster gets the same
  number of batches whatever its size. Each cluster is its own endless stream (a cluster smaller
  than a batch wraps around into its next epoch). The EBPO paper's topic streams.
- `curriculum`: every epoch sorted by difficulty, easy (low) to hard (high), ties shuffled.
  Needs a finite difficulty on every row (e.g. 1 - pass rate of the base model).
- `sampled`: every batch drawn uniformly with replacement, batch k being draw k of one NumPy
  generator seeded by `seed` (`default_rng(seed).integers(0, N, batch_size)`, draw after draw):
  the supervised warm start's batches. Not an RL order (`data.order` takes the three above): a row
  may repeat within a batch and epochs mean nothing. Reaching batch k replays the draws before it
  (sequential reads are one draw each).
"""

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

ORDERS = ("shuffle", "clustered", "curriculum")  # config.data.order's
_SAMPLED = "sampled"  # the warm start's order (make_batches only)
_NUM_BATCHES = 2**40  # "infinite": a trillion batches
_MAX_BATCH_SIZE = 2**20  # keeps stream positions (batch number * batch size) inside int64
_CACHE_SIZE = 64  # permutations kept, enough for the epochs of a few consecutive batches


def make_batches(
  rows: Sequence[dict[str, Any]] | int,
  cluster_ids: Sequence[int] | np.ndarray | None = None,
  difficulties: Sequence[float] | np.ndarray | None = None,
  *,
  batch_size: int,
  order: str = "shuffle",
  seed: int = 0,
  run_length: int = 1,
) -> grain.DatasetIterator:
  """An endless iterator of np.int32 [batch_size] row indices; see the module docstring.

  `rows` is the list of row dicts (clusters and difficulties are read from them unless given) or
  the number of rows. `run_length` (clustered order only) is how many consecutive batches each
  cluster gets before the next one's turn.
  """
  indexer = BatchIndexer(
    num_rows=rows if isinstance(rows, int) else len(rows),
    cluster_ids=_column(rows, cluster_ids, "cluster", 0),
    difficulties=_column(rows, difficulties, "difficulty", np.nan),
    batch_size=batch_size,
    order=order,
    seed=seed,
    run_length=run_length,
  )
  dataset = grain.MapDataset.range(_NUM_BATCHES).map(indexer)
  # Batches are cheap to compute: no threads, no prefetch (and no work past a checkpoint).
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return iter(dataset.to_iter_dataset(options))


def _column(
  rows: Sequence[dict[str, Any]] | int, given: Any, key: str, default: float
) -> np.ndarray | None:
  if given is not None:
    return np.asarray(given)
  if isinstance(rows, int):
    return None
  return np.asarray([row.get(key, default) for row in rows])


class BatchIndexer:
  """Maps a batch number to its row indices (picklable; caches recent permutations)."""

  def __init__(
    self,
    *,
    num_rows: int,
    cluster_ids: np.ndarray | None,
    difficulties: np.ndarray | None,
    batch_size: int,
    order: str,
    seed: int,
    run_length: int,
  ):
    _check_args(num_rows, batch_size, order, seed, run_length)
    self.num_rows, self.batch_size, self.order = num_rows, batch_size, order
    self.seed, self.run_length = seed, run_length
    self._cache: dict[tuple[int, ...], np.ndarray] = {}
    self._draws: tuple[int, np.random.Generator] | None = None  # (next batch number, generator)
    if order == "clustered":
      ids = _checked_cluster_ids(cluster_ids, num_rows)
      self.clusters = np.unique(ids)  # the non-empty clusters, in increasing id order
      self.members = [np.flatnonzero(ids == c) for c in self.clusters]
    if order == "curriculum":
      self.difficulties = _checked_difficulties(difficulties, num_rows)

  def __call__(self, batch_number: int) -> np.ndarray:
    if self.order == "clustered":
      return self._clustered_batch(batch_number).astype(np.int32)
    if self.order == _SAMPLED:
      return self._sampled_batch(batch_number).astype(np.int32)
    perm = self._shuffled_epoch if self.order == "shuffle" else self._sorted_epoch
    start = batch_number * self.batch_size
    return _take(start, self.batch_size, self.num_rows, perm).astype(np.int32)

  def _clustered_batch(self, batch_number: int) -> np.ndarray:
    turn, within_run = divmod(batch_number, self.run_length)
    rounds, k = divmod(turn, len(self.clusters))
    visit = rounds * self.run_length + within_run  # this cluster's visit count before this batch
    members = self.members[k]
    cluster = int(self.clusters[k])

    def perm(epoch: int) -> np.ndarray:
      return self._cached(
        (cluster, epoch), lambda: members[self._permutation((cluster, epoch), len(members))]
      )

    return _take(visit * self.batch_size, self.batch_size, len(members), perm)

  def _sampled_batch(self, batch_number: int) -> np.ndarray:
    """Draw `batch_number` of the generator seeded by `seed`, from where the last call left it
    (or, going back, from the start)."""
    if self._draws is None or self._draws[0] > batch_number:
      self._draws = (0, np.random.default_rng(self.seed))
    done, rng = self._draws
    for _ in range(batch_number - done):
      rng.integers(0, self.num_rows, self.batch_size)
    batch = rng.integers(0, self.num_rows, self.batch_size)
    self._draws = (batch_number + 1, rng)
    return batch

  def _shuffled_epoch(self, epoch: int) -> np.ndarray:
    return self._cached((epoch,), lambda: self._permutation((epoch,), self.num_rows))

  def _sorted_epoch(self, epoch: int) -> np.ndarray:
    def build() -> np.ndarray:
      shuffled = self._permutation((epoch,), self.num_rows)
      return shuffled[np.argsort(self.difficulties[shuffled], kind="stable")]

    return self._cached((epoch,), build)

  def _permutation(self, key: tuple[int, ...], n: int) -> np.ndarray:
    """A permutation of range(n) drawn from a generator seeded by (seed, *key)."""
    return np.random.default_rng(np.random.SeedSequence([self.seed, *key])).permutation(n)

  def _cached(self, key: tuple[int, ...], build: Callable[[], np.ndarray]) -> np.ndarray:
    """The row order of an epoch (of a cluster), built once while in use."""
    order = self._cache.get(key)
    if order is None:
      if len(self._cache) >= _CACHE_SIZE:
        self._cache.clear()
      order = self._cache[key] = build()
    return order


def _take(start: int, count: int, n: int, epoch_perm: Callable[[int], np.ndarray]) -> np.ndarray:
  """Items start..start+count-1 of the stream epoch_perm(0), epoch_perm(1), ... (each n long)."""
  positions = np.arange(start, start + count, dtype=np.int64)
  epochs, offsets = np.divmod(positions, n)
  out = np.empty(count, dtype=np.int64)
  for epoch in np.unique(epochs):
    in_epoch = epochs == epoch
    out[in_epoch] = epoch_perm(int(epoch))[offsets[in_epoch]]
  return out


def _check_args(num_rows: int, batch_size: int, order: str, seed: int, run_length: int) -> None:
  if order not in (*ORDERS, _SAMPLED):
    raise ValueError(f"order must be one of {(*ORDERS, _SAMPLED)}, got {order!r}")
  if not isinstance(num_rows, int) or num_rows < 1:
    raise ValueError(f"need at least one row, got {num_rows!r}")
  if not isinstance(batch_size, int) or not 1 <= batch_size <= _MAX_BATCH_SIZE:
    raise ValueError(f"batch_size must be an int in [1, {_MAX_BATCH_SIZE}], got {batch_size!r}")
  if not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be an int >= 0, got {seed!r}")
  if not isinstance(run_length, int) or run_length < 1:
    raise ValueError(f"run_length must be an int >= 1, got {run_length!r}")


def _checked_cluster_ids(cluster_ids: np.ndarray | None, num_rows: int) -> np.ndarray:
  if cluster_ids is None:
    raise ValueError("order 'clustered' needs cluster ids")
  if cluster_ids.shape != (num_rows,) or not np.issubdtype(cluster_ids.dtype, np.integer):
    raise ValueError(
      f"cluster ids must be {num_rows} ints, got {cluster_ids.dtype} shape {cluster_ids.shape}"
    )
  return cluster_ids


def _checked_difficulties(difficulties: np.ndarray | None, num_rows: int) -> np.ndarray:
  if difficulties is None:
    raise ValueError("order 'curriculum' needs difficulties")
  difficulties = np.asarray(difficulties, dtype=np.float64)
  if difficulties.shape != (num_rows,):
    raise ValueError(f"difficulties must have shape ({num_rows},), got {difficulties.shape}")
  missing = np.flatnonzero(~np.isfinite(difficulties))
  if missing.size:
    raise ValueError(
      f"order 'curriculum' needs a finite difficulty on every row; {missing.size} rows have none "
      f"(first: row {missing[0]})"
    )
  return difficulties
