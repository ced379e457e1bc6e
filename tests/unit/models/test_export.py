"""Export of a run's policy as a Hugging Face directory: transformers loads it with our logits,
and a run that started from a model directory carries its tokenizer and chat template along."""

import numpy as np
import pytest
import transformers

from ebpo_jax import export
from ebpo_jax.trainer import policy
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.configs import arith_config
from tests.helpers.exports import MAX_REL_ERR, our_logits, rel_err, torch_logits


def test_export_of_a_random_init_run_loads_in_transformers_with_our_logits(tmp_path):
  model, params = save_checkpoint(tmp_path / "run", arith_config())
  out = tmp_path / "hf"
  summary = export.export(str(tmp_path / "run"), str(out))
  assert summary["step"] == 0 and summary["source_model"] is None
  ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 12))
  ours = our_logits(model, params, ids)
  assert rel_err(ours, torch_logits(out, ids)) < MAX_REL_ERR


TOKENIZER_NAMES = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_export_of_a_run_from_a_model_directory_keeps_its_tokenizer(
  run_from_a_model_directory, tiny_llama_dir, tmp_path
):
  run_dir, model, params = run_from_a_model_directory
  source, out = tiny_llama_dir, tmp_path / "hf"
  summary = export.export(str(run_dir), str(out))
  assert summary["source_model"] == str(source)
  copied = export.tokenizer_files(str(out))
  assert summary["copied"] == copied == export.tokenizer_files(str(source))
  assert set(TOKENIZER_NAMES) <= set(copied)
  for name in copied:
    assert (out / name).read_bytes() == (source / name).read_bytes()
  # The tokenizer and chat template come back as the source directory's.
  ours_tok = transformers.AutoTokenizer.from_pretrained(out)
  source_tok = transformers.AutoTokenizer.from_pretrained(source)
  messages = [{"role": "user", "content": "What is 2+3?"}]
  assert ours_tok.apply_chat_template(messages, tokenize=False) == (
    source_tok.apply_chat_template(messages, tokenize=False)
  )
  # The weights are the run's (perturbed), not the source model's.
  ids = np.array([ours_tok.encode("Answer: 5 apples and 7 pears")])
  ours = our_logits(model, params, ids)
  assert rel_err(ours, torch_logits(out, ids)) < MAX_REL_ERR
  assert rel_err(ours, torch_logits(source, ids)) > 1e-2


def test_peft_export_of_a_full_run_is_one_clear_error(run_from_a_model_directory, tmp_path):
  run_dir, _, _ = run_from_a_model_directory
  with pytest.raises(policy.PolicyError, match="full fine-tuning run .* --format=merged"):
    export.export(str(run_dir), str(tmp_path / "hf"), format="peft")
  assert not (tmp_path / "hf").exists()


def test_export_without_a_checkpoint_is_one_clear_error(tmp_path):
  with pytest.raises(policy.PolicyError, match="no checkpoints/ directory"):
    export.export(str(tmp_path), str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()
