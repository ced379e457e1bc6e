"""The trainer's host loop, read from trainer runs (processes): resume first, plot panels."""

import json
import os
import shutil

from ebpo_jax import metrics
from tests.helpers.processes import run_trainer

# ----------------------------------------------------------------------------- resume first


def test_resume_restores_without_reading_the_model_weights(tiny_llama_dir, tmp_path):
  """Resume first: with a checkpoint in the workdir the state is restored into abstract shapes;
  the model directory's weights are never read (here they are deleted before resuming)."""
  model_dir = tmp_path / "model"
  shutil.copytree(tiny_llama_dir, model_dir)
  workdir = tmp_path / "run"
  args = [
    f"--config.model.path={model_dir}",
    "--config.sft.num_steps=0",
    "--config.checkpoint.every_steps=1",
    "--config.rl.loss.kl_coef=0.01",  # a reference policy too: it must not be rebuilt either
    "--config.task.num_eval=2",
    "--config.eval.every_steps=100",
  ]
  # The first run ends at checkpoint 0 (the state before any RL step); the second resumes it.
  for num_steps in (0, 1):
    result = run_trainer(workdir, *args, f"--config.train.num_steps={num_steps}", devices=1)
    assert result.returncode == 0, result.stderr[-3000:]
    for weights in model_dir.glob("*.safetensors"):  # the resumed run must not read them
      weights.unlink()
  assert "] resuming from step 0\n" in result.stderr
  steps = [
    json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]
  assert steps[-1] == 1 and sorted(os.listdir(workdir / "checkpoints"))[-1] == "1"


# ----------------------------------------------------------------------------- metric names


def test_every_default_plot_panel_reads_a_logged_key(arith_run):
  """The default plots and the trainer name their metrics from one list (ebpo_jax.metrics): every
  panel pattern matches a key the runlocal EBPO run logged. (The old panels tokens_per_sec,
  step_time and the per-cluster rewards matched nothing.)"""
  workdir, _ = arith_run
  records = metrics.read_metrics(workdir / metrics.METRICS_FILE)
  assert metrics.missing_panels(records) == []
  logged = {k for r in records for k in r}
  assert {"reward/mean/add_1", "ebpo/prior_mean/add_2", "eval/accuracy/add_2"} <= logged
  assert {"ebpo/prior_std/add_1", "ebpo/shrinkage/add_2", "adv/all_equal_frac"} <= logged
  train = [r for r in records if "reward/mean" in r]
  for line in train:  # S and the all-equal share are shares; tau is a std of rewards in [0, 1]
    assert 0.0 <= line["adv/all_equal_frac"] <= 1.0 and 0.0 <= line["ebpo/shrinkage/add_1"] <= 1.0
    assert 0.0 <= line["ebpo/prior_std/add_2"] <= 0.5
