"""A run's workdir: its lock and its config.json (DESIGN.md: "A workdir holds config.json (the
resolved config of the run) and is locked while a run uses it").

The lock, WORKDIR/lock, holds the identity of the run that has the workdir (host, pid, start time):
- Local: the file is `flock`ed; the OS releases the lock when the process ends, however it ends
  (kill -9 included), so a local lock is never stale.
- On a bucket (`gs://...`) an object cannot be flocked: the lock is the object itself, created
  only where none exists (GCS's `ifGenerationMatch=0`), and deleted when the run ends. A run killed
  with no chance to clean up (kill -9, a preempted VM) leaves it behind; the next run then stops
  and names the object to delete, or `--config.workdir.break_lock=True` takes it over. A lock whose
  holder ran on this host and is dead is taken over without asking.
Under `jax.distributed` only process 0 takes the lock and checks the config; the others learn the
outcome from it and stop with it.

config.json is the resolved config of the run (rewritten by every run that starts). A run whose
config differs from it in a key that defines the experiment stops with one line listing the keys,
before anything compiles; SAFE_KEYS (steps, evaluation, logging and checkpoint cadence, the mesh,
...) and the logging.* keys (SAFE_PREFIXES) may change on a resume;
`--config.workdir.accept_changes=KEY,...` (or `all`) accepts others.

A workdir without config.json compares the config saved in its newest checkpoint instead. A start
on a workdir whose metrics.jsonl shows a run but that has no checkpoint to resume (checkpoints/
deleted) stops with one line rather than starting over silently; `workdir.fresh=True` starts over,
moving the old run to WORKDIR/previous.<n>/ (never deleting it); `workdir.resume_step=N` resumes
from an older retained checkpoint.

format.json beside it holds the workdir's format number (FORMAT); a workdir of another format (an
older ebpo-jax's) is refused with one line, never migrated.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from ebpo_jax import checkpoint, cli, errors, files, jsonable
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.metrics.log import flatten

CONFIG_FILE = "config.json"
LOCK_FILE = "lock"
CHECKPOINTS_DIR = "checkpoints"  # WORKDIR/checkpoints/: the run's Checkpointer
PREVIOUS_PREFIX = "previous."  # WORKDIR/previous.<n>/: a run that `workdir.fresh` moved aside
# WORKDIR/format.json, {"format": FORMAT}: the layout of the workdir this code writes and reads
# (config.json, metrics.jsonl, samples.jsonl, what ablations keep). Raise it when that layout
# changes; a workdir of another format is refused, never migrated.
FORMAT_FILE = "format.json"
FORMAT = 1
# Keys whose change does not change the experiment: a resume may change them freely.
SAFE_KEYS = frozenset(
  {
    "train.num_steps",
    "train.log_every",
    "train.max_bad_steps",
    "train.transfer_guard",
    "eval.every_steps",
    "eval.num_samples",
    # Not eval.path: with data.path, it decides which of its rows are held out of training.
    "checkpoint.every_steps",
    "checkpoint.every_minutes",
    "checkpoint.max_to_keep",
    "rewards.workers",
    "rewards.max_error_frac",
    "env.tool_latency_s",  # a wait on the host: the same episodes
    "sampling.concurrent_calls",  # the same calls, overlapped
    # The device layout: a checkpoint restores onto another mesh, and the math is the same.
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "mesh.rollout_devices",
    # How the layer loop compiles (rolled or unrolled): the same math.
    "model.unroll_layers",
  }
)
# Keys added since FORMAT 1, with the default that a run saved before them ran with: a saved config
# without one compares as that default (a committed workdir resumes under the newer code).
ADDED_KEYS = {
  "rl.max_staleness": 0,
  "env.tool_latency_s": 0.0,
  "mesh.rollout_devices": 0,
  "sampling.concurrent_calls": 1,
  "rl.loss.ratio_level": "token",
  "rl.loss.seq_clip_low": 3e-4,
  "rl.loss.seq_clip_high": 4e-4,
  "model.num_experts": 0,
  "model.num_experts_per_tok": 2,
  "model.moe_intermediate_size": 64,
  "model.router_aux_loss_coef": None,
  "model.moe_kernel": "auto",
}
# Key prefixes that are as safe: where and how the run logs (logging.*).
SAFE_PREFIXES = ("logging.",)
# Keys about this invocation only (the workdir's own switches): never compared.
SESSION_PREFIX = "workdir."


class WorkdirError(errors.ConfigError):
  """The workdir is in use, or holds a run of another config; the message says what to do."""


# ----------------------------------------------------------------------------- the lock


class Lock:
  """The held lock of a workdir; `release` gives it up (idempotent)."""

  def __init__(self, path: str, token: str, fd: int | None):
    self.path, self._token, self._fd = path, token, fd

  def release(self) -> None:
    if self._fd is not None:  # local: closing the flocked file releases it
      os.ftruncate(self._fd, 0)
      os.close(self._fd)
      self._fd = None
    elif self._token is not None:  # remote: delete the object if it is still ours
      if _holder(self.path).get("token") == self._token:
        files.remove(self.path)
      self._token = None


def lock(workdir: str, *, break_lock: bool = False) -> Lock:
  """Takes the lock of `workdir` or raises WorkdirError naming the holder (never waits)."""
  path = files.join(workdir, LOCK_FILE)
  token = uuid.uuid4().hex
  identity = {
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "token": token,
  }
  text = json.dumps(identity) + "\n"
  if not files.is_remote(workdir):
    return Lock(path, token, _flock(path, text, workdir))
  if files.write_new(path, text):
    return Lock(path, token, None)
  holder = _holder(path)
  if not (break_lock or _dead_here(holder)):
    raise WorkdirError(
      f"{workdir} is in use by {_describe(holder)} (lock object {path}); if that run is dead, "
      f"delete {path} or pass --config.workdir.break_lock=True"
    )
  files.write_atomic(path, text)  # taken over
  return Lock(path, token, None)


def _flock(path: str, text: str, workdir: str) -> int:
  files.makedirs(workdir)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise WorkdirError(f"{workdir} is in use by {_describe(_holder(path))}") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, text.encode(), 0)
  return fd


def _holder(path: str) -> dict[str, Any]:
  """The identity in lock file `path`; {} when it is gone or not written yet."""
  try:
    return json.loads(files.read_text(path))
  except (FileNotFoundError, ValueError):
    return {}


def _describe(holder: Mapping[str, Any]) -> str:
  if not holder:
    return "another run (starting)"
  host, pid, started = (holder.get(key, "?") for key in ("host", "pid", "started"))
  return f"a run on host {host} pid {pid} since {started}"


def _dead_here(holder: Mapping[str, Any]) -> bool:
  """Whether the lock's holder ran on this host and its process is gone."""
  if holder.get("host") != socket.gethostname():
    return False
  try:
    os.kill(int(holder["pid"]), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, KeyError, ValueError):
    return False
  return False


