"""Loading a config file and checking every value before anything compiles."""

import contextlib
import difflib
import importlib.util
import json
import os
import re
import struct
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from ebpo_jax import advantages, cli, data, files, losses, metrics, models, sharding
from ebpo_jax.tasks import reward_fns


class ConfigError(ValueError):
  """An invalid config value; the message names the key and the value."""


class PolicyError(ValueError):
  """Nothing to load a policy from, or a checkpoint that does not fit; the message says what to
  pass."""


# Bad input of an entry point: each exits with one line (never a traceback) and this status.
USER_ERRORS = (ConfigError, PolicyError, data.DataError)
BAD_INPUT_STATUS = 2


@contextlib.contextmanager
def entry_point(verbosity: int = logging.WARNING) -> Iterator[None]:
  """The frame of every command-line entry point: absl logging at `verbosity` for other libraries
  (orbax logs each save at INFO; the project's own INFO lines are shown, `cli.set_verbosity`),
  `jax.distributed` joined when the environment asks for it, and a bad input (USER_ERRORS) turned
  into `error: <message>` and exit status 2 (BAD_INPUT_STATUS); on N fake CPU devices, XLA:CPU
  thread pools that fit them (`sharding.size_cpu_thread_pools`)."""
  cli.set_verbosity(verbosity)
  try:
    sharding.size_cpu_thread_pools()  # 8 CPU devices on 2 cores: no rendezvous abort
    sharding.init_distributed()
    yield
  except USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT_STATUS)


def define_config_flags() -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """`--config=FILE.py[:ARG]` (required; `--config.KEY=VALUE` overrides) and `--print_config`,
  in absl's FLAGS: the flags of every entry point that reads a config. The entry point adopts
  them (`flags.adopt_module_key_flags(config_lib)`) so that its `--help` lists them."""
  config = config_flags.DEFINE_config_file("config", None, "Experiment config file: FILE.py[:ARG].")
  flags.mark_flag_as_required("config")
  print_config = flags.DEFINE_bool(
    "print_config",
    False,
    "Print the resolved config (the file and its --config.* overrides) as JSON and exit; "
    "nothing is compiled or written.",
  )
  return config, print_config


def print_config(config: ml_collections.ConfigDict) -> None:
  """`--print_config`: the resolved config as JSON on stdout, as config.json holds it."""
  print(json.dumps(config_json(config), indent=1, sort_keys=True), flush=True)


def config_json(config: ml_collections.ConfigDict | Mapping[str, Any]) -> dict[str, Any]:
  """`config` as the JSON config.json holds (tuples as lists)."""
  if isinstance(config, ml_collections.ConfigDict):
    return json.loads(config.to_json_best_effort())
  return json.loads(json.dumps(config, default=str))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (pass as `app.run(main, flags_parser=parse_flags)`), with a `--config.KEY`
  override that names no key of the config file turned into one line with the closest key and
  exit status 2 (ml_collections raises a long traceback from inside the parser); any other bad
  flag is one line and status 2 too (`cli.parse_flags`)."""
  try:
    return cli.parse_flags(argv)
  except (AttributeError, KeyError, TypeError):
    problem = _unknown_override(argv)
    if problem is None:
      raise
    print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT_STATUS)


def _unknown_override(argv: Sequence[str]) -> str | None:
  """The first `--config.KEY=VALUE` of `argv` whose KEY the `--config=` file lacks, described with
  the closest known key; None when every key exists (or the config file does not load)."""
  spec = _flag_value(argv, "--config")
  if spec is None:
    return None
  try:
    known = set(flat_keys(load_config(spec)))
  except Exception:  # the file's own error is absl's to report
    return None
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    key = arg.removeprefix("--config.").split("=", 1)[0]
    if key not in known and not any(k.startswith(key + ".") for k in known):
      close = difflib.get_close_matches(key, sorted(known), n=1)
      hint = f"; did you mean {close[0]}?" if close else ""
      return f"{arg}: no config key {key}{hint}"
  return None


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
  """The value of `flag` in `argv`, given as `FLAG=VALUE` or as `FLAG VALUE`."""
  for i, arg in enumerate(argv):
    if arg.startswith(flag + "="):
      return arg.split("=", 1)[1]
    if arg == flag and i + 1 < len(argv):
      return argv[i + 1]
  return None


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every dotted key of `config` (nested ConfigDicts descended, their own keys included)."""
  keys = []
  for name, value in config.items():
    keys.append(prefix + name)
    if isinstance(value, ml_collections.ConfigDict):
      keys += flat_keys(value, f"{prefix}{name}.")
  return keys


