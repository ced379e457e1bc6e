"""The cost of `rl.recompute_old_logps` (and of `rl.loss.rollout_is`) in the default job's step.

    python bench/recompute.py [--repeats 20]   # configs/arith_ebpo.py's step, as the trainer's
    python bench/recompute.py --quick          # CI smoke: 1 layer, 4 updates, no token_tis

Compiled train steps of the same config and batch, in two layouts: the default job's (one update
per step) and `train.mini_batch_size=8` (4 updates). In each, the default (PPO's old log-probs the
sampler's, no correction), `rl.recompute_old_logps=True` and `rl.loss.rollout_is=token_tis`. With
one update the first pass is that update's own forward (no extra work but the weights); with four,
the step runs a forward of the policy before its updates. Each round times every variant in turn
(the order rotating), so load drift hits all alike; the ratios to the same layout's default are
per round (paired), and the last line is JSON with their medians. Ratios, not times: the machine
may be shared.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train_step as bench_step  # noqa: E402

from ebpo_jax import cli, models, sharding  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 18  # the arithmetic task's characters
CORRECTIONS = {
  "default": {},
  "recompute": {"rl.recompute_old_logps": True},
  "token_tis": {"rl.loss.rollout_is": "token_tis"},
}
LAYOUTS = {"1_update": {}, "4_updates": {"train.mini_batch_size": 8}}


def variants(quick: bool) -> dict[str, dict]:
  """Each correction in each layout ("layout/correction": overrides); --quick: 4 updates, the
  default and recompute only (token_tis is one more step to compile, ~3 CPU-s, on the same path)."""
  layouts = {"4_updates": LAYOUTS["4_updates"]} if quick else LAYOUTS
  corrections = {k: CORRECTIONS[k] for k in ("default", "recompute")} if quick else CORRECTIONS
  return {
    f"{layout}/{name}": layout_overrides | overrides
    for layout, layout_overrides in layouts.items()
    for name, overrides in corrections.items()
  }


def compiled(overrides: dict, args):
  """The default job's train step with `overrides`, compiled, with its fresh state and a batch."""
  config = cli.load_config(os.path.join(ROOT, "configs/arith_ebpo.py"))
  if args.quick:
    config.model.num_layers = 1
  config.mesh.data, config.mesh.fsdp = 1, -1
  for key, value in overrides.items():
    section, name = key.rsplit(".", 1)
    node = config
    for part in section.split("."):
      node = node[part]
    node[name] = value
  mesh = sharding.make_mesh(dict(config.mesh))
  model = models.build.make_model(config, VOCAB)
  state, step, _ = bench_step.fresh_state_and_step(config, model, mesh, num_clusters=3)
  batch = bench_step.synthetic_batch(config, args.prompt_len, VOCAB)
  return [step.compile(state, batch), state, batch]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--prompt_len", type=int, default=8, help="the default job's prompt bucket")
  parser.add_argument("--quick", action="store_true", help="CI smoke run")
  args = parser.parse_args()
  if args.quick:
    args.repeats = 2
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
  runs = {name: compiled(overrides, args) for name, overrides in variants(args.quick).items()}
  names = list(runs)
  times = {name: [] for name in names}
  for repeat in range(args.repeats + 1):  # the first round warms up
    shift = repeat % len(names)
    for name in names[shift:] + names[:shift]:
      fn, state, batch = runs[name]
      start = time.perf_counter()
      state, metrics, _ = fn(state, batch)
      jax.block_until_ready((state, metrics))
      runs[name][1] = state
      if repeat:
        times[name].append(time.perf_counter() - start)
  summary = {}
  for name in names:
    layout, correction = name.split("/")
    ratios = np.array(times[name]) / np.array(times[f"{layout}/default"])
    print(f"{name:21} median step {np.median(times[name]) * 1e3:8.1f} ms   x default: median "
          f"{np.median(ratios):.3f}, range {ratios.min():.3f}-{ratios.max():.3f}")  # fmt: skip
    if correction != "default":
      summary[f"{layout}/{correction}_over_default"] = float(np.median(ratios))
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
