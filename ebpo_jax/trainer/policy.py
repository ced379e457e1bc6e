"""Where a policy comes from: a run's checkpoint or an HF directory (evaluate, export, difficulty,
and a fresh run's `model.init_from`).

Used by the entry points evaluate, export and difficulty. A run's checkpoint is read through
`checkpoint.Checkpointer(read_only=True)` (the only code that knows the checkpoint layout), so a
trainer may keep writing there; only the params are restored, straight into abstract shapes. A run
directory may be local or `gs://bucket/...` (paths through `ebpo_jax.files`).
"""

from typing import Any

import ml_collections

from ebpo_jax import checkpoint, errors, files, models


class PolicyError(errors.BadInput):
  """Nothing to load a policy from, or a checkpoint that does not fit; the message says what to
  pass."""


def _checkpoints(run_dir: str) -> checkpoint.Checkpointer:
  try:
    return checkpoint.Checkpointer(files.join(run_dir, "checkpoints"), read_only=True)
  except FileNotFoundError:
    raise PolicyError(f"{run_dir}: no checkpoints/ directory (not a trainer workdir?)") from None


def checkpoint_step(run_dir: str, step: int | None) -> int:
  """`step`, checked to exist in `run_dir`'s checkpoints, or the latest one."""
  steps = _checkpoints(run_dir).all_steps()
  if not steps:
    raise PolicyError(f"{run_dir}: no complete checkpoint in {run_dir}/checkpoints")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise PolicyError(f"--step={step}: no such checkpoint in {run_dir}/checkpoints; steps: {steps}")
  return step


def saved_config(run_dir: str, step: int) -> ml_collections.ConfigDict:
  """The config that the run saved with checkpoint `step`."""
  config = _checkpoints(run_dir).saved_config(step)
  if config is None:
    raise PolicyError(f"checkpoint {step} of {run_dir} has no saved config")
  return ml_collections.ConfigDict(config)


def with_run_model(config: ml_collections.ConfigDict, run_config) -> ml_collections.ConfigDict:
  """`config` with the model section (shape, dtype, path) of the run that is evaluated."""
  config = ml_collections.ConfigDict(config.to_dict())
  with config.unlocked():
    config.model.update(dict(run_config.model))
  return config


def resolve_run_dir(run_dir: str | None, workdir: str | None, step: int | None) -> str | None:
  """The trainer workdir to read: `--run_dir`, else `--workdir` when it has checkpoints/."""
  if run_dir is None and workdir and files.isdir(files.join(workdir, "checkpoints")):
    run_dir = workdir
  if run_dir is None and step is not None:
    raise PolicyError(f"--step={step} needs a trainer workdir (--run_dir)")
  return run_dir


def check_policy_source(config: ml_collections.ConfigDict, run_dir: str | None) -> None:
  """Raises PolicyError unless there is a run or a model directory to take the policy from."""
  if run_dir is None and not config.model.path:
    raise PolicyError(
      "nothing to evaluate: no trainer workdir with checkpoints/ (--run_dir, or --workdir "
      "itself) and config.model.path is empty; pass --run_dir=RUN or "
      "--config.model.path=HF_DIR"
    )


def load_policy(config, tokenizer, mesh, run_dir: str | None, step: int | None):
  """(model, params, origin) from a run's checkpoint, else from `config.model.path`.

  With `run_dir`, `config.model` must already be the run's (`with_run_model`); its params are
  restored into abstract shapes, without loading or initialising any weights first.
  """
  check_policy_source(config, run_dir)
  model = models.build.make_model(config, tokenizer.vocab_size)
  if run_dir is None:
    path = models.build.model_dir(config)
    params = initial_params(config, model, mesh)
    return model, params, {"kind": "hf", "path": files.abspath(path)}
  abstract = models.build.abstract_params(model, mesh)
  if model.config.lora_rank == 0:
    params = run_params(run_dir, step, abstract)
  else:  # the checkpoint holds the adapters; the base is the run's, built as the run built it
    adapters = run_params(run_dir, step, models.lora.split(abstract)[0])
    # A random-init base comes from the run's seed, which `config` (the tool's own) may not hold.
    run_config = ml_collections.ConfigDict(config.to_dict())
    run_config.seed = saved_config(run_dir, step).seed
    params = models.lora.combine(adapters, lora_base(run_config, model, mesh))
  return model, params, {"kind": "checkpoint", "run_dir": files.abspath(run_dir), "step": step}


