"""SmolLM2-135M-Instruct (the packaged model) in the trainer: its chat template and tokenizer, and
`configs/smollm2_135m_cpu.py:runlocal` (the laptop run's config: LoRA, reasoning-gym's datasets
at set difficulties, the held-out avg@k) for 1 RL step on a CPU and its evaluation, as the README
documents them."""

import json
import math
import os
import pathlib

import pytest

from ebpo_jax import models
from ebpo_jax.tasks import tokenizers

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir() -> str:
  return models.resolve_model_path("packaged:smollm2-135m-instruct")


def test_packaged_path_resolves_and_unknown_names_fail(model_dir):
  assert os.path.isfile(os.path.join(model_dir, "config.json"))
  assert models.resolve_model_path("/some/dir") == "/some/dir"
  with pytest.raises(ValueError, match="unknown packaged model 'nope'"):
    models.resolve_model_path("packaged:nope")


def test_prompts_follow_the_chat_template(model_dir):
  tok = tokenizers.HFTokenizer(model_dir)
  hf = tok.hf_tokenizer
  messages = [{"role": "user", "content": "What is 2+3?"}]
  want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert hf.decode(tok.prompt_ids("What is 2+3?")) == want
  assert want.endswith("<|im_start|>assistant\n")
  with_system = hf.decode(tok.prompt_ids("Q", system_prompt="Be brief."))
  assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")
  plain = tokenizers.HFTokenizer(model_dir, chat_template=False)
  assert plain.prompt_ids("hi") == [plain.bos_id, *plain.encode("hi")]


def test_decode_stops_at_the_end_of_turn(model_dir):
  tok = tokenizers.HFTokenizer(model_dir)
  assert tok.eos_id in tok.stop_ids and tok.pad_id == tok.eos_id
  ids = tok.encode("Answer: 5") + [tok.eos_id] + tok.encode(" trailing")
  assert tok.decode(ids) == "Answer: 5"


@pytest.mark.e2e
def test_runlocal_trains_a_step_and_evaluates_from_the_readme_commands(tmp_path, module_cli):
  def run_module(module: str, *args: str) -> None:
    """`python -m module` on one CPU device, as the README runs it; fails with its stderr. The
    evaluation reuses the trainer's compiled sampler (the session's compilation cache)."""
    config = "--config=configs/smollm2_135m_cpu.py:runlocal"
    result = module_cli(module, config, *args, devices=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

  run_module("ebpo_jax.train", f"--workdir={tmp_path}")
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_lines = [m for m in lines if "loss" in m]
  assert [m["step"] for m in train_lines] == [1]
  assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in train_lines)
  assert all(m["rollout/tokens"] > 0 for m in train_lines)
  clusters = {"chain_sum", "basic_arithmetic", "products"}
  assert {f"eval/accuracy/{c}" for c in clusters} <= set(lines[-1])
  assert (tmp_path / "checkpoints" / "1").is_dir()

  run_module("ebpo_jax.evaluate", f"--workdir={tmp_path}")  # the run's latest checkpoint
  result = json.loads((tmp_path / "eval.json").read_text())
  assert result["params"]["step"] == 1 and result["num_samples"] == 2
  assert result["num_responses"] == 2 * result["num_problems"] > 0
  assert set(result["metrics"]["by_cluster"]) == clusters
