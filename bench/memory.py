"""Per-device memory and expected step time of the paper's configs on their target slice.

    python bench/memory.py                      # the table (3 models; ~6 minutes of CPU)
    python bench/memory.py --write table.md     # also into a file (bench/MEMORY.md quotes it)
    python bench/memory.py --configs=qwen3_8b,ebpo_topic,g32 --prompts_per_call=8  # a what-if
    python bench/memory.py --quick              # CI smoke run: a runlocal config on 8 devices
    python bench/memory.py --sweep              # the sampler's KV cache, every model x G (seconds)

Memory: the trainer's own jitted `train_step` (with `mesh=`, as the trainer jits it: micro-batch
rows constrained to the mesh's batch axes, reference log-probs one micro-batch at a time), lowered
with abstract sharded inputs (`jax.ShapeDtypeStruct`; nothing is allocated) on a CPU topology of
the target device count (a subprocess per config with `--xla_force_host_platform_device_count`),
compiled, and read back with `memory_analysis()` (argument + output - aliased + temp bytes per
device). The CPU compiler is not the TPU one (fusion, layouts, bf16 handling differ), so the
numbers are indicative. Next to it an analytic estimate: the sharded state (float32 params, grads
and their accumulator, two Adam moments, the KL reference) plus activations under full remat
(every layer's input kept; one layer recomputed with its attention scores, probabilities and their
gradient; the logits of one sequence a few times). Sequences are the worst case, the largest
prompt bucket (4,096) + 8,192 responses. One sampler call (`sampling.prompts_per_call` prompts
x G rows, the trainer's mesh) is compiled and read the same way; the rest of the train state (Adam
moments, the KL reference) waits on the device meanwhile and is added from the analytic numbers.
Its KV cache is also computed: rows over the batch axes, P + N - 1 slots, bf16 K and V, KV heads
over the tensor axis.

Step time from FLOPs at an assumed MFU on v5p (459 TFLOP/s bf16 per chip): training
(6 + 2 for full remat + 2 for the KL reference forward) x params x tokens plus attention (as
implemented: the full T x T score matrix), at 40% MFU; generation 2 x params per generated token
plus its attention over the cache, at 10% MFU (decoding is bound by memory bandwidth: reading the
KV cache and all-gathering FSDP weights every token). Typical prompts are short: step times assume
a 512-token prompt bucket and responses running to the 8,192-token limit (the sampler and the train
step compute on the padded length).
"""