def load_module(path: str | os.PathLike) -> types.ModuleType:
  """The Python module of a config file (its `get_config` and any tables it defines)."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(spec: str | os.PathLike, overrides: Mapping[str, Any] | None = None):
  """The ConfigDict of `configs/NAME.py[:ARG]` (what `--config=` takes), with `overrides`
  (dotted keys, e.g. {"rl.group_size": 4}) applied as `--config.KEY=VALUE` would."""
  path, _, arg = os.fspath(spec).partition(":")
  module = load_module(path)
  config = module.get_config(arg or None)
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  return config


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


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Validates every value before anything compiles; raises ConfigError naming key and value."""
  try:
    advantages.from_config(config.rl)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _choice(config, "rl.loss.aggregation", losses.AGG_MODES)
  _choice(config, "rl.loss.kl_kind", losses.KL_KINDS)
  _choice(config, "data.order", data.ORDERS)
  _check_data_columns(config)
  _choice(config, "train.schedule", ("constant", "cosine"))
  _choice(config, "train.transfer_guard", ("disallow", "log", "allow"))
  _choice(config, "model.remat", tuple(models.decoder.REMAT_POLICIES))
  rl, tc = config.rl, config.train
  _require(rl.group_size >= 2, config, "rl.group_size", "must be >= 2")
  _require(rl.num_iterations >= 1, config, "rl.num_iterations", "must be >= 1")
  _require(tc.num_steps >= 0, config, "train.num_steps", "must be >= 0")
  _require(tc.batch_size >= 1, config, "train.batch_size", "must be >= 1")
  _require(tc.learning_rate > 0, config, "train.learning_rate", "must be > 0")
  _require(tc.max_bad_steps >= 1, config, "train.max_bad_steps", "must be >= 1")
  _require(config.sampling.temperature > 0, config, "sampling.temperature", "must be > 0")
  _require(0 < config.sampling.top_p <= 1, config, "sampling.top_p", "must lie in (0, 1]")
  _require(config.sampling.max_new_tokens >= 1, config, "sampling.max_new_tokens", "must be >= 1")
  _require(
    config.sampling.prompts_per_call >= 0,
    config,
    "sampling.prompts_per_call",
    "must be >= 0 (0: all prompts in one sampler call)",
  )
  _choice(config, "rl.dynamic_sampling", (True, False))
  _choice(config, "sampling.compact", (True, False))
  _require(rl.max_refill_rounds >= 0, config, "rl.max_refill_rounds", "must be >= 0")
  _require(
    0 <= rl.overlong_buffer <= config.sampling.max_new_tokens,
    config,
    "rl.overlong_buffer",
    f"must lie in [0, sampling.max_new_tokens={config.sampling.max_new_tokens}]",
  )
  _require(rl.overlong_penalty >= 0, config, "rl.overlong_penalty", "must be >= 0")
  _require(config.rl.loss.clip_low >= 0, config, "rl.loss.clip_low", "must be >= 0")
  _require(config.rl.loss.clip_high >= 0, config, "rl.loss.clip_high", "must be >= 0")
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
  # prompt's prefill (the TPU compiler's finding for Qwen3-8B on v5p-64: bench/MEMORY.md).
  _require(
    config.sampling.prompts_per_call % data_shards == 0,
    config,
    "sampling.prompts_per_call",
    f"must be a multiple of the mesh's data x fsdp = {data_shards} devices (0: all prompts)",
  )


def _data_shards(config, num_devices: int) -> int:
  try:
    sizes = sharding.mesh_shape(dict(config.mesh), num_devices)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  return sizes["data"] * sizes["fsdp"]


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
  ("rl.loss.dual_clip", 1, False),
  ("rl.loss.kl_coef", 0, True),
  ("rl.loss.entropy_coef", 0, True),
  ("sampling.top_k", 0, True),
  ("checkpoint.every_steps", 1, True),
  ("checkpoint.max_to_keep", 1, True),
  ("rewards.workers", 0, True),
  ("rewards.timeout_s", 0, False),
  ("sft.num_steps", 0, True),
  ("sft.batch_size", 1, True),
  ("sft.learning_rate", 0, False),
  ("logging.samples_every", 0, True),
  ("logging.num_samples", 1, True),
)
_DTYPES = ("float32", "bfloat16")


def _check_counts_and_rates(config: ml_collections.ConfigDict) -> None:
  """Counts, cadences, rates and bounds that would fail late (a modulo by zero, an empty
  evaluation, a checkpoint manager error after the warm start) or train wrongly."""
  for key, low, inclusive in _BOUNDS:
    value = _get(config, key)
    ok = value >= low if inclusive else value > low
    _require(ok, config, key, f"must be {'>=' if inclusive else '>'} {low}")
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
  regex = config.data.answer_regex
  try:
    re.compile(regex)
  except (re.error, TypeError) as e:
    message = f"config.data.answer_regex={regex!r}: not a regular expression ({e})"
    raise ConfigError(message) from None


def check_model_path(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the key and the file unless `config.model.path` (local or gs://) is a
  directory with a config.json and intact safetensors files; the files' check of an entry point,
  before anything compiles (check_config checks values only). A `packaged:` model is converted
  (once, cached) and its GGUF file named when it does not read."""
  path = config.model.path
  if not path:
    return
  if path.startswith(models.gguf_io.PACKAGED_PREFIX):
    try:  # converted once (cached) here rather than later: a truncated GGUF file is named
      path = models.resolve_model_path(path)
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
  config_file = files.join(path, models.hf_io.CONFIG_FILE)
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
