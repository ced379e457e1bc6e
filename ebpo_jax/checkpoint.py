"""Checkpoints of the training state, the data iterator and the config (orbax), and SIGTERM.

One step directory per checkpoint under `directory`, with four items:
  state/      the TrainState pytree (any pytree of jax arrays: params, optax state, prior, typed
              PRNG keys, step), written sharded by every process (orbax OCDBT)
  checksums/  two uint32 sums per array of the state and the array's path (JSON), computed on the
              devices at save and compared after every restore (`restore_params` too): flipped
              bytes in a chunk are an error, not garbage
  data_iter/  the grain iterator state, one JSON file per process
  config/     the run config as JSON
Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a
checkpoint whose write was interrupted is never listed, restored or counted as latest; leftover
temporary directories are deleted when a Checkpointer opens the directory. `restore_latest`
falls back past checkpoints that do not restore or verify, moving them to `<directory>.unusable/`
(one line on stderr says so).
`directory` may be `gs://bucket/...`: orbax writes there through tensorstore; the checks here go
through `ebpo_jax.files`.
"""

import dataclasses
import functools
import json
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from ebpo_jax import files

_STATE, _DATA_ITER, _CONFIG, _CHECKSUMS = "state", "data_iter", "config", "checksums"


class CorruptCheckpointError(Exception):
  """A checkpoint that does not restore, or whose arrays differ from their saved checksums."""


