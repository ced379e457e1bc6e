"""Every advantage estimator on rollouts simulated from the EBPO paper's model, side by side.

    python -m ebpo_jax.simulate [--num_prompts=1024] [--num_clusters=8] [--group_sizes=2,4,8,16]
        [--steps=5] [--rewards=bernoulli|gaussian] [--seed=0] [--json=results.json]

The model (Han et al., arXiv 2602.05165, Sec. 3): each prompt q has a latent success rate theta_q;
its G responses score r_qi ~ Bernoulli(theta_q) (or theta_q + N(0, noise^2) with
--rewards=gaussian). Prompts come in clusters of different difficulty: cluster k's logit centre is
spread evenly over [-3, 1.5] (success rates 5% to 82%) and a prompt's logit is its centre plus
N(0, prompt_spread^2). Every step draws fresh prompts (clusters uniformly at random) and feeds all
estimators; EBPO's prior runs across the steps. One table per G, averaged over steps:

- baseline_mse: mean over responses of (baseline - theta_q)^2, the baseline being what the
  estimator subtracts from each reward (paper Theorem 3.3: EB beats the group mean);
- zero_adv: share of responses whose advantage is exactly 0 (the trainer's `adv/zero_frac`);
- signal: share of prompts with any non-zero advantage (prompts that move the policy);
- shrinkage: mean weight on the prior (EBPO's S, James-Stein's lambda);
- mean|A|: mean absolute advantage, the scale the policy gradient sees.

Rows: grpo, dr_grpo, rloo, js_shrinkage, ebpo (per-cluster running prior, the default),
ebpo/global (one prior for all clusters) and ebpo/batch (the authors' released code: current
batch only).
"""

import json
import time
import types
from collections.abc import Sequence

import jax
import numpy as np
from absl import flags

from ebpo_jax import advantages, cli, files

CLUSTER_LOGIT_RANGE = (-3.0, 1.5)
COLUMNS = ("baseline_mse", "zero_adv", "signal", "shrinkage", "mean|A|")


def variants(normalize: str, decay: float) -> dict[str, advantages.Estimator]:
  """The table's rows: one estimator entry each."""
  ebpo = {"normalize": normalize, "decay": decay}
  return {
    "grpo": advantages.Estimator("grpo"),
    "dr_grpo": advantages.Estimator("dr_grpo"),
    "rloo": advantages.Estimator("rloo"),
    "js_shrinkage": advantages.Estimator("js_shrinkage"),
    "ebpo": advantages.Estimator("ebpo", advantages.EBPOParams(**ebpo)),
    "ebpo/global": advantages.Estimator("ebpo", advantages.EBPOParams(**ebpo, per_cluster=False)),
    "ebpo/batch": advantages.Estimator("ebpo", advantages.EBPOParams(**ebpo, mode="batch")),
  }


class _GroupSizes(flags.ArgumentParser):
  """`--group_sizes=2,4`: comma-separated integers >= 2."""

  def parse(self, argument) -> list[int]:
    if isinstance(argument, list):  # the default
      return argument
    try:
      sizes = [int(part) for part in argument.split(",")]
    except ValueError:
      sizes = []
    if not sizes or min(sizes) < 2:
      raise ValueError(f"must be comma-separated integers >= 2, got {argument!r}")
    return sizes

  def flag_type(self) -> str:
    return "comma-separated integers"


def define_flags(flag_values: flags.FlagValues) -> None:
  """The command line's flags (`cli.run` and `cli.parse` call this)."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_integer("num_prompts", 1024, "Prompts per step.", lower_bound=2, **fv)
  flags.DEFINE_integer("num_clusters", 8, "Clusters of prompts.", lower_bound=1, **fv)
  flags.DEFINE(_GroupSizes(), "group_sizes", [2, 4, 8, 16], "Group sizes G, e.g. 2,4.", **fv)
  flags.DEFINE_integer(
    "steps", 5, "Batches per G (the prior runs across them).", lower_bound=1, **fv
  )
  flags.DEFINE_enum("rewards", "bernoulli", ["bernoulli", "gaussian"], "Reward model.", **fv)
  flags.DEFINE_float("noise", 0.5, "Reward std with --rewards=gaussian.", **fv)
  flags.DEFINE_float("prompt_spread", 1.0, "Logit std in a cluster.", **fv)
  flags.DEFINE_enum("normalize", "batch", list(advantages.NORMALIZATIONS), "EBPO normalize.", **fv)
  flags.DEFINE_float("decay", 1.0, "EBPO prior decay in (0, 1].", **fv)
  flags.register_validator(
    "decay", lambda d: 0.0 < d <= 1.0, "must be in (0, 1]", flag_values=flag_values
  )
  flags.DEFINE_integer("seed", 0, "Random seed.", **fv)
  flags.DEFINE_string(
    "json", None, "Also write the results to this JSON file (local or gs://...).", **fv
  )


def parse_args(argv: Sequence[str] | None = None) -> types.SimpleNamespace:
  """The flags by name: `argv` (flags only), or absl's parsed command line when None."""
  return cli.parse(define_flags, argv)


