"""A Pallas kernel's FLOPs and HBM bytes counted from its body, its grid and its index maps.

The TPU compiler's cost analysis counts about nothing for a custom call, so `aot.roofline` counts
every `pallas_call` of a program's jaxpr here, from what the kernel itself says (`count_kernel`):

- FLOPs: the `dot_general`s of the kernel's body (2 x M x N x K each, from their shapes; a loop in
  the body times its trip count: a scan its length, a `while` once), once per grid step whose
  compute runs. Predicated compute (`pl.when`: a `cond` at the body's top level) is evaluated per
  grid step: the slice of the body that computes the predicate (program ids, grid sizes, the
  prefetched scalars, arithmetic) is run over the whole grid, and each branch counted at the steps
  that take it. A predicate that reads anything else (a block's data) counts its costliest branch
  at every step (`notes` says so); so does a `cond` nested in a branch. Elementwise work (exp,
  max, the masking) is not counted: the FLOPs are matmul FLOPs, as the limits' are.
- HBM bytes: each input's and output's block index map (its jaxpr) is evaluated for every grid
  step, in the grid's order (the last axis fastest), at the prefetched scalars; a block is fetched
  (an output's written back) once per run of steps with the same block index (Pallas's pipeline
  skips the copy when the index repeats between consecutive steps), at its bytes clipped to the
  array's bounds (a last block that the array does not fill moves only its part). The prefetched
  scalars themselves are read once.

The prefetched scalars must be concrete: `aot.roofline` takes them from the program's constants
(splash attention's mask tables) or, for the decode kernel, from its model of the written lengths
(`scalar_sets`: one set per decode step; the counts are their mean). A kernel with a dynamic grid,
an operand outside the pipeline (memory space ANY: manual DMA) or a block dimension of another
kind is not counted here (`count_kernel` returns None; roofline falls back to its formula).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas import core as pallas_core
from jax._src.state import discharge as state_discharge
from jax.extend import core as jax_core

_MAX_POINTS = 1 << 22  # grid steps x scalar sets evaluated at once
_MAX_GRID = 1 << 25  # a larger grid is not walked (None: the formula counts it)


@dataclasses.dataclass
class KernelCount:
  """What `count_kernel` counted for one call: means over the scalar sets."""

  name: str
  flops: float
  bytes: float
  grid_steps: int
  computed_steps: float  # grid steps whose dot-bearing compute runs
  operand_bytes: dict  # bytes moved by operand (its origin, as Pallas names it)
  notes: list = dataclasses.field(default_factory=list)


def sub_jaxprs(value) -> list:
  """The jaxprs inside an equation's parameter (a closed jaxpr, a jaxpr, or a tuple of them)."""
  if isinstance(value, jax_core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jax_core.Jaxpr):
    return [value]
  if isinstance(value, tuple | list):
    return [j for v in value for j in sub_jaxprs(v)]
  return []


def dot_flops(jaxpr: jax_core.Jaxpr, notes: list | None = None) -> float:
  """Matmul FLOPs of `jaxpr` and what it nests: a scan its length, a `while` once (noted), a
  `cond` its costliest branch."""
  return sum(_eqn_flops(eqn, notes) for eqn in jaxpr.eqns)


def _eqn_flops(eqn, notes: list | None = None) -> float:
  name = eqn.primitive.name
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
  if name == "cond":
    return max(dot_flops(j, notes) for j in sub_jaxprs(eqn.params["branches"]))
  subs = [j for v in eqn.params.values() for j in sub_jaxprs(v)]
  trips = eqn.params.get("length", 1) if name == "scan" else 1
  flops = trips * sum(dot_flops(j, notes) for j in subs)
  if name == "while" and notes is not None and flops:
    notes.append("a while loop with matmuls in the kernel's body: counted once")
  return flops


