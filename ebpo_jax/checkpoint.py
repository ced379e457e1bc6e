"""Checkpoints of the training state, the data iterator and the config (orbax).

One step directory per checkpoint under `directory`, with five items:
  meta/       {"format": FORMAT}: the layout of the checkpoint; one of another format (an older
              ebpo-jax's) is refused with one line (FormatError), never migrated
  state/      the TrainState pytree (any pytree of jax arrays: params, optax state, prior, typed
              PRNG keys, step), written sharded by every process (orbax OCDBT)
  checksums/  two uint32 sums per array of the state and the array's path, computed on the
              devices at save, and the SHA-256 of the data iterator's state (one per process) and
              of the config (JSON); compared after every restore (`restore_params` and
              `saved_config` too): flipped bytes are an error, not garbage, and a checkpoint
              without them is never read as if it were good
  data_iter/  the grain iterator state, one JSON file per process
  config/     the run config as JSON
Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a
checkpoint whose write was interrupted is never listed, restored or counted as latest; leftover
temporary directories are deleted when a Checkpointer opens the directory. `restore_latest`
falls back past checkpoints that do not restore or verify, moving them to `<directory>.unusable/`
(one line on stderr says so). `save` writes every `every_steps` steps and at the first call
`every_minutes` after the last save (process 0's clock decides for every process).
`directory` may be `gs://bucket/...`: orbax writes through tensorstore, the checks through `files`.
"""

import contextlib
import functools
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from ebpo_jax import errors, files, jsonable, sharding

_STATE, _DATA_ITER, _CONFIG, _CHECKSUMS, _META = "state", "data_iter", "config", "checksums", "meta"
# The checkpoint layout this code writes and reads (the items above, the checksums' form). Raise it
# when the layout changes: a checkpoint of another format is refused, never migrated.
# 2: the checksums cover the data iterator and the config.
FORMAT = 2
_now = time.monotonic  # the clock of `every_minutes`


class CorruptCheckpointError(Exception):
  """A checkpoint that does not restore, or whose arrays differ from their saved checksums."""


class FormatError(errors.BadInput):
  """A checkpoint of another FORMAT (an older ebpo-jax's); the message says what to do."""


