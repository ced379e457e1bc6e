"""Will it fit? The train step and a sampler call compiled by the TPU compiler, on any machine.

  python -m ebpo_jax.aot --config=configs/paper.py:qwen3_8b,ebpo_topic,g4 --topology=v5p-64 \
      [--config.KEY=VALUE ...] [--prompt_len=N]

SLICE is a slice name, as `gcloud` spells the accelerator type (`v5p-64`, `v4-32`: TensorCores,
two per chip, so v5p-64 is 32 chips; `v5e-16` or `v5litepod-16`, `v6e-8`: chips), or a topology
(`v5p:4x4x2`, `v5e:2x2`). With `libtpu` installed (`pip install -e '.[aot]'`) JAX hands out
compile-only devices of that topology; the config's mesh is built over them and two programs are
compiled from abstract sharded inputs (`jax.ShapeDtypeStruct`; nothing is allocated):
- the trainer's own train step (`jit_train_step`, as train.py jits it: state shardings, the state
  donated) on a batch at the prompt bucket `--prompt_len` (default: for a task's own rows, the
  bucket of the longest training prompt; for a rows file, the largest bucket: the worst case);
- one sampler call (`sampling.prompts_per_call` prompts x G rows: prefill, then the decode loop)
  with the rollout worker's own static options (`sampling.DecodeOptions.generate_kwargs`).

Memory per chip is the compiler's `memory_analysis()`: arguments + outputs - aliased (the donated
state is updated in place) + temporaries + generated code. While the sampler runs, the rest of the
train state (optimizer moments, the KL reference) and the rollouts already drawn this step (up to
1 + `rl.max_refill_rounds` rounds of the step's batch) wait on the device beside it; their shard
sizes are added to the sampler's. A phase fits when its bytes are at most the HBM that the TPU
compiler makes available on the chip (CHIPS). A program that cannot fit does not compile at all:
the compiler's RESOURCE_EXHAUSTED message gives the bytes it needed.

FLOPs, HBM bytes and collectives per chip, and the roofline, are `aot.roofline`'s (its
docstring states the method): the compiler's `cost_analysis()` corrected for loop trip counts, the
Pallas kernels (splash attention: `model.attention` is `auto`, which is splash on TPU; the decode
kernel) counted from their bodies, grids and index maps (`aot.kernels`), and the collectives of the
compiled HLO at the chip's ICI bandwidth. Beside each ratio, `*_shares` says which share of its
numerator the compiler measured, kernel bodies counted or formulas modelled. The roofline time of a
program is the largest of its compute-, HBM- and ICI-bound times; `roofline_to_compute` says how
far it is off the compute limit. An RL step is one train step plus ceil(batch / prompts_per_call)
sampler calls per rollout round. The two programs compile at once, in two threads (the compiler
mostly keeps to one core).

Last line of stdout: one JSON object (`topology`, `chips`, `fits`, `hbm_bytes_per_chip`,
`train_step` and `sampler` with `bytes_per_chip`, `flops`, ...). Exit status 0 whether or not it
fits (launch/tpu_pod.sh reads `fits`); 2 with one line for a bad config or an unknown slice.
"""

import concurrent.futures
import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from ebpo_jax import errors, files, models, sampling, sharding
from ebpo_jax.aot import collectives, roofline
from ebpo_jax.aot import report as report_lib
from ebpo_jax.aot.topology import Slice, topology_devices
from ebpo_jax.rollouts import prompts as prompts_lib
from ebpo_jax.rollouts.options import completion_width
from ebpo_jax.sampling import DecodeOptions
from ebpo_jax.sampling import loop as sampling_loop
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import task_rows
from ebpo_jax.trainer.step import StepOptions, abstract_batch, jit_train_step

# ----------------------------------------------------------------------------- compiling


@dataclasses.dataclass(frozen=True)
class Target:
  """What is compiled: the config's model and state, abstract, on the slice's mesh."""

  config: ml_collections.ConfigDict
  tpu: Slice
  mesh: Mesh
  model: models.Decoder
  params: Any  # abstract, sharded
  stop_ids: tuple[int, ...]
  pad_id: int
  num_clusters: int
  prompt_len: int  # the prompt bucket compiled


