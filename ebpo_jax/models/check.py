"""The model directory of a config checked before anything compiles: a readable config.json and
intact safetensors files (their headers read with `struct`, no tensor loaded)."""

import json
import os
import struct

import ml_collections

from ebpo_jax import files
from ebpo_jax.errors import ConfigError
from ebpo_jax.models import gguf_io, hf_io


def check_model_path(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the key and the file unless `config.model.path` (local or gs://) is a
  directory with a config.json and intact safetensors files; the files' check of an entry point,
  before anything compiles (check_config checks values only). A `packaged:` model is converted
  (once, cached) and its GGUF file named when it does not read."""
  path = config.model.path
  if not path:
    return
  if path.startswith(gguf_io.PACKAGED_PREFIX):
    try:  # converted once (cached) here rather than later: a truncated GGUF file is named
      path = gguf_io.resolve_model_path(path)
    except (ValueError, OSError) as e:
      raise ConfigError(f"config.model.path={config.model.path!r}: {e}") from None
  key = f"config.model.path={config.model.path!r}"
  if not files.isdir(path):
    raise ConfigError(f"{key}: no such model directory")
  try:
    check_model_files(path)
  except ValueError as e:
    raise ConfigError(f"{key}: {e}") from None


def check_model_files(path: str) -> None:
  """ValueError naming the file when the Hugging Face directory `path` lacks a readable
  config.json, or a safetensors file is not one or is shorter than its header says."""
  config_file = files.join(path, hf_io.CONFIG_FILE)
  if not files.isfile(config_file):
    raise ValueError(f"{config_file}: not found (not a Hugging Face model directory)")
  try:
    json.loads(files.read_text(config_file))
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f"{config_file}: not JSON ({e})") from None
  for name in files.listdir(path):
    if name.endswith(".safetensors"):
      _check_safetensors(files.join(path, name))


def _check_safetensors(path: str) -> None:
  """The 8-byte header length, the JSON header and the file size its tensors' offsets imply."""
  with files.open_file(path, "rb") as f:
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    head = f.read(8)
    header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 2 <= header_len <= 100_000_000:
      raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
    if header_len > size - 8:
      raise ValueError(f"{path}: truncated ({size} bytes; its header alone needs {8 + header_len})")
    try:
      header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError):
      raise ValueError(f"{path}: truncated or corrupt safetensors header") from None
  ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
  expected = 8 + header_len + max(ends, default=0)
  if size < expected:
    raise ValueError(f"{path}: truncated ({size} bytes; its header needs {expected})")