def _block_dims(bm) -> list[tuple[str, int]] | None:
  """`(kind, size)` per dimension of a block mapping: 'block' (index x size), 'element' (the
  index is the start) or 'squeezed' (size 1); None for another kind."""
  dims = []
  for b in bm.block_shape:
    if b is None or isinstance(b, pallas_core.Squeezed):
      dims.append(("squeezed", 1))
    elif isinstance(b, pallas_core.Blocked):
      dims.append(("block", int(b.block_size)))
    elif isinstance(b, pallas_core.Element):
      dims.append(("element", int(b.block_size)))
    elif isinstance(b, int):
      dims.append(("block", b))
    else:
      return None
  return dims


def _in_pipeline(bm) -> bool:
  space = getattr(bm.transformed_block_aval, "memory_space", None)
  return "ANY" not in str(space).upper() and "HBM" not in str(space).upper()


def _on_grid(fn, ids: Sequence[np.ndarray], sets: list, part: slice) -> list[np.ndarray]:
  """`fn(*ids, *scalars)` (a tuple of scalars) at every grid step (`ids`: each `[N]`) and each
  scalar set of `sets[part]`: its outputs, each `[M, N]`."""
  m, n = part.stop - part.start, ids[0].size
  num_ids, num_scalars = len(ids), len(sets[0])
  inner = jax.vmap(fn, in_axes=(0,) * num_ids + (None,) * num_scalars)
  if num_scalars:
    scalars = [np.stack([s[k] for s in sets[part]]) for k in range(num_scalars)]
    outs = jax.vmap(inner, in_axes=(None,) * num_ids + (0,) * num_scalars)(*ids, *scalars)
  else:
    outs = [np.asarray(o)[None] for o in inner(*ids)]
  return [np.broadcast_to(np.asarray(o), (m, n)) for o in outs]


def _chunks(num_sets: int, steps: int) -> list[slice]:
  size = max(1, _MAX_POINTS // max(steps, 1))
  return [slice(s, min(s + size, num_sets)) for s in range(0, num_sets, size)]


def _block_bytes(bm, dims, idx: np.ndarray) -> np.ndarray:
  """Bytes of the blocks at block indices `idx [..., ndim]`, clipped to the array's bounds."""
  shape = bm.array_aval.shape
  size = np.ones(idx.shape[:-1], np.int64)
  for d, ((kind, n), full) in enumerate(zip(dims, shape, strict=True)):
    start = idx[..., d].astype(np.int64) * (n if kind == "block" else 1)
    size *= np.clip(np.minimum(n, full - start), 0, None)
  return size * bm.array_aval.dtype.itemsize


def _moved_bytes(bm, dims, ids: Sequence[np.ndarray], sets: list) -> np.ndarray:
  """Bytes a block mapping moves over the grid, per scalar set `[M]` (module docstring)."""
  closed = state_discharge.discharge_state(bm.index_map_jaxpr)
  fn = jax_core.jaxpr_as_fun(closed)
  out = len(bm.block_shape)
  totals = []
  for part in _chunks(len(sets), ids[0].size):
    idx = np.stack(_on_grid(lambda *a: tuple(fn(*a)[:out]), ids, sets, part), axis=-1)
    starts = np.ones(idx.shape[:2], bool)
    starts[:, 1:] = np.any(idx[:, 1:] != idx[:, :-1], axis=-1)
    totals.append(np.where(starts, _block_bytes(bm, dims, idx), 0).sum(axis=1))
  return np.concatenate(totals).astype(np.float64)


def _slice_eval(jaxpr: jax_core.Jaxpr, target, allowed: set, grid, body_axes):
  """A function `(*ids, *scalars) -> value of target` running the eqns of `jaxpr` that compute
  `target` from the grid position and the prefetched scalars (`allowed`: the jaxpr's invars for
  them, in order); None when `target` needs anything else."""
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  needed, stack, seen = [], [target], set()
  while stack:
    v = stack.pop()
    if isinstance(v, jax_core.Literal) or v in seen or v in allowed:
      continue
    seen.add(v)
    eqn = producers.get(v)
    if eqn is None or eqn.effects:
      return None
    needed.append(eqn)
    stack.extend(eqn.invars)
  order = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  needed = sorted({id(e): e for e in needed}.values(), key=lambda e: order[id(e)])
  scalars_in = [v for v in jaxpr.invars if v in allowed]

  def fn(*args):
    ids, scalars = args[: len(grid)], args[len(grid) :]
    env = dict(zip(scalars_in, scalars, strict=True))
    # Literals as plain arrays: jax shares a literal's value between traces, typed in the abstract
    # mesh of the trace that made it, which a kernel traced over another mesh cannot mix with
    # (a split slice's two programs).
    read = lambda v: np.asarray(v.val) if isinstance(v, jax_core.Literal) else env[v]
    for eqn in needed:
      name = eqn.primitive.name
      if name == "program_id":
        outs = [ids[body_axes[eqn.params["axis"]]]]
      elif name == "num_programs":
        outs = [jnp.int32(grid[body_axes[eqn.params["axis"]]])]
      else:
        outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs, strict=True))
    return read(target)

  return fn


