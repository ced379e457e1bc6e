"""The policy model: one config-driven decoder (dense, or with Qwen3-MoE's sparse blocks:
`moe`), its HF/GGUF weight I/O, the packaged SmolLM2, building it from a config (`build`), and
the model directory checked (`check_model_path`)."""

from ebpo_jax.models import build, lora, moe, shared_prefix
from ebpo_jax.models.check import check_model_path
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.decoder import Decoder, KVCache, init_cache
from ebpo_jax.models.gguf_io import convert_gguf, resolve_model_path, smollm2_135m_instruct
from ebpo_jax.models.hf_io import from_pretrained, save_pretrained
from ebpo_jax.models.shared_prefix import PrefixGroups

__all__ = [
  "Decoder",
  "KVCache",
  "ModelConfig",
  "PrefixGroups",
  "build",
  "check_model_path",
  "convert_gguf",
  "from_pretrained",
  "init_cache",
  "lora",
  "moe",
  "resolve_model_path",
  "save_pretrained",
  "shared_prefix",
  "smollm2_135m_instruct",
]