def _model_dir(path: str) -> bool:
  return path.startswith("packaged:") or files.isfile(files.join(path, "config.json"))


def make_target(
  config: ml_collections.ConfigDict, tpu: Slice, prompt_len: int = 0, mesh: Mesh | None = None
) -> Target:
  """The config's mesh over the slice's devices (or `mesh`, one side of a split slice), its model
  and abstract params. The model is `model.path`'s (config.json and tokenizer) when that
  directory is on this machine; otherwise a decoder of the config's shape keys over
  `model.vocab_size` tokens (placeholder stop and pad ids, which do not change what is compiled);
  a random-init model uses the task's tokenizer.
  `prompt_len` 0: for a task's own rows (random-init models), the bucket of the longest training
  prompt, as the trainer pads them; otherwise the largest bucket (the worst case)."""
  config_lib.check_config(config, tpu.chips)
  mesh = mesh or sharding.make_mesh(dict(config.mesh), topology_devices(tpu))
  devices = list(mesh.devices.flat)
  mc, num_clusters = config.model, 16
  if mc.path and _model_dir(mc.path):
    tokenizer = task_rows.load_tokenizer(config, task=None)
    model = models.build.make_model(config, tokenizer.vocab_size, devices[0])
  elif mc.path:
    if mc.vocab_size < 1:
      raise errors.ConfigError(
        f"config.model.path={mc.path!r} is not a model directory on this machine: set "
        f"config.model.vocab_size (with the shape keys) to compile its shape"
      )
    model_config = models.build.random_init_config(mc, mc.vocab_size)
    model_config = models.build.with_attention(model_config, mc, devices[0])
    model = models.Decoder(models.build.with_lora(model_config, mc.lora))
    tokenizer = None
  else:
    inputs = task_rows.load_task_and_rows(config)
    tokenizer = inputs.tokenizer
    model = models.build.make_model(config, tokenizer.vocab_size, devices[0])
    num_clusters = len(inputs.cluster_names)
    # The bucket of the longest training prompt: the widest batch the run will compile.
    encoder = prompts_lib.PromptEncoder.from_config(config, inputs.task, tokenizer)
    prompt_len = prompt_len or encoder.prompts(inputs.rows)[0].shape[1]
  stop_ids, pad_id = (tokenizer.stop_ids, tokenizer.pad_id) if tokenizer else ((1,), 0)
  params = models.build.abstract_params(model, mesh)
  prompt_len = prompt_len or max(config.sampling.prompt_buckets)
  return Target(config, tpu, mesh, model, params, tuple(stop_ids), pad_id, num_clusters, prompt_len)


def shard_bytes(tree: Any) -> int:
  """Bytes of one device's shards of an abstract sharded tree."""
  leaves = jax.tree.leaves(tree)
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def state_bytes(state: state_lib.TrainState) -> dict[str, int]:
  """Bytes per chip of an abstract sharded TrainState, by part: `params` (the trained weights:
  under LoRA the adapters), `opt_state` (Adam's moments of those), `ref_params` (the KL
  reference copy; 0 under LoRA), `base` (LoRA's frozen base; 0 otherwise) and `total`."""
  parts = {k: shard_bytes(getattr(state, k)) for k in ("params", "opt_state", "ref_params", "base")}
  return {**parts, "total": shard_bytes(state)}


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  parts = {
    "argument_bytes": m.argument_size_in_bytes,
    "output_bytes": m.output_size_in_bytes,
    "alias_bytes": m.alias_size_in_bytes,
    "temp_bytes": m.temp_size_in_bytes,
    "code_bytes": m.generated_code_size_in_bytes,
  }
  total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  total += m.temp_size_in_bytes + m.generated_code_size_in_bytes
  return {"bytes_per_chip": total, **parts}


_NEEDED = re.compile(r"(?:required for HLO temporaries|Used) \(?([\d.]+)([KMGT])")


@dataclasses.dataclass(frozen=True)
class Program:
  """A lowered program, its jaxpr's dot counts, and what its report adds (shard sizes)."""

  lowered: jax.stages.Lowered
  dots: roofline.DotCount
  extra: dict
  list_collectives: bool = False  # the report lists its collective ops (`collective_shapes`)
  name: str = "program"  # for the progress line