class Checkpointer:
  """Saves and restores (state, data iterator, config) at integer steps; keeps the last N."""

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    max_to_keep: int | None = 3,
    save_every: int | None = None,
    async_save: bool = True,
    read_only: bool = False,
  ):
    """`save_every`: `save` writes only at multiples of it (and the first step) unless forced;
    None writes at every call. `max_to_keep=None` keeps everything. `read_only`: reads a
    directory that a trainer may be writing right now, without touching it (it must exist)."""
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
    if save_every is not None and save_every < 1:
      raise ValueError(f"save_every must be >= 1 or None, got {save_every!r}")
    self.directory = files.abspath(directory)
    if read_only:
      if not files.isdir(self.directory):
        raise FileNotFoundError(f"{self.directory}: no such checkpoint directory")
      options = ocp.CheckpointManagerOptions(read_only=True, create=False)
      self._manager = ocp.CheckpointManager(self.directory, options=options)
      return
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_interval_steps=save_every or 1,
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
  ) -> bool:
    """Starts writing a checkpoint at `step` (asynchronously by default) and returns True, or
    returns False when `save_every` says not now (unless `force`) or `step` is already saved.

    Called on every process. The iterator's position and the arrays are captured before this
    returns, so the caller may advance the iterator and donate `state` right after.
    """
    step = int(step)
    if step in self._manager.all_steps():
      return False
    if not force and not self._manager.should_save(step):
      return False
    items = {
      _STATE: ocp.args.StandardSave(state),
      _CHECKSUMS: ocp.args.JsonSave({"leaves": state_checksums(state), "paths": _paths(state)}),
    }
    if data_iter is not None:
      items[_DATA_ITER] = grain.checkpoint.CheckpointSave(data_iter)
    if config is not None:
      items[_CONFIG] = ocp.args.JsonSave(_to_json_dict(config))
    return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

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
    saved_items = self._saved_items(step)
    if data_iter is not None and _DATA_ITER not in saved_items:
      raise ValueError(f"checkpoint {step} in {self.directory} has no data iterator state")
    try:
      return self._restore_items(step, abstract_state, data_iter, saved_items, added=())
    except ValueError:  # a tree that differs; only a counter added since is accepted
      added = self._counters_added_since(step, abstract_state)
      if not added:
        raise
      return self._restore_items(step, abstract_state, data_iter, saved_items, added=added)

  def _restore_items(self, step, abstract_state, data_iter, saved_items, *, added) -> tuple:
    """(state, config) of checkpoint `step`, verified; the fields `added` restore as 0."""
    if added:
      fields = [f.name for f in dataclasses.fields(abstract_state) if f.name not in added]
      items = {_STATE: ocp.args.StandardRestore({n: getattr(abstract_state, n) for n in fields})}
    else:
      items = {_STATE: ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      items[_DATA_ITER] = grain.checkpoint.CheckpointRestore(data_iter)
    if _CONFIG in saved_items:
      items[_CONFIG] = ocp.args.JsonRestore()
    if _CHECKSUMS in saved_items:  # checkpoints written before checksums are not verified
      items[_CHECKSUMS] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = restored[_STATE]
    if added:  # the saved fields in the state's order (as saved), then the counters
      state = abstract_state.replace(**state, **dict.fromkeys(added))
    if _CHECKSUMS in saved_items:
      self._verify(step, state, restored[_CHECKSUMS]["leaves"])
    if added:
      state = state.replace(**{n: _zeros_like(getattr(abstract_state, n)) for n in added})
    config = restored[_CONFIG] if _CONFIG in saved_items else None
    return state, config

  def _counters_added_since(self, step: int, abstract_state: Any) -> list[str]:
    """The fields of a dataclass state (e.g. TrainState) that checkpoint `step` lacks, when each
    is a scalar integer (a counter added later, like `bad_steps`); else []."""
    if not dataclasses.is_dataclass(abstract_state):
      return []
    saved = self._manager.item_metadata(step)[_STATE]
    saved = getattr(saved, "tree", saved)
    if not isinstance(saved, Mapping):
      return []
    fields = [f.name for f in dataclasses.fields(abstract_state)]
    missing = [n for n in fields if n not in saved and getattr(abstract_state, n) is not None]
    counters = [n for n in missing if _is_scalar_int(getattr(abstract_state, n))]
    return counters if counters == missing else []

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
    for step in reversed(self.all_steps()):
      try:
        state, config = self.restore(step, abstract_state, data_iter=data_iter)
      except Exception as e:  # orbax and tensorstore raise many kinds; each means "unusable"
        failed.append(f"checkpoint {step} ({_first_line(e)})")
        continue
      if failed:
        aside = self._move_aside([bad for bad in self.all_steps() if bad > step])
        if jax.process_index() == 0:
          print(
            f"warning: {'; '.join(failed)} in {self.directory} did not restore: moved to "
            f"{aside}; resuming from step {step}",
            file=sys.stderr,
          )
      return step, state, config
    if not failed:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    raise CorruptCheckpointError(f"no checkpoint in {self.directory} restores: {'; '.join(failed)}")

  def _move_aside(self, steps: list[int]) -> str:
    """Moves the directories of `steps` (process 0) into `<directory>.unusable/`, as `<step>` or
    `<step>.<n>` when that name is taken; every process then sees them gone. Returns the folder."""
    aside = f"{self.directory.rstrip('/')}.unusable"
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

  def _verify(self, step: int, state: Any, saved: list) -> None:
    """Raises CorruptCheckpointError naming the first array whose checksums differ."""
    got = state_checksums(state)
    if got != saved:
      bad = next((p for p, a, b in zip(_paths(state), got, saved, strict=False) if a != b), "")
      self._corrupt(step, bad)

  def _corrupt(self, step: int, path: str) -> NoReturn:
    where = f"state{path}" if path else "the state's tree"
    raise CorruptCheckpointError(
      f"checkpoint {step} in {self.directory} is corrupt: the checksum of {where} differs"
    )

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the policy params of checkpoint `step` (`state.params`), restored into
    `abstract_params` (`jax.ShapeDtypeStruct`s with shardings) and verified against their saved
    checksums (checkpoints since the checksums named their arrays); nothing else is read."""
    item = {"params": abstract_params}
    args = {
      _STATE: ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
      )
    }
    if _CHECKSUMS in self._saved_items(step):
      args[_CHECKSUMS] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    params = restored[_STATE]["params"]
    saved = restored[_CHECKSUMS] if _CHECKSUMS in args else {}
    if "paths" in saved:
      by_path = dict(zip(saved["paths"], saved["leaves"], strict=True))
      for path, sums in zip(_paths(params), state_checksums(params), strict=True):
        expected = by_path.get(f".params{path}", by_path.get(f"['params']{path}"))
        if expected != sums:
          self._corrupt(step, f".params{path}")
    return params

  def saved_arrays(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """What checkpoint `step`'s state holds, from its metadata (no array is read): each array's
    path (`['params']['w']`) -> (shape, dtype name)."""
    path = epath.Path(files.join(self.directory, str(int(step)), _STATE))
    metadata = ocp.PyTreeCheckpointHandler().metadata(path)
    leaves = jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}

  def saved_config(self, step: int) -> dict[str, Any] | None:
    """The config saved with checkpoint `step`, or None when it has none."""
    if _CONFIG not in self._saved_items(step):
      return None
    return self._manager.restore(
      step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
    )[_CONFIG]

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


def _is_scalar_int(x: Any) -> bool:
  return getattr(x, "shape", None) == () and jnp.issubdtype(x.dtype, jnp.integer)


def _zeros_like(abstract: jax.ShapeDtypeStruct) -> jax.Array:
  """A zero of `abstract`'s shape and dtype, placed with its sharding."""
  return jax.device_put(np.zeros(abstract.shape, abstract.dtype), abstract.sharding)


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
  replicated = (
    jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
    if isinstance(first, jax.sharding.NamedSharding)
    else None
  )
  sums = _jit_checksums(replicated)(leaves)
  return np.asarray(jax.device_get(sums)).tolist()


@functools.lru_cache(maxsize=8)
def _jit_checksums(out_sharding):
  """The jitted checksum function (one per output sharding, so a second save does not retrace)."""
  return jax.jit(
    lambda leaves: jnp.stack([_leaf_checksum(x) for x in leaves]), out_shardings=out_sharding
  )


def _to_json_dict(config: Mapping[str, Any]) -> dict[str, Any]:
  """A plain JSON-able dict from a dict or ConfigDict; fails here rather than in a save thread."""
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a mapping, got {type(config).__name__}")

  def default(value):
    if isinstance(value, np.generic | np.ndarray | jax.Array):
      return np.asarray(value).tolist()
    raise TypeError(f"config value {value!r} of type {type(value).__name__} is not JSON-able")

  return json.loads(json.dumps(dict(config), default=default))


class SigtermFlag:
  """`.requested` becomes True when the process receives SIGTERM (preemption notice)."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame) -> None:
    del signum, frame
    self.requested = True

  def requested_anywhere(self) -> bool:
    """True if any process got SIGTERM; a collective, so call it on every process at once."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array(self.requested))
    return bool(np.any(flags))

  def uninstall(self) -> None:
    """Puts back the SIGTERM handler that was there before."""
    signal.signal(signal.SIGTERM, self._previous)


def install_sigterm_flag() -> SigtermFlag:
  """Installs a SIGTERM handler (main thread only) that sets a flag instead of exiting; the
  trainer checks `flag.requested` each step, saves a checkpoint and exits cleanly."""
  return SigtermFlag()
