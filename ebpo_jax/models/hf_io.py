"""Hugging Face directories in and out: config.json + (sharded) safetensors, and the tokenizer.

A directory may be local or `gs://...` (through `ebpo_jax.files`): config.json is read directly,
each safetensors file from a local mirror (`files.local_copy`: safetensors memory-maps a local
file), and a remote output directory is written locally first, then uploaded (`files.staged_dir`).
Weights are read tensor by tensor with `safetensors` (no torch). Per-layer HF tensors are stacked
along our scanned `layers` axis; with a mesh, every stacked tensor goes straight into its sharding,
so no device ever holds a full copy of the model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ebpo_jax import files
from ebpo_jax import sharding as sharding_lib
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.decoder import Decoder

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
Path = tuple[str, ...]


def read_hf_config(path: str) -> dict:
  """The `config.json` of a Hugging Face model directory."""
  config_path = files.join(path, CONFIG_FILE)
  if not files.isfile(config_path):
    raise FileNotFoundError(
      f"{config_path} not found: {path!r} is not a Hugging Face model directory"
    )
  return json.loads(files.read_text(config_path))


def abstract_params(model: Decoder) -> Any:
  """Boxed (logically annotated) `ShapeDtypeStruct`s of the model's params, built without memory."""
  ids = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), ids)["params"]


def hf_name(path: Path, layer: int | None = None, expert: int | None = None) -> str:
  """HF tensor name of our param `path` (for layer `layer` inside the scanned stack, and expert
  `expert` of a MoE block's stacked experts)."""
  if is_experts(path):  # ("layers", "mlp", "experts", "gate_proj")
    return f"model.layers.{layer}.mlp.experts.{expert}.{path[-1]}.weight"
  if path == ("embed_tokens",):
    return "model.embed_tokens.weight"
  if path == ("lm_head",):
    return "lm_head.weight"
  *modules, leaf = path
  suffix = "bias" if leaf == "bias" else "weight"
  if modules[0] == "layers":
    modules = ["layers", str(layer), *modules[1:]]
  return ".".join(["model", *modules, suffix])


def is_experts(path: Path) -> bool:
  """Whether `path` is a MoE block's stacked experts `[E, in, out]` (one HF tensor per expert)."""
  return len(path) > 1 and path[-2] == "experts"


def _input_rank(path: Path) -> int:
  """How many leading axes of our kernel are the input features (HF keeps `[out, in]`)."""
  return 2 if path[-2] == "o_proj" else 1


def hf_to_ours(path: Path, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """One HF tensor -> our layout (`shape` excludes the layers axis, and an expert's the experts
  axis)."""
  if path[-1] in ("kernel", "lm_head") or is_experts(path):
    tensor = tensor.T
  return tensor.reshape(shape)


def ours_to_hf(path: Path, value: np.ndarray) -> np.ndarray:
  """One of our (per-layer) arrays -> the HF tensor."""
  if path[-1] == "lm_head" or is_experts(path):
    return value.T
  if path[-1] == "kernel":
    rank = _input_rank(path)
    return value.reshape(math.prod(value.shape[:rank]), -1).T
  return value.reshape(-1) if value.ndim > 1 and path[-1] in ("bias", "scale") else value


def _flat_boxed(tree: Any) -> dict[Path, Any]:
  flat = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )[0]
  return {tuple(k.key for k in keys): leaf for keys, leaf in flat}