def compile_program(program: Program, target: Target) -> dict:
  """Compiles a lowered program of `target` (over its mesh's chips): its memory and costs, or,
  when the compiler finds that it does not fit, the bytes its message names and the message."""
  tpu = target.tpu
  t0 = time.perf_counter()
  try:
    compiled = program.lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    report_lib.progress(program.name, "does not fit", target.mesh.size, time.perf_counter() - t0)
    found = _NEEDED.search(str(e))
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    needed = int(float(found[1]) * scale[found[2]]) if found else None
    line = str(e).strip().splitlines()[0]
    result = {"bytes_per_chip": needed, "compile_error": line, "flops": None, "roofline_s": None}
    return {**result, **program.extra}
  report_lib.progress(program.name, "compiled", target.mesh.size, time.perf_counter() - t0)
  costs = roofline.costs(compiled, program.dots, tpu.chip, target.mesh.size)
  result = {**_memory(compiled), **costs, **program.extra}
  result["compile_s"] = time.perf_counter() - t0
  if program.list_collectives:
    result["collective_shapes"] = collectives.collective_shapes(compiled.as_text())
  if "limit_flops" in result:  # the work the shapes ask for, against what the program does
    result["limit_s"] = result["limit_flops"] / tpu.chip.peak_flops
    result["roofline_to_limit"] = result["roofline_s"] / result["limit_s"]
    result["flops_to_limit"] = result["flops"] / result["limit_flops"]
    # Where each ratio's numerator comes from (`roofline.SOURCES`); the limits are all counted.
    result["roofline_to_limit_shares"] = result["roofline_shares"]
    result["flops_to_limit_shares"] = roofline.shares(result["flops_sources"])
  return result


def train_limit_flops(target: Target) -> float:
  """`roofline.train_step_limit` of the target's train step, per chip."""
  config = target.config
  mc, lora = target.model.config, config.model.lora.rank > 0
  reference = config.rl.loss.kl_coef > 0
  passes = roofline.train_step_passes(
    remat=mc.remat, lora=lora, reference=reference, epochs=config.rl.num_iterations
  )
  flops = roofline.train_step_limit(
    mc,
    prompts=config.train.batch_size,
    prompt_len=target.prompt_len,
    group_size=config.rl.group_size,
    response_len=completion_width(config),  # a multi-turn trajectory's, observations included
    passes=passes,
  )
  return flops / target.mesh.size  # the chips it runs on (one side of a split slice)


def abstract_step_batch(target: Target) -> dict:
  """The train step's batch at the target's prompt bucket, its rows over the target's mesh."""
  layout = StepOptions.from_config(target.config, target.mesh).layout
  return abstract_batch(layout, target.prompt_len, completion_width(target.config), target.mesh)


def train_step_program(target: Target) -> Program:
  """The trainer's jitted train step (state donated), lowered for a batch at the target's prompt
  bucket."""
  config, mesh = target.config, target.mesh
  spec = state_lib.StateSpec.from_config(config, target.num_clusters)
  state, shardings = spec.abstract(target.params), spec.shardings(target.params)
  options = StepOptions.from_config(config, mesh)
  batch = abstract_step_batch(target)
  step = jit_train_step(target.model, spec, options, mesh, shardings)
  traced = step.trace(state, batch)
  parts = state_bytes(state)
  extra = {"state_bytes": parts.pop("total"), "batch_bytes": shard_bytes(batch)}
  extra.update({f"{k}_bytes": v for k, v in parts.items()})  # trained vs frozen, per chip
  extra["limit_flops"] = train_limit_flops(target)
  extra["shared_prefix"] = options.layout.shared_prefix
  dots = roofline.count_dots(traced.jaxpr, 1, target.model.config.attention_block)
  return Program(traced.lower(), dots, extra, name="train step")


