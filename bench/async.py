"""Asynchronous RL against synchronous, with a slow tool: steps per second and held-out accuracy.

  nice python bench/async.py                      # configs/arith_tool.py, 50 ms a tool turn
  nice python bench/async.py --ks=2 --k_override=rl.loss.rollout_is=token_tis
  nice python bench/async.py --override=sampling.prompts_per_call=8 \
      --override=sampling.concurrent_calls=2   # two sampler calls in flight, every k
  python bench/async.py --quick                   # :runlocal, 1 seed, 3 steps (the CI smoke)

Runs `configs/arith_tool.py` with `env.tool_latency_s` (each turn that steps environments waits
that long: the calls of a turn concurrently, as an I/O-bound tool service answers them) at
`rl.max_staleness` k = 0 (synchronous) and each k of `--ks`, for each seed, one trainer process at
a time in this run. Steps per second are over the RL steps after the first (its compiles), from
the trainer's own `time/step_s` (the sampler, environments, rewards and train step of a step;
evaluations apart); accuracy is the last evaluation's held-out greedy `eval/accuracy`. Prints a
markdown table per k and, as its last line, JSON: `steps_per_s_ratio` (k = first of --ks over
k = 0, mean over seeds of the per-seed ratio) and `accuracy_delta` (mean over seeds of that k's
last accuracy minus k = 0's), per k under `by_k`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ebpo_jax import metrics as metrics_lib


def run(workdir: str, config: str, k: int, seed: int, latency: float, extra: list[str]) -> dict:
  """One trainer process; (steps per second after the first step, last accuracy, the mean
  async/trainer_wait_s)."""
  args = [
    sys.executable, "-m", "ebpo_jax.train", f"--config={config}", f"--workdir={workdir}",
    f"--config.rl.max_staleness={k}", f"--config.seed={seed}",
    f"--config.env.tool_latency_s={latency}", "--config.logging.plots=False",
    *extra,
  ]  # fmt: skip
  result = subprocess.run(args, capture_output=True, text=True)
  if result.returncode != 0:
    raise SystemExit(f"k={k} seed={seed} failed:\n{result.stderr[-3000:]}")
  lines = metrics_lib.read_metrics(workdir)
  trained = [m for m in lines if metrics_lib.REWARD_MEAN in m]
  times = [m[metrics_lib.TIME_STEP_S] for m in trained[1:]] or [trained[0][metrics_lib.TIME_STEP_S]]
  evals = [m for m in lines if metrics_lib.EVAL_ACCURACY in m]
  waits = [m.get(metrics_lib.ASYNC_TRAINER_WAIT_S, 0.0) for m in trained[1:]] or [0.0]
  return {
    "steps_per_s": 1 / statistics.mean(times),
    "accuracy": evals[-1][metrics_lib.EVAL_ACCURACY],
    "trainer_wait_s": statistics.mean(waits),
    "env_s": statistics.mean(m.get(metrics_lib.ENV_TIME_S, 0.0) for m in trained),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/arith_tool.py")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--ks", default="1,2", help="staleness values beside k = 0")
  parser.add_argument("--latency", type=float, default=0.05, help="env.tool_latency_s, seconds")
  parser.add_argument("--steps", type=int, default=None, help="train.num_steps (config's: None)")
  parser.add_argument("--quick", action="store_true", help=":runlocal, 1 seed, 3 steps, k = 1")
  parser.add_argument(
    "--override", action="append", default=[], metavar="KEY=VALUE",
    help="a config override of every run, k = 0 included",
  )  # fmt: skip
  parser.add_argument(
    "--k_override", action="append", default=[], metavar="KEY=VALUE",
    help="a config override of the k > 0 runs only (e.g. rl.loss.rollout_is=token_tis)",
  )  # fmt: skip
  args = parser.parse_args()
  extra = [] if args.steps is None else [f"--config.train.num_steps={args.steps}"]
  extra += [f"--config.{o}" for o in args.override]
  if args.quick:  # a 10-step warm start: the smoke checks that it runs, not what it learns
    args.config, args.seeds, args.ks = "configs/arith_tool.py:runlocal", 1, "1"
    extra += ["--config.train.num_steps=3", "--config.sft.num_steps=10"]
  ks = [int(k) for k in args.ks.split(",")]
  results: dict[int, list[dict]] = {k: [] for k in [0, *ks]}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in range(args.seeds):
      for k in results:
        workdir = os.path.join(tmp, f"k{k}_s{seed}")
        lagged = [f"--config.{o}" for o in args.k_override] if k else []
        results[k].append(run(workdir, args.config, k, seed, args.latency, extra + lagged))
  print(
    f"{args.config}, env.tool_latency_s={args.latency}, {args.seeds} seed(s), one run at a time"
  )
  if args.override:
    print(f"every run with {', '.join(args.override)}")
  if args.k_override:
    print(f"k > 0 runs with {', '.join(args.k_override)}")
  print("| k | seed | steps/s | ratio to k=0 | accuracy | minus k=0 | trainer wait s | env s |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  summary = {}
  for k, runs in results.items():
    ratios, deltas = [], []
    for seed, (r, base) in enumerate(zip(runs, results[0], strict=True)):
      ratios.append(r["steps_per_s"] / base["steps_per_s"])
      deltas.append(r["accuracy"] - base["accuracy"])
      print(
        f"| {k} | {seed} | {r['steps_per_s']:.2f} | {ratios[-1]:.2f} | {r['accuracy']:.3f} | "
        f"{deltas[-1]:+.3f} | {r['trainer_wait_s']:.3f} | {r['env_s']:.3f} |"
      )
    summary[k] = {
      "steps_per_s_ratio": statistics.mean(ratios),
      "accuracy_delta": statistics.mean(deltas),
    }
  first = summary[ks[0]]
  print(json.dumps({**first, "k": ks[0], "seeds": args.seeds, "by_k": summary}))


if __name__ == "__main__":
  main()
