"""What a compiled program costs per TPU chip: FLOPs, HBM bytes, collectives, and its roofline.

The compiler's `cost_analysis()` counts the body of a loop once, whatever its trip count (the layers
under `nn.scan`, the micro-batches, the decode `while_loop`), and about nothing for a custom call
(a Pallas kernel). The method, in three parts:

1. Loops. The FLOPs (2 x M x N x K) and operand bytes of every `dot_general` in the program's jaxpr
   are summed once with each loop body counted once, as the compiler counts (an unrolled scan's body
   once per copy), and once weighted by trip counts (a scan its length; each `while` the trip count
   given in program order; a `cond` its costliest branch). The compiler's FLOPs are scaled by the
   first ratio, its bytes by the second (`loop_factor_*`). This assumes the compiler's count is
   spread over the program like the dots are: close for FLOPs (matmuls are nearly all of them),
   but not always: on the paper's Qwen3-8B train step it gave 26% under the jaxpr's own matmuls
   (their global count / chips). The report's FLOPs are the larger of the two, plus the kernels:
   never under what the program's matmuls need.
2. Kernels. Every `pallas_call` in the jaxpr is counted from its body instead (`aot.kernels`: the
   body's matmuls at each grid step whose compute runs, `pl.when` evaluated per step; the HBM bytes
   of the distinct consecutive blocks its index maps address over the grid), weighted by the trip
   counts around it, and added. The index maps and predicates need the prefetched scalars: for
   splash attention (`models.attention`) its mask tables, constants of the program (followed
   through calls, scans' and loops' constants, shard_map's replicated operands, and integer
   arithmetic on them); for the decode kernel (`models.decode_attention`, prefetched `[written,
   layer]`) the written lengths of the decode loop's steps (`decode_lengths`; aot's sampler:
   `P + t` at step t = 1 .. N - 1 after a prompt bucket of P), each call counted at their mean,
   else at the whole cache. A kernel whose body cannot be counted (scalars not known, a dynamic
   grid, manual DMA) falls back to its hand formula below (`modelled_*`), one of another name
   without a formula is listed in `uncounted_kernels`; `kernel_notes` says which and why.
   The hand formulas stay as the cross-check (`formula_*`: their count of the body-counted
   kernels; tests compare the two). Splash runs causal masks with the queries the last of the keys,
   in blocks (`attention.block_size` of the padded lengths): of the `Tq/bq x Tk/bkv` blocks per q
   head it computes those with any allowed pair (block (i, j) when `j bkv <= (i + 1) bq - 1 + Tk -
   Tq`), each `c x bq x bkv x D` FLOPs with c = 4 for the forward (QK^T, PV), 6 for the dq kernel
   (QK^T, dO V^T, dS K) and 8 for the dkv kernel (QK^T, P^T dO, dO V^T, dS^T Q). Its HBM bytes:
   the query-side blocks (q, o, dO, dq: per q head, read or written once) plus one key-side block
   pair (k and v, or q and dO for dkv) per computed block (dkv: also k and v read, dk and dv
   written, per q head); the body count adds what these leave out (segment ids, the forward's
   log-sum-exp residual). The decode kernel reads, per row and kv head, the blocks of `bkv` slots
   up to the written length w (at most S): `r(w) = min(ceil(w / bkv) bkv, S)` slots of keys,
   values and the slot mask (int32; fetched again for each kv head), and computes `4 x G x D x
   r(w)` FLOPs over its G query heads; plus the queries read and the float32 outputs written once.
   Each ratio of the report says which share of its numerator the compiler measured
   (`compiler`), the jaxpr's own matmuls gave (`jaxpr_dots`, where they replace the compiler's
   count), kernel bodies counted (`kernel_bodies`) and formulas modelled (`modelled`):
   `*_shares`, from `flops_sources` and `bytes_sources`.
3. Collectives (`aot.collectives`). Every all-reduce, all-gather, reduce-scatter,
   all-to-all and collective-permute in the compiled HLO (the `-start` of an async pair), times the
   trip counts of the while loops around it (`known_trip_count`, or the bound of the condition's `i
   < N`; else 1; a conditional's branches all counted, an upper bound; the TPU compiler's
   all-reduce-scatter fusions as the all-reduce inside them, up to twice the reduce-scatter's
   bytes), with the bytes a chip sends over a ring of the op's group of n: all-reduce 2 (n-1)/n of
   its payload, all-gather and all-to-all (n-1)/n of the result, reduce-scatter (n-1) x its result,
   a permute its payload.

Per program: `compute_s` = FLOPs / peak, `hbm_s` = bytes / HBM bandwidth, `collective_s` = bytes
sent / the chip's ICI bandwidth, `roofline_s` the largest of the three (collectives overlap
compute on TPU), and `roofline_to_compute` = roofline_s / compute_s.

4. The limit, from the model's shapes alone (`train_step_limit`): what the train step must compute
   whatever the program does, to judge the program by (a roofline can equal its own compute time
   and still be slow when the program computes more than it needs). Each prompt runs once per group
   (B x (P + G x R) tokens), every matmul parameter once per token but the LM head (at the B x G x R
   completion tokens only), causal attention over the (query, key) pairs that the shared-prefix
   layout allows (P (P + 1) / 2 + G (P R + R (R + 1) / 2) per group) at 4 x heads x head_dim FLOPs
   a pair and layer; times the passes the config makes (`train_step_passes`; the paper's recipe:
   forward, remat, backward 2, reference = 5; the head 4, not rematerialised).
   `roofline_to_limit` = roofline_s / limit_s.
5. The sampler's limit (`sampler_limit_bytes`): decoding is bandwidth-bound, so its limit is the
   HBM bytes a call must move: every decode step reads each weight once at the compute dtype (its
   chip's share: weights split over 'tensor') and the keys and values written so far, not the
   empty slots. A compiler counts a loop's body once, so the sampler is costed in parts
   (`combine`): its prefill, plus the decode loop's trips x one step compiled alone
   (`sampling.trace_parts`), each with its own cost analysis, kernels and collectives.
   `roofline_to_limit` = roofline_s / limit_s; `bytes_to_limit` = bytes / limit bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
from jax.extend import core as jax_core

from ebpo_jax.aot import collectives, formulas, kernels
from ebpo_jax.aot.topology import Chip
from ebpo_jax.models import decode_attention

_KERNEL_FIELDS = (
  "kernel_flops", "kernel_bytes", "counted_flops", "counted_bytes", "modelled_flops",
  "modelled_bytes", "formula_flops", "formula_bytes",
)  # fmt: skip


@dataclasses.dataclass
class DotCount:
  """FLOPs and operand bytes of a jaxpr's `dot_general`s and grouped matmuls (`ragged_dot`), loop
  bodies counted once (`*_once`, as the compiler's cost analysis counts them) and weighted by
  their trip counts; and its kernels' FLOPs and bytes, weighted by trip counts: `kernel_*` in all,
  of which `counted_*` from the kernels' bodies (`aot.kernels`) and `modelled_*` from the hand
  formulas (a kernel whose body could not be counted); `formula_*`: the formulas' count of the
  body-counted kernels, the cross-check (0 where a kernel has no formula)."""

  flops_once: float = 0.0
  flops: float = 0.0
  bytes_once: float = 0.0
  bytes: float = 0.0
  kernel_flops: float = 0.0
  kernel_bytes: float = 0.0
  counted_flops: float = 0.0
  counted_bytes: float = 0.0
  modelled_flops: float = 0.0
  modelled_bytes: float = 0.0
  formula_flops: float = 0.0
  formula_bytes: float = 0.0
  kernels: int = 0
  uncounted_kernels: list = dataclasses.field(default_factory=list)
  kernel_notes: list = dataclasses.field(default_factory=list)
  kernel_steps: list = dataclasses.field(default_factory=list)  # per body-counted call

  def add(self, other: DotCount, trips: float, copies: int = 1) -> None:
    """Adds `other`, a body that runs `trips` times and appears `copies` times in the compiled
    program (an unrolled scan's body: the compiler counts each copy)."""
    self.flops_once += copies * other.flops_once
    self.bytes_once += copies * other.bytes_once
    self.flops += trips * other.flops
    self.bytes += trips * other.bytes
    for field in _KERNEL_FIELDS:
      setattr(self, field, getattr(self, field) + trips * getattr(other, field))
    self.kernels += copies * other.kernels
    for mine, theirs in (
      (self.uncounted_kernels, other.uncounted_kernels),
      (self.kernel_notes, other.kernel_notes),
    ):
      mine += [k for k in theirs if k not in mine]
    self.kernel_steps += other.kernel_steps


def _nbytes(aval) -> int:
  return math.prod(aval.shape) * aval.dtype.itemsize


def count_dots(
  jaxpr: jax_core.Jaxpr | jax_core.ClosedJaxpr,
  while_trips: int | Sequence[int],
  attention_block: int = 512,
  decode_lengths: Sequence[int] = (),
) -> DotCount:
  """`DotCount` of `jaxpr` and everything nested in it. A `while` body runs `while_trips` times;
  with a sequence, the k-th while loop met in program order runs `while_trips[k]` times (0 after
  the sequence ends). Each kernel is counted from its body (`aot.kernels`) at its prefetched
  scalars: constants of the program (a `ClosedJaxpr`'s consts and literals, followed through
  calls, loops' constants and integer arithmetic on them), or for the decode kernel its written
  length at each of `decode_lengths` (the written slots of each decode step, their mean; none: the
  whole cache); else from its hand formula with blocks of at most `attention_block` (module
  docstring)."""
  trips = itertools.repeat(while_trips) if isinstance(while_trips, int) else None
  trips = trips or itertools.chain(while_trips, itertools.repeat(0))
  known: dict = {}
  if isinstance(jaxpr, jax_core.ClosedJaxpr):
    kernels.known_consts(known, jaxpr)
    jaxpr = jaxpr.jaxpr
  kernel = functools.partial(_kernel_count, block=attention_block, lengths=tuple(decode_lengths))
  return _count_dots(jaxpr, trips, kernel, known)


def _ragged_dot_flops(eqn) -> float:
  """2 M K N of a grouped matmul (forward, or either gradient): every lhs element meets each of
  the rhs's free columns once (rhs dims neither contracted, batched nor the group's); the bytes
  count every group's weights, read or not."""
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
  bound = {*rhs_contract, *rhs_batch, *numbers.rhs_group_dimensions}
  rhs = eqn.invars[1].aval.shape
  free = math.prod(size for d, size in enumerate(rhs) if d not in bound)
  return 2.0 * math.prod(eqn.invars[0].aval.shape) * free


def _count_dots(jaxpr: jax_core.Jaxpr, while_trips: Iterator[int], kernel, known: dict) -> DotCount:
  total = DotCount()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    bindings = kernels.inner_bindings(eqn)
    for sub, outer, _ in bindings:
      kernels.known_consts(known, sub)
      inner = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
      kernels.pass_known(known, inner.invars, outer)
    if name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval
      k = math.prod(lhs.shape[d] for d in lhs_contract)
      flops = 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
      nbytes = float(sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars)))
      total.add(DotCount(flops, flops, nbytes, nbytes), 1)
    elif name == "ragged_dot_general":  # a MoE block's grouped matmuls (models.moe)
      flops = _ragged_dot_flops(eqn)
      nbytes = float(sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars)))
      total.add(DotCount(flops, flops, nbytes, nbytes), 1)
    elif name == "pallas_call":  # its body is the kernel's, not run once: `aot.kernels`
      total.add(kernel(eqn, known), 1)
    elif name == "cond":  # one branch runs: the costliest
      branches = [
        _count_dots(j, while_trips, kernel, known)
        for j in kernels.sub_jaxprs(eqn.params["branches"])
      ]
      total.add(max(branches, key=lambda c: c.flops + c.kernel_flops), 1)
    else:
      trips = {"scan": eqn.params.get("length", 1)}.get(name, 1)
      if name == "while":
        trips = next(while_trips)
      copies = min(int(eqn.params.get("unroll", 1)), trips) if name == "scan" else 1
      for value in eqn.params.values():
        for sub in kernels.sub_jaxprs(value):
          total.add(_count_dots(sub, while_trips, kernel, known), trips, copies)
      if not bindings:
        kernels.fold(known, eqn)
    for sub, _, outputs in bindings:  # a call's known results (a constant passed through)
      if outputs:
        inner = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
        kernels.pass_known(known, eqn.outvars, inner.outvars)
  return total


