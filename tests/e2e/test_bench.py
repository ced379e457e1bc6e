"""Every benchmark runs at smoke sizes and prints its summary; CI does not time them. bench/peers.py
runs its own side there (`--ours_only`); the comparison itself needs tunix, installed apart: its
test is marked `peers` and runs with `-m peers`."""

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.processes import cpu_env

SMOKE_RUNS = {
  "advantages": ["--batch_sizes=64", "--group_sizes=4", "--repeats=1", "--loop_iters=2"],
  # 1 layer (each is code to compile), torch on 1 thread (its default spins on 2 shared cores)
  "forward": ["--models=tiny", "--batch=2", "--seq=16", "--seconds=0.2", "--tiny_layers=1",
              "--torch_threads=1"],
  "sampler": ["--quick", "--reps=1", "--new-tokens=8"],  # 1 layer, torch on 1 thread
  "compact": ["--quick"],  # compacting vs plain decode, long-tailed lengths
  "train_step": ["--quick"],
  "recompute": ["--quick"],  # rl.recompute_old_logps vs the default step (not token_tis)
  "gpu": ["--dry-run"],  # decode at batch 2, the train step's MFU table
  "lora": ["--quick", "--ranks=8"],  # full vs LoRA rank 8 on the one-layer smoke shape
  "memory": ["--quick"],  # the TPU compiler on a runlocal config for v5p:2x2x1
  # Our side of the comparison with tunix (no peer installed): the sampler and the trainer's RL
  # step as the comparison runs them (its tokenizer once lacked a parameter, and nothing ran it).
  "peers": ["--quick", "--ours_only"],
  # A committed run's learning curve ({out}: the smoke run's folder).
  "learning_curve": ["results/ablation_smollm2_cpu/runs/ebpo_batch_G4_s0", "--out={out}/curve.png"],
  # k = 0 and k = 1 of arith_tool:runlocal, 3 steps with the slow tool, two sampler calls at once
  "async": [
    "--quick",
    "--override=sampling.prompts_per_call=4",
    "--override=sampling.concurrent_calls=2",
  ],
}  # fmt: skip
# Benchmarks run in one process per group (tests/helpers/bench_runs.py): they share its imports
# and JAX's warm-up (46 CPU-s for the eight together, 54 as two groups, JAX-only and torch). The
# TPU compiler's run, the longest, is the other group: the two groups about balance two workers.
SMOKE_GROUPS = {
  "cpu": (
    "advantages",
    "compact",
    "train_step",
    "recompute",
    "gpu",
    "lora",
    "forward",
    "sampler",
    "peers",
    "learning_curve",
  ),
  "memory": ("memory", "async"),  # trainer processes of their own, like the compiler's run
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


def _run_group(names: tuple[str, ...], out, timeout: int = 900) -> dict[str, str]:
  """The smoke runs of `names` in one process on one CPU device (tests/helpers/bench_runs.py);
  each must succeed. Their stdouts by name."""
  env = cpu_env(1) | {"PYTHONPATH": str(ROOT)}
  runs = [arg for name in names for arg in ("--", name, *SMOKE_RUNS[name])]
  result = subprocess.run(
    [sys.executable, "-m", "tests.helpers.bench_runs", str(out), *runs[1:]],
    env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
  )  # fmt: skip
  errors = {p.stem: p.read_text()[-3000:] for p in out.glob("*.err")}
  assert result.returncode == 0 and not errors, (errors, result.stderr[-3000:])
  return {name: (out / f"{name}.out").read_text() for name in names}


def _check_output(name: str, stdout: str) -> None:
  """A smoke run's stdout: its table (gpu) or its last line, a JSON summary."""
  if name == "learning_curve":  # a markdown row per run, then the figure's path
    assert "| ebpo_batch_G4_s0 | 72 |" in stdout and stdout.strip().endswith("curve.png"), stdout
    return
  if name == "gpu":  # a markdown table for results/gpu.md
    assert "| tiny | 2 |" in stdout, stdout[-2000:]
    return
  summary = json.loads(stdout.strip().splitlines()[-1])
  assert summary, stdout[-2000:]
  if name == "lora":  # the adapters' optimizer state is a small share of full fine-tuning's
    assert 0 < summary["lora8_opt_state_over_full"] < 0.2, summary
    assert summary["sampling"]["on_the_fly_tok_s"] > 0, summary
  if name == "peers":  # our side alone: the sampler's tok/s and the RL step's parts
    ours = summary["ours_only"]
    assert ours["sampler_tiny_tok_s"] > 0 and ours["rl_step_s"] >= ours["rl_rollout_s"] > 0, ours
  if name == "async":  # both staleness values ran, and the k = 1 run overlapped something
    assert set(summary["by_k"]) == {"0", "1"} and summary["steps_per_s_ratio"] > 0, summary
  if name == "compact":  # both modes timed (the bench checks they draw the same tokens)
    assert summary["compact_over_plain"] > 0 and summary["same_length_compact_over_plain"] > 0


def test_every_benchmark_has_a_smoke_run_in_one_group():
  grouped = [name for names in SMOKE_GROUPS.values() for name in names]
  assert sorted(grouped) == sorted(SMOKE_RUNS)


# e2e: each group of benchmarks is a process running their scripts in turn (10-40 s)
@pytest.mark.parametrize("group", sorted(SMOKE_GROUPS))
def test_benchmarks_run_and_end_with_json(group, tmp_path):
  for name, stdout in _run_group(SMOKE_GROUPS[group], tmp_path).items():
    _check_output(name, stdout)


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
