"""`python -m ebpo_jax.export --format=peft` as a process on a LoRA run: PEFT loads the adapter it
writes with our logits; a trained run's exports load with its logits by the printed recipe."""

import textwrap

import jax
import numpy as np
import peft
import torch
import transformers

from ebpo_jax import export, sharding
from ebpo_jax.models import lora
from ebpo_jax.trainer import policy, task_rows
from tests.helpers.exports import (
  assert_same_logits,
  jitted_logits,
  load_peft_model,
  random_ids,
  torch_model_logits,
)
from tests.helpers.processes import on_pythonpath, run_module, run_trainer


def test_export_cli_writes_a_peft_adapter(
  lora_run_from_a_model_directory, tiny_llama_dir, tmp_path
):
  run_dir, model, params = lora_run_from_a_model_directory
  out = tmp_path / "peft"
  result = run_module(
    "ebpo_jax.export", f"--run_dir={run_dir}", f"--out={out}", "--format=peft", devices=1
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"step 0 of {run_dir} -> {out}; tokenizer files from {tiny_llama_dir}" in result.stdout
  assert f"a PEFT adapter for the base {tiny_llama_dir}" in result.stdout
  config = policy.saved_config(str(run_dir), 0)
  recipe = export.loading_recipe(config, str(out), format="peft")
  assert result.stdout.endswith("load it with:\n" + textwrap.indent(recipe, "  ") + "\n")
  ids = random_ids(model.config.vocab_size, (1, 12))
  peft_logits = torch_model_logits(load_peft_model(tiny_llama_dir, out), ids)
  assert_same_logits(jitted_logits(model, params, ids), peft_logits)


# A reward that varies between completions of a random model (their decoded lengths differ), so
# that the advantages, hence the adapters' gradients, are not all zero.
LENGTH_REWARD = """
def text_length(completions, rows, **extras):
  return [len(c) / 10 for c in completions]
"""


def _exec_recipe(recipe: str):
  """The model that an export's loading recipe (`export.loading_recipe`) builds."""
  namespace = {"torch": torch, "AutoModelForCausalLM": transformers.AutoModelForCausalLM}
  namespace["PeftModel"] = peft.PeftModel
  exec(recipe, namespace)  # the recipe as a user pastes it
  return namespace["model"].eval()


def test_exports_of_trained_adapters_load_with_the_runs_logits_by_the_printed_recipe(
  tiny_llama_dir, tmp_path, monkeypatch
):
  """A LoRA run on a bfloat16 base whose reward is not all zero (its adapters move); the PEFT
  adapter and the float32 merged model, each loaded as the export says, give the run's logits.
  Before: the printed advice (a bfloat16 model) was 1.41 off, and the merged model was rounded to
  bfloat16 whatever --dtype said."""
  on_pythonpath(monkeypatch, tmp_path, length_reward=LENGTH_REWARD)
  run_dir = tmp_path / "run"
  overrides = {
    "model.path": tiny_llama_dir,
    "model.lora.rank": 4,
    "model.lora.base_dtype": "bfloat16",
    "rewards.fns": "length_reward:text_length",
    "sft.num_steps": 0,
    "train.num_steps": 1,
    "train.learning_rate": 0.05,
    "eval.every_steps": 100,
  }
  result = run_trainer(run_dir, *[f"--config.{k}={v}" for k, v in overrides.items()], devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  config = policy.saved_config(str(run_dir), 1)
  tokenizer = task_rows.load_tokenizer(config, None)
  mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
  model, params, _ = policy.load_policy(config, tokenizer, mesh, str(run_dir), 1)
  moved = [np.abs(np.asarray(b)).max() for b in jax.tree.leaves(lora.split(params)[0])]
  assert min(moved) > 1e-4  # every adapter moved: lora_b starts at 0
  ids = random_ids(model.config.vocab_size, (1, 12))
  ours = jitted_logits(model, params, ids)
  for format, dtype in (("peft", ""), ("merged", "float32")):  # --dtype=float32
    out = str(tmp_path / format)
    export.export(str(run_dir), out, format=format, dtype=dtype)
    recipe = export.loading_recipe(config, out, format=format)  # what the CLI prints
    theirs = torch_model_logits(_exec_recipe(recipe), ids)
    assert_same_logits(ours, theirs, format)
