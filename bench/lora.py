"""LoRA vs full fine-tuning on the SmolLM2-135M shape: train-step time, optimizer state, checkpoint.

    python bench/lora.py                # 135m shape, 2 prompts x G=2, 32 + 32 tokens (minutes)
    python bench/lora.py --quick        # CI smoke run: smoke shape, one timed round, no sampling
                                        # merged in the sampler's jit (seconds)

The step is the trainer's own jitted `train_step` (bench/train_step.py builds it the same way),
EBPO, float32, `rl.loss.kl_coef = 0` (no reference forward), one update per step, on a random-init
model of SmolLM2-135M's shape (30 layers, d=576, 9/3 heads, vocab 49152, tied embeddings). Three
variants: full fine-tuning, LoRA rank 8 and rank 64 on all seven projections; their steps are timed
in turn, round after round, after one warm-up round (compilation), so background load hits all
alike; a variant's time relative to full is the median over rounds of the round's ratio.
Optimizer-state bytes are the AdamW moments' arrays; checkpoint bytes are the directory
`ebpo_jax.checkpoint.Checkpointer` writes for `state.checkpointed(state)` (under LoRA without the
frozen base).

Sampling with LoRA, two ways on the same adapted policy (rank 8, B non-zero as after training):
on the fly (the LoRA decoder: two extra small matmuls per projection per decoded token) and merged
once per step (`lora.merge`, then the plain decoder; the merge's time counted in). Batch 16,
32-token prompts, 32 new tokens, interleaved, best of `--sample_reps`.

Prints a table, then last a JSON line with the ratios to full fine-tuning and the sampling rates.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402  (bench/_common.py: the table)
import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import train_step as train_step_bench  # noqa: E402  (bench/train_step.py: shapes, config, batch)

from ebpo_jax import checkpoint, models, sampling, sharding  # noqa: E402
from ebpo_jax.trainer import policy as policy_lib  # noqa: E402
from ebpo_jax.trainer import state as state_lib  # noqa: E402
from ebpo_jax.trainer import step as step_lib  # noqa: E402

NUM_CLUSTERS = 3


def variant_config(shape: dict, rank: int, args):
  """bench/train_step.py's config (EBPO, the benchmark's batch) without a KL term, with LoRA of
  `rank` on every projection (0: full fine-tuning)."""
  config = train_step_bench.load_config(shape, "ebpo", args)
  config.model.tie_word_embeddings = True
  config.rl.loss.kl_coef = 0.0
  config.model.lora.rank = rank
  return config


def build_variant(shape_name: str, rank: int, args) -> dict:
  """The compiled train step of one variant, its fresh state and a synthetic batch."""
  shape = train_step_bench.SHAPES[shape_name]
  config = variant_config(shape, rank, args)
  mesh = sharding.make_mesh(dict(config.mesh))
  model = models.build.make_model(config, shape["vocab_size"])
  params = policy_lib.initial_params(config, model, mesh)  # base + fresh adapters under LoRA
  spec = state_lib.StateSpec.from_config(config, NUM_CLUSTERS)
  shardings = spec.shardings(params)
  state = spec.create(params)  # params are donated
  options = step_lib.StepOptions.from_config(config, mesh)
  step = step_lib.jit_train_step(model, spec, options, mesh, shardings)
  batch = train_step_bench.synthetic_batch(config, args.prompt_len, shape["vocab_size"])
  # Every group mixed (one reward 1, the rest 0): non-zero advantages, so the adapters and the
  # optimizer's moments move and the checkpoint holds real (incompressible) values, not zeros.
  batch["rewards"] = np.zeros_like(batch["rewards"])
  batch["rewards"][:, 0] = 1.0
  batch = jax.device_put(batch, step_lib.batch_shardings(options.layout, mesh))
  compiled = step.compile(state, batch)
  traced = step_lib.bound_train_step(model, spec, options)
  flops = dot_flops(jax.make_jaxpr(traced)(state, batch).jaxpr)
  return {
    "fn": compiled,
    "state": state,
    "batch": batch,
    "model": model,
    "mesh": mesh,
    "flops": flops,
  }


def dot_flops(jaxpr, times: int = 1) -> int:
  """Matmul FLOPs of a jaxpr: 2 x output size x contracted size per `dot_general`, a scan's body
  counted `length` times (XLA's cost analysis counts it once). Shows what the step computes: no
  weight gradients of the frozen base under LoRA."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += (
        times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
      )
    inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
    for param in eqn.params.values():
      for sub in param if isinstance(param, list | tuple) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += dot_flops(sub.jaxpr, inner)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += dot_flops(sub, inner)
  return total


