"""The one attention entry point without a KV cache, over three backends (`config.model.attention`).

- `xla`: einsum + softmax over the materialised `[B, Hkv, G, T, S]` scores; the reference.
- `splash`: Pallas TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, in
  the pinned jax: no extra package; tokamax, which MaxText uses, needs jax >= 0.9.2 and adds
  nothing this decoder needs). The scores never leave the chip's VMEM: memory is O(T) per head, and
  fully masked blocks (the causal upper half, a completion's prompt-free corner) are skipped.
  Padding tokens get segment id 0, valid ones 1: a valid query sees only valid keys. GQA runs
  natively (each kv head serves its q heads; nothing is repeated). Sequences are padded to a
  multiple of the block, `min(ModelConfig.attention_block, T rounded up to 128)`. Under a context
  mesh (`jax.set_mesh`, or `jax.sharding.use_abstract_mesh` inside jit, as the train step and the
  sampler's prefill trace) the kernel runs per shard in `shard_map`: rows over ('data', 'fsdp'),
  heads over 'tensor' (each only when it divides); a Mosaic kernel is not partitioned otherwise.
  On a platform without the kernel (`ModelConfig.attention_emulate`) it runs in Pallas interpret
  mode, for tests on the CPU.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused attention on
  NVIDIA GPUs; the validity goes in as its boolean mask (cuDNN turns it into an additive bias:
  `[B, 1, T, S]` in the compute dtype, not the float32 scores, yet O(T^2); untimed on a GPU so
  far). Emulated, it runs the same call with `implementation="xla"`.

`auto` (`resolve`) is splash on TPU, cudnn on NVIDIA GPUs when the compute dtype is bfloat16 or
float16 (jax's cuDNN attention refuses float32: "Q must be fp16/bf16/fp8"), and xla otherwise (a
float32 model on a GPU, any other platform); an explicit cudnn at another dtype is an error, on
every platform (its emulation would run what the GPU refuses). The sampler resolves again at its
own `sampling.dtype` (`models.build.with_compute_dtype`).

Every backend takes the layout `layout` builds (query/key token masks for splash, allowed (query,
key) pairs for the others) over full rows or the shared-prefix layout (`models.shared_prefix`); the
sampler's prefill (a cache exactly as long as the prompt, so empty before it) takes the same path
(`fresh_prefill`).

Decoding over the KV cache (`decode`, one query per row): splash runs `models.decode_attention`'s
flash-decoding kernel, which reads only the slots written so far (of a stacked cache, only the
layer's, in place); xla and cudnn run `xla_attention` over all S slots (of a stacked cache, the
layer's slice: the reference may copy it). For cudnn that is a choice made without a GPU to time
on: cuDNN's fused attention is a prefill kernel (its mask an O(T S) bias), and a blockwise XLA loop
that stops at the written length would be an untimed guess; the XLA path is the reference and is
known to be right. Prefill chunks over a cache (multi-turn continuation, T > 1) run
`xla_attention`.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from ebpo_jax.models import decode_attention, shared_prefix
from ebpo_jax.models.config import ATTENTION_BACKENDS, ModelConfig

CHOICES = ("auto", *ATTENTION_BACKENDS)
_NEG_INF = -1e30  # finite, so a query with no valid key gives a uniform (ignored) row, not NaN
_LANES = 128  # splash's blocks are multiples of the TPU's 128 lanes
CUDNN_DTYPES = ("bfloat16", "float16")  # the compute dtypes cuDNN attention takes (fp8 unused)


def resolve(name: str, device: jax.Device, dtype: str) -> tuple[str, bool]:
  """`(backend, emulate)` for `config.model.attention = name` on `device`'s platform, computing
  in `dtype`: `auto` is splash on TPU, cudnn on an NVIDIA GPU at a dtype cuDNN takes
  (`CUDNN_DTYPES`), else xla; a kernel named on a platform without it is emulated
  (`emulate=True`: interpret mode, or cudnn's call through XLA). ValueError for an unknown name,
  or cudnn at a dtype cuDNN refuses."""
  if name not in CHOICES:
    raise ValueError(f"attention={name!r}; expected one of {CHOICES}")
  half = jnp.dtype(dtype).name in CUDNN_DTYPES
  if name == "cudnn" and not half:
    raise ValueError(
      f"cuDNN's fused attention computes in {' or '.join(CUDNN_DTYPES)} only, not {dtype} "
      '(jax: "Q must be fp16/bf16/fp8"): use one of those, or attention auto or xla'
    )
  nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
  if name == "auto":
    name = "splash" if device.platform == "tpu" else "cudnn" if nvidia and half else "xla"
  native = {"xla": True, "splash": device.platform == "tpu", "cudnn": nvidia}[name]
  return name, not native


class TokenMasks(flax.struct.PyTreeNode):
  """Splash's layout: which queries `[B, T]` and keys `[B, S]` are valid tokens; the T queries
  are the last T of the S keys, each seeing the keys at or before it."""

  query: jax.Array
  key: jax.Array


def valid_pairs(attention_mask_bt: jax.Array) -> jax.Array:
  """`[B, T, T]` bool without a cache: valid queries see the valid keys at or before them."""
  t = attention_mask_bt.shape[1]
  causal_tt = jnp.tril(jnp.ones((t, t), bool))
  return causal_tt[None] & attention_mask_bt[:, None, :] & attention_mask_bt[:, :, None]


def layout(backend: str, attention_mask_bt: jax.Array, groups: shared_prefix.PrefixGroups | None):
  """What `attend` reads for `backend`: over full rows, or over packed rows (`groups`) a
  `shared_prefix.GroupedValid` of the prompts' and the completions' parts."""
  if backend == "splash":
    if groups is None:
      return TokenMasks(attention_mask_bt, attention_mask_bt)
    prompt, completions = shared_prefix.query_key_masks(attention_mask_bt, groups)
    return shared_prefix.GroupedValid(TokenMasks(*prompt), TokenMasks(*completions))
  if groups is None:
    return valid_pairs(attention_mask_bt)
  return shared_prefix.valid_pairs(attention_mask_bt, groups)


def fresh_prefill(backend: str, cache_slots: int, num_tokens: int) -> bool:
  """Whether a cached forward is a prefill that `attend` runs: a cache exactly as long as the
  tokens can only be written from slot 0, so attention over it is attention over the tokens."""
  return backend != "xla" and cache_slots == num_tokens


def attend(q_bthd, k_btkd, v_btkd, valid, config: ModelConfig) -> jax.Array:
  """Attention without a cache on `config.attention`'s backend: over the row, or (`valid` a
  `shared_prefix.GroupedValid`) the prompt over itself and each completion over its prompt, then
  itself. Returns [B,T,H,D]."""
  emulate = config.attention_emulate
  core = {
    "xla": xla_attention,
    "splash": functools.partial(splash_attention, block=config.attention_block, interpret=emulate),
    "cudnn": functools.partial(cudnn_attention, implementation="xla" if emulate else "cudnn"),
  }[config.attention]
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  if not isinstance(valid, shared_prefix.GroupedValid):
    return core(q_bthd, heads_first(k_btkd), heads_first(v_btkd), valid)
  split = lambda x: shared_prefix.split(x, valid.groups)
  (q_p, q_c), (k_p, k_c), (v_p, v_c) = split(q_bthd), split(k_btkd), split(v_btkd)
  k_p, k_c, v_p, v_c = map(heads_first, (k_p, k_c, v_p, v_c))
  out_p = core(q_p, k_p, v_p, valid.prompt)
  prefixed = shared_prefix.prefixed
  out_c = core(q_c, prefixed(k_p, k_c), prefixed(v_p, v_c), valid.completions)
  return shared_prefix.merge(out_p, out_c)


def decode(
  q_b1hd, k_bksd, v_bksd, slot_mask_bs, written, config: ModelConfig, *, layer=None, row_blocks=1
) -> jax.Array:
  """Attention of one new query per row over a cache its key is already written to: slots
  `[0, written)` whose `slot_mask_bs [B, S]` is true (the new slot included) of heads-first
  `[B, Hkv, S, D]` buffers, or of layer `layer` of stacked `[L, R, Hkv, S, D]` ones (the B rows
  the first of each of `row_blocks` blocks: `models.KVCache`), on `config.attention`'s backend
  (module docstring). Returns [B,1,H,D] float32."""
  if config.attention == "splash":
    return decode_attention.flash_decode(
      q_b1hd,
      k_bksd,
      v_bksd,
      slot_mask_bs,
      written,
      layer=layer,
      block=config.attention_block,
      interpret=config.attention_emulate,
    )
  written_bs = slot_mask_bs & (jnp.arange(slot_mask_bs.shape[1]) < written)
  kv = layer_of((k_bksd, v_bksd), layer, rows=q_b1hd.shape[0], row_blocks=row_blocks)
  return xla_attention(q_b1hd, *kv, written_bs[:, None])


def layer_of(kv: tuple[jax.Array, jax.Array], layer, *, rows: int, row_blocks: int = 1):
  """`(k, v)` `[B, Hkv, S, D]` of one layer: the buffers themselves (`layer` None), or the `rows`
  rows of layer `layer` of stacked `[L, R, Hkv, S, D]` ones (the first of each of `row_blocks`
  blocks), sliced out (the XLA reference path may copy them)."""
  if layer is None:
    return kv

  def one(x):
    x = jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
    if x.shape[0] == rows:
      return x
    blocked = x.reshape(row_blocks, x.shape[0] // row_blocks, *x.shape[1:])
    return blocked[:, : rows // row_blocks].reshape(rows, *x.shape[1:])

  return one(kv[0]), one(kv[1])


def xla_attention(q_bthd, k_bksd, v_bksd, valid_bts) -> jax.Array:
  """Softmax attention with GQA over heads-first `[B, Hkv, S, D]` keys and values.

  `valid_bts` marks allowed (query, key) pairs. Both matmuls run in the natural batched order
  (batch b, k; the query's (g, t) rows), so XLA CPU transposes only the small query and output,
  never the keys, values or scores. Returns [B,T,H,D].
  """
  b, t, h, d = q_bthd.shape
  kv_heads = k_bksd.shape[1]
  q_bkgtd = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
  scores = jnp.einsum(
    "bkgtd,bksd->bkgts", q_bkgtd.astype(k_bksd.dtype), k_bksd, preferred_element_type=jnp.float32
  )
  scores = jnp.where(valid_bts[:, None, None], scores * d**-0.5, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_bksd.dtype)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, v_bksd, preferred_element_type=jnp.float32)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def cudnn_attention(q_bthd, k_bksd, v_bksd, valid_bts, *, implementation: str) -> jax.Array:
  """`jax.nn.dot_product_attention` over `[B, T, H, D]` queries and heads-first keys and values
  (GQA native), the allowed pairs as its mask; causal also when T = S (cuDNN skips the upper
  half). Returns [B,T,H,D]."""
  t, s = q_bthd.shape[1], k_bksd.shape[2]
  k_bskd, v_bskd = jnp.swapaxes(k_bksd, 1, 2), jnp.swapaxes(v_bksd, 1, 2)
  return jax.nn.dot_product_attention(
    q_bthd.astype(k_bksd.dtype),
    k_bskd,
    v_bskd,
    mask=valid_bts[:, None],
    is_causal=t == s,
    implementation=implementation,
  )


def block_size(length: int, block: int) -> int:
  """The splash block for a sequence of `length`: `block`, or less for a shorter sequence (the
  length rounded up to the 128 lanes)."""
  return min(block, -(-length // _LANES) * _LANES)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _kernel(heads: int, q_len: int, kv_len: int, offset: int, bq: int, bkv: int, interpret: bool):
  """The splash kernel of one row: `heads` q heads, causal with the queries the last of the keys
  (`offset` = S - T of the unpadded lengths), blocks `bq` x `bkv`, for forward and backward.
  Built in each trace (its mask tables become that trace's constants); splash caches the numpy
  work of the mask."""
  mask = splash.MultiHeadMask([splash.CausalMask((q_len, kv_len), offset=offset)] * heads)
  sizes = splash.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )
  return splash.make_splash_mha(
    mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
  )


def splash_attention(q_bthd, k_bksd, v_bksd, masks: TokenMasks, *, block: int, interpret: bool):
  """Splash attention (module docstring) over `[B, T, H, D]` queries and heads-first keys and
  values; per shard under a context mesh. Returns [B,T,H,D]."""
  b, t, h, d = q_bthd.shape
  kv_heads, s = k_bksd.shape[1:3]
  bq, bkv = block_size(t, block), block_size(s, block)
  t_pad, s_pad = _round_up(t, bq), _round_up(s, bkv)
  pad = lambda x, n: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, n - x.shape[-2]), (0, 0)])
  q_bhtd = pad(jnp.swapaxes(q_bthd.astype(k_bksd.dtype) * d**-0.5, 1, 2), t_pad)
  k_bksd, v_bksd = pad(k_bksd, s_pad), pad(v_bksd, s_pad)
  segments = lambda m, n: jnp.pad(m.astype(jnp.int32), ((0, 0), (0, n - m.shape[1])))
  q_seg, kv_seg = segments(masks.query, t_pad), segments(masks.key, s_pad)

  def rows(q, k, v, q_seg, kv_seg):
    kernel = _kernel(q.shape[1], t_pad, s_pad, s - t, bq, bkv, interpret)
    call = lambda *a: kernel(*a[:3], segment_ids=splash.SegmentIds(q=a[3], kv=a[4]))
    return jax.vmap(call)(q, k, v, q_seg, kv_seg)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and math.prod(mesh.shape.values()) > 1:
    rows = _per_shard(rows, mesh, b, (h, kv_heads))
  out_bhtd = rows(q_bhtd, k_bksd, v_bksd, q_seg, kv_seg)
  return jnp.swapaxes(out_bhtd[:, :, :t], 1, 2)


def _per_shard(fn, mesh, batch: int, heads: tuple[int, ...]):
  """`fn` over `[B, H, T, D]` arrays and `[B, T]` segment ids in `shard_map`: rows over the
  mesh's ('data', 'fsdp') and heads over 'tensor', each only where the mesh has the axes and
  they divide (else that dimension is whole on every shard)."""
  sizes = dict(mesh.shape)
  row_axes = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  rows = row_axes if row_axes and batch % math.prod(sizes[a] for a in row_axes) == 0 else None
  tensor = sizes.get("tensor", 1)
  q_heads, kv_heads = heads
  q_axis = "tensor" if tensor > 1 and q_heads % tensor == 0 else None
  # One key/value head (MQA) stays whole on every shard beside split queries: each query head
  # reads it. Other key/value heads split with the queries, or neither does (a split of the
  # queries alone would misalign the groups). Seen on v5p (libtpu 0.0.42): with 4 query heads
  # over tensor = 2 and one key head, the kernel with nothing split failed in the TPU compiler
  # (an internal bitcast error); split queries beside the whole key head compile.
  kv_axis = q_axis if q_axis and kv_heads % tensor == 0 else None
  if kv_axis is None and kv_heads > 1:
    q_axis = None
  q_spec, kv_spec, spec2 = (
    PartitionSpec(rows, q_axis),
    PartitionSpec(rows, kv_axis),
    PartitionSpec(rows),
  )
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, spec2, spec2),
    out_specs=q_spec,
    check_vma=False,
  )