def _sampler_inputs(target: Target) -> tuple[tuple, dict]:
  """The abstract arguments of one sampler call (`sampling.prompts_per_call` prompts x G rows)
  and the worker's static options, as `rollouts.worker.SingleTurn` calls `sampling.generate`: the
  weights in the round's decode layout (`DecodeOptions.decode_params`)."""
  config, mesh, prompt_len = target.config, target.mesh, target.prompt_len
  prompts = config.sampling.prompts_per_call or config.train.batch_size
  shape = (prompts, prompt_len)
  rows = sharding.row_sharding(shape, mesh)
  replicated = sharding.replicated(mesh)
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
  args = (
    jax.eval_shape(_decode_converter(target), target.params),
    jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
    jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=rows),
    jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    scalar,
    scalar,
  )
  options = DecodeOptions.from_config(config).generate_kwargs(
    _Ids(target.stop_ids, target.pad_id), group_size=config.rl.group_size, greedy=False
  )
  return args, {**options, "mesh": mesh}


def _sampler_model(target: Target) -> models.Decoder:
  """The decoder the rollout worker runs: the policy's at `sampling.dtype`, its attention resolved
  at that dtype (`rollouts.worker.make_worker`)."""
  config, device = target.config, target.mesh.devices.flat[0]
  return models.build.with_compute_dtype(target.model, config.sampling.dtype, config.model, device)


def sampler_dtype(target: Target) -> jnp.dtype:
  """The dtype the sampler computes and holds its weights in (`sampling.dtype`)."""
  return jnp.dtype(_sampler_model(target).config.dtype)


def _decode_converter(target: Target):
  """The round's conversion of the weights to the sampler's layout (`sampling.decode_params`)."""
  options = DecodeOptions.from_config(target.config)
  rows = sharding.ROW_AXES if options.replicate_weights else ()
  config = _sampler_model(target).config
  return sampling.decode_converter(target.params, config, dtype=config.dtype, replicate_over=rows)


def rollout_layout_program(target: Target) -> Program:
  """The conversion of the policy's weights to the sampler's layout, once per round."""
  convert = _decode_converter(target)
  traced = convert.trace(target.params)
  extra = {"copy_bytes": shard_bytes(jax.eval_shape(convert, target.params))}
  return Program(
    traced.lower(), roofline.count_dots(traced.jaxpr, 1), extra, name="weights' conversion"
  )


