"""The decoder's static config, `ModelConfig`, and its Hugging Face `config.json` in and out.

`ARCHITECTURES` names the supported HF model types (Qwen3-MoE's sparse block: `models.moe`);
`REMAT_POLICIES` the per-layer remat policies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
}
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_saveable,
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# The projections a LoRA adapter may sit on (`q` is `q_proj`, ...): models.lora.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# The attention backends of the full forward and the prefill (models.attention; `auto` resolved).
ATTENTION_BACKENDS = ("xla", "splash", "cudnn")
# A MoE block's grouped matmuls (models.moe): XLA's ragged_dot, or the Pallas megablox kernel.
MOE_KERNELS = ("ragged_dot", "megablox")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static shape and numerics of the decoder; hashable so it can be a linen attribute."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable form of HF's llama3 rope dict
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 2048
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: str = "none"  # per-layer remat policy: one of REMAT_POLICIES
  unroll_layers: bool = False  # the scanned layer loop fully unrolled (XLA:CPU fuses across layers)
  architecture: str = "llama"  # llama | qwen2 | qwen3 (for writing config.json back)
  lora_rank: int = 0  # LoRA adapters of this rank on lora_targets (models.lora); 0: none
  lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank
  lora_targets: tuple[str, ...] = LORA_TARGETS
  lora_dropout: float = 0.0  # dropout rate of the adapters' input x (models.lora.DROPOUT_RNG)
  attention: str = "xla"  # attention without a KV cache: xla | splash | cudnn (models.attention)
  attention_block: int = 512  # splash's largest block (a multiple of 128)
  attention_emulate: bool = False  # the kernel emulated: splash interpreted, cudnn through XLA
  # Mixture of experts (qwen3_moe; models.moe): every layer's MLP is a sparse block of
  # num_experts SwiGLU experts of moe_intermediate_size, num_experts_per_tok per token. 0: dense.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True  # the top-k router probabilities renormalised to sum to 1
  router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (HF's; 0: none)
  moe_kernel: str = "ragged_dot"  # one of MOE_KERNELS
  moe_interpret: bool = False  # megablox interpreted (built for a device that is not a TPU)

  @property
  def attention_bias(self) -> bool:
    """Qwen2's q/k/v bias: set by the architecture, as in HF (the one place that says so)."""
    return self.architecture == "qwen2"

  @property
  def qk_norm(self) -> bool:
    """Qwen3's per-head RMSNorm on q and k: set by the architecture, as in HF."""
    return self.architecture in ("qwen3", "qwen3_moe")

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; expected one of {sorted(REMAT_POLICIES)}")
    if self.architecture not in ARCHITECTURES:
      raise ValueError(
        f"architecture={self.architecture!r}; expected one of {sorted(ARCHITECTURES)}"
      )
    if self.lora_rank < 0:
      raise ValueError(f"lora_rank={self.lora_rank} must be >= 0")
    if not set(self.lora_targets) <= set(LORA_TARGETS):
      raise ValueError(f"lora_targets={self.lora_targets!r}; expected any of {LORA_TARGETS}")
    if not 0.0 <= self.lora_dropout < 1.0:
      raise ValueError(f"lora_dropout={self.lora_dropout} must lie in [0, 1)")
    if self.attention not in ATTENTION_BACKENDS:
      raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_BACKENDS}")
    if self.attention_block <= 0 or self.attention_block % 128:
      raise ValueError(f"attention_block={self.attention_block} must be a positive multiple of 128")
    for name in ("dtype", "param_dtype"):
      jnp.dtype(getattr(self, name))  # raises on an unknown dtype name
    _check_experts(self)
    if self.rope_scaling is not None:
      rope_type = dict(self.rope_scaling).get("rope_type")
      if rope_type not in ("llama3", "default"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (llama3 or default)")

  @classmethod
  def from_hf(cls, hf_config: dict, **overrides: Any) -> ModelConfig:
    """Builds a config from a Hugging Face `config.json` dict (transformers 4 or 5 rope keys)."""
    model_type = hf_config.get("model_type", "llama")
    if model_type not in ARCHITECTURES:
      raise ValueError(
        f"model_type={model_type!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
      )
    _check_supported(hf_config, model_type)
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type != "default":
      rope.pop("type", None)
      rope["rope_type"] = rope_type
      rope_scaling = tuple(sorted(rope.items()))
    num_heads = hf_config["num_attention_heads"]
    kwargs = dict(
      vocab_size=hf_config["vocab_size"],
      hidden_size=hf_config["hidden_size"],
      intermediate_size=hf_config["intermediate_size"],
      num_layers=hf_config["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
      head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
      rope_theta=float(rope_theta),
      rope_scaling=rope_scaling,
      rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
      tie_word_embeddings=hf_config.get("tie_word_embeddings", False),
      max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
      architecture=model_type,
    )
    if model_type == "qwen3_moe":
      kwargs.update(
        num_experts=hf_config.get("num_experts") or hf_config["num_local_experts"],
        num_experts_per_tok=hf_config["num_experts_per_tok"],
        moe_intermediate_size=hf_config["moe_intermediate_size"],
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
      )
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf(self) -> dict:
    """The `config.json` dict transformers needs to rebuild this model."""
    rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
    if self.rope_scaling is not None:
      rope_parameters.update(dict(self.rope_scaling))
    hf = {
      "architectures": [ARCHITECTURES[self.architecture]],
      "model_type": self.architecture,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": self.rms_norm_eps,
      "tie_word_embeddings": self.tie_word_embeddings,
      "max_position_embeddings": self.max_position_embeddings,
      "rope_theta": self.rope_theta,
      "rope_parameters": rope_parameters,
      "attention_dropout": 0.0,
      "dtype": self.param_dtype,
    }
    if self.rope_scaling is not None:
      hf["rope_scaling"] = rope_parameters
    if self.architecture == "llama":
      hf["attention_bias"] = False
      hf["mlp_bias"] = False
    if self.num_experts:
      hf.update(
        num_experts=self.num_experts,
        num_experts_per_tok=self.num_experts_per_tok,
        moe_intermediate_size=self.moe_intermediate_size,
        norm_topk_prob=self.norm_topk_prob,
        router_aux_loss_coef=self.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
      )
    return hf


def _check_experts(c: ModelConfig) -> None:
  """A MoE config is qwen3_moe's, with k of E experts; LoRA adapters sit outside the experts."""
  if c.moe_kernel not in MOE_KERNELS:
    raise ValueError(f"moe_kernel={c.moe_kernel!r}; expected one of {MOE_KERNELS}")
  if c.num_experts == 0:
    return
  if c.architecture != "qwen3_moe":
    raise ValueError(f"num_experts={c.num_experts} needs architecture 'qwen3_moe'")
  if not 0 < c.num_experts_per_tok <= c.num_experts or c.moe_intermediate_size <= 0:
    raise ValueError(
      f"num_experts_per_tok={c.num_experts_per_tok} must lie in [1, num_experts="
      f"{c.num_experts}] and moe_intermediate_size={c.moe_intermediate_size} be > 0"
    )
  mlp_targets = sorted(set(c.lora_targets) & {"gate", "up", "down"})
  if c.lora_rank > 0 and mlp_targets:
    raise ValueError(
      f"lora_targets {mlp_targets} are MLP projections: a MoE model's experts take no adapters "
      "(targets q, k, v, o)"
    )


def _check_supported(hf_config: dict, model_type: str) -> None:
  """Rejects config.json features this decoder does not implement, instead of ignoring them."""
  sparse_every = hf_config.get("decoder_sparse_step", 1)
  dense_layers = hf_config.get("mlp_only_layers") or []
  if model_type == "qwen3_moe" and (sparse_every != 1 or dense_layers):
    raise ValueError(
      f"config.json decoder_sparse_step={sparse_every}, mlp_only_layers={dense_layers}: dense "
      "layers between MoE layers are not supported (the layers are scanned: one structure)"
    )
  unsupported = {
    "hidden_act": hf_config.get("hidden_act", "silu") != "silu",
    "mlp_bias": bool(hf_config.get("mlp_bias")),
    "use_sliding_window": bool(hf_config.get("use_sliding_window")),
    # Llama/Qwen3 `attention_bias` also biases o_proj; only Qwen2's q/k/v bias is implemented.
    "attention_bias": model_type != "qwen2" and bool(hf_config.get("attention_bias")),
  }
  for key, bad in unsupported.items():
    if bad:
      raise ValueError(f"config.json {key}={hf_config[key]!r} is not supported for {model_type!r}")
