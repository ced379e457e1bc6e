"""GGUF conversion: SmolLM2-135M-Instruct converted by us vs transformers' own GGUF loader."""

import json
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


# e2e: the real model
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


# e2e: the real model
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


# e2e: the real model
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
