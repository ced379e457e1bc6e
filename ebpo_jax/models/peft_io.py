"""LoRA adapters out as a PEFT directory: `adapter_config.json` + `adapter_model.safetensors`.

The layout is the one `peft.PeftModel.save_pretrained` writes (checked against peft 0.21), so

  base = transformers.AutoModelForCausalLM.from_pretrained(BASE)
  model = peft.PeftModel.from_pretrained(base, DIR)

runs our adapted policy. The directory holds the adapters only: BASE is the run's `model.path`
(its resolved Hugging Face directory, written as `base_model_name_or_path`), which the user loads
themselves.

Tensors: our `lora_a [in, r]` / `lora_b [r, out]` beside a projection's kernel become PEFT's
`base_model.model.<HF module>.lora_A.weight [r, in]` / `.lora_B.weight [out, r]` (torch Linear
layout, transposed); the HF module name is `hf_io.hf_name` of the kernel, so the flattening of
`in` / `out` (o_proj's `(heads, head_dim)` input) is the one the full-weight export uses. Scaling:
PEFT's plain LoRA multiplies by `lora_alpha / r`, as `models.lora` does (not rsLoRA's
`alpha / sqrt(r)`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from ebpo_jax import files
from ebpo_jax import sharding as sharding_lib
from ebpo_jax.models import hf_io, lora
from ebpo_jax.models.config import ModelConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PeftModelForCausalLM (`base_model`) wraps a LoraModel (`model`) that wraps the HF model.
_PREFIX = "base_model.model."
_PEFT_NAMES = {lora.A_NAME: "lora_A", lora.B_NAME: "lora_B"}


def target_modules(config: ModelConfig) -> list[str]:
  """PEFT's `target_modules`: the HF module names of the adapted projections (`q` -> `q_proj`;
  decoder.Projection carries the same names)."""
  return [f"{t}_proj" for t in config.lora_targets]


def adapter_config(
  config: ModelConfig, *, base_model: str | None = None, dropout: float = 0.0
) -> dict[str, Any]:
  """The `adapter_config.json` dict of the adapters of `config` (a LoRA decoder's)."""
  if config.lora_rank <= 0:
    raise ValueError(f"lora_rank={config.lora_rank}: the model has no LoRA adapters")
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base_model,
    "r": config.lora_rank,
    "lora_alpha": config.lora_alpha,
    "target_modules": target_modules(config),
    "lora_dropout": dropout,
    "bias": "none",
    # Our delta is x A B * alpha / r beside a plain kernel: PEFT's defaults, written out so that
    # no later default changes what the file means.
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "inference_mode": True,
  }


def peft_tensors(params: Any) -> Iterator[tuple[str, np.ndarray]]:
  """(PEFT name, torch-layout tensor) of every adapter in `params` (scanned: a leading layers
  axis; a full tree or `lora.split(params)[0]`), gathered to the host."""
  leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
  for keys, value in leaves:
    path = tuple(k.key for k in keys)
    if path[-1] not in _PEFT_NAMES:
      continue
    if path[0] != "layers":
      raise ValueError(f"adapter {'/'.join(path)} outside the scanned layers stack")
    host = sharding_lib.to_host(value)
    kernel = (*path[:-1], "kernel")
    for layer in range(host.shape[0]):
      module = hf_io.hf_name(kernel, layer).removesuffix(".weight")
      name = f"{_PREFIX}{module}.{_PEFT_NAMES[path[-1]]}.weight"
      yield name, np.ascontiguousarray(host[layer].T)


def save_adapter(
  path: str,
  config: ModelConfig,
  params: Any,
  *,
  base_model: str | None = None,
  dropout: float = 0.0,
) -> None:
  """Writes `adapter_config.json` and `adapter_model.safetensors` of the adapters in `params`
  into the directory `path`, local or gs:// (written locally, then uploaded).

  Tensors keep their dtype (float32 as trained); on several hosts every process must call this
  (the gather is collective) and process 0 writes.
  """
  tensors = dict(peft_tensors(params))
  if not tensors:
    raise ValueError("no LoRA adapters (lora_a / lora_b) in the params")
  adapter = adapter_config(config, base_model=base_model, dropout=dropout)
  if jax.process_index() != 0:
    return
  with files.staged_dir(path) as local:
    hf_io.save_readable(tensors, os.path.join(local, ADAPTER_WEIGHTS_FILE), {"format": "pt"})
    with open(os.path.join(local, ADAPTER_CONFIG_FILE), "w") as f:
      json.dump(adapter, f, indent=2)