def sample_batch(
  rng: np.random.Generator, args: types.SimpleNamespace, group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(rewards [B, G] float32, cluster_ids [B] int32, theta [B]) for one step."""
  centres = np.linspace(*CLUSTER_LOGIT_RANGE, args.num_clusters)
  cluster_ids = rng.integers(0, args.num_clusters, args.num_prompts).astype(np.int32)
  logits = centres[cluster_ids] + args.prompt_spread * rng.standard_normal(args.num_prompts)
  theta = 1.0 / (1.0 + np.exp(-logits))
  shape = (args.num_prompts, group_size)
  if args.rewards == "bernoulli":
    rewards = rng.random(shape) < theta[:, None]
  else:
    rewards = theta[:, None] + args.noise * rng.standard_normal(shape)
  return rewards.astype(np.float32), cluster_ids, theta


def _row_metrics(adv_bg, stats, theta_b) -> dict[str, float]:
  stats = {k: np.asarray(v) for k, v in stats.items()}
  return {
    "baseline_mse": float(np.mean(np.square(stats["baseline"] - theta_b[:, None]))),
    "zero_adv": float(advantages.zero_fraction(adv_bg)),
    "signal": float(advantages.signal_fraction(adv_bg)),
    "shrinkage": float(np.mean(stats["shrinkage"])) if "shrinkage" in stats else float("nan"),
    "mean|A|": float(np.mean(np.abs(adv_bg))),
  }


def _make_step(rows: dict[str, advantages.Estimator]):
  """One jitted step running every variant (one compilation per G instead of one per variant)."""

  def step(rewards_bg, cluster_ids_b, priors):
    new_priors, outputs = {}, {}
    for name, estimator in rows.items():
      adv_bg, new_priors[name], stats = estimator.with_stats(
        rewards_bg, cluster_ids_b=cluster_ids_b, prior=priors[name]
      )
      outputs[name] = (adv_bg, stats)
    return new_priors, outputs

  return jax.jit(step)


def simulate_group_size(
  args: types.SimpleNamespace, group_size: int
) -> dict[str, dict[str, float]]:
  """Metrics per estimator variant for one G, averaged over `args.steps` simulated batches."""
  rng = np.random.default_rng([args.seed, group_size])
  rows = variants(args.normalize, args.decay)
  step = _make_step(rows)
  priors = {name: estimator.init_prior(args.num_clusters) for name, estimator in rows.items()}
  totals = {name: dict.fromkeys(COLUMNS, 0.0) for name in rows}
  for _ in range(args.steps):
    rewards_bg, cluster_ids_b, theta_b = sample_batch(rng, args, group_size)
    priors, outputs = step(rewards_bg, cluster_ids_b, priors)
    for name, (adv_bg, stats) in outputs.items():
      for column, value in _row_metrics(adv_bg, stats, theta_b).items():
        totals[name][column] += value / args.steps
  return totals


def format_table(group_size: int, rows: dict[str, dict[str, float]]) -> str:
  lines = [f"{'G = ' + str(group_size):<14}" + "".join(f"{c:>14}" for c in COLUMNS)]
  for name, metrics in rows.items():
    cells = ("-" if np.isnan(metrics[c]) else f"{metrics[c]:.4f}" for c in COLUMNS)
    lines.append(f"{name:<14}" + "".join(f"{cell:>14}" for cell in cells))
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, dict[str, float]]]:
  """Run the simulation, print one table per G, and return {G: {variant: {column: value}}}."""
  args = parse_args(argv)
  start = time.perf_counter()
  print(
    f"{args.num_prompts} prompts x {args.steps} steps per G, {args.num_clusters} clusters, "
    f"{args.rewards} rewards, EBPO normalize={args.normalize} decay={args.decay}, "
    f"seed {args.seed}\n"
  )
  results = {}
  for group_size in args.group_sizes:
    results[group_size] = simulate_group_size(args, group_size)
    print(format_table(group_size, results[group_size]) + "\n", flush=True)
  print(f"done in {time.perf_counter() - start:.1f} s")
  if args.json:
    files.write_atomic(args.json, json.dumps({"args": vars(args), "results": results}, indent=1))
  return results


if __name__ == "__main__":
  cli.run(define_flags, main)
