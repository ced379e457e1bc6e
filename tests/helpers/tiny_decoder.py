"""The tiny decoder (configs.TINY_MODEL, another RoPE base) that tests/unit/models/test_lora.py and
test_shared_prefix.py share, and its params built in one compiled program (imported by those
tests, not collected: no test_ prefix)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from ebpo_jax.models import Decoder, ModelConfig
from tests.helpers.configs import TINY_MODEL

BASE = dataclasses.replace(TINY_MODEL, rope_theta=500.0)


def init_params(config: ModelConfig, seed: int = 0, noise: float = 0.0):
  """`Decoder(config)`'s params from `key(seed)`, plus, with `noise`, `noise` x N(0, 1) on every
  leaf (norm scales, biases and a fresh LoRA B are then not their init's ones or zeros).

  Init and noise run as one jitted program: drawn eagerly, each leaf's distinct shape would
  compile its own random-normal program (about a second each on 2 busy cores)."""

  def build():
    ids = jnp.zeros((1, 4), jnp.int32)
    params = nn.meta.unbox(Decoder(config).init(jax.random.key(seed), ids)["params"])
    if not noise:
      return params
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + noise * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noisy)

  return jax.jit(build)()
