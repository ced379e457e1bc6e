"""GGUF conversion: the llama.cpp Q/K permutation, the converted-model cache, the convert CLI,
round trips of small hand-made files (the real model vs transformers: e2e/test_model_gguf.py)."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from ebpo_jax.models import convert, from_pretrained, gguf_io
from ebpo_jax.tasks.tokenizers import HFTokenizer
from tests.helpers.configs import hf_shape


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the one the converter undoes)."""
  return (
    weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    .swapaxes(1, 2)
    .reshape(weight.shape)
  )


def test_unpermute_inverts_llama_cpp_permutation():
  weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of head_dim 8
  np.testing.assert_array_equal(
    gguf_io.unpermute_rope_rows(_llama_cpp_permute(weight, 3), 3), weight
  )
  # Rows of head 0 after permuting: 0,4,1,5,2,6,3,7 (the rotate-half halves interleaved).
  assert _llama_cpp_permute(weight, 3)[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_smollm2_cache_converts_once(tmp_path, monkeypatch, caplog):
  calls = []

  def fake_convert(gguf, out, dtype="float32"):
    calls.append(gguf)
    with open(os.path.join(out, "config.json"), "w") as f:
      f.write("{}")
    return out

  monkeypatch.setenv("EBPO_JAX_CACHE", str(tmp_path))
  monkeypatch.setattr(gguf_io, "convert_gguf", fake_convert)
  with caplog.at_level(logging.INFO):
    first = gguf_io.smollm2_135m_instruct()
    assert gguf_io.smollm2_135m_instruct() == first
  assert first.startswith(str(tmp_path)) and len(calls) == 1
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("converting ")]
  assert len(said) == 1 and said[0].endswith("(once; later runs reuse it) ...")
  assert os.listdir(tmp_path) == [os.path.basename(first)]  # no staging directory left behind


def test_convert_cli_reports_a_missing_file(tmp_path, capsys):
  assert convert.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 1
  assert "nope.gguf" in capsys.readouterr().err


_GGUF_LAYER_NAMES = {hf: gguf for gguf, hf in gguf_io._LAYER_TENSORS.items()}

TINY_GGUF_CASES = {  # overrides of configs.hf_shape()
  "llama": dict(tie_word_embeddings=False),
  "qwen2": dict(tie_word_embeddings=False),
  "qwen3": dict(head_dim=16, tie_word_embeddings=True),
}


def _byte_level_vocab() -> tuple[list[str], list[str]]:
  from transformers.convert_slow_tokenizer import bytes_to_unicode

  tokens = ["<|endoftext|>", *sorted(bytes_to_unicode().values())]
  merges = ["Ġ t", "h e", "Ġt he"]
  return [*tokens, "Ġt", "he", "Ġthe"], merges


def _write_tiny_gguf(arch: str, path: str) -> tuple[torch.nn.Module, str]:
  """A random transformers model written as a GGUF file the way llama.cpp lays it out."""
  import gguf

  tokens, merges = _byte_level_vocab()
  name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
  kwargs = {**hf_shape(), "vocab_size": len(tokens), "rms_norm_eps": 1e-5, **TINY_GGUF_CASES[arch]}
  model = getattr(transformers, f"{name}ForCausalLM")(
    getattr(transformers, f"{name}Config")(**kwargs)
  )
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
  config = model.config
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(config.num_hidden_layers)
  writer.add_context_length(64)
  writer.add_embedding_length(config.hidden_size)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_attention_heads)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_key_length(config.head_dim)
  writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types([3] + [1] * (len(tokens) - 1))
  writer.add_eos_token_id(0)
  for hf_name, tensor in model.state_dict().items():
    value = tensor.numpy()
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
      continue
    if hf_name.startswith("model.layers."):
      _, _, layer, *module, suffix = hf_name.split(".")
      gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.{suffix}"
      if arch == "llama" and module[-1] in ("q_proj", "k_proj"):
        heads = config.num_attention_heads if module[-1] == "q_proj" else config.num_key_value_heads
        value = _llama_cpp_permute(value, heads)
    else:
      gguf_name = {v: k for k, v in gguf_io._GLOBAL_TENSORS.items()}[hf_name]
    writer.add_tensor(gguf_name, np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return model.eval(), path


@pytest.mark.parametrize("arch", list(TINY_GGUF_CASES))
def test_tiny_gguf_round_trip(arch, tmp_path):
  torch_model, gguf_file = _write_tiny_gguf(arch, str(tmp_path / "tiny.gguf"))
  out = gguf_io.convert_gguf(gguf_file, str(tmp_path / "hf"))
  ours = load_file(os.path.join(out, "model.safetensors"))
  expected = {k: v.numpy() for k, v in torch_model.state_dict().items()}
  if torch_model.config.tie_word_embeddings:
    expected.pop("lm_head.weight")
  assert set(ours) == set(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)
  model, params = from_pretrained(out)
  assert model.config.architecture == arch
  ids = np.random.default_rng(0).integers(0, len(_byte_level_vocab()[0]), (1, 12))
  logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids, jnp.int32)))
  with torch.no_grad():
    ref = torch_model(torch.as_tensor(ids)).logits.numpy()
  assert np.max(np.abs(logits - ref)) / np.max(np.abs(ref)) <= 1e-4
  tokenizer = HFTokenizer(str(out)).hf_tokenizer
  # Merges "Ġ t", "h e", "Ġt he": no "t he", so the leading "the" stays split.
  assert tokenizer.convert_ids_to_tokens(tokenizer("the the")["input_ids"]) == ["t", "he", "Ġthe"]
