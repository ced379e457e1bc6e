"""Jitted generation with a KV cache: prefill once per prompt, then a `lax.while_loop` decode.

`generate` prefills B left-padded prompts, repeats the cache G times (group rollouts share one
prefill), and decodes up to `max_new_tokens` tokens per row until every row has drawn a stop token
(`sampling.loop`: by default in halving batches of the rows still running, as RL's long tails
leave most rows of a batch done early).
Rows are prompt-major: row `b * G + g` is sample g of prompt b, at the positions of the layout the
trainer reads back (`sampling.sequences`). One compiled program per (model, batch, prompt length,
static settings); `pad_prompts` rounds prompt lengths up to buckets so a training run compiles a
handful of times, and `compile_count` lets a test check that. The KV cache
never crosses the jit boundary: it is built by the prefill and then carried by the while loop, which
XLA updates in place, so there is no cache buffer for a caller to donate.

Prefill and decode run the layer loop that `model.unroll_layers` picks, as training does
(`models.decoder`'s module docstring): rolled, the scanned decoder on the stacked params over a
stacked cache, one layer's code to compile (the TPU configs); unrolled, `Decoder(scan_layers=False)`
on per-layer params over a per-layer cache (XLA CPU copies every stacked weight slice on every
scanned step, which cost ~40% of a decode step at the tiny config). There the stacked params are
unstacked once per call (a copy of every layer weight, 7% of a SmolLM2 call on CPU); a caller that
samples several times from the same weights converts them once with `decode_params` and passes
those instead.

Each token is drawn by `draw.draw` (temperature, top-k, top-p, inverse CDF).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ebpo_jax import sharding
from ebpo_jax.models import KVCache, ModelConfig, init_cache
from ebpo_jax.models.decoder import unstack_layers
from ebpo_jax.sampling import loop
from ebpo_jax.sampling.draw import draw
from ebpo_jax.sampling.sequences import prompt_positions


class SampleOutput(NamedTuple):
  """Completions, `[B*G, N]`, prompt-major rows (`b * G + g`)."""

  tokens: jax.Array  # [B*G, N] int32; pad_id after the end
  logprobs: jax.Array  # [B*G, N] float32: log_softmax(logits)[token], the policy at temperature 1
  mask: jax.Array  # [B*G, N] bool: completion tokens, the stop token included
  lengths: jax.Array  # [B*G] int32: mask.sum(-1)
  truncated: jax.Array  # [B*G] bool: reached max_new_tokens without a stop token
  nonfinite: jax.Array  # [B*G] bool: a NaN or inf logit was met; the row ended there (pad_id)


# ----------------------------------------------------------------------------- prompts and buckets


def bucket_length(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket `>= n`; raises when `n` exceeds the largest bucket."""
  fitting = [b for b in buckets if b >= n]
  if not fitting:
    raise ValueError(f"length {n} exceeds the largest bucket {max(buckets, default=None)}")
  return min(fitting)


