"""LoRA adapters as after training."""

from typing import Any

import jax

from ebpo_jax import models


def trained_lora(params: Any, seed: int = 1, scale: float = 0.1) -> Any:
  """`params` (a full tree or the adapters) with every LoRA B random, as after training (a fresh B
  is zero: the adapters would not act), each on its old leaf's sharding."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
  out = [
    jax.device_put(scale * jax.random.normal(next(keys), x.shape), x.sharding)
    if path[-1].key == models.lora.B_NAME
    else x
    for path, x in leaves
  ]
  return jax.tree_util.tree_unflatten(treedef, out)