# ----------------------------------------------------------------------------- config.json


def changed_keys(saved: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
  """{dotted key: (saved value, new value)} of the keys whose values differ (a key on one side
  only: None on the other, but for `ADDED_KEYS` missing from `saved`); SESSION_PREFIX keys are not
  compared."""
  before, after = flatten(jsonable.to_data(saved)), flatten(jsonable.to_data(new))
  before = {k: v for k, v in ADDED_KEYS.items() if k in after} | before
  return {
    key: (before.get(key), after.get(key))
    for key in sorted(before.keys() | after.keys())
    if not key.startswith(SESSION_PREFIX) and before.get(key) != after.get(key)
  }


def save_config(workdir: str, config) -> None:
  """Writes WORKDIR/format.json (this code's FORMAT), then WORKDIR/config.json."""
  files.write_atomic(files.join(workdir, FORMAT_FILE), json.dumps({"format": FORMAT}) + "\n")
  text = jsonable.dumps(config, indent=1, sort_keys=True) + "\n"
  files.write_atomic(files.join(workdir, CONFIG_FILE), text)


def saved_config(workdir: str) -> dict[str, Any] | None:
  """WORKDIR/config.json, or None when the workdir has none; WorkdirError when the workdir is of
  another FORMAT (format.json absent: an ebpo-jax from before the format numbers)."""
  path = files.join(workdir, CONFIG_FILE)
  if not files.exists(path):
    return None
  format_path = files.join(workdir, FORMAT_FILE)
  found = json.loads(files.read_text(format_path))["format"] if files.exists(format_path) else None
  problem = errors.format_mismatch(
    found, FORMAT, where=workdir, kind="workdir", remedy="delete this one"
  )
  if problem:
    raise WorkdirError(problem)
  return json.loads(files.read_text(path))


def check_and_save_config(
  workdir: str,
  config: ml_collections.ConfigDict,
  *,
  checkpointed: tuple[int, Mapping[str, Any]] | None = None,
) -> None:
  """Raises WorkdirError when WORKDIR/config.json (absent: the config of `checkpointed`, the
  newest checkpoint's (step, config)) differs from `config` in a key neither safe nor accepted
  (`workdir.accept_changes`); else writes `config` as the new config.json."""
  saved, source = saved_config(workdir), files.join(workdir, CONFIG_FILE)
  if saved is None and checkpointed is not None:
    saved, source = checkpointed[1], files.join(workdir, CHECKPOINTS_DIR, str(checkpointed[0]))
  if saved is not None:
    changed = changed_keys(saved, config)
    safe = SAFE_KEYS | _accepted(config, changed)
    refused = [k for k in changed if k not in safe and not k.startswith(SAFE_PREFIXES)]
    if refused:
      listing = ", ".join(f"{key} ({changed[key][0]!r} -> {changed[key][1]!r})" for key in refused)
      raise WorkdirError(
        f"{source}: the run used another config: {listing}; resume "
        "with the same values, use another --workdir, or accept the change with "
        f"--config.workdir.accept_changes={','.join(refused)}"
      )
  save_config(workdir, config)


def _accepted(config: ml_collections.ConfigDict, changed: Mapping[str, Any]) -> set[str]:
  keys = accepted_keys(config)
  return set(changed) if keys == "all" else keys


def accepted_keys(config: ml_collections.ConfigDict) -> set[str] | str:
  """`workdir.accept_changes`' keys, or "all"; a key the config lacks is a WorkdirError (checked
  by `config.check_config` before any start, fresh or resumed)."""
  text = config.workdir.accept_changes.strip()
  if text == "all":
    return text
  keys = {key.strip() for key in text.split(",") if key.strip()}
  known = flatten(jsonable.to_data(config))
  unknown = sorted(keys - known.keys())
  if unknown:
    raise WorkdirError(
      f"config.workdir.accept_changes={text!r}: no config key {', '.join(unknown)} "
      "(comma-separated dotted keys, or 'all')"
    )
  return keys


# ----------------------------------------------------------------------------- a run's claim


@contextlib.contextmanager
def claim(workdir: str, config: ml_collections.ConfigDict) -> Iterator[None]:
  """The workdir for the life of a run: locked, the old run moved aside (`workdir.fresh`), the
  start checked against what the workdir holds and config.json written (process 0; the
  checkpoints are read by every process, as orbax reads); unlocked when the block ends (an
  exception or sys.exit included). Raises WorkdirError in every process when process 0 could not
  claim it."""
  held = []

  def take() -> None:
    held.append(lock(workdir, break_lock=config.workdir.break_lock))
    check_session_keys(config)
    if config.workdir.fresh:
      move_run_aside(workdir)

  try:
    _on_process_0(workdir, take)
    steps, newest = _checkpoints(workdir)
    _on_process_0(workdir, lambda: _check_start(workdir, config, steps, newest))
    yield
  finally:
    for taken in held:
      taken.release()


def _on_process_0(workdir: str, fn: Callable[[], None]) -> None:
  """Runs `fn` on process 0; its WorkdirError is raised in every process."""
  error = None
  if jax.process_index() == 0:
    try:
      fn()
    except WorkdirError as e:
      error = e
  if not _everyone_agrees(error is None) and error is None:
    error = WorkdirError(f"process 0 could not claim {workdir} (its output says why)")
  if error is not None:
    raise error


def check_session_keys(config: ml_collections.ConfigDict) -> None:
  """`workdir.resume_step` and `workdir.fresh`, alone and together (a WorkdirError)."""
  resume_step = config.workdir.resume_step
  if not isinstance(resume_step, int) or resume_step < -1:
    raise WorkdirError(
      f"config.workdir.resume_step={resume_step!r}: must be >= -1 (-1: the latest checkpoint)"
    )
  if config.workdir.fresh and resume_step >= 0:
    raise WorkdirError(
      f"config.workdir.resume_step={resume_step} with config.workdir.fresh=True: a fresh start "
      "resumes nothing; pass one of them"
    )


def _checkpoints(workdir: str) -> tuple[list[int], tuple[int, dict[str, Any]] | None]:
  """The steps of WORKDIR/checkpoints/ and the newest one's (step, config) (every process)."""
  directory = files.join(workdir, CHECKPOINTS_DIR)
  if not files.isdir(directory):
    return [], None
  # Not read_only (orbax warns twice then): the workdir is this run's, its lock held.
  with checkpoint.Checkpointer(directory, max_to_keep=None) as ckpt:
    return ckpt.all_steps(), ckpt.newest_config()


def _check_start(workdir: str, config, steps: list[int], newest) -> None:
  """What the workdir holds allows this start (a checkpoint to resume where metrics show a run,
  the checkpoint `workdir.resume_step` names, the same config); then config.json is written."""
  resume_step, checkpoints = config.workdir.resume_step, files.join(workdir, CHECKPOINTS_DIR)
  if resume_step >= 0 and resume_step not in steps:
    retained = ", ".join(map(str, steps)) or "none"
    raise WorkdirError(
      f"config.workdir.resume_step={resume_step}: no checkpoint of step {resume_step} in "
      f"{checkpoints} (retained: {retained})"
    )
  metrics_path = files.join(workdir, metrics_lib.METRICS_FILE)
  if not steps and files.exists(metrics_path):
    logged = [record["step"] for record in metrics_lib.read_metrics(metrics_path)]
    # Lines past step 0 follow checkpoint 0; a step-0 line alone, a kill before it (checkpoints/
    # exists, since the Checkpointer opens before the metrics writer).
    if logged and (max(logged) > 0 or not files.isdir(checkpoints)):
      raise WorkdirError(
        f"{workdir} holds a run (metrics.jsonl up to step {max(logged)}) but no checkpoint in "
        f"{checkpoints} to resume from: put its checkpoints back, or start over with "
        f"--config.workdir.fresh=True (the old run moves to {workdir}/{PREVIOUS_PREFIX}<n>/)"
      )
  check_and_save_config(workdir, config, checkpointed=newest)


def move_run_aside(workdir: str) -> str | None:
  """Moves everything in `workdir` but its lock and earlier moved runs into
  WORKDIR/previous.<n>/ (the first free n from 1); returns that folder, or None when there was
  nothing to move."""
  names = [
    name
    for name in (files.listdir(workdir) if files.isdir(workdir) else [])
    if name != LOCK_FILE and not name.startswith(PREVIOUS_PREFIX)
  ]
  if not names:
    return None
  n = 1
  while files.exists(files.join(workdir, f"{PREVIOUS_PREFIX}{n}")):
    n += 1
  target = files.join(workdir, f"{PREVIOUS_PREFIX}{n}")
  for name in names:
    files.move_tree(files.join(workdir, name), files.join(target, name))
  return target


def _everyone_agrees(ok: bool) -> bool:
  """Process 0's `ok`, in every process (one broadcast when there are several)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


# ----------------------------------------------------------------------------- tools


def resolved_config(spec: str, args: Sequence[str]) -> ml_collections.ConfigDict:
  """The config the trainer resolves from `--config=SPEC` and `args` (`--config.KEY=VALUE`): the
  file loaded by `cli.load_config`, the args parsed by the config flags' own parser."""
  argv = ["resolve", *args]
  flag_values = flags.FlagValues()
  config = cli.load_config(spec)
  config_flags.DEFINE_config_dict("config", config, flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  return flag_values.config