class Checkpointer:
  """Saves and restores (state, data iterator, config) at integer steps; keeps the last N."""

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 3,
    every_steps: int = 1,
    every_minutes: float = 0.0,
    async_save: bool = True,
    read_only: bool = False,
  ):
    """`save` writes, unless forced, at the multiples of `every_steps` and at the first call
    `every_minutes` after the last save (or the opening); 0 turns either off. `max_to_keep=None`
    keeps everything. `read_only`: reads a directory that a trainer may be writing right now,
    without touching it (it must exist)."""
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
    if every_steps < 0 or not every_minutes >= 0:
      raise ValueError(f"every_steps and every_minutes must be >= 0: {every_steps, every_minutes}")
    self.directory = files.abspath(directory)
    self._every_steps, self._every_minutes, self._last_save = every_steps, every_minutes, _now()
    if read_only:
      if not files.isdir(self.directory):
        raise FileNotFoundError(f"{self.directory}: no such checkpoint directory")
      options = ocp.CheckpointManagerOptions(read_only=True, create=False)
      self._manager = ocp.CheckpointManager(self.directory, options=options)
      return
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,
      create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of all complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def save(
    self,
    step: int,
    state: Any,
    *,
    data_iter: Any = None,
    config: Mapping[str, Any] | None = None,
    force: bool = False,
    before_write: Callable[[], None] | None = None,
  ) -> bool:
    """Starts writing a checkpoint at `step` (asynchronously by default) and returns True, or
    returns False when it is not due (see the constructor; unless `force`) or `step` is already
    saved. `before_write` is called when it is due, before anything is written (the trainer makes
    metrics.jsonl durable with it: no checkpoint commits ahead of its metrics).

    Called on every process, at the same steps (the clock's decision is a collective). The
    iterator's position and the arrays are captured before this returns, so the caller may
    advance the iterator and donate `state` right after.
    """
    step = int(step)
    due = force or self._clock_due() or (self._every_steps and step % self._every_steps == 0)
    if not due or step in self._manager.all_steps():
      return False
    if before_write is not None:
      before_write()
    sums = {"leaves": state_checksums(state), "paths": _paths(state)}
    items = {_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave({"format": FORMAT})}
    if data_iter is not None:
      sums[_DATA_ITER] = _iterator_digests(data_iter)
      items[_DATA_ITER] = grain.checkpoint.CheckpointSave(data_iter)
    if config is not None:
      config = _config_json(config)
      sums[_CONFIG] = _digest(config)
      items[_CONFIG] = ocp.args.JsonSave(config)
    items[_CHECKSUMS] = ocp.args.JsonSave(sums)
    saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._last_save = _now()
    return saved

  def _clock_due(self) -> bool:
    """Whether `every_minutes` have passed since the last save, by process 0's clock: its
    elapsed time is broadcast, so every process decides alike (one broadcast per call)."""
    if not self._every_minutes:
      return False
    elapsed = _now() - self._last_save
    if jax.process_count() > 1:
      elapsed = float(multihost_utils.broadcast_one_to_all(np.float32(elapsed)))
    return elapsed >= 60 * self._every_minutes

  def restore(
    self, step: int | None, abstract_state: Any, *, data_iter: Any = None
  ) -> tuple[Any, dict[str, Any] | None]:
    """Reads checkpoint `step` (None: the latest) and returns (state, config or None).

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` (e.g. from
    `jax.eval_shape` plus the run's shardings); arrays come back with exactly those shardings,
    whatever the mesh at save time, and in the same pytree structure. `data_iter`, if given, is
    set in place to the saved position.
    """
    self.wait()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    step = int(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
        f"no checkpoint for step {step} in {self.directory}; steps: {self.all_steps()}"
      )
    saved_items = self._check_format(step)
    if data_iter is not None and _DATA_ITER not in saved_items:
      raise ValueError(f"checkpoint {step} in {self.directory} has no data iterator state")
    sums = self._checksums(step, saved_items)
    items = {_STATE: ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      items[_DATA_ITER] = grain.checkpoint.CheckpointRestore(data_iter)
    if _CONFIG in saved_items:
      items[_CONFIG] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state, config = restored[_STATE], restored.get(_CONFIG)
    self._verify(step, state, sums["leaves"])
    if data_iter is not None:
      self._verify_iterator(step, data_iter, sums)
    self._verify_config(step, config, sums)
    return state, config

  def restore_latest(
    self, abstract_state: Any, *, data_iter: Any = None
  ) -> tuple[int, Any, dict[str, Any] | None]:
    """`restore` of the newest checkpoint that restores and verifies: (step, state, config).

    Newer ones that fail are moved to `<directory>.unusable/` (a later save of their step would
    otherwise be skipped as existing; moved, not deleted, so that a transient read error destroys
    nothing), and one line on stderr says so; CorruptCheckpointError when none restores.
    """
    self.wait()
    failed = []
    with _abandoned_reads_unreported():  # every attempt's, collected once the last has ended
      for step in reversed(self.all_steps()):
        try:
          state, config = self.restore(step, abstract_state, data_iter=data_iter)
          break
        except FormatError:  # refused as it is: not unusable, of another ebpo-jax
          raise
        except Exception as e:  # orbax and tensorstore raise many kinds; each means "unusable"
          failed.append(f"checkpoint {step} ({_first_line(e)})")
      else:
        step = None
    reasons = "; ".join(failed)
    if step is None and not failed:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    if step is None:
      raise CorruptCheckpointError(f"no checkpoint in {self.directory} restores: {reasons}")
    if failed:
      aside = self._move_aside([bad for bad in self.all_steps() if bad > step])
      if jax.process_index() == 0:
        print(
          f"warning: {reasons} in {self.directory} did not restore: moved to "
          f"{aside}; resuming from step {step}",
          file=sys.stderr,
        )
    return step, state, config

  def restore_and_drop_later(
    self, step: int, abstract_state: Any, *, data_iter: Any = None
  ) -> tuple[Any, dict[str, Any] | None]:
    """`restore` of checkpoint `step`, then the later ones moved to `<directory>.dropped/` (the
    run goes on from `step`: its saves of those steps must not be skipped as existing); one line
    on stderr says so."""
    state, config = self.restore(step, abstract_state, data_iter=data_iter)
    later = [s for s in self.all_steps() if s > step]
    if later:
      aside = self._move_aside(later, suffix="dropped")
      if jax.process_index() == 0:
        print(
          f"resuming from checkpoint {step}: later checkpoints {', '.join(map(str, later))} "
          f"moved to {aside}",
          file=sys.stderr,
        )
    return state, config

  def _move_aside(self, steps: list[int], *, suffix: str = "unusable") -> str:
    """Moves the directories of `steps` (process 0) into `<directory>.<suffix>/`, as `<step>` or
    `<step>.<n>` when that name is taken; every process then sees them gone. Returns the folder."""
    aside = f"{self.directory.rstrip('/')}.{suffix}"
    if jax.process_index() == 0:
      for step in steps:
        target, n = files.join(aside, str(step)), 1
        while files.exists(target):
          target, n = files.join(aside, f"{step}.{n}"), n + 1
        files.move_tree(files.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("ebpo_jax: unusable checkpoints moved aside")
    self._manager.reload()
    return aside

  def _checksums(self, step: int, saved_items: set[str]) -> dict[str, Any]:
    """Checkpoint `step`'s checksums; CorruptCheckpointError when they are missing (a checkpoint
    is never read unverified)."""
    sums = None
    if _CHECKSUMS in saved_items:
      with contextlib.suppress(FileNotFoundError):  # the item's folder without its file
        sums = self._manager.restore(
          step, args=ocp.args.Composite(**{_CHECKSUMS: ocp.args.JsonRestore()})
        )[_CHECKSUMS]
    if not isinstance(sums, dict) or "leaves" not in sums:
      raise CorruptCheckpointError(
        f"checkpoint {step} in {self.directory} has no checksums: not read unverified"
      )
    return sums

  def _verify(self, step: int, state: Any, saved: list) -> None:
    """Raises CorruptCheckpointError naming the first array whose checksums differ."""
    got = state_checksums(state)
    if got != saved:
      bad = next((p for p, a, b in zip(_paths(state), got, saved, strict=False) if a != b), "")
      self._corrupt(step, f"state{bad}" if bad else "the state's tree")

  def _verify_iterator(self, step: int, data_iter: Any, sums: Mapping[str, Any]) -> None:
    """The restored iterator's state against this process's saved digest; every process learns
    whether any differs (they fall back alike)."""
    saved = sums.get(_DATA_ITER) or []
    index = jax.process_index()
    bad = index >= len(saved) or saved[index] != _iterator_digest(data_iter)
    if jax.process_count() > 1:
      bad = bool(np.any(multihost_utils.process_allgather(np.array(bad))))
    if bad:
      self._corrupt(step, "the data iterator state")

  def _verify_config(self, step: int, config: Any, sums: Mapping[str, Any]) -> None:
    if config is not None and sums.get(_CONFIG) != _digest(config):
      self._corrupt(step, "the config")

  def _corrupt(self, step: int, what: str) -> NoReturn:
    raise CorruptCheckpointError(
      f"checkpoint {step} in {self.directory} is corrupt: the checksum of {what} differs"
    )

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the policy params of checkpoint `step` (`state.params`), restored into
    `abstract_params` (`jax.ShapeDtypeStruct`s with shardings) and verified against their saved
    checksums; nothing else is read."""
    saved = self._checksums(step, self._check_format(step))
    item = {"params": abstract_params}
    args = {
      _STATE: ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
      ),
    }
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    params = restored[_STATE]["params"]
    by_path = dict(zip(saved["paths"], saved["leaves"], strict=True))
    for path, sums in zip(_paths(params), state_checksums(params), strict=True):
      # The params of a dataclass state (`.params`, TrainState) or of a dict (`['params']`).
      expected = by_path.get(f".params{path}", by_path.get(f"['params']{path}"))
      if expected != sums:
        self._corrupt(step, f"state.params{path}")
    return params

  def saved_arrays(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """What checkpoint `step`'s state holds, from its metadata (no array is read): each array's
    path (`['params']['w']`) -> (shape, dtype name)."""
    path = epath.Path(files.join(self.directory, str(int(step)), _STATE))
    metadata = ocp.PyTreeCheckpointHandler().metadata(path)
    leaves = jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}

  def saved_config(self, step: int) -> dict[str, Any] | None:
    """The config saved with checkpoint `step` (verified), or None when it has none."""
    saved_items = self._check_format(step)
    if _CONFIG not in saved_items:
      return None
    sums = self._checksums(step, saved_items)
    config = self._manager.restore(
      step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
    )[_CONFIG]
    self._verify_config(step, config, sums)
    return config

  def newest_config(self) -> tuple[int, dict[str, Any]] | None:
    """(step, config) of the newest checkpoint whose saved config reads and verifies, or None;
    FormatError as `saved_config` raises it."""
    for step in reversed(self.all_steps()):
      try:
        config = self.saved_config(step)
      except FormatError:
        raise
      except Exception:  # unusable: restore_latest says so when it gets there
        continue
      if config is not None:
        return step, config
    return None

  def _check_format(self, step: int) -> set[str]:
    """The item names of checkpoint `step`; FormatError unless its meta holds this FORMAT."""
    saved_items = self._saved_items(step)
    found = None
    if _META in saved_items:
      meta = ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
      found = self._manager.restore(step, args=meta)[_META].get("format")
    where = f"checkpoint {step} in {self.directory}"
    problem = errors.format_mismatch(
      found, FORMAT, where=where, kind="checkpoint", remedy="delete its checkpoints"
    )
    if problem:
      raise FormatError(problem)
    return saved_items

  def _saved_items(self, step: int) -> set[str]:
    """The item names checkpoint `step` holds: its directory's entries (orbax's item_metadata
    would warn once per item that this manager has no handler registered for yet)."""
    return set(files.listdir(files.join(self.directory, str(step))))

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are complete (and raises their errors)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


@contextlib.contextmanager
def _abandoned_reads_unreported() -> Iterator[None]:
  """Python's reports of what it cannot raise, silenced while restores are tried: when one array
  read fails, orbax abandons the others, and each abandoned coroutine (at its collection) printed
  "Exception ignored in: <coroutine object _read_array_index_and_device_put ...>" with a traceback
  and the TensorStore spec (about 130 lines under the one warning line that says what failed). The
  attempts' garbage is collected before the reports are let through again, and only theirs: the
  older objects are frozen meanwhile (collecting all of a trainer's took about 1 s)."""
  previous = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  gc.freeze()
  try:
    yield
  finally:
    gc.collect()  # the abandoned reads, still silenced
    gc.unfreeze()
    sys.unraisablehook = previous


def _first_line(error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def _leaf_words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words (one per element; 8-byte elements give two)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """[2] uint32: the sum of the words and the sum of mix(word) * (2 * flat index + 1), mod 2^32.

  The flat index comes from iotas (no reshape, so a sharded array is never regathered); the
  second sum also catches moved or swapped chunks."""
  words = _leaf_words(x)
  index, stride = jnp.zeros(words.shape, jnp.uint32), 1
  for axis in reversed(range(words.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    index, stride = index + iota * jnp.uint32(stride), (stride * words.shape[axis]) % 2**32
  mixed = (words ^ (words >> 16)) * 0x45D9F3B  # spreads the high bits (float exponents) down
  weighted = (mixed ^ (mixed >> 16)) * (2 * index + 1)
  return jnp.stack([words.sum(dtype=jnp.uint32), weighted.sum(dtype=jnp.uint32)])


def _paths(state: Any) -> list[str]:
  """The path of each array leaf of `state`, in leaf order (`.params['w']`, `['step']`)."""
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def state_checksums(state: Any) -> list[list[int]]:
  """Two uint32 checksums per array leaf of `state`, computed on its devices (jitted)."""
  leaves = jax.tree.leaves(state)
  if not leaves:
    return []
  first = getattr(leaves[0], "sharding", None)
  on_mesh = isinstance(first, jax.sharding.NamedSharding)
  sums = _jit_checksums(sharding.replicated(first.mesh) if on_mesh else None)(leaves)
  return np.asarray(jax.device_get(sums)).tolist()


@functools.lru_cache(maxsize=8)
def _jit_checksums(out_sharding):
  """The jitted checksum function (one per output sharding, so a second save does not retrace)."""
  return jax.jit(
    lambda leaves: jnp.stack([_leaf_checksum(x) for x in leaves]), out_shardings=out_sharding
  )


def _digest(data: Any) -> str:
  """The SHA-256 of JSON data (keys sorted), hex."""
  return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _iterator_digest(data_iter: Any) -> str:
  """The SHA-256 of a grain iterator's state: a dict (DatasetIterator) or JSON bytes
  (DataLoader)."""
  state = data_iter.get_state()
  return _digest(json.loads(state) if isinstance(state, bytes) else state)


def _iterator_digests(data_iter: Any) -> list[str]:
  """`_iterator_digest` of every process's iterator, by process index (a collective)."""
  digest = _iterator_digest(data_iter)
  if jax.process_count() == 1:
    return [digest]
  words = np.frombuffer(bytes.fromhex(digest), np.uint8).astype(np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(words)).reshape(-1, words.size)
  return [bytes(row.astype(np.uint8).tolist()).hex() for row in gathered]


def _config_json(config: Mapping[str, Any]) -> dict[str, Any]:
  """The JSON data of a dict or ConfigDict (`jsonable.to_data`); fails here rather than in a save
  thread."""
  data = jsonable.to_data(config)
  if not isinstance(data, dict):
    raise TypeError(f"config must be a mapping, got {type(config).__name__}")
  return data
