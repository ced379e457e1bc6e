"""`configs/smollm2_135m_cpu.py:runlocal` (the laptop run's config: LoRA, reasoning-gym's datasets
at set difficulties, the held-out avg@k) for 1 RL step on a CPU and its evaluation, as
docs/models.md documents them."""

import json
import math

from tests.helpers.processes import run_module


def test_runlocal_trains_a_step_and_evaluates_from_the_readme_commands(tmp_path):
  def run_checked(module: str, *args: str) -> None:
    """`python -m module` on one CPU device, as docs/models.md runs it; fails with its stderr. The
    evaluation reuses the trainer's compiled sampler (the session's compilation cache)."""
    config = "--config=configs/smollm2_135m_cpu.py:runlocal"
    result = run_module(module, config, *args, devices=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

  run_checked("ebpo_jax.train", f"--workdir={tmp_path}")
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train_lines = [m for m in lines if "loss" in m]
  assert [m["step"] for m in train_lines] == [1]
  assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in train_lines)
  assert all(m["rollout/tokens"] > 0 for m in train_lines)
  clusters = {"chain_sum", "basic_arithmetic", "products"}
  assert {f"eval/accuracy/{c}" for c in clusters} <= set(lines[-1])
  assert (tmp_path / "checkpoints" / "1").is_dir()

  run_checked("ebpo_jax.evaluate", f"--workdir={tmp_path}")  # the run's latest checkpoint
  result = json.loads((tmp_path / "eval.json").read_text())
  assert result["params"]["step"] == 1 and result["num_samples"] == 2
  assert result["num_responses"] == 2 * result["num_problems"] > 0
  assert set(result["metrics"]["by_cluster"]) == clusters