def run_params(run_dir: str, step: int, abstract: Any) -> Any:
  """Only the params of checkpoint `step` of `run_dir`, restored into `abstract` (shapes with
  shardings): no weights are loaded or initialised first."""
  try:
    return _checkpoints(run_dir).restore_params(step, abstract)
  except checkpoint.FormatError:  # its own message says what to do
    raise
  except ValueError as e:
    raise PolicyError(
      f"checkpoint {step} of {run_dir} does not fit the model its config builds (a random-init "
      f"model's vocabulary is its task's tokenizer: is config.task the run's?): {e}"
    ) from e


def initial_params(config: ml_collections.ConfigDict, model, mesh) -> Any:
  """A fresh run's params: the latest checkpoint's of the run `config.model.init_from` (e.g. an
  ablation's shared warm start), else `state.init_params` (`config.model.path` or random). Under
  LoRA: `lora_base` with `initial_adapters`."""
  if model.config.lora_rank > 0:
    adapters = initial_adapters(config, model, mesh)
    return models.lora.combine(adapters, lora_base(config, model, mesh))
  run_dir = config.model.init_from
  if not run_dir:
    return models.build.init_params(config, model, mesh)
  step = checkpoint_step(run_dir, None)
  return run_params(run_dir, step, models.build.abstract_params(model, mesh))


def initial_adapters(config: ml_collections.ConfigDict, model, mesh) -> Any:
  """A fresh LoRA run's adapters: those of the latest checkpoint of `model.init_from` when that is
  a LoRA run (an ablation's warm start of a LoRA config), else fresh ones."""
  init_run = _lora_init_run(config)
  if init_run is None:
    return models.build.fresh_adapters(config, model, mesh)
  run_dir, step, _ = init_run
  abstract = models.lora.split(models.build.abstract_params(model, mesh))[0]
  return run_params(run_dir, step, abstract)


def lora_base(config: ml_collections.ConfigDict, model, mesh) -> Any:
  """A LoRA run's frozen base: the params a full run of `config` starts from (model.path,
  model.init_from or random), in the base's dtype. Rebuilt, never checkpointed. When
  `model.init_from` is itself a LoRA run, whose checkpoints hold adapters only, its base is built
  as that run built it (its own `model.init_from`, and its seed for a random base)."""
  init_run = _lora_init_run(config)
  if init_run is not None:
    run_config = init_run[2]
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.init_from = run_config.model.init_from
    config.seed = run_config.seed
  return initial_params(config, models.lora.base_model(model), mesh)


def _lora_init_run(config: ml_collections.ConfigDict):
  """(run_dir, latest step, saved config) when `model.init_from` is a LoRA run; else None."""
  run_dir = config.model.init_from
  if not run_dir:
    return None
  step = checkpoint_step(run_dir, None)
  run_config = saved_config(run_dir, step)
  return (run_dir, step, run_config) if run_config.model.lora.rank > 0 else None


def policy_config(config, run_dir: str | None, step: int | None):
  """(config with the run's model section, checkpoint step) for `run_dir`; (config, None)
  without a run."""
  if run_dir is None:
    return config, None
  step = checkpoint_step(run_dir, step)
  return with_run_model(config, saved_config(run_dir, step)), step


def model_source(config: ml_collections.ConfigDict) -> Any:
  """The resolved model directory of `config.model.path`, or None for a random-init model."""
  return models.build.model_dir(config) if config.model.path else None
