"""Jitted cost of every advantage estimator, measured side by side in one run.

    python bench/advantages.py [--batch_sizes=64,512] [--group_sizes=4,8,32] [--num_clusters=10]

(from the repository root, after `pip install -e .`; or with PYTHONPATH=. instead of installing).

For each (B, G) and estimator (an `advantages.Estimator` with default hyperparameters: EBPO in its
running mode with the paper's batch normalisation and a per-cluster prior of K clusters) two
numbers, each the best of --repeats timings:
- call_us: one jitted call from Python, dispatch included, results blocked on;
- loop_us: one iteration of a jitted fori_loop that calls the estimator --loop_iters times, each
  iteration depending on the last (the estimator's own compute, without dispatch).
Prints a table, then, last, one JSON line whose `ebpo_over_grpo` holds the EBPO/GRPO time ratios
(geometric mean and max over the (B, G) grid, per config too). Goal: EBPO within 2x of GRPO.
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import advantages


def _ints(text: str) -> list[int]:
  return [int(part) for part in text.split(",")]


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch_sizes", type=_ints, default=[64, 512])
  parser.add_argument("--group_sizes", type=_ints, default=[4, 8, 32])
  parser.add_argument("--num_clusters", type=int, default=10)
  parser.add_argument("--estimators", default=",".join(advantages.ESTIMATORS))
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--loop_iters", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args()


def _inputs(rng: np.random.Generator, b: int, g: int, k: int):
  """(rewards, mask, cluster_ids), one Bernoulli batch; about 5% of responses masked."""
  theta = rng.beta(1.0, 2.0, (b, 1))
  rewards = jnp.asarray((rng.random((b, g)) < theta).astype(np.float32))
  mask = jnp.asarray(rng.random((b, g)) > 0.05)
  cluster_ids = jnp.asarray(rng.integers(0, k, b).astype(np.int32))
  return rewards, mask, cluster_ids


def _best_us(fn, iters: int, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      fn()
    times.append((time.perf_counter() - start) / iters * 1e6)
  return min(times)  # the least disturbed run: other processes only ever add time


def time_estimator(name: str, inputs, args: argparse.Namespace) -> tuple[float, float]:
  """(call_us, loop_us) for estimator `name` on `inputs`."""
  estimator = advantages.Estimator(name)  # default hyperparameters
  # Its own prior (K clusters for EBPO, a placeholder otherwise), after one batch.
  rewards, mask, cluster_ids = inputs
  first = estimator.init_prior(args.num_clusters)
  _, prior, _ = estimator(rewards, cluster_ids_b=cluster_ids, prior=first, mask_bg=mask)
  inputs = (*inputs, prior)
  call = jax.jit(lambda r, m, c, p: estimator(r, cluster_ids_b=c, prior=p, mask_bg=m)[:2])

  @jax.jit
  def loop(rewards, mask, cluster_ids, prior):
    def body(_, carry):
      rewards, prior = carry
      adv, prior = estimator(rewards, cluster_ids_b=cluster_ids, prior=prior, mask_bg=mask)[:2]
      return rewards + 1e-12 * adv, prior  # a real dependence between iterations

    return jax.lax.fori_loop(0, args.loop_iters, body, (rewards, prior))

  jax.block_until_ready(call(*inputs))
  jax.block_until_ready(loop(*inputs))
  calls_per_timing = max(1, 20_000 // inputs[0].size)
  call_us = _best_us(lambda: jax.block_until_ready(call(*inputs)), calls_per_timing, args.repeats)
  loop_us = _best_us(lambda: jax.block_until_ready(loop(*inputs)), 1, args.repeats)
  return call_us, loop_us / args.loop_iters


def main() -> None:
  args = parse_args()
  names = args.estimators.split(",")
  rng = np.random.default_rng(args.seed)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, K = {args.num_clusters}")
  print(f"{'B':>5} {'G':>4} {'estimator':<14} {'call_us':>10} {'loop_us':>10}")
  results = {}
  for b in args.batch_sizes:
    for g in args.group_sizes:
      inputs = _inputs(rng, b, g, args.num_clusters)
      for name in names:
        call_us, loop_us = time_estimator(name, inputs, args)
        results[(b, g, name)] = (call_us, loop_us)
        print(f"{b:>5} {g:>4} {name:<14} {call_us:>10.1f} {loop_us:>10.2f}", flush=True)
  if not {"ebpo", "grpo"} <= set(names):
    return
  configs = [(b, g) for b in args.batch_sizes for g in args.group_sizes]
  ratios = {
    kind: {
      f"B{b}_G{g}": results[(b, g, "ebpo")][i] / results[(b, g, "grpo")][i] for b, g in configs
    }
    for i, kind in enumerate(("call", "loop"))
  }
  summary = {
    kind: {
      "geomean": round(math.exp(statistics.mean(math.log(r) for r in per.values())), 3),
      "max": round(max(per.values()), 3),
      "per_config": {key: round(r, 3) for key, r in per.items()},
    }
    for kind, per in ratios.items()
  }
  print(
    json.dumps({"bench": "advantages", "backend": jax.default_backend(), "ebpo_over_grpo": summary})
  )


if __name__ == "__main__":
  main()
