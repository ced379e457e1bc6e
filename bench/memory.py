"""Per-device memory and expected step time of the paper's configs on their target slice.

    python bench/memory.py                      # the table (3 models; minutes of CPU)
    python bench/memory.py --write bench/MEMORY.md
    python bench/memory.py --quick              # CI smoke run: a runlocal config on 8 devices

Memory: the trainer's own jitted `train_step`, lowered with abstract sharded inputs
(`jax.ShapeDtypeStruct`; nothing is allocated) on a CPU topology of the target device count (a
subprocess per config with `--xla_force_host_platform_device_count`), compiled, and read back with
`memory_analysis()` (argument + output - aliased + temp bytes per device). The CPU compiler is not
the TPU one (fusion, layouts, bf16 handling differ), so the numbers are indicative. Next to it an
analytic estimate: the sharded state (float32 params, grads and their accumulator, two Adam
moments, the KL reference) plus activations under full remat (every layer's input kept; one layer
recomputed with its attention scores, probabilities and their gradient; the logits of one sequence
a few times). Sequences are the worst case, the largest prompt bucket (4,096) + 8,192 responses.

Step time from FLOPs at an assumed MFU on v5p (459 TFLOP/s bf16 per chip): training
(6 + 2 for full remat + 2 for the KL reference forward) x params x tokens plus attention (as
implemented: the full T x T score matrix), at 40% MFU; generation 2 x params per generated token
plus its attention over the cache, at 10% MFU (decoding is bound by memory bandwidth: reading the
KV cache and all-gathering FSDP weights every token). Typical prompts are short: step times assume
a 512-token prompt bucket and responses running to the 8,192-token limit (the sampler and the train
step compute on the padded length).
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9
PEAK_FLOPS = 459e12  # v5p bf16 per chip
HBM_GB = 95.0  # v5p HBM per chip
TRAIN_MFU = 0.40
DECODE_MFU = 0.10
TYPICAL_PROMPT = 512
ROWS = [  # (model, method, G): EBPO with the KL term; DAPO without; G 4 (the default) and 32
  *((m, "ebpo_topic", 4) for m in ("qwen3_8b", "qwen3_14b", "llama31_8b")),
  *((m, "dapo", 4) for m in ("qwen3_8b", "qwen3_14b", "llama31_8b")),
  ("qwen3_8b", "ebpo_topic", 32),
]


def load_paper():
  spec = importlib.util.spec_from_file_location("paper", os.path.join(ROOT, "configs/paper.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def num_params(spec: dict) -> int:
  """Parameters of a decoder of `spec`'s shape (embeddings, attention, MLP, norms, head)."""
  e, m, layers = spec["hidden_size"], spec["intermediate_size"], spec["num_layers"]
  h, kv, d, v = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"], spec["vocab_size"]
  attention = e * h * d * 2 + e * kv * d * 2 + (2 * d if spec["architecture"] == "qwen3" else 0)
  layer = attention + 3 * e * m + 2 * e
  head = 0 if spec["tie_word_embeddings"] else v * e
  return v * e + layers * layer + e + head


