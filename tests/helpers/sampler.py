"""The sampler tests' tiny policy, prompts and shared checks (tests/unit/sampling/)."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from ebpo_jax import sampling, sharding
from ebpo_jax.models import Decoder
from tests.helpers.configs import TINY_MODEL

# Most tests sample with the unrolled layer loop over per-layer params and cache (the CPU configs');
# the rolled loop over the stacked ones (the TPU configs') is held equal to it in
# tests/unit/sampling/test_sampling_layouts.py.
UNROLLED = dataclasses.replace(TINY_MODEL, unroll_layers=True)
PROMPTS = [[5, 9, 2, 7, 11, 3], [8], [12, 4, 4]]
BUCKETS = (4, 8)
PAD = 0


# Log-probs of one sampler program split over 8 devices (data = 2 x fsdp = 4) against another
# layout: the fsdp-sharded contractions of the decoder's float32 matmuls add their partial sums in
# another order (log2(4) = 2 more levels of rounding, each up to half an ulp of the running sum),
# and every layer carries the difference on to the logits. A log-softmax shifts a row's entries
# alike, so the error is absolute, not relative to the log-prob: measured up to 2.0e-5 (x86, a
# fresh clone; atol 1e-5 failed there) on log-probs down to about -6. 1e-4 is 5x that, still 1,000
# times below what a wrong token or a wrong position changes (O(0.1) and more).
SHARDED_ATOL = 1e-4


def tiny_policy():
  """(model, params): the unrolled tiny model with its init's weights x 6. A larger scale than the
  init's 0.02 gives peaked next-token distributions (few near-ties)."""
  model = Decoder(UNROLLED)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  params = nn.meta.unbox(params)
  return model, jax.jit(lambda p: jax.tree.map(lambda x: 6.0 * x, p))(params)  # one compile


# long_tailed_sample's static settings: 8 prompts of 1 to 4 tokens (bucket 4) x G = 4.
LONG_TAILED = dict(group_size=4, max_new_tokens=16, stop_ids=tuple(range(1, 64, 6)), pad_id=PAD)


def _long_tailed_prompts():
  prompts = [PROMPTS[i % 3][: 1 + i % 5] for i in range(8)]
  return sampling.pad_prompts(prompts, PAD, BUCKETS)


def long_tailed_sample(model, params, *, compact, mesh=None):
  """32 rows (8 prompts x G = 4) with a few stop tokens: lengths from 1 to the cap of 16."""
  ids, mask = _long_tailed_prompts()
  return sampling.generate(
    model, params, ids, mask, jax.random.key(4), temperature=0.9, top_p=0.95, mesh=mesh,
    compact=compact, **LONG_TAILED,
  )  # fmt: skip


def long_tailed_program(model, params, *, compact):
  """The compiled program of `long_tailed_sample` on one device: the same program (one compile
  in a process for both), to read its HLO."""
  ids, mask = _long_tailed_prompts()
  temperature, top_p = jnp.float32(0.9), jnp.float32(0.95)
  traced = sampling.trace_generate(
    model, params, ids, mask, jax.random.key(4), temperature, top_p, compact=compact, **LONG_TAILED
  )
  return traced.lower().compile()


def while_body(hlo: str, carried: str) -> str:
  """The text of the body computation of the while loop whose carry holds `carried`."""
  loop = next(line for line in hlo.splitlines() if " while(" in line and carried in line)
  body = re.search(r"body=(%[\w.\-]+)", loop).group(1)
  start = hlo.index(f"\n{body} ") + 1
  return hlo[start : hlo.index("\n}", start)]


def on_mesh(model, params, mesh):
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  return jax.device_put(params, sharding.logical_shardings(abstract["params"], mesh))
