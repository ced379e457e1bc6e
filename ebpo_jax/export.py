"""Export a trained policy as a Hugging Face directory, for transformers, vLLM and other tools.

  python -m ebpo_jax.export --run_dir=/tmp/smollm2_ebpo --out=/tmp/smollm2_ebpo_hf [--step=N]
      [--dtype=bfloat16]
  python -m ebpo_jax.export --run_dir=gs://bucket/run --out=gs://bucket/run_hf
  python -m ebpo_jax.export --run_dir=/tmp/smollm2_lora --out=/tmp/smollm2_lora_peft --format=peft

Reads the run's config from its checkpoint (no --config needed), rebuilds the model it trained,
restores the policy params of the latest (or `--step`) checkpoint and writes config.json +
safetensors with `models.save_pretrained`. A run that started from a model directory
(`config.model.path`) also gets that directory's tokenizer, chat template and generation config
copied over, so `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(OUT)` load it as they load
the original. A random-init run uses the task's own character or byte tokenizer, which has no
Hugging Face form: only the weights and config are written.

`--format=merged` (the default) writes the full model; for a LoRA run (`model.lora.rank > 0`)
each adapter is first folded into its kernel in float32 (`models.lora.merge`), so OUT is a plain
model whose config.json knows nothing of LoRA; `--dtype` casts the result (float32: the folded
weights unrounded; default: the base's dtype, e.g. bfloat16). `--format=peft` (a LoRA run on
`model.path` only) writes the adapters alone as `adapter_config.json` +
`adapter_model.safetensors` (`models.peft_io`), with the tokenizer files beside them: the base is
the run's `model.path` (written as `base_model_name_or_path`), which the user loads themselves.
Either way the export prints the transformers code that loads OUT with the run's logits
(`loading_recipe`): for a run on a bfloat16 base, the base loaded in bfloat16 (the weights the
adapters learned on), then cast to the run's compute dtype:

  base = AutoModelForCausalLM.from_pretrained(MODEL_PATH, dtype=torch.bfloat16).to(torch.float32)
  model = PeftModel.from_pretrained(base, OUT)

The run directory, the source model directory and OUT may each be local or `gs://bucket/...`
(`save_pretrained` writes a remote OUT locally, then uploads it file by file).
"""

import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags, logging

from ebpo_jax import cli, files, models, sharding, tasks
from ebpo_jax.models import hf_io, peft_io
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer import task_rows
from ebpo_jax.trainer.policy import PolicyError

# Files of a model directory that describe the weights (written anew by save_pretrained).
_WEIGHT_FILES = (hf_io.CONFIG_FILE, hf_io.INDEX_FILE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
FORMATS = ("merged", "peft")


def tokenizer_files(model_dir: str) -> list[str]:
  """The files of a model directory other than weights and config.json: tokenizer, chat
  template, generation config, README and license."""
  return sorted(
    name
    for name in files.listdir(model_dir)
    if name not in _WEIGHT_FILES
    and not name.endswith(_WEIGHT_SUFFIXES)
    and files.isfile(files.join(model_dir, name))
  )


def export(
  run_dir: str, out: str, *, step: int | None = None, dtype: str = "", format: str = "merged"
) -> dict[str, Any]:
  """Writes the policy of checkpoint `step` (None: the latest) of `run_dir` to `out` in `format`
  (FORMATS); returns a summary (step, source model directory, files copied)."""
  if format not in FORMATS:
    raise PolicyError(f"--format={format!r}: must be one of {', '.join(FORMATS)}")
  step = policy_lib.checkpoint_step(run_dir, step)
  config = policy_lib.saved_config(run_dir, step)
  if format == "peft":
    check_peft_base(config, run_dir)  # before any weight is read
  mesh = sharding.make_mesh({"fsdp": -1})  # every local device: no host holds a full copy
  task = tasks.from_config(config.task)
  tokenizer = task_rows.load_tokenizer(config, task)
  source = policy_lib.model_source(config)
  if format == "peft":
    _export_adapters(config, tokenizer, mesh, run_dir, step, out, dtype, source)
  else:
    _export_merged(config, tokenizer, mesh, run_dir, step, out, dtype)
  copied = []
  if source is not None and jax.process_index() == 0:
    for name in tokenizer_files(source):
      files.copy_file(files.join(source, name), files.join(out, name))
      copied.append(name)
  return {"step": step, "source_model": source, "out": files.abspath(out), "copied": copied}


def _cast(tree: Any, dtype: str) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), tree) if dtype else tree


def _export_merged(config, tokenizer, mesh, run_dir: str, step: int, out: str, dtype: str) -> None:
  """The full model; a LoRA run's adapters folded into the kernels first (in float32, rounded
  once: to `dtype` if given, else to the kernel's own dtype), written as the plain base decoder."""
  model, params, _ = policy_lib.load_policy(config, tokenizer, mesh, run_dir, step)
  if model.config.lora_rank > 0:
    if dtype:  # merge's sum is rounded to the kernel's dtype: a bfloat16 base's would be
      params = _cast(params, "float32")
    params = models.lora.merge(params, model.config)
    model = models.lora.base_model(model)
  models.save_pretrained(out, model, _cast(params, dtype))  # collective; process 0 writes


