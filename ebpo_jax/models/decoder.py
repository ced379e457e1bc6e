"""One config-driven decoder-only transformer: Llama 3, Qwen2, Qwen3 and SmolLM2.

Layers are scanned (`nn.scan`): every per-layer parameter carries a leading `layers` axis, the
layout of checkpoints and training. `ModelConfig.unroll_layers` unrolls the loop (same params, one
program per layer: slower to compile, faster on XLA:CPU, which fuses across layers). Cached prefill
and decode follow the same switch, each with its own `KVCache` layout (`KVCache.stacked`):
- rolled (`unroll_layers=False`, the TPU configs): the scanned decoder runs one loop body over the
  stacked params and carries a stacked cache `[L, B, Hkv, S, D]`; layer i writes only its new slots
  of the carried stack in place (at `[i, :, :, index, :]`), and the decode kernel reads the stack at
  layer i (`models.decode_attention`), so neither weights nor cache are copied per layer, and the
  program holds one layer's code, not L (36 unrolled layers took minutes to compile, twice).
- unrolled: `Decoder(config, scan_layers=False)`, the same math over modules `layers_0 ...
  layers_{L-1}` (`unstack_layers` converts the params once) and a buffer `[B, Hkv, S, D]` per layer
  that each step updates in place (XLA CPU copies every stacked weight or cache slice on every
  scanned step).
The full forward also runs the shared-prefix layout (`models.shared_prefix`: each prompt once, then
its G completions) for training.

Parameter layout (HF name -> ours):
  embed_tokens.weight [V, E]            -> embed_tokens/embedding      (vocab, embed)
  layers.i.self_attn.q_proj [H*D, E]    -> layers/self_attn/q_proj/kernel [L, E, H, D]
  layers.i.self_attn.o_proj [E, H*D]    -> layers/self_attn/o_proj/kernel [L, H, D, E]
  layers.i.mlp.gate_proj [M, E]         -> layers/mlp/gate_proj/kernel [L, E, M]
  lm_head.weight [V, E]                 -> lm_head/kernel [E, V]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.models import attention, lora, moe, shared_prefix
from ebpo_jax.models.config import REMAT_POLICIES, ModelConfig


class KVCache(flax.struct.PyTreeNode):
  """Keys and values of every layer for `S` slots; slots `< index` are written. Heads first, as the
  attention matmuls read them, in one of two layouts (module docstring): per layer, a tuple of L
  buffers for `Decoder(scan_layers=False)`, or `stacked`, one array for the rolled loop."""

  k: tuple[jax.Array, ...] | jax.Array  # L x [B, Hkv, S, D], or stacked [L, R >= B, Hkv, S, D]
  v: tuple[jax.Array, ...] | jax.Array  # as k
  mask: jax.Array  # [B, S] bool: slot holds a valid (non-pad) key
  index: jax.Array  # int32 scalar: next slot to write
  # A stacked cache may hold R > B rows, in `row_blocks` equal blocks (a mesh's row shards) whose
  # first B / row_blocks rows are the batch's: the compacting decode moves the running rows to the
  # front of each block in place rather than into a smaller copy (old and new at once: 1.5x).
  row_blocks: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def stacked(self) -> bool:
    """Whether k and v are one `[L, B, Hkv, S, D]` array each (else a tuple of L buffers)."""
    return not isinstance(self.k, tuple)

  def map_layers(self, fn) -> KVCache:
    """The cache with `fn` applied to every layer's `[B, Hkv, S, D]` key and value buffer (vmapped
    over a stacked cache's layers); the mask and index as they are."""
    if self.stacked:
      return self.replace(k=jax.vmap(fn)(self.k), v=jax.vmap(fn)(self.v))
    return self.replace(k=tuple(map(fn, self.k)), v=tuple(map(fn, self.v)))


def init_cache(
  config: ModelConfig, batch_size: int, max_len: int, dtype: Any = None, *, stacked: bool = False
) -> KVCache:
  """An empty cache of `max_len` slots (dtype defaults to the compute dtype), per layer or
  `stacked` (the layout of `Decoder(scan_layers=True)`, the rolled loop)."""
  shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
  dtype = jnp.dtype(dtype or config.dtype)
  if stacked:
    buffers = lambda: jnp.zeros((config.num_layers, *shape), dtype)
  else:
    buffers = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  return KVCache(
    k=buffers(),
    v=buffers(),
    mask=jnp.zeros((batch_size, max_len), bool),
    index=jnp.zeros((), jnp.int32),
  )


