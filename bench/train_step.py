"""Train-step cost: EBPO vs GRPO in the same jitted step, and achieved FLOP/s vs a plain matmul.

    python bench/train_step.py [--shapes tiny,135m] [--rows 8] [--prompt_len 32] [--new_tokens 32]
    python bench/train_step.py --quick        # CI smoke run: smoke shape, one timed step

The step is the trainer's own `train_step` (advantages, sequence assembly, PPO-clip update with
AdamW), compiled once per estimator. The 135m shape is SmolLM2-135M's (30 layers, d=576, 9/3 heads,
vocab 49152), randomly initialised. FLOPs are counted from the shapes (step_flops); the
reference rate is a square float32 matmul timed in the same process. Prints a table, then last a
JSON line with the EBPO/GRPO time ratio (goal <= 1.02: the prior must be free) and the FLOP/s share.

It also times the step's weight matmuls alone (the same shapes, forward and backward, chained in
one program): the share the step would have if it took only their time. At small widths this is
itself well below the square matmul's rate (about 70% at the tiny shape), and bounds what the step
can reach with these matmuls.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402  (bench/_common.py: the shapes)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import op_profile  # noqa: E402

from ebpo_jax import cli, models, sharding  # noqa: E402
from ebpo_jax.trainer import state as state_lib  # noqa: E402
from ebpo_jax.trainer import step as step_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=4,
            head_dim=32, vocab_size=18)  # fmt: skip
SHAPES = {
  "tiny": TINY,
  # CI smoke runs (--quick): tiny's widths, one layer. The trainer unrolls the layer loop
  # (model.unroll_layers), so each layer is its own code to compile.
  "smoke": TINY | {"num_layers": 1},
  # bench/gpu.py's train step: Qwen3-0.6B's widths (its q/k norms and tied head left out: they
  # change neither the matmuls nor the FLOP count much).
  "0.6b": _common.shape(_common.QWEN3_0_6B),
  "135m": _common.shape(_common.SMOLLM2_135M),
}


def load_config(shape: dict, advantage: str, args):
  """configs/arith_ebpo.py with `shape`'s model, `advantage`, and the benchmark's batch."""
  config = cli.load_config(os.path.join(ROOT, "configs/arith_ebpo.py"))
  for key, value in shape.items():
    if key != "vocab_size":
      config.model[key] = value
  config.rl.advantage = advantage
  config.rl.group_size = args.group_size
  config.train.batch_size = args.rows // args.group_size
  config.train.mini_batch_size = config.train.batch_size
  config.train.micro_batch_size = args.micro_rows
  config.sampling.max_new_tokens = args.new_tokens
  config.model.dtype = config.model.param_dtype = args.dtype
  config.mesh.data, config.mesh.fsdp = 1, -1
  return config


def synthetic_batch(config, prompt_len: int, vocab: int, seed: int = 0) -> dict:
  """A batch of `step.abstract_batch`'s layout: random prompts, completions and 0/1 rewards,
  every mask on, no row truncated or non-finite."""
  rng = np.random.default_rng(seed)
  tokens = lambda shape: rng.integers(3, vocab, shape).astype(np.int32)
  fill = {
    "prompt_ids": tokens,
    "tokens": tokens,
    "old_logps": lambda shape: np.full(shape, -np.log(vocab), np.float32),
    "rewards": lambda shape: rng.integers(0, 2, shape).astype(np.float32),
    "cluster_ids": lambda shape: (np.arange(shape[0]) % 3).astype(np.int32),
  }
  batch = {}
  layout = step_lib.StepLayout.from_config(config, None)
  abstract = step_lib.abstract_batch(layout, prompt_len, config.sampling.max_new_tokens)
  for key, spec in abstract.items():
    if key in fill:
      batch[key] = fill[key](spec.shape)
    else:  # the masks on, the per-row flags (truncated, nonfinite) off
      batch[key] = np.full(spec.shape, key.endswith("_mask"), bool)
  return batch


def fresh_state_and_step(config, model, mesh, num_clusters: int):
  """A fresh train state of `model` (random init) and the trainer's jitted `train_step` for it,
  built as the trainer builds them; also the number of matmul weights (for FLOP counts)."""
  params = models.build.init_params(config, model, mesh)
  spec = state_lib.StateSpec.from_config(config, num_clusters)
  state_sharding = spec.shardings(params)
  num_params = sum(x.size for x in jax.tree.leaves(params) if x.ndim >= 2)
  state = spec.create(params)  # params are donated
  options = step_lib.StepOptions.from_config(config, mesh)
  step = step_lib.jit_train_step(model, spec, options, mesh, state_sharding)
  return state, step, num_params


def compiled_step(shape_name: str, advantage: str, args):
  """The trainer's train_step for this shape and estimator, compiled, with its state and batch."""
  shape = SHAPES[shape_name]
  config = load_config(shape, advantage, args)
  mesh = sharding.make_mesh(dict(config.mesh))
  model = models.build.make_model(config, shape["vocab_size"])
  state, step, num_params = fresh_state_and_step(config, model, mesh, num_clusters=3)
  batch = synthetic_batch(config, args.prompt_len, shape["vocab_size"])
  shared = step_lib.StepLayout.from_config(config, mesh).shared_prefix
  return step.compile(state, batch), state, batch, num_params, shared


