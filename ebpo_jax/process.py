"""Setting up a process of an entry point: Python's garbage collector, XLA:CPU's thread pools,
`jax.distributed`, SIGTERM and SIGINT.

The first three run before anything touches a device (`cli.entry_point` calls them);
`install_sigterm_flag` turns a preemption notice (or Ctrl-C) into a flag the trainer checks each
step.
"""

import gc
import os
import re
import signal
from collections.abc import Mapping, MutableMapping

import jax
import numpy as np
from jax.experimental import multihost_utils

_FAKE_CPU_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")

# CPython's cyclic garbage collector at its defaults (700, 10, 10) runs a young collection every
# 700 new objects and, as the heap grows, full ones that traverse every object of the process. An
# entry point's heap holds millions (the modules JAX, flax and orbax import, JAX's traced and
# lowered programs) and tracing allocates objects by the million. These thresholds collect young
# objects every 50,000 and the whole heap about 25 times less often: the test suite, whose every
# process sets them, took 6% fewer CPU-seconds (883 -> 820-837: results/suite_time.md, session 26).
GC_THRESHOLDS = (50_000, 50, 100)


def collect_garbage_less_often() -> None:
  """Sets Python's garbage-collection thresholds to GC_THRESHOLDS (cycles are freed later)."""
  gc.set_threshold(*GC_THRESHOLDS)


def fake_cpu_devices_env(devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """`base` (default: os.environ) for a process on `devices` fake CPU devices: the device count in
  XLA_FLAGS replaced, its other flags kept."""
  env = dict(os.environ if base is None else base)
  flags = _FAKE_CPU_DEVICES_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
  return env


def size_cpu_thread_pools(environ: MutableMapping[str, str] = os.environ) -> None:
  """Room in XLA:CPU's thread pools for N > 1 CPU devices (`XLA_FLAGS=
  --xla_force_host_platform_device_count=N` or `JAX_NUM_CPU_DEVICES=N`): sets `PJRT_NPROC` (the
  pools' size; XLA's own is max(cores, N)) to max(cores, 2 N) unless it is set already. Call it
  before anything touches a device; accelerators and a single CPU device are left alone.

  Each device's part of a program holds a pool thread until the program ends, and a launch that
  waits for a device's in-flight slot holds one too. With only N threads (N > cores), one
  device's part can find none free: the other N - 1 wait at the program's first all-reduce and
  XLA aborts the process after 40 s ("Expected 8 threads to join the rendezvous, but only 6 of
  them arrived"), as the 8-device warm start did on 2 cores (issue 14 item 11).
  """
  counts = [int(n) for n in _FAKE_CPU_DEVICES_FLAG.findall(environ.get("XLA_FLAGS", ""))]
  count = environ.get("JAX_NUM_CPU_DEVICES", "")
  counts.append(int(count) if count.isdigit() else 0)  # not a number: jax's to report
  devices = max(counts)
  if devices > 1 and not environ.get("PJRT_NPROC"):
    environ["PJRT_NPROC"] = str(max(os.cpu_count() or 1, 2 * devices))


DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def init_distributed() -> bool:
  """Joins a multi-process run (one process per host, the same command on every host).

  With `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` set (as
  launch/local_multiprocess.sh does, or a cluster script per host) they are passed on; with
  `EBPO_JAX_DISTRIBUTED=auto` (launch/tpu_pod.sh) JAX detects the cluster (TPU pod, SLURM).
  Otherwise this is a single-process run and nothing happens. Returns whether it initialised.
  Call it before anything touches a device.
  """
  given = [name for name in DISTRIBUTED_ENV if os.environ.get(name)]
  if 0 < len(given) < len(DISTRIBUTED_ENV):
    missing = sorted(set(DISTRIBUTED_ENV) - set(given))
    raise ValueError(f"multi-process run: {', '.join(given)} set but {', '.join(missing)} not")
  if given or os.environ.get("EBPO_JAX_DISTRIBUTED") == "auto":
    # Cross-process collectives on CPU (loopback runs) need gloo; GPU and TPU ignore the option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if given:
    jax.distributed.initialize(
      coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
      process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    return True
  if os.environ.get("EBPO_JAX_DISTRIBUTED") == "auto":
    jax.distributed.initialize()
    return True
  return False


# ----------------------------------------------------------------------------- SIGTERM, SIGINT


class SigtermFlag:
  """`.requested` becomes True when the process receives SIGTERM (a preemption notice) or SIGINT
  (Ctrl-C): the run stops at the next step boundary with a checkpoint either way. A second SIGINT
  raises KeyboardInterrupt at once (the user wants out now)."""

  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self.signal_name = ""  # the first signal received, e.g. "SIGTERM"
    self._previous = {signum: signal.signal(signum, self._handle) for signum in self._SIGNALS}

  def _handle(self, signum, frame) -> None:
    del frame
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if not self.requested:
      self.signal_name = signal.Signals(signum).name
    self.requested = True

  @property
  def exit_status(self) -> int:
    """128 + the signal's number, the status of a process that signal ended (143 for SIGTERM,
    130 for SIGINT; 143 in a process that stops because another one got a signal)."""
    return 128 + signal.Signals[self.signal_name or "SIGTERM"].value

  def requested_anywhere(self) -> bool:
    """True if any process got SIGTERM or SIGINT; a collective, so call it on every process at
    once."""
    if jax.process_count() == 1:
      return self.requested
    flags = multihost_utils.process_allgather(np.array(self.requested))
    return bool(np.any(flags))

  def uninstall(self) -> None:
    """Puts back the handlers that were there before."""
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


def install_sigterm_flag() -> SigtermFlag:
  """Installs SIGTERM and SIGINT handlers (main thread only) that set a flag instead of exiting;
  the trainer checks `flag.requested` each step, saves a checkpoint and exits cleanly."""
  return SigtermFlag()
