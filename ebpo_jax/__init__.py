"""ebpo_jax: RL with verifiable rewards on language models, built around EBPO."""

import glob
import os

__version__ = "0.1.0"


# What libtpu probes for at start-up, for one host without chips.
_LIBTPU_QUIET = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}


def _quiet_libtpu_without_a_tpu() -> None:
  """On a machine without TPU chips, where libtpu is installed for `ebpo_jax.aot`'s TPU compiler,
  jax's start-up loads it and it prints six lines of errors (it cannot find the slice's host
  bounds and worker hostnames) above every command. Giving it both (one host, this one) before jax
  starts its backends keeps it quiet; it then finds no chip, as before, and jax runs on the CPU or
  GPU. `TPU_ACCELERATOR_TYPE`, which notebooks and scripts read to detect a TPU, is left unset.
  Nothing is set on a TPU machine, or where libtpu's variables are set already."""
  if any(os.environ.get(k) for k in (*_LIBTPU_QUIET, "TPU_ACCELERATOR_TYPE")):
    return
  # Google's PCI vendor id, as jax's own probe reads it (jax is not imported here: the reward
  # workers import this package and must not start jax).
  vendors = glob.glob("/sys/bus/pci/devices/*/vendor")
  if not vendors or any(_read(path) == "0x1ae0" for path in vendors):
    return  # a TPU machine, or one whose devices cannot be read: leave it as it is
  os.environ.update(_LIBTPU_QUIET)


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


_quiet_libtpu_without_a_tpu()
