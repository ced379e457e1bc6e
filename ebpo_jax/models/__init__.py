"""The policy model: one config-driven decoder and its weight I/O."""

from ebpo_jax.models.decoder import Decoder, KVCache, ModelConfig, init_cache
from ebpo_jax.models.hf_io import from_pretrained, load_tokenizer, save_pretrained

__all__ = [
  "Decoder",
  "KVCache",
  "ModelConfig",
  "from_pretrained",
  "init_cache",
  "load_tokenizer",
  "save_pretrained",
]