def pad_prompts(
  prompts: Sequence[Sequence[int]], pad_id: int, buckets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to the bucket of the longest: `(ids [B, P] int32, mask [B, P] bool)`."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("pad_prompts needs at least one prompt and no empty prompt")
  width = bucket_length(max(len(p) for p in prompts), buckets)
  ids = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for row, prompt in enumerate(prompts):
    ids[row, width - len(prompt) :] = prompt
    mask[row, width - len(prompt) :] = True
  return ids, mask


# ----------------------------------------------------------------------------- the decode loop


def cached_decoder(model: nn.Module) -> nn.Module:
  """The decoder that prefill and decode run (module docstring): the scanned one (a rolled loop
  over a stacked cache) unless `model.unroll_layers`, then the per-layer one."""
  return model.clone(scan_layers=not model.config.unroll_layers)


def empty_cache(config: ModelConfig, batch_size: int, slots: int) -> KVCache:
  """An empty cache in the layout of `cached_decoder`'s loop."""
  return init_cache(config, batch_size, slots, stacked=not config.unroll_layers)


def _prefill(apply, prompt_ids_bp, prompt_mask_bp, st: _Static):
  """Caches the prompts once; returns `(cache of B * G rows with P + N - 1 slots, next-token
  logits [B * G, V])`, rows prompt-major, sharded as the decode loop keeps them.

  `apply` is `cached_decoder`'s apply with its params bound.
  All but the last prompt token go through a cache of just P - 1 slots (attention over the prompt,
  not over the empty slots to come) and their logits go unused, so XLA drops the [B, P, V] LM head.
  The cache then grows to P + N - 1 slots (the last drawn token never enters it) and the last
  prompt token runs alone for the first draw. The rows repeat G times after it; a stacked cache
  repeats before it, so that the grown stack is built in one pass from the small one (a repeat of
  the grown stack holds both at once: 1.25x the cache at G = 4; per-layer buffers go one by one).
  """
  num_prompts, prompt_len = prompt_ids_bp.shape
  g, mesh = st.group_size, st.mesh
  positions_bp = prompt_positions(prompt_mask_bp)
  cache = empty_cache(st.model.config, num_prompts, prompt_len - 1)
  if prompt_len > 1:
    head = slice(None), slice(None, -1)
    with kernel_mesh(mesh):  # the attention kernels run per shard (shard_map)
      _, cache = apply(prompt_ids_bp[head], positions_bp[head], prompt_mask_bp[head], cache=cache)
  cache = _grow_cache(cache, st.max_new_tokens)
  tail = [x[:, -1:] for x in (prompt_ids_bp, positions_bp, prompt_mask_bp)]
  if cache.stacked:
    cache = loop.constrain_cache(repeat_rows(cache, g), mesh)
    tail = [jnp.repeat(x, g, axis=0) for x in tail]
  with kernel_mesh(mesh):
    logits_r1v, cache = apply(*tail, cache=cache)
  logits_rv = logits_r1v[:, 0]
  if not cache.stacked:
    cache = loop.constrain_cache(repeat_rows(cache, g), mesh)
    logits_rv = jnp.repeat(logits_rv, g, axis=0)
  return cache, sharding.constrain_rows(logits_rv, mesh)


def _grow_cache(cache: KVCache, extra_slots: int) -> KVCache:
  """Appends empty (invalid) slots to every layer's `[B, Hkv, S, D]` buffer."""
  grow = functools.partial(jnp.pad, pad_width=((0, 0), (0, 0), (0, extra_slots), (0, 0)))
  return cache.map_layers(grow).replace(mask=jnp.pad(cache.mask, ((0, 0), (0, extra_slots))))


def repeat_rows(cache: KVCache, group_size: int) -> KVCache:
  """Repeats each row of a cache `group_size` times (prompt-major)."""
  repeat = functools.partial(jnp.repeat, repeats=group_size, axis=0)
  return cache.map_layers(repeat).replace(mask=repeat(cache.mask))


class _Static(NamedTuple):
  """`_generate`'s static arguments (`_static_args`)."""

  model: nn.Module
  group_size: int
  max_new_tokens: int
  greedy: bool
  stop_ids: tuple[int, ...]
  top_k: int
  pad_id: int
  mesh: Mesh | None
  compact: bool


def _apply(params, model: nn.Module):
  """`cached_decoder(model)`'s apply with `params` bound; for the per-layer decoder, stacked
  params are unstacked first (once, outside the loop: prefill and decode read each weight in
  place)."""
  decoder = cached_decoder(model)
  if not decoder.scan_layers and not is_decode_params(params):
    params = unstack_layers(params)
  elif decoder.scan_layers and "layers" not in params:
    raise ValueError(
      "per-layer params given for a model with unroll_layers=False, whose sampler runs the rolled "
      "loop on the stacked params: pass them stacked (decode_params(params, model.config))"
    )
  return functools.partial(decoder.apply, {"params": params})


def _start(apply, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, st: _Static):
  """Prefill, then the first draw: the decode loop's state before its first step."""
  width, mesh, g = st.max_new_tokens, st.mesh, st.group_size
  cache, first_logits_rv = _prefill(apply, prompt_ids_bp, prompt_mask_bp, st)
  first_position_r = jnp.repeat(prompt_positions(prompt_mask_bp)[:, -1] + 1, g)
  state = loop.State(
    step=jnp.zeros((), jnp.int32),
    cache=cache,
    rows=sharding.constrain_rows(loop.initial_rows(first_position_r, width, st.pad_id), mesh),
  )
  return _draw_and_record(state, first_logits_rv, rng, temperature, top_p, st)


def _draw_and_record(state: loop.State, logits_rv, rng, temperature, top_p, st: _Static):
  drawn = draw(
    logits_rv,
    loop.row_uniforms(rng, state.step, state.rows.row_id),
    temperature,
    top_p,
    top_k=st.top_k,
    greedy=st.greedy,
  )
  return loop.record(state, drawn, st.stop_ids, st.pad_id)


def _decode_step(apply, state: loop.State, rng, temperature, top_p, st: _Static) -> loop.State:
  """One step of the decode loop: the last drawn tokens through the cache, then the next draw."""
  positions = (state.rows.first_position + state.step - 1)[:, None]
  with kernel_mesh(st.mesh):
    logits_r1v, cache = apply(state.rows.last_token[:, None], positions, cache=state.cache)
  state = state._replace(cache=loop.constrain_cache(cache, st.mesh))
  return _draw_and_record(state, logits_r1v[:, 0], rng, temperature, top_p, st)


def kernel_mesh(mesh: Mesh | None):
  """The context under which `models.attention`'s kernels run per shard of `mesh` (none without):
  every cached forward of a sampler runs under it."""
  return (
    contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
  )


@functools.partial(jax.jit, static_argnames=("st",))
def _generate(params, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, st: _Static):
  apply = _apply(params, st.model)
  state = _start(apply, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, st)
  decode_one = functools.partial(
    _decode_step, apply, rng=rng, temperature=temperature, top_p=top_p, st=st
  )
  rows = state.rows.row_id.shape[0]
  sizes = loop.stage_sizes(rows, compact=st.compact, shards=loop.batch_shards(rows, st.mesh))
  out = loop.decode(state, decode_one, width=st.max_new_tokens, sizes=sizes, mesh=st.mesh)
  mask = jnp.arange(st.max_new_tokens)[None, :] < out.lengths[:, None]
  return SampleOutput(
    tokens=out.tokens,
    logprobs=out.logprobs,
    mask=mask,
    lengths=out.lengths,
    truncated=~out.done,
    nonfinite=out.nonfinite,
  )


def generate(
  model: nn.Module,
  params,
  prompt_ids_bp: jax.Array,
  prompt_mask_bp: jax.Array,
  rng: jax.Array,
  *,
  group_size: int = 1,
  max_new_tokens: int,
  temperature: float | jax.Array = 1.0,
  top_p: float | jax.Array = 1.0,
  top_k: int = 0,
  greedy: bool = False,
  stop_ids: Sequence[int] = (),
  pad_id: int = 0,
  mesh: Mesh | None = None,
  compact: bool = True,
) -> SampleOutput:
  """Samples `group_size` completions of each left-padded prompt (prefilled once, cache shared).

  Args:
    model: the scanned linen decoder (`model.apply({"params": p}, ids, positions, mask, cache=c)`).
    params: its parameters (placed by the caller; sharded as the model's rules say), stacked, or
      converted by `decode_params` (to sample several times from the same weights without
      copying them out of the stack in every call).
    prompt_ids_bp, prompt_mask_bp: `[B, P]` left-padded prompts and their mask (`pad_prompts`).
    rng: a PRNG key; row r draws token t with `fold_in(fold_in(rng, t), r)`
      (`loop.row_uniforms`), so outputs are a function of the key, compacting or not.
    group_size: samples per prompt (G); output rows `b * G + g`.
    max_new_tokens: N, the width of the output.
    temperature, top_p: may be traced (no recompile when they change); temperature > 0.
    top_k: 0 for no top-k filter. greedy: argmax instead of sampling.
    stop_ids: token ids that end a completion (kept in it, masked after).
    mesh: when given, rows and the cache are sharded over ('data', 'fsdp') of this mesh.
    compact: decode the long tail in smaller, halving batches of the rows still running
      (`sampling.loop`); the same outputs as the plain loop, fewer row-steps.

  Returns:
    `SampleOutput` with `[B * G, N]` tokens, log-probs and mask, `[B * G]` lengths, truncated
    and nonfinite (the caller treats a flagged row's step as bad).
  """
  prompt_ids_bp = jnp.asarray(prompt_ids_bp, jnp.int32)
  prompt_mask_bp = jnp.asarray(prompt_mask_bp, bool)
  if prompt_ids_bp.ndim != 2 or prompt_ids_bp.shape != prompt_mask_bp.shape:
    raise ValueError(
      f"prompt ids {prompt_ids_bp.shape} and mask {prompt_mask_bp.shape} must both be [B, P]"
    )
  if group_size < 1 or max_new_tokens < 1:
    raise ValueError(f"group_size={group_size} and max_new_tokens={max_new_tokens} must be >= 1")
  if not model.scan_layers:
    raise ValueError("generate takes the scanned Decoder (stacked params); it unstacks them itself")
  vocab_size = model.config.vocab_size
  if not 0 <= top_k <= vocab_size:
    raise ValueError(f"top_k={top_k} must be in [0, vocab_size={vocab_size}]")
  if isinstance(temperature, int | float) and not greedy and temperature <= 0:
    raise ValueError(f"temperature={temperature} must be > 0 (use greedy=True for argmax)")
  if isinstance(top_p, int | float) and not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1]")
  if mesh is not None:
    spec = sharding.logical_to_spec(prompt_ids_bp.shape, ("batch", None), mesh)
    prompt_ids_bp = jax.device_put(prompt_ids_bp, NamedSharding(mesh, spec))
    prompt_mask_bp = jax.device_put(prompt_mask_bp, NamedSharding(mesh, spec))
  static = _static_args(
    model, group_size, max_new_tokens, greedy, stop_ids, top_k, pad_id, mesh, compact
  )
  temperature, top_p = _device_scalar(temperature, mesh), _device_scalar(top_p, mesh)
  return _generate(params, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, static)