def _scalar_sets(eqn, known: dict, lengths: tuple[int, ...]) -> list | None:
  """The concrete prefetched scalars of a kernel's call: its operands' known values (one set), or
  for the decode kernel (prefetched `[written, layer]`) one set per written length (none: the
  whole cache; the layer's index does not change what a call moves); else None."""
  gm = eqn.params["grid_mapping"]
  operands = eqn.invars[gm.num_dynamic_grid_bounds :]
  values = [kernels.known_value(known, v) for v in operands[: gm.num_index_operands]]
  if all(v is not None for v in values):
    return [values]
  if str(eqn.params.get("name")) == decode_attention.NAME and gm.num_index_operands == 1:
    slots = operands[2].aval.shape[-2]  # the stacked keys [L, B, Hkv, S, D]
    return [[np.array([w, 0], np.int32)] for w in (lengths or (slots,))]
  return None


def _kernel_count(eqn, known: dict, block: int, lengths: tuple[int, ...]) -> DotCount:
  name = str(eqn.params.get("name", "?"))
  formula = formulas.of_call(eqn, block, lengths)
  sets = _scalar_sets(eqn, known, lengths)
  counted = kernels.count_kernel(eqn, sets) if sets is not None else None
  if counted is not None:
    notes = [f"{name}: {n}" for n in counted.notes]
    return DotCount(
      kernel_flops=counted.flops,
      kernel_bytes=counted.bytes,
      counted_flops=counted.flops,
      counted_bytes=counted.bytes,
      formula_flops=formula[0] if formula else 0.0,
      formula_bytes=formula[1] if formula else 0.0,
      kernels=1,
      kernel_notes=notes,
      kernel_steps=[
        {
          "name": name,
          "grid_steps": counted.grid_steps,
          "computed_steps": counted.computed_steps,
        }
      ],
    )
  why = "prefetched scalars not known" if sets is None else "its body could not be counted"
  if formula is None:
    return DotCount(kernels=1, uncounted_kernels=[name], kernel_notes=[f"{name}: {why}"])
  return DotCount(
    kernel_flops=formula[0],
    kernel_bytes=formula[1],
    modelled_flops=formula[0],
    modelled_bytes=formula[1],
    kernels=1,
    kernel_notes=[f"{name}: {why}: modelled by its formula"],
  )