def layer_tokens(args, shared_prefix: bool) -> int:
  """Tokens the layers run per step: each prompt once per group with `shared_prefix`, else once
  per row, plus every completion token."""
  prompts = args.rows // args.group_size if shared_prefix else args.rows
  return prompts * args.prompt_len + args.rows * args.new_tokens


def step_flops(weights: int, shape: dict, args, shared_prefix: bool) -> float:
  """Model FLOPs of one step: 6 per weight per token (forward + backward) plus attention, with the
  LM head counted only where a completion token is predicted (the step computes no other logits).

  The tokens the layers run: with `shared_prefix` (step.StepLayout.shared_prefix) each prompt
  once per group, its completions' attention over the prompt's keys and their own; else each of
  the rows in full. Counted by hand because XLA's cost analysis counts a scanned layer body once,
  not L times. `weights`: the entries of every matrix, each a matmul weight (the tied embedding
  is the LM head; its lookup is free).
  """
  p, n, rows = args.prompt_len, args.new_tokens, args.rows
  prompts = rows // args.group_size if shared_prefix else rows  # prompt copies the layers run
  tokens = layer_tokens(args, shared_prefix)
  # Score and value matmuls (2 x 2 FLOPs per query-key pair and head dim), x3 for the backward.
  pairs = prompts * p * p + rows * n * (p + n) if shared_prefix else rows * (p + n) ** 2
  head = shape["vocab_size"] * shape["hidden_size"]
  heads_dim = shape["num_heads"] * shape["head_dim"]
  attention = 12 * shape["num_layers"] * pairs * heads_dim
  return 6.0 * ((weights - head) * tokens + head * rows * n) + attention


def projection_matmuls(shape: dict, args, shared_prefix: bool) -> list[tuple[int, int, int]]:
  """(m, k, n) of every weight matmul of one step, forward and backward (the input's and the
  weight's gradients), at the tokens step_flops counts: the step's matmuls without the rest."""
  d, f, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
  q, kv = shape["num_heads"] * hd, shape["num_kv_heads"] * hd
  tokens, completion_tokens = layer_tokens(args, shared_prefix), args.rows * args.new_tokens
  layer = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
  weights = [(tokens, k, out) for k, out in layer] * shape["num_layers"]
  weights.append((completion_tokens, d, shape["vocab_size"]))  # the LM head: completions only
  return [s for t, k, out in weights for s in ((t, k, out), (t, out, k), (k, t, out))]


def matmuls_timer(shapes: list[tuple[int, int, int]]):
  """A function that times the matmuls of `shapes` chained in one program (as XLA runs them in the
  step, nothing else between them) and returns their seconds: the fastest of 3 calls."""
  # Drawn by numpy: jax.random would compile a sampler per shape (~1.3 CPU-s at the smoke shape);
  # a matmul's time does not depend on the values.
  rng = np.random.default_rng(1)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  operands = [(normal((m, k)), normal((k, n))) for m, k, n in shapes]
  chain = jax.jit(lambda ops: sum(jnp.sum(a @ b) for a, b in ops))
  jax.block_until_ready(chain(operands))
  return lambda: fastest_seconds(lambda: chain(operands))