class LayerCache(flax.struct.PyTreeNode):
  """What one layer reads and writes of a `KVCache`: its own buffers (`layer` None), or the stacked
  arrays and the layer's index in them (a pytree with `row_blocks` static: it passes through
  `nn.remat` as a Python int)."""

  k: jax.Array  # [B, Hkv, S, D], or [L, R >= B, Hkv, S, D] when `layer` is given
  v: jax.Array
  index: jax.Array  # int32 scalar: the slot the first new token goes to
  layer: jax.Array | None  # int32 scalar: this layer's place in stacked k and v
  row_blocks: int = flax.struct.field(pytree_node=False, default=1)  # `KVCache.row_blocks`


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """Scanned params (`layers` with a leading `[L]` axis) -> `layers_0 ... layers_{L-1}`.

  Under jit this copies the weights once; `Decoder(scan_layers=False)` then reads each layer's
  weights in place instead of slicing the stack on every call.
  """
  if "layers" not in params:
    raise ValueError(f"no stacked 'layers' in params (keys {sorted(params)})")
  unstacked = {name: value for name, value in params.items() if name != "layers"}
  num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
  for i in range(num_layers):
    unstacked[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
  return unstacked


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """The inverse of `unstack_layers`: `layers_0 ... layers_{L-1}` -> `layers` with an `[L]` axis."""
  names = [name for name in params if name.startswith("layers_")]
  expected = [f"layers_{i}" for i in range(len(names))]
  if not names or sorted(names) != sorted(expected):
    raise ValueError(f"expected per-layer params layers_0 ... layers_<L-1>, got {sorted(params)}")
  stacked = {name: value for name, value in params.items() if name not in expected}
  stacked["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[n] for n in expected))
  return stacked


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies `theta^(-2i/D)`, with HF's `llama3` long-context scaling if configured."""
  dim = config.head_dim
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  scaling = dict(config.rope_scaling or {})
  if scaling.get("rope_type") != "llama3":
    return inv_freq.astype(np.float32)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(config: ModelConfig, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sin, cos)`, each `[B, T, D]` float32, in HF's rotate-half layout."""
  angles_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
  angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
  return jnp.sin(angles_btd), jnp.cos(angles_btd)


def apply_rope(x_bthd: jax.Array, sin_btd: jax.Array, cos_btd: jax.Array) -> jax.Array:
  half = x_bthd.shape[-1] // 2
  rotated = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
  sin, cos = sin_btd[:, :, None, :], cos_btd[:, :, None, :]
  return (x_bthd * cos + rotated * sin).astype(x_bthd.dtype)


def _param(
  module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], init
) -> jax.Array:
  config = module.config
  value = module.param(
    name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(config.param_dtype)
  )
  return jnp.asarray(value, jnp.dtype(config.dtype))


class RMSNorm(nn.Module):
  """`x / sqrt(mean(x^2) + eps) * scale`, computed in float32 as in HF."""

  config: ModelConfig
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dim = x.shape[-1]
    scale = _param(self, "scale", (dim,), (self.axis_name,), nn.initializers.ones)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(
      jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps
    )
    return scale * normed.astype(x.dtype)


def token_matmul(x: jax.Array, w_io: jax.Array, **kwargs) -> jax.Array:
  """`x [..., I] @ w [I, O] -> [..., O]` as one 2-D matmul over all tokens. A 3-D einsum's weight
  gradient contracts two axes (batch and time), which XLA:CPU runs at about half the rate of this
  2-D form (0.77x train step time at a 4-layer d=256 model; results/speed.md)."""
  y = jnp.matmul(x.reshape(-1, x.shape[-1]), w_io, **kwargs)
  return y.reshape(*x.shape[:-1], w_io.shape[-1])


class Projection(nn.Module):
  """`x @ kernel (+ bias)` with named logical axes on the kernel, plus a LoRA adapter
  (`models.lora`) when the config's rank is > 0 and the name (`q_proj` -> `q`) is a target. The
  kernel's first `num_in` axes are the input (flattened: the last axis of x), the rest the output
  (y's trailing axes)."""

  config: ModelConfig
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  bias_axes: tuple[str, ...] | None = None
  num_in: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.normal(0.02)
    kernel = _param(self, "kernel", self.shape, self.axes, init)
    out_dims = self.shape[self.num_in :]
    kernel_io = kernel.reshape(math.prod(self.shape[: self.num_in]), math.prod(out_dims))
    y = token_matmul(x, kernel_io).reshape(*x.shape[:-1], *out_dims)
    c = self.config
    if c.lora_rank > 0 and self.name.removesuffix("_proj") in c.lora_targets:
      y = y + lora.delta(self, x, self.shape, self.axes, self.num_in, y.shape)
    if self.bias_axes is not None:
      bias_shape = self.shape[len(self.shape) - len(self.bias_axes) :]
      y = y + _param(self, "bias", bias_shape, self.bias_axes, nn.initializers.zeros)
    return y


class Attention(nn.Module):
  """GQA self-attention with RoPE. With a cache (`LayerCache`), the new keys and values go into
  their slots, attention reads the written cache, and the updated `(k, v)` is returned (else
  None)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_bte, sin_btd, cos_btd, valid_bts, layer_cache: LayerCache | None):
    c = self.config
    e, h, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    bias = c.attention_bias
    q = Projection(c, (e, h, d), ("embed", "heads", "head_dim"),
                   ("heads", "head_dim") if bias else None, name="q_proj")(x_bte)  # fmt: skip
    k = Projection(c, (e, kv, d), ("embed", "kv_heads", "head_dim"),
                   ("kv_heads", "head_dim") if bias else None, name="k_proj")(x_bte)  # fmt: skip
    v = Projection(c, (e, kv, d), ("embed", "kv_heads", "head_dim"),
                   ("kv_heads", "head_dim") if bias else None, name="v_proj")(x_bte)  # fmt: skip
    if c.qk_norm:
      q = RMSNorm(c, "head_dim", name="q_norm")(q)
      k = RMSNorm(c, "head_dim", name="k_norm")(k)
    q, k = apply_rope(q, sin_btd, cos_btd), apply_rope(k, sin_btd, cos_btd)
    slots = None if layer_cache is None else layer_cache.k.shape[-2]
    if slots is None or attention.fresh_prefill(c.attention, slots, q.shape[1]):
      out = attention.attend(q, k, v, valid_bts, c)
      new_kv = None if layer_cache is None else _write_all(layer_cache, k, v)
    else:
      # The attention reads the written buffer, so it runs after the write and XLA updates the
      # buffer in place (a read of the old buffer beside the write would force a copy).
      new_kv = _write_all(layer_cache, k, v)
      where = dict(layer=layer_cache.layer, row_blocks=layer_cache.row_blocks)
      if q.shape[1] == 1:  # decode: the written slots only, on the configured backend
        written = layer_cache.index + 1
        out = attention.decode(q, *new_kv, valid_bts[:, 0], written, c, **where)
      else:
        kv = attention.layer_of(new_kv, rows=q.shape[0], **where)
        out = attention.xla_attention(q, *kv, valid_bts)
    # One flat (h d) contraction: with two contracting axes XLA CPU transposed the o_proj kernel
    # on every call (inside the decode loop too).
    out = out.astype(x_bte.dtype).reshape(*out.shape[:2], h * d)
    y = Projection(c, (h, d, e), ("heads", "head_dim", "embed"), num_in=2, name="o_proj")(out)
    return y, new_kv


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_bte: jax.Array) -> jax.Array:
    c = self.config
    shape, axes = (c.hidden_size, c.intermediate_size), ("embed", "mlp")
    gate = Projection(c, shape, axes, name="gate_proj")(x_bte)
    up = Projection(c, shape, axes, name="up_proj")(x_bte)
    down = Projection(c, shape[::-1], axes[::-1], name="down_proj")
    return down(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  """Pre-norm block `(x, context, layer_cache) -> (x, new (k, v) or None)` (scan-compatible)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_bte, context, layer_cache=None):
    sin, cos, valid, mask_bt = context
    attn_in = RMSNorm(self.config, name="input_layernorm")(x_bte)
    attn_out, new_kv = Attention(self.config, name="self_attn")(
      attn_in, sin, cos, valid, layer_cache
    )
    x_bte = x_bte + attn_out
    mlp_in = RMSNorm(self.config, name="post_attention_layernorm")(x_bte)
    if self.config.num_experts:
      return x_bte + moe.SparseMoE(self.config, name="mlp")(mlp_in, mask_bt), new_kv
    return x_bte + MLP(self.config, name="mlp")(mlp_in), new_kv


def _written_mask(cache: KVCache, attention_mask_bt: jax.Array) -> jax.Array:
  """`cache.mask` with the T new tokens' validity in slots `[index, index + T)`."""
  return jax.lax.dynamic_update_slice(cache.mask, attention_mask_bt, (0, cache.index))


def _valid_slots(attention_mask_bt: jax.Array, cache: KVCache) -> jax.Array:
  """`[B, T, S]` bool over a cache the T new tokens are already written to: query t sees the
  valid slots `s <= index + t`."""
  t, s = attention_mask_bt.shape[1], cache.mask.shape[1]
  causal_ts = jnp.arange(s)[None, :] <= cache.index + jnp.arange(t)[:, None]
  return causal_ts[None] & _written_mask(cache, attention_mask_bt)[:, None, :]


class Decoder(nn.Module):
  """Causal LM: `(input_ids [B,T], positions, attention_mask, cache) -> logits [B,T,V] float32`.

  `scan_layers=True` (stacked params) scans its layers, over a stacked cache when given one (the
  rolled loop); `scan_layers=False` is the same model with per-layer params, with or without a
  per-layer cache (see the module docstring).
  """

  config: ModelConfig
  scan_layers: bool = True

  @nn.compact
  def __call__(
    self,
    input_ids: jax.Array,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    cache: KVCache | None = None,
    logits_slice: tuple[int, int] | None = None,
    prefix_groups: shared_prefix.PrefixGroups | None = None,
  ):
    """Without a cache returns logits; with one (stacked for `scan_layers=True`, per layer for
    `scan_layers=False`) also the cache with the T tokens written. `logits_slice=(start, stop)`
    computes the logits of those positions only (`[B, stop - start, V]`): the LM head is a large
    share of a small model's work, and training needs it only where completion tokens are
    predicted.

    `prefix_groups` (no cache): the rows are packed, each a prompt then its G completions
    (`models.shared_prefix`), and the logits are those that predict the completions' N tokens,
    `[B*G, N, V]`: each prompt runs once, not once per completion.

    Default positions are `arange(T)` (offset by `cache.index` when a cache is given). The caller
    sizes the cache: writing past its last slot is not detected under jit.
    """
    c = self.config
    if cache is not None and prefix_groups is not None:
      raise ValueError("prefix_groups is a full forward's layout: no KV cache with it")
    if cache is not None and cache.stacked != self.scan_layers:
      raise ValueError(
        f"a {'stacked' if cache.stacked else 'per-layer'} KV cache given to "
        f"Decoder(scan_layers={self.scan_layers}): the scanned decoder takes a stacked cache "
        "(init_cache(..., stacked=True)), the per-layer one (scan_layers=False, on "
        "unstack_layers(params)) a per-layer cache"
      )
    b, t = input_ids.shape
    if attention_mask is None:
      attention_mask = jnp.ones((b, t), bool)
    attention_mask = attention_mask.astype(bool)
    if positions is None:
      start = 0 if cache is None else cache.index
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    embedding = _param(self, "embed_tokens", (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                       nn.initializers.normal(0.02))  # fmt: skip
    x = jnp.take(embedding, input_ids, axis=0)
    sin, cos = rope_tables(c, positions)
    if cache is not None and not attention.fresh_prefill(c.attention, cache.mask.shape[1], t):
      valid = _valid_slots(attention_mask, cache)
    else:
      valid = attention.layout(c.attention, attention_mask, prefix_groups)
    context = (sin, cos, valid, attention_mask)  # the mask: a MoE block's valid tokens
    if self.scan_layers and cache is None:
      x, new_cache = self._scanned_layers()(x, context)[0], None
    elif self.scan_layers:
      x, new_cache = self._rolled_loop(x, context, cache, attention_mask)
    else:
      x, new_cache = self._layer_loop(x, context, cache, attention_mask)
    x = RMSNorm(c, name="norm")(x)
    if prefix_groups is not None:
      x = shared_prefix.predicting_states(x, prefix_groups)
    elif logits_slice is not None:
      x = x[:, slice(*logits_slice)]
    if c.tie_word_embeddings:
      lm_head = embedding.T
    else:
      lm_head = _param(self, "lm_head", (c.hidden_size, c.vocab_size), ("embed", "vocab"),
                       nn.initializers.normal(0.02))  # fmt: skip
    logits = token_matmul(x, lm_head, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    return logits if cache is None else (logits, new_cache)

  def _layer_cls(self) -> type[nn.Module]:
    if self.config.remat == "none":
      return DecoderLayer
    return nn.remat(DecoderLayer, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False)

  def _layer_loop(self, x_bte, context, cache: KVCache | None, attention_mask_bt):
    """The layers one by one over a per-layer cache: `(x, the written cache or None)`."""
    layer_cls, new_k, new_v = self._layer_cls(), [], []
    for i in range(self.config.num_layers):
      layer_cache = None if cache is None else LayerCache(cache.k[i], cache.v[i], cache.index, None)
      layer = layer_cls(self.config, name=f"layers_{i}")
      x_bte, kv = layer(x_bte, context, layer_cache)
      if cache is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
    if cache is None:
      return x_bte, None
    return x_bte, _written(cache, tuple(new_k), tuple(new_v), attention_mask_bt)

  def _rolled_loop(self, x_bte, context, cache: KVCache, attention_mask_bt):
    """The scanned layers over a stacked cache, carried through the loop with the layer's index
    (each layer writes its new slots in place): `(x, the written cache)`."""

    def body(layer: nn.Module, carry, context):
      x_bte, k, v, i = carry
      x_bte, (k, v) = layer(x_bte, context, LayerCache(k, v, cache.index, i, cache.row_blocks))
      return (x_bte, k, v, i + 1), None

    scanned = nn.scan(body, **self._scan_options())
    carry = (x_bte, cache.k, cache.v, jnp.zeros((), jnp.int32))
    (x_bte, k, v, _), _ = scanned(self._layer_cls()(self.config, name="layers"), carry, context)
    return x_bte, _written(cache, k, v, attention_mask_bt)

  def _scan_options(self) -> dict:
    """`nn.scan`'s options of the layer loop: stacked params, unrolled as the config says."""
    c = self.config
    return dict(
      variable_axes={"params": 0, "intermediates": 0},  # a MoE block's sown RouterStats too
      split_rngs={"params": True, lora.DROPOUT_RNG: True},  # each layer its own dropout masks
      in_axes=(nn.broadcast,),
      length=c.num_layers,
      unroll=c.num_layers if c.unroll_layers else 1,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )

  def _scanned_layers(self) -> nn.Module:
    return nn.scan(self._layer_cls(), **self._scan_options())(self.config, name="layers")


def _written(cache: KVCache, k, v, attention_mask_bt: jax.Array) -> KVCache:
  """`cache` with the layers' written `k` and `v` and the T new tokens' slots marked."""
  return cache.replace(
    k=k,
    v=v,
    mask=_written_mask(cache, attention_mask_bt),
    index=cache.index + attention_mask_bt.shape[1],
  )


def _write_all(layer_cache: LayerCache, k_btkd, v_btkd) -> tuple[jax.Array, jax.Array]:
  """The layer's `(k, v)` cache buffers (or stacked arrays) with the T new keys and values in
  their slots."""
  write = functools.partial(
    _write_slots,
    index=layer_cache.index,
    layer=layer_cache.layer,
    row_blocks=layer_cache.row_blocks,
  )
  return write(layer_cache.k, k_btkd), write(layer_cache.v, v_btkd)


def _write_slots(old, new_btkd: jax.Array, index, layer, row_blocks: int) -> jax.Array:
  """Writes `[B, T, Hkv, D]` keys or values into slots `[index, index + T)` of one layer's
  `[B, Hkv, S, D]` buffer, or of layer `layer` of a stacked `[L, R, Hkv, S, D]` cache, the B rows
  the first of each of its `row_blocks` blocks (`KVCache.row_blocks`). Only the new slots: in a
  loop XLA updates the carried stack in place."""
  new_bktd = jnp.swapaxes(new_btkd, 1, 2).astype(old.dtype)
  if layer is None:
    return jax.lax.dynamic_update_slice(old, new_bktd, (0, 0, index, 0))
  num_layers, rows, *rest = old.shape
  blocked = old.reshape(num_layers, row_blocks, rows // row_blocks, *rest)
  new = new_bktd.reshape(1, row_blocks, new_bktd.shape[0] // row_blocks, *new_bktd.shape[1:])
  written = jax.lax.dynamic_update_slice(blocked, new, (layer, 0, 0, 0, index, 0))
  return written.reshape(old.shape)
