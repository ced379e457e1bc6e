"""The policy model: one config-driven decoder and its weight I/O."""

from ebpo_jax.models.decoder import Decoder, KVCache, ModelConfig, init_cache

__all__ = ["Decoder", "KVCache", "ModelConfig", "init_cache"]