def time_steps(shape_name: str, args) -> dict[str, float]:
  """Median seconds per step of each estimator and of the reference matmul, timed in turn each
  round so load drift hits all three alike (the two estimators in alternating order, so neither
  always runs second), and the EBPO/GRPO ratios of the rounds (paired: one load each)."""
  runs = {adv: list(compiled_step(shape_name, adv, args)) for adv in ("grpo", "ebpo")}
  num_params, shared = runs["grpo"][3:]
  matmul = matmul_timer(512 if args.quick else 2048)
  matmuls_alone = matmuls_timer(projection_matmuls(SHAPES[shape_name], args, shared))
  times = {adv: [] for adv in runs} | {"matmul": [], "matmuls_alone": []}
  for repeat in range(args.repeats + 1):  # the first round warms up
    matmul_rate, alone = matmul(), matmuls_alone()
    for adv, run in sorted(runs.items(), reverse=bool(repeat % 2)):
      fn, state, batch = run[:3]
      start = time.perf_counter()
      state, metrics, _ = fn(state, batch)
      jax.block_until_ready((state, metrics))
      run[1] = state
      if repeat:
        times[adv].append(time.perf_counter() - start)
    if repeat:
      times["matmul"].append(matmul_rate)
      times["matmuls_alone"].append(alone)
  if args.profile:
    fn, state, batch = runs["grpo"][:3]
    print_profile(shape_name, op_profile.op_times(fn, state, batch, steps=2))
  print(f"{shape_name}: the step runs {'each prompt once per group' if shared else 'full rows'}")
  flops = step_flops(num_params, SHAPES[shape_name], args, shared)
  ratios = np.array(times["ebpo"]) / np.array(times["grpo"])
  medians = {key: float(np.median(t)) for key, t in times.items()}
  return medians | {"flops": flops, "ebpo_over_grpo": ratios}


def matmul_timer(n: int, calls: int = 3):
  """A function that times `calls` square float32 matmuls and returns the fastest one's FLOP/s
  (the machine's rate at that moment: a call that another process interrupted does not count)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
  dot = jax.jit(lambda x: x @ x)
  jax.block_until_ready(dot(a))
  return lambda: 2 * n**3 / fastest_seconds(lambda: dot(a), calls)


def fastest_seconds(fn, calls: int = 3) -> float:
  """The fastest of `calls` timed calls of `fn` (its outputs waited for)."""
  seconds = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    seconds.append(time.perf_counter() - start)
  return min(seconds)


def print_profile(shape_name: str, op_seconds: dict[str, float]) -> None:
  total = sum(op_seconds.values())
  print(f"{shape_name}: where the grpo step's op time goes ({total:.3f} s, summed over threads)")
  for part, seconds in sorted(op_seconds.items(), key=lambda kv: -kv[1]):
    print(f"  {part:44} {seconds:8.3f} s {seconds / total:6.1%}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="tiny,135m")
  parser.add_argument("--rows", type=int, default=8, help="responses per step (B * G)")
  parser.add_argument("--group_size", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--micro_rows", type=int, default=0, help="rows per micro-batch; 0: all")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--quick", action="store_true", help="CI smoke run")
  parser.add_argument("--profile", action="store_true", help="trace the grpo step: op time by part")
  args = parser.parse_args()
  if args.profile:
    op_profile.enable_op_events()
  if args.quick:
    args.shapes, args.rows, args.prompt_len, args.new_tokens, args.repeats = "smoke", 8, 8, 8, 1

  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
  summary = {}
  for shape_name in args.shapes.split(","):
    timed = time_steps(shape_name, args)
    matmul = timed["matmul"]
    print(f"{shape_name}: f32 matmul {matmul / 1e9:.1f} GFLOP/s (median over rounds)")
    print(f"{'shape':6} {'estimator':10} {'step ms':>9} {'GFLOP':>8} {'GFLOP/s':>9} {'matmul':>9}")
    for advantage in ("grpo", "ebpo"):
      seconds, flops = timed[advantage], timed["flops"]
      print(f"{shape_name:6} {advantage:10} {seconds * 1e3:9.1f} {flops / 1e9:8.2f} "
            f"{flops / seconds / 1e9:9.2f} {flops / seconds / matmul:9.1%}")  # fmt: skip
    # The step's share if it took only the time of its weight matmuls run alone: above what the
    # step can reach at this shape, since attention and the rest take time too.
    ceiling = timed["flops"] / timed["matmuls_alone"] / matmul
    print(f"{shape_name}: its weight matmuls alone (forward and backward, nothing else) take "
          f"{timed['matmuls_alone'] * 1e3:.1f} ms: at most {ceiling:.1%} for the step")  # fmt: skip
    ratios = timed["ebpo_over_grpo"]
    print(f"{shape_name}: EBPO/GRPO step time, per round: median {np.median(ratios):.3f}, "
          f"range {ratios.min():.3f}-{ratios.max():.3f} over {len(ratios)} rounds")  # fmt: skip
    summary[shape_name] = {
      "ebpo_over_grpo": float(np.median(ratios)),
      "ebpo_over_grpo_range": [float(ratios.min()), float(ratios.max())],
      "flops_share_of_matmul": timed["flops"] / timed["grpo"] / matmul,
      "matmuls_alone_share": ceiling,
    }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