def count_kernel(eqn, scalar_sets: Sequence[Sequence[np.ndarray]]) -> KernelCount | None:
  """FLOPs and HBM bytes of one `pallas_call` equation (module docstring), the mean over
  `scalar_sets` (each: the concrete values of its prefetched scalar operands, in order; `[()]`
  for a kernel without). None when it cannot be counted from its body."""
  params = eqn.params
  gm = params["grid_mapping"]
  name = str(params.get("name", "?"))
  grid = tuple(gm.grid)
  if not all(isinstance(g, int) for g in grid) or gm.num_dynamic_grid_bounds:
    return None
  steps = math.prod(grid)
  if steps > _MAX_GRID or (steps == 0):
    return None
  sets = [tuple(np.asarray(s) for s in ss) for ss in scalar_sets] or [()]
  if any(len(s) != gm.num_index_operands for s in sets):
    return None
  dims = [_block_dims(bm) for bm in gm.block_mappings]
  if any(d is None for d in dims) or not all(_in_pipeline(bm) for bm in gm.block_mappings):
    return None
  notes: list[str] = []
  ids = [a.reshape(-1) for a in np.indices(grid, dtype=np.int32)]
  # Bytes: each operand's distinct consecutive blocks.
  moved = {}
  for bm, d in zip(gm.block_mappings, dims, strict=True):
    moved[str(bm.origin)] = _moved_bytes(bm, d, ids, sets)
  scalar_bytes = sum(float(np.asarray(s).nbytes) for s in sets[0])
  total_bytes = sum(moved.values()) + scalar_bytes
  # FLOPs: the body's unconditional matmuls at every step, each top-level cond's branches at the
  # steps that take them.
  body = params["jaxpr"]
  body = body if isinstance(body, jax_core.ClosedJaxpr) else jax_core.ClosedJaxpr(body, ())
  n_idx = gm.num_index_operands
  try:
    should = [i < n_idx for i in range(len(body.jaxpr.invars))]
    with pallas_core.tracing_grid_env(grid, gm.vmapped_dims):  # program_id traces in a grid
      discharged = state_discharge.discharge_state(body, should_discharge=should).jaxpr
    allowed = set(discharged.invars[:n_idx])
  except Exception as e:  # noqa: BLE001 - a body discharge cannot take: predicates unevaluated
    notes.append(f"body not discharged ({type(e).__name__}): every branch at its costliest")
    discharged, allowed = body.jaxpr, set()
  body_axes = [a for a in range(len(grid)) if a not in gm.vmapped_dims]
  per_set_flops = np.zeros(len(sets))
  runs_any = np.zeros((len(sets), steps), bool)
  uncond = 0.0
  for e in discharged.eqns:
    if e.primitive.name != "cond":
      uncond += _eqn_flops(e, notes)
      continue
    branches = [dot_flops(j, notes) for j in sub_jaxprs(e.params["branches"])]
    if max(branches) == 0:
      continue
    fn = _slice_eval(discharged, e.invars[0], allowed, grid, body_axes)
    if fn is None:
      notes.append("a predicate not from the grid and scalars: its costliest branch always")
      per_set_flops += steps * max(branches)
      runs_any[:] = True
      continue
    as_index = lambda *a, fn=fn: (jnp.asarray(fn(*a), jnp.int32),)
    for part in _chunks(len(sets), steps):
      (index,) = _on_grid(as_index, ids, sets, part)
      index = np.clip(index, 0, len(branches) - 1)
      per_set_flops[part] += np.asarray(branches)[index].sum(axis=1)
      runs_any[part] |= np.asarray(branches)[index] > 0
  if uncond:
    runs_any[:] = True
  flops = float(np.mean(per_set_flops + steps * uncond))
  return KernelCount(
    name=name,
    flops=flops,
    bytes=float(np.mean(total_bytes)),
    grid_steps=steps,
    computed_steps=float(runs_any.sum(axis=1).mean()),
    operand_bytes={k: float(np.mean(v)) for k, v in moved.items()},
    notes=sorted(set(notes)),
  )


