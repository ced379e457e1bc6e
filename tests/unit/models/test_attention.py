"""The attention backends (models.attention) against the XLA reference in float32: splash in Pallas
interpret mode and cudnn's call through XLA, on outputs and on the gradients of q, k and v (full
rows: causal, left-padded, GQA; the shared-prefix layout at G = 4); and `auto` per platform and
compute dtype."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import sharding
from ebpo_jax.models import attention, shared_prefix
from tests.helpers.tiny_decoder import BASE

ATOL = 1e-5
SPLASH = dataclasses.replace(BASE, attention="splash", attention_emulate=True)
CUDNN = dataclasses.replace(BASE, attention="cudnn", attention_emulate=True)


def _qkv(b: int, t: int, heads: int, kv_heads: int, d: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  draw = lambda h: jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  return draw(heads), draw(kv_heads), draw(kv_heads)


def _outputs_and_grads(config, q, k, v, mask_bt, groups=None):
  """The attention's output and the gradients of q, k, v of a loss over the valid queries' outputs
  (a pad query's output is read by nothing, in any backend)."""
  valid = attention.layout(config.attention, mask_bt, groups)
  weights = jax.random.normal(jax.random.key(1), q.shape) * mask_bt[:, :, None, None]

  def loss(q, k, v):
    out = attention.attend(q, k, v, valid, config)
    return (out * weights).sum(), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out * mask_bt[:, :, None, None], grads


def _assert_equal_to_xla(config, q, k, v, mask_bt, groups=None):
  want, want_grads = _outputs_and_grads(BASE, q, k, v, mask_bt, groups)
  got, got_grads = _outputs_and_grads(config, q, k, v, mask_bt, groups)
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, atol=ATOL, rtol=0, err_msg=f"d{name}")
  # A plausible bug (no mask, no causality) moves the outputs by far more than the tolerance.
  assert float(jnp.abs(want).max()) > 100 * ATOL


FULL_ROWS = {
  "causal": (2, 2, np.ones((2, 20), bool)),
  "left_padded": (2, 2, np.arange(20)[None] >= np.array([[0], [7]])),
  "gqa_4_per_kv_head": (4, 1, np.arange(20)[None] >= np.array([[3], [0]])),
}


@pytest.mark.parametrize("backend", ["splash", "cudnn"])
@pytest.mark.parametrize("case", FULL_ROWS)
def test_full_rows_equal_xla(backend, case):
  heads, kv_heads, mask = FULL_ROWS[case]
  config = {"splash": SPLASH, "cudnn": CUDNN}[backend]
  _assert_equal_to_xla(config, *_qkv(2, 20, heads, kv_heads), jnp.asarray(mask))


@pytest.mark.parametrize("backend", ["splash", "cudnn"])
def test_shared_prefix_layout_equals_xla(backend):
  """Packed rows of 2 prompts (P = 6, one left-padded) x G = 4 completions (N = 5, early stops),
  2 q heads per kv head: the prompt causal over itself, each completion over its prompt then
  itself."""
  groups = shared_prefix.PrefixGroups(prompt_len=6, group_size=4)
  prompt_mask = np.arange(6)[None] >= np.array([[0], [4]])
  completion_mask = np.arange(5)[None] < np.array([[5], [2], [4], [1], [5], [3], [5], [5]])
  mask = np.concatenate([prompt_mask, completion_mask.reshape(2, 20)], axis=1)
  config = {"splash": SPLASH, "cudnn": CUDNN}[backend]
  _assert_equal_to_xla(config, *_qkv(2, 26, 4, 2), jnp.asarray(mask), groups)


def test_splash_blocks_pad_long_rows():
  """A row longer than the block (T = 200, block 128: two query and key blocks, padded to 256)."""
  config = dataclasses.replace(SPLASH, attention_block=128)
  mask = jnp.asarray(np.arange(200)[None] >= np.array([[5]]))
  _assert_equal_to_xla(config, *_qkv(1, 200, 2, 1, d=8), mask)
  assert attention.block_size(200, 128) == 128 and attention.block_size(20, 512) == 128


def _device(platform: str, kind: str = ""):
  return types.SimpleNamespace(platform=platform, device_kind=kind)


H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
  "platform, kind, name, dtype, want",
  [
    ("tpu", "TPU v5", "auto", "float32", ("splash", False)),
    ("tpu", "TPU v5", "auto", "bfloat16", ("splash", False)),
    # cuDNN's attention refuses float32 ("Q must be fp16/bf16/fp8"): auto is xla there.
    ("gpu", H100, "auto", "float32", ("xla", False)),
    ("gpu", H100, "auto", "bfloat16", ("cudnn", False)),
    ("gpu", H100, "auto", "float16", ("cudnn", False)),
    ("gpu", H100, "cudnn", "bfloat16", ("cudnn", False)),
    ("gpu", "AMD Instinct MI300X", "auto", "bfloat16", ("xla", False)),
    ("cpu", "cpu", "auto", "float32", ("xla", False)),
    ("cpu", "cpu", "auto", "bfloat16", ("xla", False)),
    ("cpu", "cpu", "splash", "float32", ("splash", True)),
    ("cpu", "cpu", "cudnn", "bfloat16", ("cudnn", True)),
    ("tpu", "TPU v5", "xla", "float32", ("xla", False)),
    ("gpu", H100, "splash", "float32", ("splash", True)),
  ],
)
def test_resolve_picks_each_backend_per_platform_and_dtype(platform, kind, name, dtype, want):
  assert attention.resolve(name, _device(platform, kind), dtype) == want


def test_resolve_refuses_an_unknown_backend():
  with pytest.raises(ValueError, match="attention='flash'; expected one of"):
    attention.resolve("flash", _device("cpu"), "float32")


@pytest.mark.parametrize("platform, kind", [("gpu", H100), ("cpu", "cpu")])
def test_resolve_refuses_cudnn_in_float32(platform, kind):
  """On the GPU, and emulated on the CPU too (the emulation would run what the GPU refuses)."""
  with pytest.raises(ValueError, match="bfloat16 or float16 only, not float32"):
    attention.resolve("cudnn", _device(platform, kind), "float32")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_splash_per_shard_under_a_mesh_equals_xla(kv_heads):
  """Under a context mesh the kernel runs in shard_map: rows over data x fsdp = 4, heads over
  tensor = 2 (4 q heads; 2 kv heads split with them, or one kv head whole on every shard), on 8
  CPU devices."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  q, k, v = _qkv(4, 20, 4, kv_heads)
  mask = jnp.asarray(np.arange(20)[None] >= np.array([[0], [5], [19], [2]]))
  want, want_grads = _outputs_and_grads(BASE, q, k, v, mask)
  with jax.set_mesh(mesh):
    got, got_grads = _outputs_and_grads(SPLASH, q, k, v, mask)
    lowered = jax.jit(
      lambda q: attention.attend(q, k, v, attention.layout("splash", mask, None), SPLASH)
    )
    assert "shard_map" in str(lowered.trace(q).jaxpr)
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
  for g, w in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, atol=ATOL, rtol=0)