def sampler_program(target: Target) -> Program:
  """One sampler call of the trainer's rollouts, prefill and decode loop, lowered as
  `rollouts.worker.SingleTurn` calls `sampling.generate`: its memory (its costs are its parts',
  `sampler_costs`)."""
  args, options = _sampler_inputs(target)
  traced = sampling.trace_generate(_sampler_model(target), *args, **options)
  prompts = args[1].shape[0]
  calls = -(-target.config.train.batch_size // prompts)
  extra = {"prompts_per_call": prompts, "calls_per_round": calls}
  return Program(traced.lower(), roofline.DotCount(), extra, name="sampler call")


def sampler_part_programs(target: Target) -> tuple[Program, Program]:
  """`(prefill, decode step)` of a sampler call, each lowered alone (`sampling.trace_parts`)."""
  args, options = _sampler_inputs(target)
  block = target.model.config.attention_block
  prefill, step = sampling.trace_parts(_sampler_model(target), *args, **options)
  # The step stands for every step of the loop: step t (1 .. N - 1) attends to the P + t slots
  # written after a prompt bucket of P, so its decode kernel is counted at their mean.
  p, n = target.prompt_len, target.config.sampling.max_new_tokens
  step_dots = roofline.count_dots(step.jaxpr, 1, block, decode_lengths=range(p + 1, p + n))
  prefill_dots = roofline.count_dots(prefill.jaxpr, 1, block)
  return Program(prefill.lower(), prefill_dots, {}, name="its prefill"), Program(
    step.lower(), step_dots, {}, list_collectives=True, name="its decode step"
  )


def sampler_limit_bytes(target: Target) -> float:
  """`roofline.sampler_limit_bytes` of one sampler call of the target, per chip."""
  config, mesh = target.config, target.mesh
  prompts = config.sampling.prompts_per_call or config.train.batch_size
  return roofline.sampler_limit_bytes(
    target.model.config,
    prompts=prompts,
    group_size=config.rl.group_size,
    prompt_len=target.prompt_len,
    new_tokens=config.sampling.max_new_tokens,
    row_shards=sampling_loop.batch_shards(prompts * config.rl.group_size, mesh),
    weight_shards=mesh.shape["tensor"],
    itemsize=sampler_dtype(target).itemsize,
  )


def sampler_costs(target: Target, prefill: dict, step: dict) -> dict:
  """A sampler call's costs from its compiled parts: the prefill once, the decode step
  `max_new_tokens - 1` times (every row running to the cap: the worst case; compacting, that is
  its first stage), against the limit from the model's shapes."""
  trips = target.config.sampling.max_new_tokens - 1
  costs = roofline.combine([(1, prefill), (trips, step)], target.tpu.chip)
  limit = sampler_limit_bytes(target)
  costs["limit_bytes"] = limit
  costs["limit_s"] = limit / target.tpu.chip.hbm_bandwidth
  costs["roofline_to_limit"] = costs["roofline_s"] / costs["limit_s"]
  costs["bytes_to_limit"] = costs["bytes_accessed"] / limit
  costs["roofline_to_limit_shares"] = costs["roofline_shares"]
  costs["bytes_to_limit_shares"] = roofline.shares(costs["bytes_sources"])
  keys = ("flops", "bytes_accessed", "hbm_s", "collectives", "collective_bytes", "collective_s")
  costs["decode_step"] = {k: step[k] for k in keys}
  costs["decode_step"]["weight_gathers"] = weight_sized_gathers(target, step["collective_shapes"])
  costs["prefill_roofline_s"] = prefill["roofline_s"]
  return costs


def weight_sized_gathers(target: Target, ops: list[dict]) -> list[dict]:
  """The all-gathers among `ops` (`collectives.collective_shapes`) whose result is as large as a
  weight matrix of the model, whole or its 'tensor' shard: in a decode step, a weight gathered
  for every token."""
  tensor = target.mesh.shape["tensor"]
  stacked = jax.tree.leaves(target.params.get("layers", {}))
  rest = [x for k, v in target.params.items() if k != "layers" for x in jax.tree.leaves(v)]
  sizes = {math.prod(x.shape[1:]) for x in stacked if x.ndim >= 3}
  sizes |= {math.prod(x.shape) for x in rest if x.ndim >= 2}
  sizes |= {n // tensor for n in sizes}
  return [op for op in ops if op["kind"] == "all-gather" and sizes & set(op["elements"])]


def compile_train_step(target: Target) -> dict:
  """`train_step_program` compiled."""
  return compile_program(train_step_program(target), target)


def compile_phases(trainer: Target, sampler: Target) -> tuple[dict, dict]:
  """(`compile_train_step(trainer)`, `compile_sampler(sampler)`), the train step in a thread
  beside the sampler's programs (the compiler mostly keeps to one core)."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    train = pool.submit(compile_train_step, trainer)
    rollout = compile_sampler(sampler)
    return train.result(), rollout


def compile_sampler(target: Target) -> dict:
  """A sampler call compiled: the whole program's memory, its parts' costs (`sampler_costs`),
  and the round's conversion of the weights (`rollout_layout`)."""
  programs = [sampler_program(target), *sampler_part_programs(target)]
  whole, prefill, step, layout = (
    compile_program(p, target) for p in (*programs, rollout_layout_program(target))
  )
  if whole.get("compile_error"):
    return whole
  memory = {k: v for k, v in whole.items() if k.endswith(("_bytes", "_per_chip", "compile_s"))}
  calls = {k: whole[k] for k in ("prompts_per_call", "calls_per_round")}
  for name, part in (("prefill", prefill), ("decode step", step), ("weights' conversion", layout)):
    if part.get("compile_error"):  # the call fits; what costs it did not compile alone
      error = f"the sampler's {name}, compiled alone, does not fit: {part['compile_error']}"
      return {**memory, **calls, "flops": None, "roofline_s": None, "costs_error": error}
  keep = ("bytes_per_chip", "copy_bytes", "collective_bytes", "roofline_s", "roofline_shares")
  keep += ("compile_s",)
  layout = {k: layout[k] for k in keep}
  return {**memory, **sampler_costs(target, prefill, step), **calls, "rollout_layout": layout}


@dataclasses.dataclass(frozen=True)
class _Ids:
  stop_ids: tuple[int, ...]
  pad_id: int


def rounds_per_step(config: ml_collections.ConfigDict) -> int:
  """The most rollout rounds of a step: 1 + `rl.max_refill_rounds` under dynamic sampling."""
  return 1 + (config.rl.max_refill_rounds if config.rl.dynamic_sampling else 0)


def resident_while_sampling(target: Target, train: dict) -> int:
  """Bytes per chip that wait on the device during a sampler call: the whole train state (the
  sampler's argument is the round's copy of the weights) and up to 1 + `rl.max_refill_rounds`
  rounds of the step's rollouts."""
  return train["state_bytes"] + rounds_per_step(target.config) * train["batch_bytes"]


def round_parts(sampler: dict) -> list[tuple[float, dict]]:
  """A rollout round's (roofline seconds, their shares): the weights converted to the decode
  layout once, then the round's sampler calls."""
  layout = sampler["rollout_layout"]
  calls = sampler["calls_per_round"] * sampler["roofline_s"]
  return [(layout["roofline_s"], layout["roofline_shares"]), (calls, sampler["roofline_shares"])]


# ----------------------------------------------------------------------------- the report


def check(config: ml_collections.ConfigDict, tpu: Slice, prompt_len: int = 0) -> dict:
  """Compiles both programs of `config` for `tpu`; the report (the JSON line of the CLI)."""
  target = make_target(config, tpu, prompt_len)
  train, sampler = compile_phases(target, target)
  add_waiting(config, sampler, resident_while_sampling(target, train))
  return summarize(config, tpu, target.prompt_len, train, sampler)


def add_waiting(config: ml_collections.ConfigDict, sampler: dict, resident: int) -> None:
  """Adds to a sampler call's bytes per chip what waits beside it: `resident`, and the other
  `sampling.concurrent_calls - 1` calls in flight (each its outputs and temporaries: the weights
  are the round's one copy)."""
  others = config.sampling.concurrent_calls - 1
  sampler["program_bytes"] = sampler["bytes_per_chip"]
  if "temp_bytes" in sampler:  # compiled (else the bytes the compiler's message names, if any)
    per_call = sampler["output_bytes"] - sampler["alias_bytes"] + sampler["temp_bytes"]
    sampler["concurrent_bytes"] = others * per_call
    resident += sampler["concurrent_bytes"]
  sampler["resident_bytes"] = resident
  if sampler["bytes_per_chip"] is not None:
    sampler["bytes_per_chip"] += resident


def summarize(config, tpu: Slice, prompt_len: int, train: dict, sampler: dict) -> dict:
  """The report of two compiled phases: fits, headroom, the roofline step time."""
  usable = tpu.chip.usable_hbm_bytes
  needed = [p["bytes_per_chip"] for p in (train, sampler)]
  fits = all(n is not None and n <= usable for n in needed)
  report = {
    "topology": tpu.topology,
    "slice": tpu.accelerator_type,
    "chips": tpu.chips,
    "mesh": sharding.mesh_shape(dict(config.mesh), tpu.chips),
    "prompt_len": prompt_len,
    "fits": fits,
    "hbm_bytes_per_chip": usable,
    "headroom_bytes": None if None in needed else usable - max(needed),
    "train_step": train,
    "sampler": sampler,
  }
  if train["roofline_s"] is not None and sampler["roofline_s"] is not None:
    calls = sampler["calls_per_round"]
    round_s = sum(s for s, _ in round_parts(sampler))
    report["rl_step_roofline_s"] = train["roofline_s"] + round_s
    report["rl_step_roofline_shares"] = roofline.weighted_shares(
      [(train["roofline_s"], train["roofline_shares"]), *round_parts(sampler)]
    )
    report["rl_step_roofline_s_max_refill"] = (
      train["roofline_s"] + rounds_per_step(config) * round_s
    )
    if "limit_s" in train and "limit_s" in sampler:  # each program at its limit from shapes
      report["rl_step_limit_s"] = train["limit_s"] + calls * sampler["limit_s"]
      report["rl_step_roofline_to_limit"] = report["rl_step_roofline_s"] / report["rl_step_limit_s"]
  return report
