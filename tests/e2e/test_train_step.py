"""train_step in process under LoRA: 8 sharded devices equal 1 (two compiles of the step)."""

import jax
import numpy as np

from ebpo_jax.models import lora
from tests.helpers.configs import TINY_LORA
from tests.helpers.tiny_step import tiny_steps


def _spec(x) -> tuple:
  return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


# e2e: in process, but two compiles of the step (8 devices, 1)
def test_a_sharded_lora_step_on_8_devices_equals_1():
  # fsdp=4 x tensor=2, so that both adapter halves are split: A on the kernel's input axis, B on
  # its output axis, the rank dim replicated (models/lora.py); the base as a full run's kernels.
  eight = tiny_steps({**TINY_LORA, "mesh.fsdp": 4, "mesh.tensor": 2})
  one = tiny_steps(TINY_LORA, num_devices=1)
  state8, state1 = eight.fresh_state(), one.fresh_state()
  attn, mlp = state8.params["layers"]["self_attn"], state8.params["layers"]["mlp"]
  assert _spec(attn["q_proj"][lora.A_NAME]) == (None, "fsdp", None)  # [layers, embed, r]
  assert _spec(attn["q_proj"][lora.B_NAME]) == (None, None, "tensor")  # [layers, r, heads*dim]
  assert _spec(attn["o_proj"][lora.A_NAME]) == (None, "tensor", None)  # [layers, heads*dim, r]
  assert _spec(attn["o_proj"][lora.B_NAME]) == (None, None, "fsdp")  # [layers, r, embed]
  assert _spec(mlp["down_proj"][lora.A_NAME]) == (None, "tensor", None)  # [layers, mlp, r]
  q_kernel = state8.base["layers"]["self_attn"]["q_proj"]["kernel"]
  assert _spec(q_kernel) == (None, "fsdp", "tensor", None)  # [layers, embed, heads, head_dim]
  mu = state8.opt_state[1][0].mu  # Adam's moments lie as their adapters
  assert _spec(mu["layers"]["self_attn"]["q_proj"][lora.A_NAME]) == (None, "fsdp", None)
  # Two steps: the second has B != 0, so A's gradients and the KL to the base are not zero.
  for seed in (0, 1):
    state8, metrics8, _ = eight(eight.batch(seed), state8)
    state1, metrics1, _ = one(one.batch(seed), state1)
    # float32 sums split across devices: the loss is a mean of B*G*N = 160 terms of O(1) whose
    # advantages cancel to about 0, so its error is absolute: a few ulps of 1 (eps 1.2e-7) times
    # log2(8) = 3 more levels of partial sums, ~4e-7, hence atol 1e-6. The others do not cancel
    # (the KL, ~1e-9 here, stays relative: a looser atol would let any KL pass).
    for key in ("loss", "grad_norm", "kl", "entropy", "ratio_mean"):
      atol = 1e-6 if key == "loss" else 1e-8
      np.testing.assert_allclose(metrics8[key], metrics1[key], rtol=1e-5, atol=atol, err_msg=key)
  assert float(metrics8["kl"]) > 1e-9
  for name in ("params", "opt_state", "prior"):
    got, want = getattr(state8, name), getattr(state1, name)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=name)
  assert _spec(state8.params["layers"]["self_attn"]["q_proj"][lora.B_NAME]) == (
    None,
    None,
    "tensor",
  )
