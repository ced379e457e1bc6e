"""`python -m ebpo_jax.export --format=peft` as a process on a LoRA run: PEFT loads the adapter it
writes with our logits."""

from tests.helpers.exports import (
  MAX_ABS_DIFF,
  jitted_logits,
  load_peft_model,
  max_abs_diff,
  random_ids,
  torch_model_logits,
)
from tests.helpers.processes import run_module


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
  ids = random_ids(model.config.vocab_size, (1, 12))
  peft_logits = torch_model_logits(load_peft_model(tiny_llama_dir, out), ids)
  assert max_abs_diff(jitted_logits(model, params, ids), peft_logits) < MAX_ABS_DIFF