def decode_params(params, config: ModelConfig, *, dtype=None, replicate_over: Sequence[str] = ()):
  """The params in the layout the sampler decodes `config`'s model with, converted in one program
  (`decode_converter`): stacked for the rolled loop, per layer for an unrolled one
  (`layers_0 ... layers_{L-1}`, as `models.decoder.unstack_layers`); floating arrays in `dtype`
  (the compute dtype, which the decoder casts every weight to anyway; None: as they are), and each
  array sharded as before without the mesh axes `replicate_over`. The trainer converts once per
  round of sampler calls (`DecodeOptions.decode_params`) with the rows' axes ('data', 'fsdp'):
  the rows are split over them, so weights split over them too would be all-gathered by every
  decode step; replicated there and split over 'tensor' only, a step reads its shard of every
  weight in place. Params already per-layer are returned as they are. `generate` takes stacked
  params either way; per-layer ones skip the copy of every layer weight it otherwise makes per
  call."""
  if config.unroll_layers and is_decode_params(params):
    return params
  return decode_converter(params, config, dtype=dtype, replicate_over=replicate_over)(params)


def decode_converter(
  params, config: ModelConfig, *, dtype=None, replicate_over: Sequence[str] = ()
):
  """The jitted program `decode_params` converts `params` (arrays or sharded
  `jax.ShapeDtypeStruct`s: `ebpo_jax.aot` traces it) with."""
  dtype, per_layer = None if dtype is None else jnp.dtype(dtype), bool(config.unroll_layers)
  mesh = _params_mesh(params)
  if mesh is None:
    return _converter(None, None, dtype, per_layer)
  targets = _decode_shardings(params, mesh, tuple(replicate_over), per_layer)
  leaves, treedef = jax.tree.flatten(targets)
  return _converter(treedef, tuple(leaves), dtype, per_layer)


