"""Every benchmark runs at smoke sizes and prints its summary; CI does not time them (bench/peers.py
needs tunix, installed apart: its test is marked `peers` and runs with `-m peers`)."""

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.processes import cpu_env

SMOKE_RUNS = {
  "advantages": ["--batch_sizes=64", "--group_sizes=4", "--repeats=1", "--loop_iters=2"],
  "forward": ["--models=tiny", "--batch=2", "--seq=16", "--seconds=0.2"],
  "sampler": ["--quick", "--reps=1", "--new-tokens=8"],
  "compact": ["--quick"],  # compacting vs plain decode, long-tailed lengths
  "train_step": ["--quick"],
  "recompute": ["--quick"],  # rl.recompute_old_logps and rl.loss.rollout_is vs the default step
  "gpu": ["--dry-run"],
  "lora": ["--quick", "--ranks=8"],  # full vs LoRA rank 8 on the one-layer smoke shape
  "memory": ["--quick"],  # the TPU compiler on a runlocal config for v5p:2x2x1
}


def _run_bench(name: str, args: list[str], env: dict, timeout: int = 600):
  """bench/NAME.py run as its own process in `env` (processes.cpu_env, one CPU device);
  it must exit 0."""
  env = env | {"PYTHONPATH": str(ROOT)}
  result = subprocess.run(
    [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args],
    env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  return result


# e2e: each benchmark is a script run as its own process (6-40 s)
@pytest.mark.parametrize("name", sorted(SMOKE_RUNS))
def test_benchmark_runs_and_ends_with_json(name):
  result = _run_bench(name, SMOKE_RUNS[name], cpu_env(1))
  if name == "gpu":  # a markdown table for bench/RESULTS.md
    assert "| tiny | 2 |" in result.stdout, result.stdout[-2000:]
    return
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert summary, result.stdout[-2000:]
  if name == "lora":  # the adapters' optimizer state is a small share of full fine-tuning's
    assert 0 < summary["lora8_opt_state_over_full"] < 0.2, summary
    assert summary["sampling"]["on_the_fly_tok_s"] > 0, summary
  if name == "compact":  # both modes timed (the bench checks they draw the same tokens)
    assert summary["compact_over_plain"] > 0 and summary["same_length_compact_over_plain"] > 0


PEERS_RL_KEYS = [
  f"{part}_over_tunix{kl}" for kl in ("", "_kl") for part in ("rl_step", "train", "rollout")
]


@pytest.mark.peers  # needs tunix, installed apart (setup.py's PEERS_REQUIRES): -m peers runs it
# e2e: a script run as its own process (about 100 s on 2 shared cores)
def test_peers_quick_run_ends_with_every_ratio():
  result = _run_bench("peers", ["--quick"], cpu_env(1), timeout=900)
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert set(summary) == {"sampler", *PEERS_RL_KEYS}, summary
  assert set(summary["sampler"]) == {"tiny"}, summary
  assert set(summary["sampler"]["tiny"]) == {"sampler_over_tunix", "sampler_over_transformers"}
  ratios = [*summary["sampler"]["tiny"].values(), *(summary[k] for k in PEERS_RL_KEYS)]
  assert all(math.isfinite(r) and r > 0 for r in ratios), summary