# ----------------------------------------------------------------------------- the limit


def matmul_params(config) -> tuple[int, int]:
  """`(per token, LM head)` matmul parameters of a decoder `ModelConfig`: the layers' projections,
  and the head's (the embedding lookup is no matmul)."""
  d, hd = config.hidden_size, config.head_dim
  heads, kv_heads = config.num_heads, config.num_kv_heads
  attention_params = d * (heads + 2 * kv_heads) * hd + heads * hd * d
  per_layer = attention_params + 3 * d * config.intermediate_size
  return config.num_layers * per_layer, d * config.vocab_size


def train_step_passes(
  *, remat: str, lora: bool, reference: bool, epochs: int = 1
) -> tuple[int, int]:
  """Passes over the batch in forward units, `(layers, LM head)`: per PPO epoch the forward, its
  backward (2 under full fine-tuning: input and weight gradients; 1 under LoRA, the adapters' share
  not counted) and, for the layers, the forward again under `remat="full"` (the head is not
  rematerialised); once, the KL reference's forward (`reference`)."""
  head = epochs * (1 + (1 if lora else 2)) + reference
  return head + epochs * (remat == "full"), head


def train_step_limit(
  config,
  *,
  prompts: int,
  prompt_len: int,
  group_size: int,
  response_len: int,
  passes: tuple[int, int],
) -> float:
  """FLOPs the train step must compute, counted from shapes (module docstring, part 4); `passes`
  as `train_step_passes` gives them."""
  p, g, r = prompt_len, group_size, response_len
  body, head = matmul_params(config)
  pairs = prompts * (p * (p + 1) // 2 + g * (p * r + r * (r + 1) // 2))
  attention_flops = 4 * config.num_heads * config.head_dim * config.num_layers * pairs
  layers = 2 * body * prompts * (p + g * r) + attention_flops
  return float(passes[0] * layers + passes[1] * 2 * head * prompts * g * r)


def sampler_limit_bytes(
  config,
  *,
  prompts: int,
  group_size: int,
  prompt_len: int,
  new_tokens: int,
  row_shards: int,
  weight_shards: int,
  itemsize: int,
) -> float:
  """HBM bytes per chip that one sampler call must move, counted from shapes (module docstring,
  part 5): the prefill reads the weights once and writes the prompts' keys and values; each of the
  `new_tokens - 1` decode steps reads the weights once and the keys and values written so far
  (step t: the prompt bucket + t - 1 drawn, every row running to the cap), at `itemsize` (the
  compute dtype). Weights split over `weight_shards` chips, rows over `row_shards`, key/value
  heads over `weight_shards` where it divides them."""
  body, head = matmul_params(config)
  weights = (body + head) * itemsize / weight_shards
  kv_shards = weight_shards if config.num_kv_heads % weight_shards == 0 else 1
  per_token = 2 * config.num_layers * config.num_kv_heads // kv_shards * config.head_dim * itemsize
  rows = prompts * group_size / row_shards
  steps = new_tokens - 1
  written = steps * prompt_len + steps * (steps - 1) / 2  # step t reads P + t - 1 slots
  prefill = weights + prompts / row_shards * prompt_len * per_token
  return float(prefill + steps * weights + rows * written * per_token)


def combine(parts: Sequence[tuple[float, dict]], chip: Chip) -> dict:
  """The costs (`costs`) of a program run as weighted parts, `[(times it runs, costs), ...]`:
  FLOPs, bytes and collectives summed, the times and roofline recomputed."""
  summed = {k: sum(w * p[k] for w, p in parts) for k in ("flops", "bytes_accessed", "kernel_flops")}
  summed["kernel_bytes"] = sum(w * p["kernel_bytes"] for w, p in parts)
  sources = {
    key: {k: sum(w * p.get(key, {}).get(k, 0.0) for w, p in parts) for k in SOURCES}
    for key in ("flops_sources", "bytes_sources")
  }
  ops: dict[str, dict[str, float]] = {}
  for w, p in parts:
    for kind, op in p["collectives"].items():
      acc = ops.setdefault(kind, {"count": 0.0, "bytes": 0.0, "largest": 0.0})
      acc["count"] += w * op["count"]
      acc["bytes"] += w * op["bytes"]
      acc["largest"] = max(acc["largest"], op.get("largest", 0.0))
  sent = sum(op["bytes"] for op in ops.values())
  notes = sorted({n for _, p in parts for n in p.get("kernel_notes", [])})
  result = {
    **summed,
    **sources,
    "uncounted_kernels": sorted({k for _, p in parts for k in p["uncounted_kernels"]}),
    "kernel_notes": notes,
    "collectives": dict(sorted(ops.items())),
    "collective_bytes": sent,
    **_roofline(summed["flops"], summed["bytes_accessed"], sent, chip),
  }
  result["roofline_shares"] = roofline_shares(result)
  return result


SOURCES = ("compiler", "jaxpr_dots", "kernel_bodies", "modelled")


def shares(sources: dict) -> dict:
  """`sources` (a numerator's parts by where they come from) as fractions of their sum."""
  total = sum(sources.values())
  return {k: (v / total if total else 0.0) for k, v in sources.items()}


def roofline_shares(p: dict) -> dict:
  """Where the numerator of a program's roofline comes from, by its bound: the FLOPs' sources
  when compute-bound, the bytes' when HBM-bound, the compiled HLO's collectives (the compiler's
  program: `compiler`) when ICI-bound."""
  if p["bound"] == "compute":
    return shares(p["flops_sources"])
  if p["bound"] == "HBM":
    return shares(p["bytes_sources"])
  return {k: float(k == "compiler") for k in SOURCES}


def weighted_shares(parts: Sequence[tuple[float, dict]]) -> dict:
  """The shares of a sum of times `[(seconds, shares), ...]`."""
  total = sum(t for t, _ in parts)
  return {k: sum(t * s.get(k, 0.0) for t, s in parts) / total if total else 0.0 for k in SOURCES}


def _roofline(flops: float, nbytes: float, sent: float, chip: Chip) -> dict:
  """The compute-, HBM- and ICI-bound times of a program's counts, its roofline and bound."""
  times = {
    "compute_s": flops / chip.peak_flops,
    "hbm_s": nbytes / chip.hbm_bandwidth,
    "collective_s": sent / chip.ici_bandwidth,
  }
  roofline = max(times.values())
  return {
    **times,
    "roofline_s": roofline,
    "roofline_to_compute": roofline / times["compute_s"] if times["compute_s"] else None,
    "bound": {"compute_s": "compute", "hbm_s": "HBM", "collective_s": "ICI"}[
      max(times, key=times.get)
    ],
  }


def costs(compiled, dots: DotCount, chip: Chip, num_devices: int) -> dict:
  """The report's costs of a compiled program (module docstring)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops_factor = dots.flops / dots.flops_once if dots.flops_once else 1.0
  bytes_factor = dots.bytes / dots.bytes_once if dots.bytes_once else 1.0
  corrected = float(cost.get("flops", 0.0)) * flops_factor
  # Never under the program's own matmuls: the jaxpr's dots are of the global arrays (outside the
  # kernels' shard_map), a chip's share of them at best 1 / num_devices.
  per_chip = dots.flops / num_devices
  flops = max(corrected, per_chip) + dots.kernel_flops
  compiler_bytes = float(cost.get("bytes accessed", 0.0)) * bytes_factor
  nbytes = compiler_bytes + dots.kernel_bytes
  flops_sources = {
    "compiler": corrected if corrected >= per_chip else 0.0,
    "jaxpr_dots": per_chip if per_chip > corrected else 0.0,
    "kernel_bodies": dots.counted_flops,
    "modelled": dots.modelled_flops,
  }
  bytes_sources = {
    "compiler": compiler_bytes,
    "jaxpr_dots": 0.0,
    "kernel_bodies": dots.counted_bytes,
    "modelled": dots.modelled_bytes,
  }
  ops = collectives.collectives(compiled.as_text(), num_devices)
  sent = sum(op["bytes"] for op in ops.values())
  result = {
    "flops": flops,
    "bytes_accessed": nbytes,
    "kernel_flops": dots.kernel_flops,
    "kernel_bytes": dots.kernel_bytes,
    "flops_sources": flops_sources,
    "bytes_sources": bytes_sources,
    "uncounted_kernels": dots.uncounted_kernels,
    "kernel_notes": dots.kernel_notes,
    "flops_counted_once": float(cost.get("flops", 0.0)),
    "flops_compiler_corrected": corrected,
    "dot_flops_per_chip": dots.flops / num_devices,
    "bytes_counted_once": float(cost.get("bytes accessed", 0.0)),
    "loop_factor_flops": flops_factor,
    "loop_factor_bytes": bytes_factor,
    "jaxpr_dots": dataclasses.asdict(dots),
    "collectives": ops,
    "collective_bytes": sent,
    **_roofline(flops, nbytes, sent, chip),
  }
  result["roofline_shares"] = roofline_shares(result)
  return result
