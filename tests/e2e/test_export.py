"""`python -m ebpo_jax.export` as a process: the directory it writes (transformers loads it with
our logits) and the tokenizer source it names."""

import numpy as np

from ebpo_jax import export
from tests.helpers.exports import MAX_REL_ERR, our_logits, rel_err, torch_logits
from tests.helpers.processes import run_module


def test_export_cli_writes_the_directory_and_names_the_tokenizer_source(
  run_from_a_model_directory, tiny_llama_dir, tmp_path
):
  run_dir, model, params = run_from_a_model_directory
  out = tmp_path / "hf"
  result = run_module("ebpo_jax.export", f"--run_dir={run_dir}", f"--out={out}", devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"step 0 of {run_dir} -> {out}; tokenizer files from {tiny_llama_dir}" in result.stdout
  assert export.tokenizer_files(str(out)) == export.tokenizer_files(str(tiny_llama_dir))
  ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (1, 12))
  assert rel_err(our_logits(model, params, ids), torch_logits(out, ids)) < MAX_REL_ERR