import argparse
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
  from ebpo_jax.trainer import config as config_lib

  return config_lib.load_module(os.path.join(ROOT, "configs/paper.py"))


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
  resident = 4 * n * (1 + 2 + kl) / devices  # between steps (sampling): params, Adam m, v, ref
  seq = max(config.sampling.prompt_buckets) + config.sampling.max_new_tokens
  rows = config.train.micro_batch_size // shards  # sequences per device per micro-batch
  e, h, layers = spec["hidden_size"], spec["num_heads"], spec["num_layers"]
  saved = layers * rows * seq * e * 2  # bf16 layer inputs kept by full remat
  scores = 3 * rows * math.ceil(h / tensor) * seq**2 * 4  # f32 scores, probabilities, gradient
  logits = 4 * rows * config.sampling.max_new_tokens * spec["vocab_size"] / tensor * 4
  train_bytes = state + saved + scores + logits
  prompts = config.sampling.prompts_per_call or config.train.batch_size  # 0: all in one call
  rows_sampled = prompts * config.rl.group_size / shards  # rows per device in one sampler call
  slots = seq - 1  # P + N - 1: the last drawn token never enters the cache
  kv_per_token = layers * 2 * math.ceil(spec["num_kv_heads"] / tensor) * spec["head_dim"] * 2
  cache = rows_sampled * slots * kv_per_token
  return {
    "params_gb": 4 * n / devices / GB,
    "state_gb": state / GB,
    "activations_gb": (saved + scores + logits) / GB,
    "train_gb": train_bytes / GB,
    "prompts_per_call": prompts,
    "sampler_calls": -(-config.train.batch_size // prompts),
    "kv_cache_gb": cache / GB,
    "resident_gb": resident / GB,
    "sampling_gb": (resident + cache) / GB,
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


def abstract_model(config, spec: dict, mesh):
  """The config's scanned decoder and its parameters as sharded `jax.ShapeDtypeStruct`s."""
  from ebpo_jax import models
  from ebpo_jax.trainer import state as state_lib

  model = models.Decoder(state_lib.random_init_config(config.model, spec["vocab_size"]))
  return model, state_lib.abstract_params(model, mesh)


def compiled_sampler_memory(config, spec: dict, prompt_len: int) -> dict:
  """memory_analysis() of one sampler call (`sampling.prompts_per_call` prompts x G rows, the
  trainer's mesh) with abstract inputs; the rest of the train state (Adam moments, the KL
  reference) stays on the device beside it and is added from the analytic numbers."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from ebpo_jax import sampling, sharding

  mesh = sharding.make_mesh(dict(config.mesh))
  model, params = abstract_model(config, spec, mesh)
  prompts = config.sampling.prompts_per_call or config.train.batch_size
  rows = sharding.batch_sharding(mesh)
  replicated = NamedSharding(mesh, PartitionSpec())
  t0 = time.perf_counter()
  compiled = sampling._generate.lower(
    params,
    jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32, sharding=rows),
    jax.ShapeDtypeStruct((prompts, prompt_len), jnp.bool_, sharding=rows),
    jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),  # temperature
    jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),  # top_p
    model=model,
    group_size=config.rl.group_size,
    max_new_tokens=config.sampling.max_new_tokens,
    greedy=False,
    stop_ids=(1,),
    top_k=config.sampling.top_k,
    pad_id=0,
    mesh=mesh,
  ).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
  return {"sampler_gb": total / GB, "sampler_compile_s": compile_s}


def compiled_memory(config, spec: dict, prompt_len: int) -> dict:
  """memory_analysis() of the trainer's train_step on this process's devices (abstract inputs),
  jitted as the trainer does (mesh, shardings, donated state)."""

  from ebpo_jax import advantages, sharding
  from ebpo_jax.trainer import state as state_lib
  from ebpo_jax.trainer import step as step_lib

  mesh = sharding.make_mesh(dict(config.mesh))
  model, params = abstract_model(config, spec, mesh)
  optimizer = state_lib.make_optimizer(config)
  estimator = advantages.from_config(config.rl)
  state_args = (config, optimizer, estimator, 10)  # 10 clusters
  state = state_lib.abstract_state(*state_args, params)
  state_shardings = state_lib.state_shardings(*state_args, params)
  batch = step_lib.abstract_batch(config, prompt_len, sharding.batch_sharding(mesh))
  step = step_lib.jit_train_step(config, model, optimizer, estimator, mesh, state_shardings)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
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


def worker(arg: str, devices: int, prompt_len: int, prompts_per_call: int) -> dict:
  """One config's numbers, computed in this process (its devices are the target topology).
  `prompts_per_call` >= 0 replaces the config's `sampling.prompts_per_call` (-1: keep it)."""
  import jax

  paper = load_paper()
  model, method, group_size, runlocal = paper.parse_arg(arg)
  config = paper.get_config(arg)
  if prompts_per_call >= 0:
    config.sampling.prompts_per_call = prompts_per_call
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
  result.update(compiled_sampler_memory(config, spec, prompt_len))
  # The sampler's arguments hold the params; the rest of the state waits on the device.
  rest_of_state = result["resident_gb"] - result["params_gb"]
  result["sampling_compiled_gb"] = result["sampler_gb"] + rest_of_state
  result["compile_s"] += result["sampler_compile_s"]
  return result


def run_in_subprocess(
  arg: str, devices: int, prompt_len: int, prompts_per_call: int, timeout: float
) -> dict:
  env = dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
  )
  cmd = [sys.executable, os.path.abspath(__file__), f"--worker={arg}", f"--devices={devices}"]
  cmd += [f"--prompt_len={prompt_len}", f"--prompts_per_call={prompts_per_call}"]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  if result.returncode != 0:
    raise SystemExit(f"{arg}: the worker failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def fits(r: dict) -> bool:
  """Whether both phases fit one chip's HBM (compiled): the train step and a sampler call."""
  return max(r["compiled_gb"], r["sampling_compiled_gb"]) <= HBM_GB


def table(results: list[dict]) -> str:
  """The full markdown table of the results (bench/MEMORY.md)."""
  head = (
    "| config | devices | params/device GB | train_step memory_analysis GB "
    "(arg + out - alias + temp) | train_step analytic GB (state + activations) "
    "| KV cache GB per sampler call (prompts x G rows; calls per step) "
    "| sampling GB: compiled sampler + rest of state (analytic: state + KV) "
    f"| fits {HBM_GB:.0f} GB | step time s (sample + train) |"
  )
  lines = [head, "|" + "---|" * 9]
  for r in results:
    lines.append(
      f"| {r['config']} | {r['devices']} | {r['params_gb']:.2f} "
      f"| {r['compiled_gb']:.1f} ({r['argument_gb']:.1f} + {r['output_gb']:.1f} - "
      f"{r['alias_gb']:.1f} + {r['temp_gb']:.1f}) "
      f"| {r['train_gb']:.1f} ({r['state_gb']:.1f} + {r['activations_gb']:.1f}) "
      f"| {r['kv_cache_gb']:.1f} ({r['prompts_per_call']} x {r['group_size']}; "
      f"{r['sampler_calls']}) "
      f"| {r['sampling_compiled_gb']:.1f} = {r['sampler_gb']:.1f} + "
      f"{r['resident_gb'] - r['params_gb']:.1f} ({r['sampling_gb']:.1f}) "
      f"| {'yes' if fits(r) else 'no'} "
      f"| {r['step_s']:.0f} ({r['sample_s']:.0f} + {r['train_s']:.0f}) |"
    )
  return "\n".join(lines)


def readme_table(results: list[dict]) -> str:
  """The compact table of the README: per device, train step / sampler call."""
  lines = [
    "| config | devices | memory/device GB, compiled (train step / sampling) "
    "| analytic GB (train step / sampling) | KV cache GB per sampler call | step time |",
    "|" + "---|" * 6,
  ]
  for r in results:
    lines.append(
      f"| {r['config']} | {r['devices']} "
      f"| {r['compiled_gb']:.0f} / {r['sampling_compiled_gb']:.0f} "
      f"| {r['train_gb']:.0f} / {r['sampling_gb']:.0f} "
      f"| {r['kv_cache_gb']:.1f} | {r['step_s'] / 60:.0f} min |"
    )
  return "\n".join(lines)


def sweep(devices: int) -> list[dict]:
  """The sampling phase of every model x G (analytic, seconds): the KV cache of one sampler call
  beside the train state (KL methods: the larger state), and the most prompts per call that fit."""
  paper = load_paper()
  results = []
  for model, spec in paper.MODELS.items():
    for group_size in paper.GROUP_SIZES:
      config = paper.get_config(f"{model},ebpo_topic,g{group_size}")
      numbers = analytic(config, spec, devices)
      per_prompt = numbers["kv_cache_gb"] / numbers["prompts_per_call"]
      numbers["max_prompts_per_call"] = int((HBM_GB - numbers["resident_gb"]) // per_prompt)
      results.append({"model": model, "group_size": group_size, **numbers})
  return results


def sweep_table(results: list[dict]) -> str:
  """A markdown table of `sweep`."""
  lines = [
    "| model | G | prompts x G rows per call | KV cache GB per call "
    "| sampling GB (state + KV cache) "
    f"| fits {HBM_GB:.0f} GB | most prompts per call within {HBM_GB:.0f} GB |",
    "|" + "---|" * 7,
  ]
  for r in results:
    lines.append(
      f"| {r['model']} | {r['group_size']} | {r['prompts_per_call']} x {r['group_size']} "
      f"| {r['kv_cache_gb']:.1f} | {r['sampling_gb']:.1f} "
      f"| {'yes' if r['sampling_gb'] <= HBM_GB else 'no'} | {r['max_prompts_per_call']} |"
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
  parser.add_argument(
    "--prompts_per_call", type=int, default=-1, help="replaces sampling.prompts_per_call if >= 0"
  )
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per config")
  parser.add_argument("--write", default="", help="also write the table to this markdown file")
  parser.add_argument("--quick", action="store_true", help="a runlocal config on 8 devices")
  parser.add_argument(
    "--sweep", action="store_true", help="the sampler's memory for every model x G (analytic)"
  )
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args.worker, args.devices, args.prompt_len, args.prompts_per_call)))
    return
  if args.sweep:
    results = sweep(args.devices)
    print(sweep_table(results), end="\n\n")
    print(json.dumps(results))
    return
  if args.quick:
    args.configs, args.devices, args.prompt_len = "qwen3_8b,ebpo_topic,runlocal", 8, 16
  results = []
  for arg in [c for c in args.configs.split(";") if c]:
    results.append(
      run_in_subprocess(arg, args.devices, args.prompt_len, args.prompts_per_call, args.timeout)
    )
    print(f"{arg}: compiled in {results[-1]['compile_s']:.0f} s", file=sys.stderr, flush=True)
  print(table(results), readme_table(results), sep="\n\n", end="\n\n")
  if args.write:
    with open(args.write, "w") as f:
      f.write(table(results) + "\n\n" + readme_table(results) + "\n")
  print(json.dumps(results))


if __name__ == "__main__":
  main()
