"""transformers models of the tests: random weights that make every term of a comparison count, and
a tiny Llama directory."""

import os
import pathlib
import shutil

import torch
import transformers

from ebpo_jax import models


def randomize_torch_weights(model: torch.nn.Module, seed: int) -> None:
  """Weights of std 0.2 and norm scales near 1, so a tiny random transformers model's logits are
  O(1) and every term matters in a comparison with ours."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)


def save_tiny_llama(path: pathlib.Path) -> pathlib.Path:
  """A random tiny Llama (transformers, 2 layers, d=16) with SmolLM2's tokenizer files, written
  to `path`; returns `path`."""
  smollm2 = models.smollm2_135m_instruct()
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
    vocab_size=49152,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=True,
  )
  transformers.LlamaForCausalLM(hf_config).save_pretrained(path)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(smollm2, name), path / name)
  return path
