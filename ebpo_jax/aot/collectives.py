"""The collectives of a compiled program's HLO text, per chip (`aot.roofline`'s part 3).

Every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (the `-start` of an
async pair), times the trip counts of the while loops around it (`known_trip_count`, or the bound
of the condition's `i < N`; else 1), with the bytes a chip sends over a ring of the op's group of n:
all-reduce 2 (n-1)/n of its payload, all-gather and all-to-all (n-1)/n of the result,
reduce-scatter (n-1) x its result, a permute its payload.
"""

from __future__ import annotations

import math
import re

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}
_CALLS = re.compile(r"\b(?:body|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _array_bytes(shape_text: str) -> list[int]:
  out = []
  for dtype, dims in _ARRAY.findall(shape_text):
    bits = 8 if dtype.startswith("f8") else _BITS.get(dtype) or int(dtype[1:])
    out.append(math.prod(int(x) for x in dims.split(",") if x) * bits // 8)
  return out


def _group_size(line: str, default: int) -> int:
  """The size of each of the op's groups: iota (`[groups,size]<=[n]`), mesh axes
  (`mesh['a'=1,'b'=4] {'b'}`) or listed (`{{0,1},{2,3}}`) replica groups; none: all devices."""
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota[2])
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if mesh:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh[1])}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", mesh[2]))
  listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
  return len(listed[1].split(",")) if listed else default


def _payload(kind: str, sizes: list[int], asynchronous: bool) -> int:
  """An op's bytes from the arrays of its result: all of them (several operands reduced at once),
  but of an async start's `(operand, result, ...)` the result (a reduce-scatter's: the smaller)."""
  if not asynchronous or kind == "all-reduce":
    return sum(sizes)
  return min(sizes) if kind == "reduce-scatter" else max(sizes)


def _sent_bytes(kind: str, payload: int, n: int) -> float:
  if n <= 1:
    return 0.0
  share = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "collective-permute": 1.0}
  return payload * share.get(kind, (n - 1) / n)


def _while_trips(line: str, bodies: dict[str, list[str]]) -> int:
  """A while op's trip count: XLA's `known_trip_count`, else the N of its condition's `i < N`
  against a constant (the TPU compiler's text of a scan: i counts from 0), else 1."""
  known = _TRIPS.search(line)
  if known:
    return int(known[1])
  condition = re.search(r"condition=%?([\w.\-]+)", line)
  cond = bodies.get(condition[1], []) if condition else []
  constants = [re.search(r"s32\[\][^=]*constant\((\d+)\)", c) for c in cond]
  bounds = [int(c[1]) for c in constants if c]
  compares = [c for c in cond if "compare(" in c and "direction=LT" in c]
  return bounds[0] if len(bounds) == 1 and len(compares) == 1 else 1


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """The HLO module's computations (name -> instruction lines) and the entry's name."""
  bodies: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s*\(", line)  # at column 0; instructions indent
    if header and line.rstrip().endswith("{"):
      name = header[2]
      entry = name if header[1] else entry
      bodies[name] = []
    elif name is not None:
      bodies[name].append(line)
  return bodies, entry


class _Collectives:
  """Per computation, per collective kind: `[count, bytes sent per chip, largest payload]` in one
  run of it, the ops of the loops it calls weighted by their trip counts (module docstring)."""

  def __init__(self, hlo_text: str, num_devices: int):
    self.bodies, self.entry = _computations(hlo_text)
    self.num_devices = num_devices
    self.memo: dict[str, dict[str, list[float]]] = {}

  def total(self, comp: str) -> dict[str, list[float]]:
    if comp in self.memo:
      return self.memo[comp]
    self.memo[comp] = sums = {}
    for line in self.bodies.get(comp, []):
      op = _OP.search(line)
      if op:
        kind, sizes = op[2], _array_bytes(op[1]) or [0]
        payload = _payload(kind, sizes, asynchronous=bool(op[3]))
        sent = _sent_bytes(kind, payload, _group_size(line, self.num_devices))
        _accumulate(sums, kind, 1, sent, payload)
      mult = _while_trips(line, self.bodies) if " while(" in line else 1
      for called in _CALLS.findall(line):
        for child in (c.strip().lstrip("%") for c in called.split(",")):
          for kind, (count, sent, largest) in self.total(child).items():
            _accumulate(sums, kind, mult * count, mult * sent, largest)
    return sums


def _accumulate(sums: dict, kind: str, count: float, sent: float, payload: float) -> None:
  acc = sums.setdefault(kind, [0.0, 0.0, 0.0])
  acc[0], acc[1], acc[2] = acc[0] + count, acc[1] + sent, max(acc[2], payload)


def _as_report(sums: dict[str, list[float]]) -> dict[str, dict[str, float]]:
  return {k: {"count": c, "bytes": b, "largest": m} for k, (c, b, m) in sorted(sums.items())}


def collectives(hlo_text: str, num_devices: int) -> dict[str, dict[str, float]]:
  """Per collective kind, `count`, `bytes` (sent per chip) and `largest` (the largest op's
  payload) in one run of the compiled module, the ops inside while loops weighted by their trip
  counts (module docstring)."""
  found = _Collectives(hlo_text, num_devices)
  return _as_report(found.total(found.entry)) if found.entry else {}


def collective_shapes(hlo_text: str) -> list[dict]:
  """Every collective op of the module's text (each once, loops not weighted): its kind and the
  element counts of the arrays of its result (an async start's `(operand, result)` both)."""
  found = []
  for line in hlo_text.splitlines():
    op = _OP.search(line)
    if op:
      elements = [
        math.prod(int(x) for x in dims.split(",") if x) for _, dims in _ARRAY.findall(op[1])
      ]
      found.append({"kind": op[2], "elements": elements, "shape": op[1].strip()})
  return found


def outer_loop_collectives(hlo_text: str, num_devices: int) -> list[dict[str, dict[str, float]]]:
  """`collectives` of one trip of each outermost `while` of the program (those whose op name is
  `jit(<fn>)/while`: a `lax.while_loop` in the jitted function's own body, such as the sampler's
  decode loop and its compacting stages), in program order: what one decode step sends."""
  found = _Collectives(hlo_text, num_devices)
  outer = re.compile(r'body=%?([\w.\-]+).*op_name="jit\([^)/]*\)/while"')
  loops = []
  for lines in found.bodies.values():
    for line in lines:
      match = outer.search(line) if " while(" in line else None
      if match:
        loops.append(_as_report(found.total(match[1])))
  return loops
