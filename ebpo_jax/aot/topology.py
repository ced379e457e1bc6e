"""TPU generations and slices: each generation's published per-chip peaks and the HBM its compiler
lets a program use, gcloud's slice names (`v5p-64`, `v5litepod-16`) and topologies (`v5p:4x4x2`),
and a slice's compile-only devices from libtpu (for `python -m ebpo_jax.aot`). Imports nothing of
the project.
"""

import dataclasses
import math
import os
import re

import jax

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation: published per-chip peaks, and the HBM its compiler lets a program use."""

  peak_flops: float  # bf16 FLOP/s
  hbm_bytes: int  # published HBM capacity
  hbm_bandwidth: float  # bytes/s
  usable_hbm_bytes: int  # what the TPU compiler (libtpu 0.0.42) reports as available HBM
  cores_per_chip: int  # TensorCores a slice name counts per chip (v4-32, v5p-64: 2)
  dims: int  # torus dimensions (3: v4, v5p; 2: v5e, v6e)
  ici_bandwidth: float  # bytes/s over the inter-chip interconnect, all links of the chip


# Cloud TPU documentation, "TPU versions" (system architecture pages), per chip; the ICI bandwidth
# is the published Gbps / 8 (v4 2,400; v5e 1,600; v5p 4,800; v6e 3,584). The usable HBM is the
# compiler's: "exceeds available HBM (95.74G)" for an oversized program, in GiB.
CHIPS = {
  "v4": Chip(275e12, 32 * GIB, 1200e9, int(30.75 * GIB), 2, 3, 300e9),
  "v5e": Chip(197e12, 16 * GIB, 819e9, int(15.75 * GIB), 1, 2, 200e9),
  "v5p": Chip(459e12, 95 * GIB, 2765e9, int(95.74 * GIB), 2, 3, 600e9),
  "v6e": Chip(918e12, 32 * GIB, 1640e9, int(31.25 * GIB), 1, 2, 448e9),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}  # gcloud's name for v5e slices
_CHIP_COUNTS = {2: (1, 4, 8, 16, 32, 64, 128, 256), 3: (4, 8, 16, 32, 64, 128, 256, 512, 1024)}


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice: its generation and the chips along each torus axis."""

  generation: str
  shape: tuple[int, ...]

  @property
  def chip(self) -> Chip:
    return CHIPS[self.generation]

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def topology(self) -> str:
    return f"{self.generation}:{'x'.join(map(str, self.shape))}"

  @property
  def accelerator_type(self) -> str:
    """gcloud's name of the slice (v5p-64, v5litepod-16)."""
    prefix = "v5litepod" if self.generation == "v5e" else self.generation
    return f"{prefix}-{self.chips * self.chip.cores_per_chip}"


def known_slices() -> list[str]:
  """The slice names `parse_slice` knows (every topology `GEN:AxB[xC]` is accepted too)."""
  return [
    Slice(gen, _shape(chip.dims, n)).accelerator_type.replace("v5litepod", "v5e")
    for gen, chip in CHIPS.items()
    for n in _CHIP_COUNTS[chip.dims]
  ]


def _shape(dims: int, chips: int) -> tuple[int, ...]:
  """The usual torus of `chips` chips: from 2x2(x1), doubling the last of the smallest axes
  (v5p-64: 2x4x4; v5e-32: 4x8)."""
  shape = [1] * dims if chips == 1 else [2, 2] + [1] * (dims - 2)
  while math.prod(shape) < chips:
    smallest = min(shape)
    last = max(i for i, s in enumerate(shape) if s == smallest)
    shape[last] *= 2
  return tuple(shape)


def parse_slice(name: str) -> Slice:
  """`v5p-64` (gcloud's accelerator type), `v5litepod-16`, or a topology `v5p:4x4x2`."""
  known = ", ".join(known_slices())
  error = ValueError(
    f"--topology={name!r}: unknown slice; known: {known}; or a topology GEN:AxB[xC] "
    f"(GEN in {', '.join(CHIPS)})"
  )
  if ":" in name:
    gen, _, dims = name.partition(":")
    gen = _ALIASES.get(gen, gen)
    if gen not in CHIPS or not re.fullmatch(r"\d+(x\d+)*", dims):
      raise error
    shape = tuple(int(d) for d in dims.split("x"))
    if len(shape) != CHIPS[gen].dims or min(shape) < 1:
      raise ValueError(f"--topology={name!r}: a {gen} topology has {CHIPS[gen].dims} axes")
    return Slice(gen, shape)
  match = re.fullmatch(r"(v\w+?)-(\d+)", name)
  if not match:
    raise error
  gen, count = _ALIASES.get(match[1], match[1]), int(match[2])
  if gen not in CHIPS or count % CHIPS[gen].cores_per_chip:
    raise error
  chips = count // CHIPS[gen].cores_per_chip
  if chips not in _CHIP_COUNTS[CHIPS[gen].dims]:
    raise error
  return Slice(gen, _shape(CHIPS[gen].dims, chips))


class NoTpuCompiler(RuntimeError):
  """libtpu is missing, or cannot describe the topology."""


def topology_devices(tpu: Slice) -> list[jax.Device]:
  """Compile-only TPU devices of the slice, one per chip (v4 as megacore: one device per chip)."""
  from jax.experimental import topologies

  os.environ.setdefault("TPU_ACCELERATOR_TYPE", tpu.accelerator_type)  # libtpu probes less
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # Compile-only: several compiles (tests, a sweep) may hold libtpu at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  extra = {"chip_config_name": "megacore"} if tpu.generation == "v4" else {}
  try:
    topology = topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology, **extra)
  except (RuntimeError, ValueError) as e:
    raise NoTpuCompiler(
      f"no TPU compiler for {tpu.topology} ({str(e).splitlines()[0]}); "
      "install libtpu: pip install -e '.[aot]'"
    ) from None
  return list(topology.devices)
