"""Building the policy model from a config: its module, abstract params and real params.

`make_model` reads `config.model`: a Hugging Face directory's architecture (`model.path`) or a
random-init decoder of the config's shape keys, with LoRA adapters when `model.lora.rank > 0`.
`abstract_params` gives the params as shapes with shardings (nothing allocated); `init_params`
and `fresh_adapters` build real ones in those shardings, under one jit.
"""

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from ebpo_jax import files, sharding
from ebpo_jax.errors import ConfigError
from ebpo_jax.models import attention, gguf_io, hf_io, lora
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.decoder import Decoder

RANDOM_INIT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001  # HF Qwen3-MoE's


def random_init_config(mc: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  """The ModelConfig of a random-init decoder from `config.model` (shape keys, `architecture`,
  `tie_word_embeddings`, `rope_theta`, and how it computes: dtypes, remat, the unrolled loop)."""
  arch = mc.architecture
  if arch not in RANDOM_INIT_ARCHITECTURES:
    raise ConfigError(
      f"config.model.architecture={arch!r}: must be one of {RANDOM_INIT_ARCHITECTURES}"
    )
  moe = {}
  if arch == "qwen3_moe":  # its keys checked by trainer.config.check_config
    moe = dict(
      num_experts=mc.num_experts,
      num_experts_per_tok=mc.num_experts_per_tok,
      moe_intermediate_size=mc.moe_intermediate_size,
      router_aux_loss_coef=DEFAULT_ROUTER_AUX_LOSS_COEF,
    )
  return ModelConfig(
    vocab_size=vocab_size,
    hidden_size=mc.hidden_size,
    intermediate_size=mc.intermediate_size,
    num_layers=mc.num_layers,
    num_heads=mc.num_heads,
    num_kv_heads=mc.num_kv_heads,
    head_dim=mc.head_dim,
    architecture=arch,
    tie_word_embeddings=bool(mc.tie_word_embeddings),
    rope_theta=float(mc.rope_theta),
    dtype=mc.dtype,
    param_dtype=mc.param_dtype,
    remat=mc.remat,
    unroll_layers=bool(mc.unroll_layers),
    **moe,
  )


def model_dir(config: ml_collections.ConfigDict) -> str:
  """The Hugging Face directory of `config.model.path` (local or gs://; a `packaged:` model is
  converted once); ConfigError naming the key when there is none."""
  try:
    path = gguf_io.resolve_model_path(config.model.path)
  except ValueError as e:
    raise ConfigError(f"config.model.path={config.model.path!r}: {e}") from e
  if not files.isfile(files.join(path, hf_io.CONFIG_FILE)):
    raise ConfigError(
      f"config.model.path={config.model.path!r}: not a Hugging Face model directory "
      f"({files.join(path, hf_io.CONFIG_FILE)} not found)"
    )
  return path


def make_model(
  config: ml_collections.ConfigDict, vocab_size: int, device: jax.Device | None = None
) -> Decoder:
  """The policy's module: the Hugging Face directory's architecture (no weights read), or a
  random-init decoder of `config.model`'s shape over `vocab_size` tokens; with LoRA adapters
  when `model.lora.rank > 0` (base weights in `model.lora.base_dtype` if set), and the attention
  backend `model.attention` resolves to on `device`'s platform (default: the first device)."""
  mc = config.model
  if mc.path:
    model_config = hf_io.pretrained_config(
      model_dir(config),
      mc.dtype,
      param_dtype=mc.param_dtype,
      remat=mc.remat,
      unroll_layers=bool(mc.unroll_layers),
    )
  else:
    model_config = random_init_config(mc, vocab_size)
  if model_config.num_experts:
    model_config = with_moe_options(model_config, mc, device or jax.devices()[0])
  model_config = with_attention(model_config, mc, device or jax.devices()[0])
  return Decoder(with_lora(model_config, mc.lora))


def with_moe_options(
  model_config: ModelConfig, mc: ml_collections.ConfigDict, device: jax.Device
) -> ModelConfig:
  """A MoE `model_config` with `config.model`'s router loss weight (None: the model's own) and
  grouped-matmul kernel (`auto`: megablox on a TPU, else ragged_dot; megablox interpreted for a
  `device` that is not a TPU). The keys are checked by trainer.config.check_config."""
  kernel = mc.moe_kernel
  if kernel == "auto":
    kernel = "megablox" if device.platform == "tpu" else "ragged_dot"
  coef = model_config.router_aux_loss_coef
  if mc.router_aux_loss_coef is not None:
    coef = float(mc.router_aux_loss_coef)
  interpret = kernel == "megablox" and device.platform != "tpu"
  return dataclasses.replace(
    model_config, router_aux_loss_coef=coef, moe_kernel=kernel, moe_interpret=interpret
  )


def with_attention(
  model_config: ModelConfig,
  mc: ml_collections.ConfigDict,
  device: jax.Device,
  dtype_key: str = "model.dtype",
) -> ModelConfig:
  """`model_config` with `config.model.attention` (`mc`) resolved for `device`'s platform and
  `model_config.dtype` (`models.attention.resolve`: `auto`'s cudnn needs bfloat16 or float16) and
  its block size; ConfigError naming the key if unknown, and with `dtype_key` (the key that set
  the dtype) if the backend refuses that dtype."""
  if mc.attention not in attention.CHOICES:
    raise ConfigError(
      f"config.model.attention={mc.attention!r}: must be one of {attention.CHOICES}"
    )
  try:
    backend, emulate = attention.resolve(mc.attention, device, model_config.dtype)
  except ValueError as e:
    raise ConfigError(
      f"config.model.attention={mc.attention!r} with config.{dtype_key}={model_config.dtype!r}: {e}"
    ) from e
  if mc.attention_block <= 0 or mc.attention_block % 128:
    raise ConfigError(
      f"config.model.attention_block={mc.attention_block}: must be a positive multiple of 128"
    )
  return dataclasses.replace(
    model_config,
    attention=backend,
    attention_emulate=emulate,
    attention_block=mc.attention_block,
  )


def with_lora(model_config: ModelConfig, lc: ml_collections.ConfigDict) -> ModelConfig:
  """`model_config` with `config.model.lora`'s adapters (`lc`), unchanged when the rank is 0."""
  if lc.rank == 0:
    return model_config
  try:
    return dataclasses.replace(
      model_config,
      lora_rank=lc.rank,
      lora_alpha=float(lc.alpha),
      lora_targets=lora.parse_targets(lc.targets),
      lora_dropout=float(lc.dropout),
      param_dtype=lc.base_dtype or model_config.param_dtype,
    )
  except ValueError as e:
    if "lora_targets" not in str(e):  # the other keys: config.check_config's, before this
      raise
    # targets the model does not have (a MoE's experts)
    raise ConfigError(f"config.model.lora.targets={lc.targets!r}: {e}") from None


def with_compute_dtype(
  model: Decoder,
  dtype: str,
  mc: ml_collections.ConfigDict | None = None,
  device: jax.Device | None = None,
) -> Decoder:
  """`model` computing in `dtype` (its params cast to it as each layer reads them; "": unchanged):
  the sampler's `sampling.dtype`. Given `config.model` (`mc`) and the `device` the model was
  built for (default: the first device), `model.attention` is resolved again at `dtype`
  (`with_attention`: `auto` may pick cudnn for a bf16 sampler of a float32 policy, or xla for a
  float32 sampler of a bf16 one; an explicit cudnn at float32 is a ConfigError naming
  `sampling.dtype`); without `mc` the backend stays, refused (ValueError) if it is cudnn at a
  dtype cuDNN refuses."""
  if not dtype or dtype == model.config.dtype:
    return model
  model_config = dataclasses.replace(model.config, dtype=dtype)
  if mc is not None:
    model_config = with_attention(model_config, mc, device or jax.devices()[0], "sampling.dtype")
  elif model_config.attention == "cudnn" and jnp.dtype(dtype).name not in attention.CUDNN_DTYPES:
    raise ValueError(f"a cudnn model cannot compute in {dtype}: pass config.model to resolve it")
  return model.clone(config=model_config)


def lora_enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether the policy trains LoRA adapters only (`model.lora.rank > 0`)."""
  return config.model.lora.rank > 0


def abstract_params(model: Decoder, mesh: Mesh) -> Any:
  """The params as `jax.ShapeDtypeStruct`s carrying their shardings on `mesh`."""
  boxed = hf_io.abstract_params(model)
  shardings = sharding.logical_shardings(boxed, mesh, sharding.DEFAULT_RULES)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed), shardings
  )


def init_params(config: ml_collections.ConfigDict, model: Decoder, mesh: Mesh) -> Any:
  """Real params in their shardings: read from `config.model.path`, else random (`config.seed`).
  Under LoRA use `trainer.policy.initial_params`, which builds the base and the adapters apart."""
  if config.model.path:
    return hf_io.load_params(model_dir(config), model, mesh)
  return _random_init(model, mesh, adapters_only=False)(jax.random.PRNGKey(config.seed))


def fresh_adapters(config: ml_collections.ConfigDict, model: Decoder, mesh: Mesh) -> Any:
  """A LoRA model's adapters at step 0 (A random from `config.seed`, B zero), in their
  shardings; the base the same init would build is dead code under the jit."""
  return _random_init(model, mesh, adapters_only=True)(jax.random.PRNGKey(config.seed))


@functools.cache
def _random_init(model: Decoder, mesh: Mesh, *, adapters_only: bool):
  """The jitted random init of `model`'s params (its LoRA adapters only with `adapters_only`),
  in their shardings on `mesh`, from a key. Cached: a process that builds equal models again (a
  LoRA run's base and adapters, a run's reference, another seed) compiles it once; it is mostly
  threefry's hashing, the slowest of a tiny model's programs to compile."""
  shardings = jax.tree.map(lambda x: x.sharding, abstract_params(model, mesh))

  def init(rng):
    params = nn.unbox(model.init(rng, jnp.zeros((1, 4), jnp.int32))["params"])
    return lora.split(params)[0] if adapters_only else params

  return jax.jit(init, out_shardings=lora.split(shardings)[0] if adapters_only else shardings)
