"""Multi-turn RL with tools in the trainer's process: configs/arith_tool.py:runlocal logs the
episodes' metrics and whole transcripts and resumes exactly (the data order, the prior and the
episodes: the same later metrics as a straight run); the SmolLM2 chat-template variant runs one
step."""

import json
import math
import shutil

from ebpo_jax import metrics
from tests.helpers.processes import run_module, run_trainer

CONFIG = "configs/arith_tool.py:runlocal"


def _lines(workdir) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _without_timing(lines: list[dict]) -> list[dict]:
  return [{k: v for k, v in m.items() if k not in metrics.TIMING_KEYS} for m in lines]


def _assert_trained_on_episodes(m: dict) -> None:
  """A training line of multi-turn RL: the policy called the tool, the observations' tokens were
  left out of the loss, and the trainer's fresh forward of the stored trajectories (the first
  pass, before any update) gives the sampler's log-probs at the model tokens: the tokens stored
  are those the cache was fed (a re-tokenized observation would shift the later turns')."""
  assert m["tool_calls/mean"] > 0 and 0 < m["masked_frac"] < 1, m
  assert m["mismatch/max_abs"] < 1e-4, m


def test_runlocal_logs_episodes_and_resumes_exactly(tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  # runlocal's 2 steps, a checkpoint after each.
  flags = ("--config.checkpoint.every_steps=1", "--config.logging.samples_every=1")
  result = run_trainer(straight, *flags, config=CONFIG)
  assert result.returncode == 0, result.stderr[-3000:]
  # The run as a kill -9 after the checkpoint of step 1 leaves it: step 2 again from there.
  shutil.copytree(straight, resumed)
  result = run_trainer(resumed, *flags, "--config.workdir.resume_step=1", config=CONFIG)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = _lines(straight)
  assert _without_timing(_lines(resumed)) == _without_timing(lines)
  train = [m for m in lines if "loss" in m]
  assert [m["step"] for m in train] == [1, 2]
  for m in train:
    _assert_trained_on_episodes(m)
    assert m["turns/mean"] >= 1 and m["tool_errors"] >= 0 and m["env/time_s"] >= 0
    assert math.isfinite(m["loss"]) and m["bad_updates"] == 0
  samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
  assert samples and all(s["completion"].startswith("[assistant] ") for s in samples)
  # evaluate runs the same episodes on the eval rows (its greedy avg@1 is the run's last one).
  result = run_module("ebpo_jax.evaluate", f"--config={CONFIG}", f"--workdir={straight}")
  assert result.returncode == 0, result.stderr[-3000:]
  evaluated = json.loads((straight / "eval.json").read_text())
  assert evaluated["num_responses"] == evaluated["num_problems"] > 0
  last = [m for m in lines if "eval/accuracy" in m][-1]["eval/accuracy"]
  assert evaluated["metrics"]["overall"]["avg@1"] == last


def test_the_smollm2_chat_template_variant_runs_one_step(tiny_llama_dir, tmp_path):
  """`:smollm2,runlocal` on the tiny Llama with SmolLM2's tokenizer files: the same chat template,
  prompts, tool messages and buckets as the packaged model, in a third of the time (SmolLM2-135M
  itself trains, with LoRA, in tests/e2e/test_smollm2.py)."""
  model = f"--config.model.path={tiny_llama_dir}"
  result = run_trainer(tmp_path, model, config="configs/arith_tool.py:smollm2,runlocal", devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  train = [m for m in _lines(tmp_path) if "loss" in m]
  assert [m["step"] for m in train] == [1]
  assert math.isfinite(train[0]["loss"]) and train[0]["turns/mean"] >= 1
  # A random model calls no tool (observations with this template: tests/unit/rollouts/
  # test_episodes.py's fresh forward); its stored log-probs still equal the trainer's.
  assert train[0]["mismatch/max_abs"] < 1e-4
