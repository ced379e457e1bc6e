"""LoRA adapters on the decoder's projections: `y = x W + (alpha / r) * (x A) B`.

Each targeted projection (`ModelConfig.lora_targets`: q, k, v, o, gate, up, down) gets
`lora_a [in, r]` and `lora_b [r, out]` beside its `kernel`, where `in` and `out` are the kernel's
input and output axes flattened (q_proj: in = embed, out = heads * head_dim). B starts at zero, so
a fresh adapter leaves the model exactly the base; A starts normal with std `1 / sqrt(in)` (the
Kaiming-style scale that keeps `x A` at the scale of `x`), so B's first gradients are not zero.

Adapters are float32 whatever the base's param dtype: they are the trained weights, and their
optimizer state follows them. Sharding: A carries the logical axis of the kernel's first input
axis on its `in` dim and B the kernel's first output axis on its `out` dim (so `x A` is
contracted, and `(x A) B` produced, on the same devices as `x W`), and the rank dim is `None`
(replicated): r is small (8 to 64), so splitting it would only add a collective per matmul.

The trainer keeps the two halves apart (`split` / `combine`): only the adapters are trained,
checkpointed and carried in the optimizer state, and the frozen base is the KL reference, run by
`base_model` (the same decoder without adapters): no second copy of the base. `merge` folds
trained adapters into the kernels, for a merged export or a sampler without adapter matmuls.

Dropout (`lora_dropout`, as PEFT's): each adapter's input is dropped out before A, only in an
apply given the `DROPOUT_RNG` stream, which the trainer passes to the policy-gradient loss's
forward alone; sampling, evaluation and the KL reference run the adapters whole.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ebpo_jax.models.config import LORA_TARGETS, ModelConfig

TARGETS = LORA_TARGETS
# The linen rng stream of the adapters' dropout: only an apply given it (the policy-gradient
# loss's forward) drops; sampling, evaluation and the KL reference never pass it.
DROPOUT_RNG = "lora_dropout"
A_NAME, B_NAME = "lora_a", "lora_b"


def parse_targets(targets: str) -> tuple[str, ...]:
  """`"q,v,down"` -> `("q", "v", "down")`; ValueError naming an unknown target."""
  names = tuple(t.strip() for t in targets.split(",") if t.strip())
  unknown = [t for t in names if t not in TARGETS]
  if unknown or not names:
    raise ValueError(
      f"unknown or no LoRA targets {unknown or targets!r}; expected any of {TARGETS}"
    )
  return names


def delta(
  module: nn.Module,
  x: jax.Array,
  shape: tuple[int, ...],
  axes: tuple[str, ...],
  num_in: int,
  out_shape: tuple[int, ...],
) -> jax.Array:
  """`(alpha / r) * (x A) B` reshaped to `out_shape`, declaring A and B on `module`.

  `shape`/`axes` are the base kernel's; its first `num_in` axes are the input (flattened, the
  last axis of `x`), the rest the output. With `config.lora_dropout > 0` and a `DROPOUT_RNG`
  stream in the apply (the training loss's forward only), `x` is dropped out before A.
  """
  c = module.config
  r = c.lora_rank
  fan_in, fan_out = math.prod(shape[:num_in]), math.prod(shape[num_in:])
  a_init = nn.initializers.normal(1.0 / math.sqrt(fan_in))
  a_init = nn.with_logical_partitioning(a_init, (axes[0], None))
  b_init = nn.with_logical_partitioning(nn.initializers.zeros, (None, axes[num_in]))
  a = module.param(A_NAME, a_init, (fan_in, r), jnp.float32)
  b = module.param(B_NAME, b_init, (r, fan_out), jnp.float32)
  dtype = jnp.dtype(c.dtype)
  if c.lora_dropout > 0 and module.has_rng(DROPOUT_RNG):
    keep = jax.random.bernoulli(module.make_rng(DROPOUT_RNG), 1.0 - c.lora_dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - c.lora_dropout), 0.0)
  low = jnp.einsum("...i,ir->...r", x.astype(dtype), a.astype(dtype))
  out = jnp.einsum("...r,ro->...o", low, b.astype(dtype)) * (c.lora_alpha / r)
  return out.reshape(out_shape).astype(dtype)


def is_adapter(path: tuple[Any, ...]) -> bool:
  """Whether a key path (from `jax.tree_util.tree_flatten_with_path`) ends at an adapter leaf."""
  last = path[-1]
  return getattr(last, "key", getattr(last, "name", None)) in (A_NAME, B_NAME)


def adapter_mask(params: Any) -> Any:
  """A tree like `params` of bools: True on adapter leaves (`lora_a`, `lora_b`)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(p), params)


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """`(adapters, base)`: two nested dicts of the same layout, the adapter leaves and the rest."""
  adapters, base = {}, {}
  for k, v in params.items():
    if k in (A_NAME, B_NAME):
      adapters[k] = v
    elif isinstance(v, Mapping):
      sub_adapters, base[k] = split(v)
      if sub_adapters:
        adapters[k] = sub_adapters
    else:
      base[k] = v
  return adapters, base


def combine(adapters: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
  """The inverse of `split`: the full params tree of an adapted model."""
  out = dict(base)
  for k, v in adapters.items():
    out[k] = combine(v, base[k]) if isinstance(v, Mapping) and k in base else v
  return out


def base_model(model: nn.Module) -> nn.Module:
  """The same decoder without adapters: it runs `split(params)[1]`, the frozen base."""
  return model.clone(config=dataclasses.replace(model.config, lora_rank=0))


def merge(params: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
  """The base params with each adapter folded into its kernel, `W + (alpha / r) A B`, in the
  kernel's dtype: the adapted model as a plain decoder (`base_model`). Works on stacked (scanned)
  and per-layer params alike: the leading axes of A and B are carried through."""
  scale = config.lora_alpha / config.lora_rank

  def fold(node: Mapping[str, Any]) -> dict[str, Any]:
    if A_NAME not in node:
      return {k: fold(v) if isinstance(v, Mapping) else v for k, v in node.items() if k != B_NAME}
    kernel = node["kernel"]
    delta = jnp.einsum("...ir,...ro->...io", node[A_NAME], node[B_NAME]) * scale
    merged = (kernel.astype(jnp.float32) + delta.reshape(kernel.shape)).astype(kernel.dtype)
    return {
      **{k: v for k, v in node.items() if k not in (A_NAME, B_NAME)},
      "kernel": merged,
    }

  return fold(params)