# ----------------------------------------------------------------------------- known scalars
# What a kernel's prefetched scalars are when the program holds them as constants (splash's mask
# tables): followed through calls, scans, loops and shard_map, small integer arithmetic folded.


_FOLD_ELEMENTS = 1 << 20  # integer constants up to this size are folded (splash's mask tables)


def known_value(known: dict, atom):
  if isinstance(atom, jax_core.Literal):
    return np.asarray(atom.val)
  return known.get(atom)


def _foldable(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None or math.prod(getattr(aval, "shape", ())) > _FOLD_ELEMENTS:
    return False
  return bool(jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_)


def known_consts(known: dict, closed) -> None:
  """A closed jaxpr's integer constants (splash's mask tables) are known."""
  if isinstance(closed, jax_core.ClosedJaxpr):
    for var, const in zip(closed.jaxpr.constvars, closed.consts, strict=True):
      if var not in known and _foldable(var.aval):
        known[var] = np.asarray(const)


def pass_known(known: dict, inner: Sequence, outer: Sequence) -> None:
  """Inner jaxpr variables take the known values of the outer atoms bound to them."""
  for i, o in zip(inner, outer, strict=False):
    value = known_value(known, o)
    if value is not None:
      known[i] = value


def _replicated(spec) -> bool:
  return spec is None or all(p is None for p in tuple(spec))


def inner_bindings(eqn) -> list[tuple[object, Sequence, bool]]:
  """`(sub jaxpr, the outer atoms bound to its invars in order, outputs 1:1 to the eqn's)` for a
  call-like equation: what the constant propagation follows."""
  name, p, ins = eqn.primitive.name, eqn.params, list(eqn.invars)
  if name == "pallas_call":  # its body's refs are not the operands: `aot.kernels` reads them
    return []
  if name == "scan":
    n = p["num_consts"]
    return [(p["jaxpr"], ins[:n], False)]
  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    return [(p["cond_jaxpr"], ins[:cn], False), (p["body_jaxpr"], ins[cn : cn + bn], False)]
  if name == "cond":
    return [(b, ins[1:], False) for b in p["branches"]]
  if name == "shard_map":
    specs = p.get("in_specs") or (None,) * len(ins)
    outer = [v if _replicated(s) else None for v, s in zip(ins, specs, strict=False)]
    return [(p["jaxpr"], outer, False)]
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = p.get(key)
    inner = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
    if isinstance(inner, jax_core.Jaxpr) and len(inner.invars) == len(ins):
      return [(sub, ins, len(inner.outvars) == len(eqn.outvars))]
  return []


def fold(known: dict, eqn) -> None:
  """Evaluates an integer equation whose inputs are all known (constants of the program)."""
  if not eqn.invars or eqn.effects or any(sub_jaxprs(v) for v in eqn.params.values()):
    return
  values = [known_value(known, v) for v in eqn.invars]
  if any(v is None for v in values):
    return
  if not all(_foldable(out.aval) for out in eqn.outvars):
    return
  try:
    outs = eqn.primitive.bind(*values, **eqn.params)
  except Exception:  # noqa: BLE001 - not foldable here: left unknown
    return
  outs = outs if eqn.primitive.multiple_results else [outs]
  for var, value in zip(eqn.outvars, outs, strict=True):
    known[var] = np.asarray(value)
