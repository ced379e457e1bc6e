"""GGUF conversion: SmolLM2-135M-Instruct converted by us vs transformers' own GGUF loader."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from ebpo_jax.models import convert, from_pretrained, gguf_io, init_cache
from ebpo_jax.models.decoder import unstack_layers
from ebpo_jax.tasks.tokenizers import HFTokenizer

NEW_TOKENS = 16
CHAT = [{"role": "user", "content": "Write a short poem about the sea and the stars."}]


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


@pytest.fixture(scope="module")
def gguf_path():
  return gguf_io.packaged_smollm2_gguf()


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("smollm2"))
  assert convert.main(["--gguf", gguf_path, "--out", out]) == 0
  return out


@pytest.fixture(scope="module")
def reference(converted, gguf_path):
  """transformers' PyTorch Llama with weights from transformers' own GGUF dequantizer."""
  config = transformers.AutoConfig.from_pretrained(converted)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  parsed = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
  result = model.load_state_dict(parsed["tensors"], strict=False)
  assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
  model.tie_weights()
  return model, parsed


@pytest.mark.e2e  # the real model
def test_converted_weights_and_config_equal_transformers_gguf_loader(converted, reference):
  _, parsed = reference
  ours = load_file(os.path.join(converted, "model.safetensors"))
  theirs = {name: t.numpy() for name, t in parsed["tensors"].items()}
  assert set(ours) == set(theirs) and len(ours) == 272
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)
  with open(os.path.join(converted, "config.json")) as f:
    config = json.load(f)
  for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers"):
    assert config[key] == parsed["config"][key], key
  assert config["rope_parameters"]["rope_theta"] == parsed["config"]["rope_theta"] == 100000.0
  assert config["rms_norm_eps"] == pytest.approx(parsed["config"]["rms_norm_eps"], rel=1e-7)
  assert config["tie_word_embeddings"] is True


@pytest.mark.e2e  # the real model
def test_tokenizer_and_chat_template(converted, reference):
  _, parsed = reference
  tokenizer = HFTokenizer(str(converted)).hf_tokenizer  # the one loader of a directory's tokenizer
  text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  theirs, _ = convert_gguf_tokenizer("llama", parsed["tokenizer"])
  ids = tokenizer(text)["input_ids"]
  assert ids == theirs.encode(text).ids
  assert ids[:1] == [1] and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> "ass" "istant" "\n"
  assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
    "<|im_end|>",
    2,
    2,
  )
  assert tokenizer.decode(ids) == text
  # Digits are split one by one, as in SmolLM2's own tokenizer.json (Digits pre-tokenizer).
  assert len(tokenizer("12345")["input_ids"]) == 5


def _reference_greedy(model, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # torch's thread pool crawls when the cores are shared with XLA
  try:
    return _torch_greedy(model, ids, steps)
  finally:
    torch.set_num_threads(threads)


def _torch_greedy(model, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
  with torch.no_grad():
    out = model(torch.as_tensor(ids), use_cache=True)
    prompt_logits, tokens = out.logits.numpy(), [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
      out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
      tokens.append(int(out.logits[0, -1].argmax()))
  return prompt_logits, tokens


def _our_greedy(path: str, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
  model, params = from_pretrained(path)
  # The cached decoder: per-layer modules on the unstacked params (as the sampler runs it).
  apply = jax.jit(model.clone(scan_layers=False).apply)
  params = unstack_layers(params)
  cache = init_cache(model.config, batch_size=1, max_len=ids.shape[1] + steps)
  prompt_logits, cache = apply({"params": params}, jnp.asarray(ids, jnp.int32), cache=cache)
  tokens = [int(jnp.argmax(prompt_logits[0, -1]))]
  for _ in range(steps - 1):
    logits, cache = apply({"params": params}, jnp.asarray([[tokens[-1]]], jnp.int32), cache=cache)
    tokens.append(int(jnp.argmax(logits[0, -1])))
  return np.asarray(prompt_logits), tokens


@pytest.mark.e2e  # the real model
def test_greedy_continuation_matches_transformers(converted, reference):
  model, _ = reference
  tokenizer = HFTokenizer(str(converted)).hf_tokenizer  # the one loader of a directory's tokenizer
  text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
  ids = np.asarray([tokenizer(text)["input_ids"]])
  ref_logits, ref_tokens = _reference_greedy(model, ids, NEW_TOKENS)
  our_logits, our_tokens = _our_greedy(converted, ids, NEW_TOKENS)
  err = float(np.max(np.abs(our_logits - ref_logits)) / np.max(np.abs(ref_logits)))
  print(
    f"SmolLM2 prompt logits: max rel err {err:.2e}; continuation {tokenizer.decode(our_tokens)!r}"
  )
  assert err <= 1e-4
  assert our_tokens == ref_tokens
  assert tokenizer.eos_token_id not in our_tokens[:8]  # a real continuation, not an immediate stop


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
  assert len(said) == 1 and said[0].endswith("(once; later runs reuse it) ...")  # the one line
  assert os.listdir(tmp_path) == [os.path.basename(first)]  # no staging directory left behind


def test_convert_cli_reports_a_missing_file(tmp_path, capsys):
  assert convert.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")]) == 1
  assert "nope.gguf" in capsys.readouterr().err


_GGUF_LAYER_NAMES = {hf: gguf for gguf, hf in gguf_io._LAYER_TENSORS.items()}
TINY_GGUF_CASES = {
  "llama": dict(num_key_value_heads=2, tie_word_embeddings=False),
  "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=False),
  "qwen3": dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
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
  kwargs = dict(vocab_size=len(tokens), hidden_size=32, intermediate_size=48, num_hidden_layers=2)
  kwargs.update(num_attention_heads=4, rms_norm_eps=1e-5, **TINY_GGUF_CASES[arch])
  model = getattr(transformers, f"{name}ForCausalLM")(
    getattr(transformers, f"{name}Config")(**kwargs)
  )
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
  config = model.config
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(2)
  writer.add_context_length(64)
  writer.add_embedding_length(32)
  writer.add_feed_forward_length(48)
  writer.add_head_count(4)
  writer.add_head_count_kv(config.num_key_value_heads)
  writer.add_key_length(TINY_GGUF_CASES[arch].get("head_dim", 32 // 4))
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