def tree_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def checkpoint_bytes(state) -> int:
  """Bytes on disk of a checkpoint of `state` (as the trainer saves it: no LoRA base)."""
  with tempfile.TemporaryDirectory() as tmp:
    with checkpoint.Checkpointer(tmp, async_save=False) as ckpt:
      ckpt.save(1, state_lib.checkpointed(state), force=True)
      ckpt.wait()
    return sum(
      os.path.getsize(os.path.join(root, f)) for root, _, names in os.walk(tmp) for f in names
    )


def time_steps(runs: dict, repeats: int) -> dict[str, list[float]]:
  """Seconds of each timed step of each variant, one step of each in turn per round; round 0
  warms up. Each step continues from the state the previous one returned (the state is donated)."""
  times = {name: [] for name in runs}
  for repeat in range(repeats + 1):
    for name, run in runs.items():
      start = time.perf_counter()
      state, metrics, _ = run["fn"](run["state"], run["batch"])
      jax.block_until_ready((state, metrics))
      run["state"] = state
      if repeat:
        times[name].append(time.perf_counter() - start)
  return times


def trained_adapters(adapters, seed: int = 1):
  """The adapters with every B random (as after training), so that merging changes the kernels."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
  keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
  out = [
    0.01 * jax.random.normal(next(keys), x.shape, x.dtype)
    if path[-1].key == models.lora.B_NAME
    else x
    for path, x in leaves
  ]
  return jax.tree_util.tree_unflatten(treedef, out)


def time_sampling(run: dict, args) -> dict[str, float]:
  """Decoded tokens per second of the adapted policy, on the fly vs merged once per call (the
  merge counted in); best of `args.sample_reps`, the two ways in turn."""
  model, state = run["model"], run["state"]
  params = models.lora.combine(trained_adapters(state.params), state.base)
  vocab = model.config.vocab_size
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, vocab, (args.sample_batch, args.prompt_len)), jnp.int32)
  mask = jnp.ones(ids.shape, bool)
  options = dict(max_new_tokens=args.sample_new_tokens, mesh=run["mesh"])
  base_model = models.lora.base_model(model)
  merge = jax.jit(lambda p: models.lora.merge(p, model.config))

  def on_the_fly(key):
    return sampling.generate(model, params, ids, mask, key, **options).tokens

  def merged(key):
    return sampling.generate(base_model, merge(params), ids, mask, key, **options).tokens

  premerged = merge(params)

  def merged_excl_merge(key):  # a diagnostic: the decode alone on already merged weights
    return sampling.generate(base_model, premerged, ids, mask, key, **options).tokens

  @jax.jit
  def merged_in_jit(params, key):  # merged inside the sampler's program (XLA may fuse the merge)
    merged_params = models.lora.merge(params, model.config)
    return sampling.generate(base_model, merged_params, ids, mask, key, **options).tokens

  ways = {
    "on_the_fly": on_the_fly,
    "merged": merged,
    "merged_in_jit": lambda key: merged_in_jit(params, key),
    "merged_excl_merge": merged_excl_merge,
  }
  if args.quick:  # the merge inside the sampler's jit is one more program to compile (~1 CPU-s)
    del ways["merged_in_jit"]
  best = dict.fromkeys(ways, float("inf"))
  for rep in range(args.sample_reps + 1):  # rep 0 compiles
    for name, fn in ways.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(jax.random.key(rep)))
      if rep:
        best[name] = min(best[name], time.perf_counter() - start)
  merge_s = float("inf")
  for _ in range(max(args.sample_reps, 1)):
    start = time.perf_counter()
    jax.block_until_ready(merge(params))
    merge_s = min(merge_s, time.perf_counter() - start)
  tokens = args.sample_batch * args.sample_new_tokens
  return {f"{name}_tok_s": tokens / seconds for name, seconds in best.items()} | {
    "merge_s": merge_s
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", default="135m", choices=sorted(train_step_bench.SHAPES))
  parser.add_argument("--ranks", default="8,64", help="LoRA ranks beside full fine-tuning")
  parser.add_argument("--rows", type=int, default=4, help="responses per step (B * G)")
  parser.add_argument("--group_size", type=int, default=2)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up")
  parser.add_argument("--micro_rows", type=int, default=0, help="rows per micro-batch; 0: all")
  parser.add_argument("--sample_batch", type=int, default=16, help="prompts per sampler call")
  parser.add_argument("--sample_reps", type=int, default=3, help="0: no sampling comparison")
  parser.add_argument("--sample_new_tokens", type=int, default=0, help="0: --new_tokens")
  parser.add_argument("--quick", action="store_true", help="CI smoke run (smoke shape)")
  args = parser.parse_args()
  args.dtype = "float32"
  if args.quick:
    args.shape, args.prompt_len, args.new_tokens, args.repeats = "smoke", 8, 8, 1
    args.sample_batch, args.sample_reps = 4, 1
  args.sample_new_tokens = args.sample_new_tokens or args.new_tokens
  ranks = [int(r) for r in args.ranks.split(",")]
  names = ["full"] + [f"lora{r}" for r in ranks]

  ranks_by_name = dict(zip(names, [0, *ranks], strict=True))
  runs = {name: build_variant(args.shape, rank, args) for name, rank in ranks_by_name.items()}
  times = time_steps(runs, args.repeats)
  seconds = {name: float(np.median(t)) for name, t in times.items()}
  # Each round's ratio to full fine-tuning, timed back to back: robust to load that changes
  # between rounds (the medians of the raw times may come from different load phases).
  ratios = {name: float(np.median(np.divide(t, times["full"]))) for name, t in times.items()}
  opt_bytes = {name: tree_bytes(run["state"].opt_state) for name, run in runs.items()}
  trained = {name: tree_bytes(run["state"].params) for name, run in runs.items()}
  ckpt_bytes = {name: checkpoint_bytes(run["state"]) for name, run in runs.items()}

  print(
    f"\n{args.shape} shape, float32, {args.rows // args.group_size} prompts x G={args.group_size},"
    f" {args.prompt_len} + {args.new_tokens} tokens, median of {args.repeats} interleaved steps;"
    f" {_common.host()}; x full: median of the rounds' ratios"
  )
  header = f"{'variant':8} {'step s':>8} {'x full':>7} {'GFLOP':>7} {'x full':>7}"
  header += f" {'trained MB':>11} {'opt MB':>9}"
  header += f" {'x full':>8} {'ckpt MB':>9} {'x full':>8}"
  lines = [
    f"{name:8} {seconds[name]:8.3f} {ratios[name]:7.3f}"
    f" {runs[name]['flops'] / 1e9:7.1f} {runs[name]['flops'] / runs['full']['flops']:7.3f}"
    f" {trained[name] / 1e6:11.2f} {opt_bytes[name] / 1e6:9.2f}"
    f" {opt_bytes[name] / opt_bytes['full']:8.2%} {ckpt_bytes[name] / 1e6:9.2f}"
    f" {ckpt_bytes[name] / ckpt_bytes['full']:8.2%}"
    for name in names
  ]
  _common.print_table(header, lines)
  summary = {"shape": args.shape}
  for name in names[1:]:
    summary[f"{name}_step_over_full"] = round(ratios[name], 4)
    summary[f"{name}_flops_over_full"] = round(runs[name]["flops"] / runs["full"]["flops"], 4)
    summary[f"{name}_opt_state_over_full"] = round(opt_bytes[name] / opt_bytes["full"], 5)
    summary[f"{name}_ckpt_over_full"] = round(ckpt_bytes[name] / ckpt_bytes["full"], 5)
  summary["step_s"] = {name: round(seconds[name], 4) for name in names}
  summary["step_times_s"] = {name: [round(t, 3) for t in times[name]] for name in names}

  if args.sample_reps and ranks:
    sampled = time_sampling(runs[names[1]], args)
    in_jit = f"{sampled['merged_in_jit_tok_s']:.0f} tok/s" if not args.quick else "not timed"
    print(
      f"\nsampling with {names[1]}: batch {args.sample_batch}, {args.prompt_len} + "
      f"{args.sample_new_tokens} tokens, best of {args.sample_reps}: on the fly "
      f"{sampled['on_the_fly_tok_s']:.0f} tok/s, merged once per call "
      f"{sampled['merged_tok_s']:.0f} tok/s, merged in the sampler's jit {in_jit} (without the "
      f"merge {sampled['merged_excl_merge_tok_s']:.0f} tok/s; the merge alone "
      f"{sampled['merge_s'] * 1e3:.0f} ms)"
    )
    summary["sampling"] = {k: round(v, 4) for k, v in sampled.items()}
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