def mesh_sizes(config, devices: int) -> dict:
  sizes = dict(config.mesh)
  known = math.prod(s for s in sizes.values() if s != -1)
  return {k: (devices // known if s == -1 else s) for k, s in sizes.items()}


def analytic(config, spec: dict, devices: int) -> dict:
  """Bytes per device of the train step (worst-case sequence) and of the sampler's KV cache."""
  n = num_params(spec)
  mesh = mesh_sizes(config, devices)
  shards, tensor = mesh["data"] * mesh["fsdp"], mesh["tensor"]
  kl = config.rl.loss.kl_coef > 0
  state = 4 * n * (1 + 2 + 2 + kl) / devices  # params, grads + accumulator, Adam m and v, ref
  seq = max(config.sampling.prompt_buckets) + config.sampling.max_new_tokens
  rows = config.train.micro_batch_size // shards  # sequences per device per micro-batch
  e, h, layers = spec["hidden_size"], spec["num_heads"], spec["num_layers"]
  saved = layers * rows * seq * e * 2  # bf16 layer inputs kept by full remat
  scores = 3 * rows * math.ceil(h / tensor) * seq**2 * 4  # f32 scores, probabilities, gradient
  logits = 4 * rows * config.sampling.max_new_tokens * spec["vocab_size"] / tensor * 4
  train_bytes = state + saved + scores + logits
  rows_sampled = config.train.batch_size * config.rl.group_size / shards
  kv_per_token = layers * 2 * math.ceil(spec["num_kv_heads"] / tensor) * spec["head_dim"] * 2
  cache = rows_sampled * seq * kv_per_token
  return {
    "params_gb": 4 * n / devices / GB,
    "state_gb": state / GB,
    "activations_gb": (saved + scores + logits) / GB,
    "train_gb": train_bytes / GB,
    "kv_cache_gb": cache / GB,
  }


def step_time(config, spec: dict, devices: int) -> dict:
  """Seconds per RL step from FLOPs (see the module docstring)."""
  n = num_params(spec)
  rows = config.train.batch_size * config.rl.group_size
  new = config.sampling.max_new_tokens
  seq = TYPICAL_PROMPT + new
  attn_fwd = 4 * seq**2 * spec["num_heads"] * spec["head_dim"] * spec["num_layers"]  # per row
  passes = 6 + 2 + (2 if config.rl.loss.kl_coef > 0 else 0)  # fwd+bwd, remat, reference fwd
  train_flops = passes * n * rows * seq + (passes / 2) * attn_fwd * rows
  mean_context = TYPICAL_PROMPT + new / 2
  per_token = 2 * n + 4 * mean_context * spec["num_heads"] * spec["head_dim"] * spec["num_layers"]
  sample_flops = rows * (new * per_token + 2 * n * TYPICAL_PROMPT)
  peak = devices * PEAK_FLOPS
  train_s = train_flops / (peak * TRAIN_MFU)
  sample_s = sample_flops / (peak * DECODE_MFU)
  return {"train_s": train_s, "sample_s": sample_s, "step_s": train_s + sample_s}


def compiled_memory(config, spec: dict, prompt_len: int, shard_micro_rows: bool = False) -> dict:
  """memory_analysis() of the trainer's train_step on this process's devices (abstract inputs).

  `shard_micro_rows`: the what-if of a one-line trainer change, each micro-batch's rows constrained
  to the (data, fsdp) axes inside the loss (as coded, XLA shards the activations' hidden dimension
  like the FSDP weights and keeps every micro-batch row on every device).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec

  from ebpo_jax import advantages, models, sharding, train

  mesh = sharding.make_mesh(dict(config.mesh))
  mc = config.model
  model_config = models.ModelConfig(
    vocab_size=spec["vocab_size"],
    hidden_size=mc.hidden_size,
    intermediate_size=mc.intermediate_size,
    num_layers=mc.num_layers,
    num_heads=mc.num_heads,
    num_kv_heads=mc.num_kv_heads,
    head_dim=mc.head_dim,
    **train._architecture(mc),
    dtype=mc.dtype,
    param_dtype=mc.param_dtype,
    remat=mc.remat,
  )
  model = models.Decoder(model_config)
  boxed = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 4), jnp.int32))["params"],
                         jax.random.PRNGKey(0))  # fmt: skip
  param_shardings = sharding.logical_shardings(boxed, mesh, sharding.DEFAULT_RULES)
  params = jax.tree.map(
    lambda box, s: jax.ShapeDtypeStruct(box.value.shape, box.value.dtype, sharding=s),
    boxed,
    param_shardings,
    is_leaf=lambda x: hasattr(x, "names"),
  )
  replicated = NamedSharding(mesh, PartitionSpec())
  optimizer = train.make_optimizer(config.train, config.train.num_steps * 4)
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_shardings = optax.tree_map_params(
    optimizer,
    lambda _, s: s,
    opt_abstract,
    param_shardings,
    transform_non_params=lambda _: replicated,
  )
  with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
  opt_state = jax.tree.map(with_sharding, opt_abstract, opt_shardings)
  prior = jax.tree.map(
    lambda x: with_sharding(x, replicated), jax.eval_shape(lambda: advantages.init_prior(10))
  )
  state = train.TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
    params=params,
    opt_state=opt_state,
    prior=prior,
    rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    ref_params=params if config.rl.loss.kl_coef > 0 else None,
  )
  b, g, n = config.train.batch_size, config.rl.group_size, config.sampling.max_new_tokens
  rows = sharding.batch_sharding(mesh)
  shapes = {
    "prompt_ids": ((b, prompt_len), jnp.int32),
    "prompt_mask": ((b, prompt_len), jnp.bool_),
    "tokens": ((b * g, n), jnp.int32),
    "completion_mask": ((b * g, n), jnp.bool_),
    "old_logps": ((b * g, n), jnp.float32),
    "truncated": ((b * g,), jnp.bool_),
    "rewards": ((b, g), jnp.float32),
    "cluster_ids": ((b,), jnp.int32),
  }
  batch = {k: jax.ShapeDtypeStruct(s, t, sharding=rows) for k, (s, t) in shapes.items()}
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  step = jax.jit(
    functools.partial(train.train_step, model=model, optimizer=optimizer, config=config),
    in_shardings=(state_shardings, rows),
    out_shardings=(state_shardings, replicated),
    donate_argnums=(0,),
  )
  t0 = time.perf_counter()
  loss_fn = train._loss_fn
  if shard_micro_rows:
    constrain = lambda x: jax.lax.with_sharding_constraint(x, rows)  # noqa: E731
    train._loss_fn = lambda p, mb, **kw: loss_fn(p, jax.tree.map(constrain, mb), **kw)
  try:
    compiled = step.lower(state, batch).compile()
  finally:
    train._loss_fn = loss_fn
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  total = (
    mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes
    + mem.temp_size_in_bytes
  )
  return {
    "argument_gb": mem.argument_size_in_bytes / GB,
    "output_gb": mem.output_size_in_bytes / GB,
    "alias_gb": mem.alias_size_in_bytes / GB,
    "temp_gb": mem.temp_size_in_bytes / GB,
    "compiled_gb": total / GB,
    "compile_s": compile_s,
  }


def worker(arg: str, devices: int, prompt_len: int) -> dict:
  """One config's numbers, computed in this process (its devices are the target topology)."""
  import jax

  paper = load_paper()
  model, method, group_size, runlocal = paper.parse_arg(arg)
  config = paper.get_config(arg)
  spec = dict(paper.MODELS[model])
  if runlocal:  # the tiny model: its own shape, the arithmetic tokenizer's vocabulary
    spec.update({k: config.model[k] for k in ("hidden_size", "intermediate_size", "num_layers")})
    spec.update({k: config.model[k] for k in ("num_heads", "num_kv_heads", "head_dim")})
    spec["vocab_size"] = 18
  if jax.device_count() != devices:
    raise SystemExit(f"expected {devices} devices, found {jax.device_count()}")
  result = {"config": arg, "devices": devices, "method": method, "group_size": group_size}
  result.update(analytic(config, spec, devices))
  result.update(step_time(config, spec, devices))
  result.update(compiled_memory(config, spec, prompt_len))
  sharded = compiled_memory(config, spec, prompt_len, shard_micro_rows=True)
  result["sharded_rows_gb"] = sharded["compiled_gb"]
  result["compile_s"] += sharded["compile_s"]
  return result


def run_in_subprocess(arg: str, devices: int, prompt_len: int, timeout: float) -> dict:
  env = dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
  )
  cmd = [sys.executable, os.path.abspath(__file__), f"--worker={arg}", f"--devices={devices}"]
  cmd.append(f"--prompt_len={prompt_len}")
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  if result.returncode != 0:
    raise SystemExit(f"{arg}: the worker failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
  """A markdown table of the results."""
  head = (
    "| config | devices | params/device GB | memory_analysis GB (arg + out - alias + temp) "
    "| memory_analysis GB, micro-batch rows sharded | analytic GB (state + activations) "
    "| KV cache GB (sampling, all rows at once) | step time s (sample + train) |"
  )
  lines = [head, "|" + "---|" * 8]
  for r in results:
    lines.append(
      f"| {r['config']} | {r['devices']} | {r['params_gb']:.2f} "
      f"| {r['compiled_gb']:.1f} ({r['argument_gb']:.1f} + {r['output_gb']:.1f} - "
      f"{r['alias_gb']:.1f} + {r['temp_gb']:.1f}) | {r['sharded_rows_gb']:.1f} "
      f"| {r['train_gb']:.1f} ({r['state_gb']:.1f} + {r['activations_gb']:.1f}) "
      f"| {r['kv_cache_gb']:.0f} "
      f"| {r['step_s']:.0f} ({r['sample_s']:.0f} + {r['train_s']:.0f}) |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--configs",
    default=";".join(f"{m},{method},g{g}" for m, method, g in ROWS),
    help="configs/paper.py arguments separated by ';' (default: the table's rows)",
  )
  parser.add_argument("--devices", type=int, default=32)
  parser.add_argument("--prompt_len", type=int, default=4096, help="prompt bucket compiled")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
  parser.add_argument("--write", default="", help="also write the table to this markdown file")
  parser.add_argument("--quick", action="store_true", help="a runlocal config on 8 devices")
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args.worker, args.devices, args.prompt_len)))
    return
  if args.quick:
    args.configs, args.devices, args.prompt_len = "qwen3_8b,ebpo_topic,runlocal", 8, 16
  results = []
  for arg in [c for c in args.configs.split(";") if c]:
    results.append(run_in_subprocess(arg, args.devices, args.prompt_len, args.timeout))
    print(f"{arg}: compiled in {results[-1]['compile_s']:.0f} s", file=sys.stderr, flush=True)
  print(table(results))
  if args.write:
    with open(args.write, "w") as f:
      f.write(table(results) + "\n")
  print(json.dumps(results))


if __name__ == "__main__":
  main()