def _decode_shardings(params, mesh: Mesh, axes: tuple[str, ...], per_layer: bool) -> dict:
  """The decode params' shardings: each array's spec (per layer, a stacked one's without its
  leading layer axis) without the mesh axes `axes`."""

  def target(x, unstacked: bool) -> NamedSharding:
    spec = x.sharding.spec
    return NamedSharding(mesh, _without_axes(spec[1:] if unstacked else spec, axes))

  out = {k: jax.tree.map(lambda x: target(x, False), v) for k, v in params.items() if k != "layers"}
  layer = jax.tree.map(lambda x: target(x, per_layer), params["layers"])
  if not per_layer:
    return {**out, "layers": layer}
  num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
  return {**out, **{f"layers_{i}": layer for i in range(num_layers)}}


def _params_mesh(params) -> Mesh | None:
  """The mesh the params are sharded over (None: not `NamedSharding`s, e.g. on one device)."""
  shardings = {getattr(x, "sharding", None) for x in jax.tree.leaves(params)}
  meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
  return meshes.pop() if len(meshes) == 1 and None not in shardings else None


def _without_axes(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
  """`spec` with the mesh axes `axes` dropped (those dimensions replicated over them)."""
  kept = []
  for entry in spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    rest = tuple(n for n in names if n is not None and n not in axes)
    kept.append(rest if len(rest) > 1 else (rest[0] if rest else None))
  return PartitionSpec(*kept)


@functools.lru_cache(maxsize=16)
def _converter(treedef, shardings: tuple | None, dtype, per_layer: bool):
  """The jitted conversion to the decode layout, `shardings` the flattened leaves of its output's
  (None: as jit places them): one compile per (params structure, target shardings, dtype,
  layout)."""

  def convert(params):
    out = unstack_layers(params) if per_layer else params
    if dtype is None:
      return out
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(cast, out)

  if shardings is None:
    return jax.jit(convert)
  return jax.jit(convert, out_shardings=jax.tree.unflatten(treedef, list(shardings)))


def is_decode_params(params) -> bool:
  """Whether `params` are in the unrolled sampler's per-layer layout (else stacked)."""
  return "layers" not in params and "layers_0" in params


def trace_generate(
  model: nn.Module,
  params,
  prompt_ids_bp,
  prompt_mask_bp,
  rng,
  temperature,
  top_p,
  **options,
) -> jax.stages.Traced:
  """The program `generate` runs, traced for these inputs (arrays or `jax.ShapeDtypeStruct`s
  with shardings; temperature and top_p as float32 scalars) with the same static arguments
  (`options`: `generate`'s keywords after `top_p`). `.jaxpr` is its computation and
  `.lower().compile()` compiles it: what ebpo_jax.aot measures."""
  static = _static_args(model, **options)
  return _generate.trace(params, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, static)


def trace_parts(model, params, prompt_ids_bp, prompt_mask_bp, rng, temperature, top_p, **options):
  """`trace_generate`'s program in two parts, each traced alone with the same inputs and static
  options: `(prefill, step)`, the prefill with the first draw, and one step of the decode loop
  on the state the prefill leaves (abstract, sharded as the loop keeps it). A compiler counts a
  loop's body once; `ebpo_jax.aot` counts a call as the prefill plus the loop's trips x a step."""
  st = _static_args(model, **options)
  args = (rng, temperature, top_p)

  def prefill(params, ids, mask, *args):
    return _start(_apply(params, st.model), ids, mask, *args, st)

  def step(params, state, *args):
    return _decode_step(_apply(params, st.model), state, *args, st)

  state = jax.eval_shape(prefill, params, prompt_ids_bp, prompt_mask_bp, *args)
  # The state donated, as the loop updates it in place (else the step would copy out the cache),
  # and under a mesh in the layouts the compiler picks, as the loop carries it in the whole program:
  # an entry parameter's or a result's default layout added a copy of the cache (the step's in and
  # out; the prefill's result, a second stacked cache at once for the rolled layer loop).
  if st.mesh is None:
    prefill, step = jax.jit(prefill), jax.jit(step, donate_argnums=1)
  else:
    state = loop.with_shardings(state, st.mesh)
    formats = _auto_layouts(state)
    prefill = jax.jit(prefill, out_shardings=formats)
    ins = (None, formats, None, None, None)
    step = jax.jit(step, donate_argnums=1, in_shardings=ins, out_shardings=formats)
  prefill_traced = prefill.trace(params, prompt_ids_bp, prompt_mask_bp, *args)
  return prefill_traced, step.trace(params, state, *args)


def _auto_layouts(state: loop.State):
  """`state`'s shardings, each leaf in the compiler's choice of layout (the same in and out, so
  that the donated state is updated in place)."""
  return jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), state)


def _static_args(
  model,
  group_size=1,
  max_new_tokens=1,
  greedy=False,
  stop_ids=(),
  top_k=0,
  pad_id=0,
  mesh=None,
  compact=True,
) -> _Static:
  """`_generate`'s static arguments, normalised (hashable Python values: one compile each)."""
  return _Static(
    model=model,
    group_size=int(group_size),
    max_new_tokens=int(max_new_tokens),
    greedy=bool(greedy),
    stop_ids=tuple(int(s) for s in stop_ids),
    top_k=int(top_k),
    pad_id=int(pad_id),
    mesh=mesh,
    compact=bool(compact),
  )


def _device_scalar(x: float | jax.Array, mesh: Mesh | None) -> jax.Array:
  """A float32 scalar on the device (replicated over `mesh`), placed explicitly: callers may run
  under `jax.transfer_guard("disallow")`."""
  if isinstance(x, jax.Array):
    return x.astype(jnp.float32)
  if mesh is None:
    return jax.device_put(np.float32(x))
  return sharding.place_from_host(np.float32(x), sharding.replicated(mesh))


def compile_count() -> int:
  """How many programs `generate` has compiled so far in this process (one per shape bucket)."""
  return _generate._cache_size()
