"""The configs the tests load, and the one tiny decoder they build."""

from collections.abc import Mapping
from typing import Any

import ml_collections

from ebpo_jax import cli
from ebpo_jax.models import ModelConfig
from tests.helpers import ROOT

ARITH = "configs/arith_ebpo.py:runlocal"  # the trainer's tests' config: seconds on a CPU


def load_config(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """`load_config("configs/NAME.py[:ARG]", {"dotted.key": value})` from the repository root."""
  path, colon, arg = spec.partition(":")
  return cli.load_config(f"{ROOT / path}{colon}{arg}", overrides)


def arith_config(overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """`arith_config({"dotted.key": value})`: configs/arith_ebpo.py:runlocal with overrides."""
  return load_config(ARITH, overrides)


def config_module(name: str):
  """The module of configs/NAME.py (get_config and its constants), as the trainer loads it."""
  return cli.load_module(ROOT / "configs" / f"{name}.py")


# LoRA on the tiny train step (tiny_step.tiny_steps): one compile shared by the LoRA tests.
TINY_LORA = {"model.lora.rank": 4, "rl.loss.kl_coef": 0.1}

RG_TINY = "configs/rg_tiny.py"  # a reasoning-gym task (chain_sum), a tiny byte-level model

# The tiny decoder of the model, sampling and sharding tests (a test that needs another value
# overrides it: `dataclasses.replace(TINY_MODEL, ...)`); transformers' models of that shape are
# `hf_shape()`'s.
TINY_MODEL = ModelConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,  # GQA: 2 query heads per key head
  head_dim=8,
)


# The shape keys of a transformers config (LlamaConfig and the like), named as in ModelConfig.to_hf.
HF_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")  # fmt: skip


def hf_shape(config: ModelConfig = TINY_MODEL) -> dict[str, int]:
  """`config`'s shape under the names of a transformers config (LlamaConfig and the like)."""
  hf = config.to_hf()
  return {key: hf[key] for key in HF_SHAPE_KEYS}