def check_peft_base(config: ml_collections.ConfigDict, run_dir: str) -> None:
  """PolicyError unless the run of `config` is a LoRA run on `model.path`: a PEFT adapter is only
  usable on a base its user can load."""
  if not models.build.lora_enabled(config):
    raise PolicyError(
      f"--format=peft: {run_dir} is a full fine-tuning run (config.model.lora.rank=0) with no "
      "adapters; export it with --format=merged"
    )
  if config.model.init_from:
    raise PolicyError(
      f"--format=peft: the base of {run_dir} is the checkpoint of run "
      f"{config.model.init_from} (config.model.init_from), not a model directory a PEFT adapter "
      "can name; export it with --format=merged"
    )
  if not config.model.path:
    raise PolicyError(
      f"--format=peft: {run_dir} is a LoRA run on a random-init base (config.model.path is "
      "empty), which no PEFT user can load; export it with --format=merged"
    )


def loading_recipe(config: ml_collections.ConfigDict, out: str, *, format: str) -> str:
  """The transformers code (defining `model`) that loads the export `out` of a run of `config`
  with the run's logits: the weights in the dtype the run read them in, computed in its
  `model.dtype`. A PEFT base is loaded in the dtype the adapters learned on
  (`model.lora.base_dtype`: its rounding is part of the policy), then cast."""
  compute = config.model.dtype
  if format == "peft":
    base = config.model.lora.base_dtype or config.model.param_dtype
    cast = f".to(torch.{compute})" if base != compute else ""
    source = policy_lib.model_source(config)
    return (
      f"base = AutoModelForCausalLM.from_pretrained({source!r}, dtype=torch.{base}){cast}\n"
      f"model = PeftModel.from_pretrained(base, {files.abspath(out)!r})"
    )
  return (
    f"model = AutoModelForCausalLM.from_pretrained({files.abspath(out)!r}, dtype=torch.{compute})"
  )


def merged_rounding_note(config: ml_collections.ConfigDict, dtype: str) -> str:
  """For a merged export of a LoRA run on a reduced-precision base without `--dtype`: its folded
  weights are rounded to that dtype (not the run's logits)."""
  base = config.model.lora.base_dtype or config.model.param_dtype
  if dtype or not models.build.lora_enabled(config) or base == "float32":
    return ""
  return f"; the folded weights are rounded to {base} (--dtype=float32 keeps the run's logits)"


def _export_adapters(
  config, tokenizer, mesh, run_dir: str, step: int, out: str, dtype: str, source: str
) -> None:
  """The adapters alone, restored from the checkpoint (the base is neither read nor built)."""
  model = models.build.make_model(config, tokenizer.vocab_size)
  abstract = models.lora.split(models.build.abstract_params(model, mesh))[0]
  adapters = policy_lib.run_params(run_dir, step, abstract)
  peft_io.save_adapter(  # collective; process 0 writes
    out, model.config, _cast(adapters, dtype), base_model=source, dropout=config.model.lora.dropout
  )


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  with cli.entry_point(logging.ERROR):  # orbax warns about the items it skips
    summary = export(f.run_dir, f.out, step=f.step, dtype=f.dtype, format=f.format)
  tokenizer_note = (
    f"tokenizer files from {summary['source_model']}: {', '.join(summary['copied'])}"
    if summary["source_model"]
    else "no tokenizer (a random-init run uses the task's own character/byte tokenizer)"
  )
  config = policy_lib.saved_config(f.run_dir, summary["step"])
  if f.format == "peft":
    tokenizer_note += f"; a PEFT adapter for the base {summary['source_model']}"
  else:
    tokenizer_note += merged_rounding_note(config, f.dtype)
  print(f"step {summary['step']} of {f.run_dir} -> {summary['out']}; {tokenizer_note}")
  recipe = loading_recipe(config, f.out, format=f.format)
  print("load it with:\n" + textwrap.indent(recipe, "  "))


if __name__ == "__main__":
  flags.DEFINE_string("run_dir", None, "Trainer workdir to export from (local or gs://...).")
  flags.DEFINE_string("out", None, "Output Hugging Face directory (local or gs://...).")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_string(
    "dtype",
    "",
    "Cast the weights: float32 or bfloat16 (default: as trained; a LoRA run's merged kernels are "
    "folded in float32 and rounded once, to this or else to the base's dtype).",
  )
  flags.DEFINE_enum(
    "format",
    "merged",
    list(FORMATS),
    "merged: the full Hugging Face model (a LoRA run's adapters folded into the kernels); peft: "
    "a LoRA run's adapters alone (adapter_config.json + adapter_model.safetensors) for "
    "peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT), where BASE "
    "is the run's config.model.path (not copied: load it yourself).",
  )
  flags.mark_flags_as_required(["run_dir", "out"])
  app.run(main, flags_parser=cli.parse_flags)  # --help exits 0