class _SafetensorsReader:
  """Lazy access to the tensors of a (sharded) safetensors checkpoint, one tensor at a time."""

  def __init__(self, path: str):
    index_path = files.join(path, INDEX_FILE)
    if files.isfile(index_path):
      weight_map = json.loads(files.read_text(index_path))["weight_map"]
    elif files.isfile(files.join(path, SINGLE_FILE)):
      with safe_open(files.local_copy(files.join(path, SINGLE_FILE)), framework="np") as f:
        weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
    else:
      raise FileNotFoundError(f"{path!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    self.path, self.weight_map, self._files = path, weight_map, {}

  def get(self, name: str) -> np.ndarray:
    if name not in self.weight_map:
      raise KeyError(f"tensor {name!r} missing from the checkpoint in {self.path!r}")
    file = self.weight_map[name]
    if file not in self._files:
      local = files.local_copy(files.join(self.path, file))  # the file itself when local
      self._files[file] = safe_open(local, framework="np")
    return self._files[file].get_tensor(name)


def _read_param(
  reader: _SafetensorsReader, path: Path, shape: tuple[int, ...], dtype
) -> np.ndarray:
  if path[0] != "layers":
    return hf_to_ours(path, reader.get(hf_name(path)), shape).astype(dtype)
  stacked = np.empty(shape, dtype)
  for layer in range(shape[0]):
    if is_experts(path):
      for e in range(shape[1]):
        tensor = reader.get(hf_name(path, layer, e))
        stacked[layer, e] = hf_to_ours(path, tensor, shape[2:])
    else:
      stacked[layer] = hf_to_ours(path, reader.get(hf_name(path, layer)), shape[1:])
  return stacked


def pretrained_config(
  path: str, dtype: Any = jnp.float32, *, param_dtype: Any = None, **config_overrides: Any
) -> ModelConfig:
  """The ModelConfig of an HF directory, local or gs:// (its config.json only; no weights read)."""
  return ModelConfig.from_hf(
    read_hf_config(path),
    dtype=jnp.dtype(dtype).name,
    param_dtype=jnp.dtype(param_dtype or dtype).name,
    **config_overrides,
  )


def load_params(
  path: str,
  model: Decoder,
  mesh: jax.sharding.Mesh | None = None,
  rules: sharding_lib.Rules = sharding_lib.DEFAULT_RULES,
) -> Any:
  """The params of `model` read from the safetensors of the HF directory `path`, in the model's
  param dtype. With `mesh`, each param is placed into its logical sharding as it is read."""
  abstract = abstract_params(model)
  shardings = None if mesh is None else sharding_lib.logical_shardings(abstract, mesh, rules)
  reader = _SafetensorsReader(path)
  param_dtype = jnp.dtype(model.config.param_dtype)

  def load(keys, leaf, sharding=None):
    path_ = tuple(k.key for k in keys)
    value = _read_param(reader, path_, nn.meta.unbox(leaf).shape, param_dtype)
    if sharding is None:
      return jnp.asarray(value)
    return sharding_lib.place_from_host(value, sharding)

  unboxed = nn.meta.unbox(abstract)
  if shardings is None:
    return jax.tree_util.tree_map_with_path(load, unboxed)
  return jax.tree_util.tree_map_with_path(load, unboxed, shardings)


def from_pretrained(
  path: str,
  dtype: Any = jnp.float32,
  *,
  param_dtype: Any = None,
  mesh: jax.sharding.Mesh | None = None,
  rules: sharding_lib.Rules = sharding_lib.DEFAULT_RULES,
  **config_overrides: Any,
) -> tuple[Decoder, Any]:
  """Loads an HF Llama/Qwen2/Qwen3/Qwen3-MoE directory (local or gs://) -> `(Decoder, params)`.

  `dtype` is the compute dtype and, unless `param_dtype` is given, the param dtype. With `mesh`,
  each param is placed into its logical sharding under `rules` as it is read.
  """
  model = Decoder(pretrained_config(path, dtype, param_dtype=param_dtype, **config_overrides))
  return model, load_params(path, model, mesh, rules)


def _hf_tensors(params: Any) -> Iterator[tuple[str, np.ndarray]]:
  for path, value in _flat_boxed(nn.meta.unbox(params)).items():
    host = sharding_lib.to_host(value)
    if path[0] != "layers":
      yield hf_name(path), ours_to_hf(path, host)
      continue
    for layer in range(host.shape[0]):
      if is_experts(path):
        for e in range(host.shape[1]):
          yield hf_name(path, layer, e), np.ascontiguousarray(ours_to_hf(path, host[layer, e]))
      else:
        yield hf_name(path, layer), np.ascontiguousarray(ours_to_hf(path, host[layer]))


def save_pretrained(
  path: str,
  model: Decoder,
  params: Any,
  *,
  tokenizer: Any = None,
  max_shard_bytes: int = 2 * 1024**3,
) -> None:
  """Writes config.json and safetensors (sharded with an index past `max_shard_bytes`) into the
  directory `path`, local or gs:// (written locally, then uploaded file by file).

  Arrays are written in their own dtype; on several hosts every process must call this (the
  gather is collective) and process 0 writes.
  """
  tensors = [(name, np.ascontiguousarray(t)) for name, t in _hf_tensors(params)]
  if jax.process_index() != 0:
    return
  with files.staged_dir(path) as local:
    _write_directory(local, model, tensors, tokenizer, max_shard_bytes)


def _write_directory(
  path: str,
  model: Decoder,
  tensors: list[tuple[str, np.ndarray]],
  tokenizer: Any,
  max_shard_bytes: int,
) -> None:
  """The files of `save_pretrained` in the local directory `path`."""
  shards: list[dict[str, np.ndarray]] = [{}]
  shard_bytes = 0
  for name, tensor in tensors:
    if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
      shards.append({})
      shard_bytes = 0
    shards[-1][name] = tensor
    shard_bytes += tensor.nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_readable(shards[0], os.path.join(path, SINGLE_FILE), metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_readable(shard, os.path.join(path, file), metadata)
      weight_map.update(dict.fromkeys(shard, file))
    index = {
      "metadata": {"total_size": sum(t.nbytes for _, t in tensors)},
      "weight_map": weight_map,
    }
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  hf_config = model.config.to_hf()
  hf_config["dtype"] = str(tensors[0][1].dtype)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(path)


def save_readable(tensors: dict[str, np.ndarray], file: str, metadata: dict) -> None:
  """safetensors' save_file, with the usual file mode (it writes 0600; other users, e.g. a vLLM
  server, could not read the export)."""
  save_file(tensors, file, metadata=metadata)
  os.chmod(file, files.default_file_mode())
