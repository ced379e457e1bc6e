"""Logit parity with transformers PyTorch Llama/Qwen2/Qwen3; save/load round trips; sharded load."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from ebpo_jax import sharding
from ebpo_jax.models import from_pretrained, save_pretrained
from tests.helpers.configs import hf_shape
from tests.helpers.torch_models import randomize_torch_weights

MAX_REL_ERR = 1e-4
SEQ_LEN = 40  # past original_max_position_embeddings=16 of the llama3 case

BASE = {**hf_shape(), "vocab_size": 96, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
LLAMA3_ROPE = dict(
  rope_type="llama3",
  rope_theta=500.0,
  factor=4.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=16,
)
CASES = {
  # GQA, untied, llama3 rope scaling (with head_dim 8: one smoothed, three scaled frequencies).
  "llama_gqa_untied_llama3": ("Llama", dict(BASE, rope_parameters=LLAMA3_ROPE)),
  "llama_mha_tied": ("Llama", dict(BASE, num_key_value_heads=4, tie_word_embeddings=True)),
  "qwen2_bias_untied": (
    "Qwen2",
    dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
  ),
  # head_dim 16 != hidden/heads = 8, as in Qwen3.
  "qwen3_qknorm_tied": ("Qwen3", dict(BASE, head_dim=16, tie_word_embeddings=True)),
}


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  """{case: (torch model, directory)} written with transformers' save_pretrained."""
  models = {}
  for i, (case, (arch, kwargs)) in enumerate(CASES.items()):
    config = getattr(transformers, f"{arch}Config")(**kwargs)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    randomize_torch_weights(model, seed=i)
    path = str(tmp_path_factory.mktemp(case))
    model.save_pretrained(path)
    models[case] = (model, path)
  return models


@pytest.fixture(scope="module")
def input_ids():
  return np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, SEQ_LEN)).astype(np.int32)


def _torch_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, hf_models, input_ids):
  torch_model, path = hf_models[case]
  model, params = from_pretrained(path)
  ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(input_ids)))
  ref = _torch_logits(torch_model, input_ids)
  err = _rel_err(ours, ref)
  print(f"{case}: max rel err {err:.2e}")
  assert ours.shape == ref.shape and ours.dtype == np.float32
  assert err <= MAX_REL_ERR, f"{case}: max relative error {err:.2e} > {MAX_REL_ERR}"


def test_config_round_trip(hf_models):
  _, path = hf_models["llama_gqa_untied_llama3"]
  model, _ = from_pretrained(path)
  config = model.config
  assert config.rope_theta == 500.0 and dict(config.rope_scaling)["factor"] == 4.0
  assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (2, 8, False)
  assert type(config).from_hf(config.to_hf()) == config


def test_save_pretrained_sharded_loads_in_transformers(hf_models, input_ids, tmp_path):
  _, path = hf_models["qwen2_bias_untied"]
  model, params = from_pretrained(path)
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(input_ids)))
  out = str(tmp_path / "saved")
  save_pretrained(out, model, params, max_shard_bytes=20_000)  # forces several shards + an index
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    files = set(json.load(f)["weight_map"].values())
  assert len(files) > 1
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == "Qwen2ForCausalLM"
  assert _rel_err(_torch_logits(reloaded, input_ids), ours) <= MAX_REL_ERR
  _, params_again = from_pretrained(out)
  jax.tree.map(np.testing.assert_array_equal, params_again, params)


def test_save_pretrained_tied_single_file(hf_models, input_ids, tmp_path):
  _, path = hf_models["qwen3_qknorm_tied"]
  model, params = from_pretrained(path)
  out = str(tmp_path / "saved")
  save_pretrained(out, model, params)
  assert os.path.isfile(os.path.join(out, "model.safetensors"))
  umask = os.umask(0)
  os.umask(umask)
  mode = os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777
  assert mode == 0o666 & ~umask  # readable by others (a vLLM server as another user), not 0600
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(input_ids)))
  assert _rel_err(_torch_logits(reloaded, input_ids), ours) <= MAX_REL_ERR


def test_sharded_load_on_8_devices(hf_models, input_ids):
  _, path = hf_models["llama_gqa_untied_llama3"]
  model, params = from_pretrained(path)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded_model, sharded = from_pretrained(path, mesh=mesh)
  q_kernel = sharded["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, E, H, D]
  assert q_kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert len(q_kernel.addressable_shards) == 8
  assert q_kernel.addressable_shards[0].data.shape == (2, 16, 2, 8)
  ids = np.concatenate([input_ids, input_ids[:, ::-1]])  # batch 4 over data x fsdp
  sharded_ids = jax.device_put(jnp.asarray(ids), sharding.row_sharding(ids.shape, mesh))
  sharded_logits = jax.jit(sharded_model.apply)({"params": sharded}, sharded_ids)
  logits = model.apply({"params": params}, jnp.asarray(ids))
  # Equal to float32 sums split across devices: the fsdp- and tensor-sharded contractions add their
  # partial sums in another order, and the layers carry the difference on (an absolute error of the
  # logits, as the sampler's in test_sampling.py: SHARDED_ATOL there, measured 2e-5, bound 1e-4).
  np.testing.assert_allclose(np.asarray(sharded_logits), np.asarray(logits), rtol=1e-5, atol=1e-4)


def test_bfloat16_compute_returns_float32_logits(hf_models, input_ids):
  _, path = hf_models["llama_mha_tied"]
  model, params = from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert params["embed_tokens"].dtype == jnp.float32
  logits = model.apply({"params": params}, jnp.asarray(input_ids))
  assert logits.dtype == jnp.float32
  _, params32 = from_pretrained(path)
  model32 = model.clone(config=dataclasses.replace(model.config, dtype="float32"))
  ref = np.asarray(model32.apply({"params": params32}, jnp.asarray(input_ids)))
  assert _rel_err(np.asarray(logits), ref) < 0.1
