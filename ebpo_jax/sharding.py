"""Device mesh over ('data', 'fsdp', 'tensor') and the logical-axis rules that place arrays on it.

Parameters carry logical axis names (`nn.with_logical_partitioning`); `DEFAULT_RULES` maps each name
to mesh axes. A dimension that its mesh axes do not divide evenly (say 3 KV heads over tensor=2) is
replicated along that dimension rather than refused, so one rule set serves every model size.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: Rules = (
  ("batch", ("data", "fsdp")),
  ("layers", None),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("length", None),
)


def mesh_shape(shape: dict[str, int], num_devices: int) -> dict[str, int]:
  """Every axis's size for `num_devices` devices: absent axes get 1, one size may be -1 (the
  remaining devices). Raises ValueError naming the mesh when the sizes do not fit."""
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(
      f"mesh={shape}: unknown axes {sorted(unknown)}; expected a subset of {MESH_AXES}"
    )
  sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
  if list(sizes.values()).count(-1) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"mesh={shape}: sizes must be positive, with at most one -1")
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % known:
      raise ValueError(f"mesh={shape}: {num_devices} devices are not divisible by {known}")
    sizes = {axis: num_devices // known if s == -1 else s for axis, s in sizes.items()}
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
      f"mesh={shape}: {math.prod(sizes.values())} devices requested, {num_devices} available"
    )
  return sizes


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes ('data', 'fsdp', 'tensor') of sizes `mesh_shape(shape, len(devices))`."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = mesh_shape(shape, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(
    tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=auto, devices=devices
  )


def logical_to_spec(
  shape: Sequence[int], names: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dimensions carry logical `names`.

  A logical name maps to the mesh axes of its first rule; mesh axes already used by an earlier
  dimension, of size 1, or not dividing the dimension are dropped (that dimension is replicated).
  """
  if len(shape) != len(names):
    raise ValueError(f"shape {tuple(shape)} and logical names {tuple(names)} differ in rank")
  rule_map: dict[str, Any] = {}
  for name, axes in rules:
    rule_map.setdefault(name, axes)
  used: set[str] = set()
  spec = []
  for dim, name in zip(shape, names, strict=True):
    if name is not None and name not in rule_map:
      raise ValueError(
        f"logical axis {name!r} has no sharding rule; rules cover {sorted(rule_map)}"
      )
    axes = rule_map.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = []
    for axis in axes:
      size = mesh.shape[axis]
      if axis in used or size == 1 or dim % (size * math.prod(mesh.shape[a] for a in kept)):
        continue
      kept.append(axis)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """NamedShardings for a tree of boxed (`nn.Partitioned`) params or their `jax.eval_shape`.

  The result has the structure of the unboxed tree; unannotated leaves are replicated.
  """

  def leaf_sharding(leaf):
    if isinstance(leaf, nn.Partitioned):
      return NamedSharding(mesh, logical_to_spec(leaf.value.shape, leaf.names, mesh, rules))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(leaf_sharding, abstract_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


_FAKE_CPU_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


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


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension over ('data', 'fsdp'), the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def row_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
  """Rows (the leading dimension) over the batch axes that divide them, the rest replicated."""
  return NamedSharding(mesh, logical_to_spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh))


def place_from_host(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """Builds a global array from a host copy; each device receives only its own shard.

  The project's explicit host-to-device placement: allowed under `jax.transfer_guard("disallow")`
  (the trainer's loop runs under it, so that any other, implicit, transfer fails)."""
  value = np.asarray(value)
  with jax.transfer_guard_host_to_device("allow"):
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def constrain_rows(tree: Any, mesh: Mesh | None) -> Any:
  """Inside jit: the leading (row) dimension of every array split over the mesh's batch axes, so
  that XLA keeps rows split over devices instead of spreading the weights' sharding onto them."""
  if mesh is None:
    return tree

  def constrain(x):
    return jax.lax.with_sharding_constraint(x, row_sharding(x.shape, mesh))

  return jax.tree.map(constrain, tree)


def to_host(tree: Any) -> Any:
  """Every array of `tree` whole, as NumPy on this process (one explicit fetch; global arrays that
  span several processes are all-gathered)."""
  from jax.experimental import multihost_utils

  leaves, treedef = jax.tree.flatten(tree)
  local = [x.is_fully_addressable or x.is_fully_replicated for x in leaves]
  fetched = iter(jax.device_get([x for x, ok in zip(leaves, local, strict=True) if ok]))
  out = [
    np.asarray(next(fetched))
    if ok
    else np.asarray(multihost_utils.process_allgather(x, tiled=True))
    for x, ok in zip(leaves, local, strict=True)
  ]
  return jax.tree.unflatten(treedef, out)
