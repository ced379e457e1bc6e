"""Checking every value of a config before anything compiles (`cli.load_config` loads it)."""

import math
import re
from collections.abc import Sequence

import jax
import ml_collections

from ebpo_jax import advantages, data, envs, losses, metrics, models, sampling, sharding
from ebpo_jax.errors import ConfigError
from ebpo_jax.rollouts.options import completion_width
from ebpo_jax.tasks import reward_fns
from ebpo_jax.trainer import workdir


def _choice(config, key: str, allowed: Sequence[str]) -> None:
  value = _get(config, key)
  if value not in allowed:
    raise ConfigError(f"config.{key}={value!r}: must be one of {', '.join(map(str, allowed))}")


def _get(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _require(ok: bool, config, key: str, rule: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}={_get(config, key)!r}: {rule}")


def _from_config(options_type, section) -> None:
  """Builds `options_type` from its config section: the options validate themselves where they are
  built, and a bad value is one ConfigError naming its key."""
  try:
    options_type.from_config(section)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_env(config: ml_collections.ConfigDict) -> None:
  """`config.env`: limits >= 1, and the environment, its tools and options load (when named)."""
  for key in ("max_turns", "max_tokens", "max_observation_tokens"):
    _require(config.env[key] >= 1, config, f"env.{key}", "must be >= 1")
  latency = config.env.tool_latency_s
  _require(math.isfinite(latency) and latency >= 0, config, "env.tool_latency_s", "must be >= 0")
  envs.from_config(config.env)  # a ConfigError naming the key


def _check_sampling(config: ml_collections.ConfigDict) -> None:
  """`config.sampling`: its options (`sampling.DecodeOptions`), and concurrent sampler calls on
  one process only (each process must launch the calls in one order)."""
  _from_config(sampling.DecodeOptions, config)
  _require(
    config.sampling.concurrent_calls == 1 or jax.process_count() == 1,
    config,
    "sampling.concurrent_calls",
    "must be 1 on more than one process (each process must launch the sampler calls in one order)",
  )


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Validates every value before anything compiles; raises ConfigError naming key and value."""
  try:
    advantages.from_config(config.rl)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _from_config(losses.LossOptions, config.rl.loss)
  _check_sampling(config)
  _choice(config, "rl.recompute_old_logps", (True, False))
  _choice(config, "data.order", data.ORDERS)
  _check_data_columns(config)
  _check_env(config)
  workdir.accepted_keys(config)  # a misspelled key: one line, on a fresh start too
  workdir.check_session_keys(config)  # before the workdir is locked (or created)
  _choice(config, "train.schedule", ("constant", "cosine"))
  _choice(config, "train.transfer_guard", ("disallow", "log", "allow"))
  _choice(config, "model.remat", tuple(models.decoder.REMAT_POLICIES))
  seed = config.seed  # PRNGKey keeps 32 bits: 2**32 would be seed 0's key
  ok_seed = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32
  _require(ok_seed, config, "seed", "must be an int in [0, 2**32)")
  if not config.model.path:  # a random-init model: its architecture
    _choice(config, "model.architecture", models.build.RANDOM_INIT_ARCHITECTURES)
  _check_experts(config)
  rl, tc = config.rl, config.train
  _require(rl.group_size >= 2, config, "rl.group_size", "must be >= 2")
  _require(rl.num_iterations >= 1, config, "rl.num_iterations", "must be >= 1")
  staleness = rl.max_staleness
  _require(
    isinstance(staleness, int) and not isinstance(staleness, bool) and staleness >= 0,
    config,
    "rl.max_staleness",
    "must be an int >= 0",
  )
  _require(tc.num_steps >= 0, config, "train.num_steps", "must be >= 0")
  _require(tc.batch_size >= 1, config, "train.batch_size", "must be >= 1")
  _require(math.isfinite(tc.learning_rate), config, "train.learning_rate", "must be finite")
  _require(tc.learning_rate > 0, config, "train.learning_rate", "must be > 0")
  _require(tc.max_bad_steps >= 1, config, "train.max_bad_steps", "must be >= 1")
  _choice(config, "rl.dynamic_sampling", (True, False))
  _require(rl.max_refill_rounds >= 0, config, "rl.max_refill_rounds", "must be >= 0")
  width_key = "env.max_tokens" if config.env.name else "sampling.max_new_tokens"
  _require(
    0 <= rl.overlong_buffer <= completion_width(config),
    config,
    "rl.overlong_buffer",
    f"must lie in [0, {width_key}={completion_width(config)}]",
  )
  _require(rl.overlong_penalty >= 0, config, "rl.overlong_penalty", "must be >= 0")
  frac = config.rewards.max_error_frac
  _require(0 <= frac <= 1, config, "rewards.max_error_frac", "must lie in [0, 1]")
  micro = _check_batch_sizes(config)
  _check_counts_and_rates(config)
  _check_wandb(config)
  try:  # imports the functions' modules: a bad path is one line before anything compiles
    for fn in reward_fns.load(config.rewards.fns):
      metrics.reward_fn_key(fn.name)
  except ValueError as e:
    raise ConfigError(f"config.rewards.fns={config.rewards.fns!r}: {e}") from None
  data_shards = _data_shards(config, num_devices)
  _require(
    micro % data_shards == 0 and tc.batch_size % data_shards == 0,
    config,
    "train.batch_size",
    f"prompts per step and rows per micro-batch ({micro}) must be divisible by the mesh's "
    f"data x fsdp = {data_shards} devices",
  )
  # Else the prompts of a sampler call are not split over the devices: every chip holds every
  # prompt's prefill (the TPU compiler's finding for Qwen3-8B on v5p-64: results/memory.md).
  _require(
    config.sampling.prompts_per_call % data_shards == 0,
    config,
    "sampling.prompts_per_call",
    f"must be a multiple of the mesh's data x fsdp = {data_shards} devices (0: all prompts)",
  )


def _check_batch_sizes(config: ml_collections.ConfigDict) -> int:
  """Mini- and micro-batches that cut the step's batch evenly; returns the rows per micro-batch."""
  rl, tc = config.rl, config.train
  _require(tc.mini_batch_size >= 1, config, "train.mini_batch_size", "must be >= 1")
  _require(
    tc.micro_batch_size >= 0,
    config,
    "train.micro_batch_size",
    "must be >= 0 (0: a whole mini-batch)",
  )
  _require(
    tc.batch_size % tc.mini_batch_size == 0,
    config,
    "train.mini_batch_size",
    f"must divide train.batch_size={tc.batch_size}",
  )
  mini_rows = tc.mini_batch_size * rl.group_size
  micro = tc.micro_batch_size or mini_rows
  _require(
    mini_rows % micro == 0,
    config,
    "train.micro_batch_size",
    f"must divide mini_batch_size * group_size = {mini_rows}",
  )
  return micro


def _data_shards(config, num_devices: int) -> int:
  """The trainer's data x fsdp shards: its mesh over the devices the sampler does not take."""
  r = config.mesh.rollout_devices
  _require(
    isinstance(r, int) and 0 <= r < num_devices,
    config,
    "mesh.rollout_devices",
    f"must lie in [0, {num_devices}) (the sampler's devices; 0: shared)",
  )
  _require(
    r == 0 or jax.process_count() == 1,
    config,
    "mesh.rollout_devices",
    "must be 0 on more than one process (jax moves arrays between disjoint device sets of "
    "several processes only where both shardings are the same; the sampler's are not the "
    "trainer's)",
  )
  num_devices -= r
  try:
    sizes = sharding.mesh_shape(dict(config.mesh), num_devices)
  except ValueError as e:
    cpu_hint = (
      " (a CPU has more devices with XLA_FLAGS=--xla_force_host_platform_device_count=8)"
      if jax.default_backend() == "cpu"
      else ""
    )
    raise ConfigError(
      f"config.{e}{_mesh_remedy(dict(config.mesh), num_devices)}{cpu_hint}"
    ) from None
  return sizes["data"] * sizes["fsdp"]


def _mesh_remedy(shape: dict[str, int], num_devices: int) -> str:
  """'; with --config.mesh.AXIS=... it fits N devices': the fixed axes at 1, fsdp taking the rest
  when no axis does; '' when the shape has no such fix."""
  fitted = {axis: 1 if size > 1 else size for axis, size in shape.items()}
  if -1 not in fitted.values():
    fitted["fsdp"] = -1
  try:
    sharding.mesh_shape(fitted, num_devices)
  except ValueError:
    return ""
  flags = [f"--config.mesh.{a}={v}" for a, v in fitted.items() if shape.get(a) != v]
  return f"; with {' '.join(flags)} it fits {num_devices} devices" if flags else ""


# (key, lowest allowed value, whether the bound itself is allowed) of plain numeric keys.
_BOUNDS = (
  ("task.num_train", 1, True),
  ("task.num_eval", 1, True),
  ("eval.every_steps", 1, True),
  ("eval.num_samples", 1, True),
  ("train.log_every", 1, True),
  ("train.grad_clip", 0, True),
  ("train.warmup_steps", 0, True),
  ("train.weight_decay", 0, True),
  ("checkpoint.every_steps", 0, True),
  ("checkpoint.every_minutes", 0, True),
  ("checkpoint.max_to_keep", 1, True),
  ("rewards.workers", 0, True),
  ("rewards.timeout_s", 0, False),
  ("sft.num_steps", 0, True),
  ("sft.batch_size", 1, True),
  ("sft.learning_rate", 0, False),
  ("logging.samples_every", 0, True),
  ("logging.num_samples", 1, True),
  # The random-init decoder's shape (a model.path brings its own; the defaults then stay).
  ("model.num_layers", 1, True),
  ("model.hidden_size", 1, True),
  ("model.intermediate_size", 1, True),
  ("model.num_heads", 1, True),
  ("model.num_kv_heads", 1, True),
  ("model.head_dim", 1, True),
  ("model.rope_theta", 0, False),
  ("model.vocab_size", 0, True),  # 0: the tokenizer's
)
_DTYPES = ("float32", "bfloat16")


def _check_counts_and_rates(config: ml_collections.ConfigDict) -> None:
  """Counts, cadences, rates and bounds that would fail late (a modulo by zero, an empty
  evaluation, a checkpoint manager error after the warm start) or train wrongly."""
  for key, low, inclusive in _BOUNDS:
    value = _get(config, key)
    ok = value >= low if inclusive else value > low
    _require(ok, config, key, f"must be {'>=' if inclusive else '>'} {low}")
  model = config.model
  _require(
    model.num_heads % model.num_kv_heads == 0,
    config,
    "model.num_kv_heads",
    f"must divide model.num_heads={model.num_heads}",
  )
  _require(math.isfinite(model.rope_theta), config, "model.rope_theta", "must be finite")
  _choice(config, "model.dtype", _DTYPES)
  _choice(config, "model.param_dtype", _DTYPES)
  _check_lora(config)
  buckets = tuple(config.sampling.prompt_buckets)
  _require(
    bool(buckets) and all(isinstance(b, int) and b >= 1 for b in buckets),
    config,
    "sampling.prompt_buckets",
    "must be a non-empty list of positive token counts",
  )


def _check_experts(config: ml_collections.ConfigDict) -> None:
  """The MoE keys: the grouped-matmul kernel and the router loss weight (any model: a model.path
  may hold experts), and a random-init qwen3_moe's experts."""
  mc = config.model
  _choice(config, "model.moe_kernel", ("auto", *models.config.MOE_KERNELS))
  coef = mc.router_aux_loss_coef
  _require(coef is None or coef >= 0, config, "model.router_aux_loss_coef", "must be None or >= 0")
  if mc.path or mc.architecture != "qwen3_moe":
    return
  moe = "for model.architecture='qwen3_moe'"
  _require(mc.num_experts > 0, config, "model.num_experts", f"must be > 0 {moe}")
  top, experts = mc.num_experts_per_tok, mc.num_experts
  rule = f"must lie in [1, model.num_experts={experts}]"
  _require(1 <= top <= experts, config, "model.num_experts_per_tok", rule)
  width = mc.moe_intermediate_size
  _require(width > 0, config, "model.moe_intermediate_size", f"must be > 0 {moe}")


def _check_lora(config: ml_collections.ConfigDict) -> None:
  """model.lora.*: a rank >= 0, a positive alpha, known targets, a dropout rate in [0, 1), a
  known base dtype."""
  _require(config.model.lora.rank >= 0, config, "model.lora.rank", "must be >= 0 (0: no LoRA)")
  _require(config.model.lora.alpha > 0, config, "model.lora.alpha", "must be > 0")
  try:
    models.lora.parse_targets(config.model.lora.targets)
  except (ValueError, AttributeError) as e:
    raise ConfigError(f"config.model.lora.targets={config.model.lora.targets!r}: {e}") from None
  _require(
    0.0 <= config.model.lora.dropout < 1.0, config, "model.lora.dropout", "must lie in [0, 1)"
  )
  _choice(config, "model.lora.base_dtype", ("", *_DTYPES))


def check_training(config: ml_collections.ConfigDict) -> None:
  """The checks of a training run beyond `check_config`'s: those that the tools reading a run's
  policy under their own config (evaluate, difficulty) must not make. LoRA refuses an SFT warm
  start (a LoRA checkpoint holds adapters, never a warm-started base)."""
  _require(
    config.model.lora.rank == 0 or config.sft.num_steps == 0,
    config,
    "sft.num_steps",
    "must be 0 with LoRA (model.lora.rank > 0): a LoRA checkpoint holds the adapters, not a "
    "warm-started base; warm start a full run, export it and point model.path at the export",
  )


def _check_wandb(config: ml_collections.ConfigDict) -> None:
  """The wandb mode is known, and wandb is installed when `logging.wandb` is on."""
  _choice(config, "logging.wandb_mode", metrics.wandb_log.MODES)
  if config.logging.wandb:
    try:
      metrics.require_wandb()
    except ImportError as e:
      raise ConfigError(f"config.logging.wandb=True: {e}") from None


def _check_data_columns(config: ml_collections.ConfigDict) -> None:
  """The split and column names of data.path are non-empty strings and answer_regex compiles."""
  for key in ("split", "prompt_column", "answer_column", "cluster_column"):
    value = config.data[key]
    _require(isinstance(value, str) and bool(value), config, f"data.{key}", "must be a name")
  _require(0 < config.data.eval_fraction < 1, config, "data.eval_fraction", "must lie in (0, 1)")
  regex = config.data.answer_regex
  try:
    re.compile(regex)
  except (re.error, TypeError) as e:
    message = f"config.data.answer_regex={regex!r}: not a regular expression ({e})"
    raise ConfigError(message) from None
