"""The mixture-of-experts block of Qwen3-MoE: a top-k softmax router and SwiGLU experts computed
as grouped matmuls (`jax.lax.ragged_dot` over the tokens sorted by expert).

Routing as in HF's `Qwen3MoeTopKRouter`: router logits x @ W_gate, a float32 softmax over the
experts, the top k probabilities (renormalised to sum to 1 with `norm_topk_prob`), cast back to
the compute dtype; each token's output is the weighted sum of its k experts' SwiGLU MLPs. The
experts' weights are stacked, `[E, in, out]`, under the logical axis "expert".

Each block sows its `RouterStats` (collection "intermediates", `STATS`) over the valid tokens; the
train step collects them (`collect`) into the load-balancing loss (`load_balancing_loss`, HF's
`load_balancing_loss_func` over all layers' tokens) and the expert-load metric (`load_max`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import PartitionSpec

from ebpo_jax import sharding
from ebpo_jax.models.config import ModelConfig


class Routing(NamedTuple):
  """A token's experts: `ids` [T, k] int32, their `weights` [T, k] (compute dtype), and the full
  float32 router probabilities `probs` [T, E] (the load-balancing loss reads them)."""

  ids: jax.Array
  weights: jax.Array
  probs: jax.Array


STATS = "router_stats"  # the sown RouterStats of a block (collection "intermediates")


class RouterStats(NamedTuple):
  """A block's routing over its valid tokens, float32, `[..., E]` (a leading layer axis once
  collected): `counts` (tokens with expert e among their k), `probs` (the router probabilities
  summed), `tokens` (`[...]`, the valid tokens)."""

  counts: jax.Array
  probs: jax.Array
  tokens: jax.Array


def router_stats(routing: Routing, mask_t: jax.Array) -> RouterStats:
  """The RouterStats of `routing` over the tokens where `mask_t` [T] is true (the others' values,
  NaN or not, count nowhere)."""
  valid = mask_t.astype(bool)[:, None]
  num_experts = routing.probs.shape[-1]
  chosen = jax.nn.one_hot(routing.ids, num_experts, dtype=jnp.float32).sum(axis=1)  # [T, E]
  counts = jnp.where(valid, chosen, 0.0).sum(axis=0)
  probs = jnp.where(valid, routing.probs, 0.0).sum(axis=0)
  return RouterStats(counts, probs, valid.sum().astype(jnp.float32))


def collect(intermediates: Any) -> RouterStats | None:
  """The sown RouterStats of every MoE layer of a forward (its "intermediates"), stacked over the
  layers `[L, ...]` (a scanned stack already is); None when the model has no MoE block."""
  found = []

  def visit(tree):
    for key, value in tree.items():
      if key == STATS:
        found.extend(value)
      elif isinstance(value, Mapping):
        visit(value)

  visit(intermediates)
  if not found:
    return None
  stacked = [s if s.tokens.ndim else jax.tree.map(lambda x: x[None], s) for s in found]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *stacked)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
  """Switch Transformer's auxiliary loss as HF's Qwen3-MoE computes it over all layers' tokens:
  E * sum_e f_e P_e, f_e the share of (layer, token) pairs that route to expert e, P_e the mean
  router probability of e (summed over its k choices, f sums to k: k when load and probabilities
  are both uniform, f_e = k / E and P_e = 1 / E)."""
  tokens = jnp.maximum(stats.tokens.sum(), 1.0)
  f = stats.counts.sum(axis=0) / tokens
  p = stats.probs.sum(axis=0) / tokens
  return stats.counts.shape[-1] * jnp.sum(f * p)


def load_max(stats: RouterStats) -> jax.Array:
  """The most loaded expert's load over the mean load, at the most unbalanced layer (1: balanced;
  E / k: every token on the same k experts)."""
  mean = jnp.maximum(stats.counts.mean(axis=-1), 1e-9)
  return jnp.max(stats.counts.max(axis=-1) / mean)


def route(logits_te: jax.Array, k: int, normalize: bool) -> Routing:
  """Top-k softmax routing of router logits [T, E] (HF's order: softmax, top k, renormalise)."""
  probs = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
  top, ids = jax.lax.top_k(probs, k)
  if normalize:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  return Routing(ids.astype(jnp.int32), top.astype(logits_te.dtype), probs)


def grouped_experts(
  x_td: jax.Array,
  routing: Routing,
  w_gate,
  w_up,
  w_down,
  kernel: str = "ragged_dot",
  interpret: bool = False,
) -> jax.Array:
  """sum_j weight_j * down_e(silu(gate_e(x)) * up_e(x)) over each token's k experts e = ids_j,
  as three grouped matmuls (`grouped_matmul` with `kernel`, `interpret`) over the T*k (token,
  expert) pairs sorted by expert. Weights are `[E, d, f]`, `[E, d, f]` and `[E, f, d]`."""
  t, k = routing.ids.shape
  num_experts = w_gate.shape[0]
  flat_ids = routing.ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)  # pair p = token p // k's j = p % k
  rows = x_td[order // k]
  sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
  matmul = functools.partial(grouped_matmul, sizes=sizes, kernel=kernel, interpret=interpret)
  out = matmul(nn.silu(matmul(rows, w_gate)) * matmul(rows, w_up), w_down)
  unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)
  return jnp.einsum("tkd,tk->td", unsorted, routing.weights.astype(out.dtype))


