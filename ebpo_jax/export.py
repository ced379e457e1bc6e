"""Export a trained policy as a Hugging Face directory, for transformers, vLLM and other tools.

  python -m ebpo_jax.export --run_dir=/tmp/smollm2_ebpo --out=/tmp/smollm2_ebpo_hf [--step=N]
      [--dtype=bfloat16]
  python -m ebpo_jax.export --run_dir=gs://bucket/run --out=gs://bucket/run_hf

Reads the run's config from its checkpoint (no --config needed), rebuilds the model it trained,
restores the policy params of the latest (or `--step`) checkpoint and writes config.json +
safetensors with `models.save_pretrained`. A run that started from a model directory
(`config.model.path`) also gets that directory's tokenizer, chat template and generation config
copied over, so `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(OUT)` load it as they load
the original. A random-init run uses the task's own character or byte tokenizer, which has no
Hugging Face form: only the weights and config are written.

The run directory, the source model directory and OUT may each be local or `gs://bucket/...`
(`save_pretrained` writes a remote OUT locally, then uploads it file by file).
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from ebpo_jax import files, models, sharding, tasks
from ebpo_jax.models import hf_io
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer import state as state_lib

# Files of a model directory that describe the weights (written anew by save_pretrained).
_WEIGHT_FILES = (hf_io.CONFIG_FILE, hf_io.INDEX_FILE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


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


def export(run_dir: str, out: str, *, step: int | None = None, dtype: str = "") -> dict[str, Any]:
  """Writes the policy of checkpoint `step` (None: the latest) of `run_dir` to `out`; returns a
  summary (step, source model directory, files written)."""
  step = policy_lib.checkpoint_step(run_dir, step)
  config = policy_lib.saved_config(run_dir, step)
  mesh = sharding.make_mesh({"fsdp": -1})  # every local device: no host holds a full copy
  task = tasks.from_config(config.task)
  tokenizer = state_lib.load_tokenizer(config, task)
  model, params, _ = policy_lib.load_policy(config, tokenizer, mesh, run_dir, step)
  if dtype:
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
  models.save_pretrained(out, model, params)  # collective; process 0 writes
  copied = []
  source = policy_lib.model_source(config)
  if source is not None and jax.process_index() == 0:
    for name in tokenizer_files(source):
      files.copy_file(files.join(source, name), files.join(out, name))
      copied.append(name)
  return {"step": step, "source_model": source, "out": files.abspath(out), "copied": copied}


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  with config_lib.entry_point(logging.ERROR):  # orbax warns about the items it skips
    summary = export(f.run_dir, f.out, step=f.step, dtype=f.dtype)
  tokenizer_note = (
    f"tokenizer files from {summary['source_model']}: {', '.join(summary['copied'])}"
    if summary["source_model"]
    else "no tokenizer (a random-init run uses the task's own character/byte tokenizer)"
  )
  print(f"step {summary['step']} of {f.run_dir} -> {summary['out']}; {tokenizer_note}")


if __name__ == "__main__":
  flags.DEFINE_string("run_dir", None, "Trainer workdir to export from (local or gs://...).")
  flags.DEFINE_string("out", None, "Output Hugging Face directory (local or gs://...).")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_string("dtype", "", "Cast the weights, e.g. bfloat16 (default: as trained).")
  flags.mark_flags_as_required(["run_dir", "out"])
  app.run(main)
