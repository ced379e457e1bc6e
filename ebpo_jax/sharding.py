"""Device mesh over ('data', 'fsdp', 'tensor') and the logical-axis rules that place arrays on it.

Parameters carry logical axis names (`nn.with_logical_partitioning`); `DEFAULT_RULES` maps each name
to mesh axes. A dimension that its mesh axes do not divide evenly (say 3 KV heads over tensor=2) is
replicated along that dimension rather than refused, so one rule set serves every model size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
ROW_AXES = ("data", "fsdp")  # what rows (the "batch" axis) split over
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: Rules = (
  ("batch", ROW_AXES),
  ("layers", None),
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("expert", None),  # a MoE block's experts (models.moe): each device holds all of them
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("length", None),
)


def mesh_shape(shape: dict[str, int], num_devices: int) -> dict[str, int]:
  """Every axis's size for `num_devices` devices: absent axes get 1, one size may be -1 (the
  remaining devices). Raises ValueError naming the mesh when the sizes do not fit."""
  shape = {k: v for k, v in shape.items() if k != ROLLOUT_DEVICES}
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


# config.mesh's key for the sampler's own devices (0: the sampler shares the trainer's mesh).
ROLLOUT_DEVICES = "rollout_devices"


def make_meshes(
  shape: dict[str, int], devices: Sequence[jax.Device] | None = None
) -> tuple[Mesh, Mesh | None]:
  """(the trainer's mesh, the sampler's or None) of `config.mesh` over `devices` (default: all):
  with `rollout_devices` = r > 0 the last r devices are the sampler's, rows over 'data' and
  'tensor' kept where it divides r (its weights replicated over the rows), and the trainer's mesh
  is `shape` over the others."""
  devices = list(jax.devices() if devices is None else devices)
  r = int(shape.get(ROLLOUT_DEVICES, 0))
  if not 0 <= r < len(devices):
    raise ValueError(f"mesh.{ROLLOUT_DEVICES}={r}: must lie in [0, {len(devices)})")
  if r == 0:
    return make_mesh(shape, devices), None
  tensor = int(shape.get("tensor", 1))
  rollout_shape = {"data": -1, "tensor": tensor if r % tensor == 0 else 1}
  return make_mesh(shape, devices[:-r]), make_mesh(rollout_shape, devices[-r:])


def to_mesh(tree: Any, mesh: Mesh, *, rows: bool = False) -> Any:
  """`tree`'s arrays on `mesh` (an array already on it is kept) with their own PartitionSpecs, or
  with `rows` their rows over its batch axes (`row_sharding`): the weights from the trainer's
  devices to the sampler's, a batch back. Explicit transfers (allowed under the loop's transfer
  guard)."""

  def moved(x):
    if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
      return x
    if x.sharding.mesh == mesh:
      return x
    spec = row_sharding(x.shape, mesh) if rows else NamedSharding(mesh, x.sharding.spec)
    return jax.device_put(x, spec)

  return jax.tree.map(moved, tree)


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
    return replicated(mesh)

  return jax.tree.map(leaf_sharding, abstract_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device of `mesh` holds the whole array."""
  return NamedSharding(mesh, PartitionSpec())


def row_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
  """Rows (the leading dimension) over the batch axes that divide them, the rest replicated."""
  return NamedSharding(mesh, logical_to_spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh))


def place_rows(value: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host array placed with its rows over the mesh's batch axes (`row_sharding`)."""
  return place_from_host(value, row_sharding(value.shape, mesh))


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
