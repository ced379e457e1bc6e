"""Checkpoints of the training state, the data iterator and the config (orbax), and SIGTERM.

One step directory per checkpoint under `directory`, with three items:
  state/      the TrainState pytree (any pytree of jax arrays: params, optax state, prior, typed
              PRNG keys, step), written sharded by every process (orbax OCDBT)
  data_iter/  the grain iterator state, one JSON file per process
  config/     the run config as JSON
Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a
checkpoint whose write was interrupted is never listed, restored or counted as latest; leftover
temporary directories are deleted when a Checkpointer opens the directory.
`directory` may be `gs://bucket/...`: orbax writes there through tensorstore; the checks here go
through `ebpo_jax.files`.
"""

import json
import os
import signal
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from ebpo_jax import files

_STATE, _DATA_ITER, _CONFIG = "state", "data_iter", "config"


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
    items = {_STATE: ocp.args.StandardSave(state)}
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
    saved_items = set(self._manager.item_metadata(step).keys())
    items = {_STATE: ocp.args.StandardRestore(abstract_state)}
    if data_iter is not None:
      if _DATA_ITER not in saved_items:
        raise ValueError(f"checkpoint {step} in {self.directory} has no data iterator state")
      items[_DATA_ITER] = grain.checkpoint.CheckpointRestore(data_iter)
    if _CONFIG in saved_items:
      items[_CONFIG] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    config = restored[_CONFIG] if _CONFIG in saved_items else None
    return restored[_STATE], config

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the policy params of checkpoint `step` (`state.params`), restored into
    `abstract_params` (`jax.ShapeDtypeStruct`s with shardings); nothing else is read."""
    item = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(
      item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    restored = self._manager.restore(step, args=ocp.args.Composite(**{_STATE: args}))
    return restored[_STATE]["params"]

  def saved_config(self, step: int) -> dict[str, Any] | None:
    """The config saved with checkpoint `step`, or None when it has none."""
    if _CONFIG not in set(self._manager.item_metadata(step).keys()):
      return None
    return self._manager.restore(
      step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
    )[_CONFIG]

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