def grouped_matmul(
  x_mk: jax.Array, w_gkn: jax.Array, sizes: jax.Array, kernel: str, interpret: bool = False
) -> jax.Array:
  """Rows [M, K] times their group's weights [G, K, N] (`sizes`: each group's rows, in order):
  XLA's `ragged_dot`, or megablox's `gmm` (Pallas; `interpret`ed for a device that is not a
  TPU), its rows padded to its tile (the padding, past every group, is dropped) and tiles of at
  most 128 that divide K and N."""
  if kernel == "ragged_dot":
    return jax.lax.ragged_dot(x_mk, w_gkn, sizes)
  m, k = x_mk.shape
  n = w_gkn.shape[-1]
  tm = min(128, -(-m // 8) * 8)
  padded = jnp.pad(x_mk, ((0, -m % tm), (0, 0)))
  tiling = (tm, _tile(k), _tile(n))
  out = megablox.gmm(padded, w_gkn, sizes, x_mk.dtype, tiling, interpret=interpret)
  return out[:m]


def _per_shard(experts, mesh, tokens: int, width: int):
  """`experts` (x, routing, w_gate, w_up, w_down) in `shard_map` over `mesh`: each shard's
  tokens (over the mesh's row axes, where they divide) through every expert's slice of the width
  (over 'tensor', where it divides; the partial outputs summed over it). The weights' `fsdp`
  shards are gathered by the compiler before, as for a dense matmul."""
  sizes = dict(mesh.shape)
  row_axes = tuple(a for a in sharding.ROW_AXES if sizes.get(a, 1) > 1)
  rows = row_axes if row_axes and tokens % math.prod(sizes[a] for a in row_axes) == 0 else None
  tensor = "tensor" if sizes.get("tensor", 1) > 1 and width % sizes["tensor"] == 0 else None
  token_spec = PartitionSpec(rows, None)

  def shard(x, routing, w_gate, w_up, w_down):
    out = experts(x, routing, w_gate, w_up, w_down)
    return out if tensor is None else jax.lax.psum(out, tensor)

  width_spec = PartitionSpec(None, None, tensor)
  return jax.shard_map(
    shard,
    mesh=mesh,
    in_specs=(
      token_spec,
      Routing(token_spec, token_spec, token_spec),
      width_spec,
      width_spec,
      PartitionSpec(None, tensor, None),
    ),  # fmt: skip
    out_specs=token_spec,
    check_vma=False,
  )


def _tile(size: int) -> int:
  """The largest of 128, 64, ..., 8 that divides `size`, else `size` (one tile)."""
  return next((t for t in (128, 64, 32, 16, 8) if size % t == 0), size)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes) -> jax.Array:
  """A param of `module` in its config's param dtype (logical `axes`), cast to the compute dtype."""
  c = module.config
  init = nn.with_logical_partitioning(nn.initializers.normal(0.02), axes)
  return jnp.asarray(module.param(name, init, shape, jnp.dtype(c.param_dtype)), jnp.dtype(c.dtype))


class Router(nn.Module):
  """`x [T, d] -> Routing`: the router's `kernel` [d, E] (HF's `mlp.gate.weight`)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_td: jax.Array) -> Routing:
    c = self.config
    kernel = _param(self, "kernel", (c.hidden_size, c.num_experts), ("embed", None))
    return route(x_td @ kernel, c.num_experts_per_tok, c.norm_topk_prob)


class Experts(nn.Module):
  """`(x [T, d], Routing) -> [T, d]`: the stacked SwiGLU experts, `gate_proj` and `up_proj`
  [E, d, f], `down_proj` [E, f, d] (HF's `mlp.experts.{e}.*.weight`, transposed)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_td: jax.Array, routing: Routing) -> jax.Array:
    c = self.config
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    w_gate = _param(self, "gate_proj", (e, d, f), ("expert", "embed", "mlp"))
    w_up = _param(self, "up_proj", (e, d, f), ("expert", "embed", "mlp"))
    w_down = _param(self, "down_proj", (e, f, d), ("expert", "mlp", "embed"))
    experts = functools.partial(grouped_experts, kernel=c.moe_kernel, interpret=c.moe_interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if c.moe_kernel == "megablox" and not mesh.empty and math.prod(mesh.shape.values()) > 1:
      experts = _per_shard(experts, mesh, x_td.shape[0], f)  # a kernel is not partitioned
    return experts(x_td, routing, w_gate, w_up, w_down)


class SparseMoE(nn.Module):
  """Qwen3-MoE's sparse MLP block, `(x [B, T, d], valid tokens [B, T]) -> [B, T, d]`: `gate` (the
  router) and `experts`, as HF names them; sows its RouterStats over the valid tokens."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_bte: jax.Array, mask_bt: jax.Array) -> jax.Array:
    x_td = x_bte.reshape(-1, x_bte.shape[-1])
    routing = Router(self.config, name="gate")(x_td)
    self.sow("intermediates", STATS, router_stats(routing, mask_bt.reshape(-1)))
    return Experts(self.config, name="experts")(x_td, routing).reshape(x_bte.shape)
