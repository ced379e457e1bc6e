"""Decode throughput, train-step MFU, cuDNN vs XLA attention and the default config's first
steps on a GPU.

  PYTHONPATH=. python bench/gpu.py                   # SmolLM2-135M, Qwen3-0.6B shapes, batch 1..256
  PYTHONPATH=. python bench/gpu.py --results results/gpu.md  # also append a dated table there
  PYTHONPATH=. python bench/gpu.py --parts=attention,trainer  # the short check of the GPU path
  PYTHONPATH=. python bench/gpu.py --dry-run         # tiny shape, batch 2, any backend (smoke test)

Each part prints its markdown table when it ends (`--parts`, in this order): decode, train_step,
attention, trainer.

Random bf16 weights of each shape (throughput does not depend on the values; no stop token, so
every row decodes all `--new-tokens`). Each timing is one `sampling.generate` call (prefill of a
short prompt + the decode loop), compiled beforehand, best of `--reps`.

Train step: the trainer's own `train_step` (EBPO advantages + PPO-clip update with AdamW, via
bench/train_step.py) for the Qwen3-0.6B shape, `--train-rows` responses of prompt + new tokens, in
micro-batches of `--train-micro` rows; MFU = model FLOPs (6 per weight per token + attention) /
step time / the device's dense bf16 peak. Goal: >= 40% on an H200.

Roofline: a decode step must read every weight once and the keys/values of the tokens so far, so
its time is at least `(param bytes + KV bytes at the mean context) / HBM bandwidth`; the roofline
tokens/s is `batch / that time`. Prefill is counted in our time but not in the roofline, so the
share is a lower bound. Our sampler reads the whole preallocated cache each step, which the share
then shows as lost bandwidth at large batch x context.

Attention: `models.attention.attend` with cudnn (`jax.nn.dot_product_attention`'s cuDNN kernel;
through XLA off a GPU) against xla, bf16, GQA, left-padded causal rows at Qwen3-0.6B's heads: the
largest difference of the valid queries' outputs and of the gradients of q, k, v, each over its
largest value (within `OUT_TOL` and `GRAD_TOL`), and the time of each, forward and forward +
backward.

Trainer: `ebpo_jax.trainer.run` on configs/arith_ebpo.py (launch/gpu.sh's default) for its first
`--sft-steps` warm-start and `--train-steps` RL steps, at its float32 (`model.attention=auto`:
xla on a GPU, as cuDNN refuses float32), with a bfloat16 sampler (`sampling.dtype`: the sampler's
prefill on cudnn) and all in bfloat16 (cudnn in the train step too); the dry run takes its
runlocal variant, float32 only, for one RL step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import tempfile
import time
import traceback

import _common  # bench/_common.py, beside this file
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import cli, sampling, trainer
from ebpo_jax.models import Decoder, ModelConfig, attention

# HBM bandwidth (bytes/s) by the vendors' datasheets, matched in order against `device_kind`.
HBM_BYTES_PER_S = (
  ("H200", 4.8e12),
  ("H100 PCIe", 2.0e12),
  ("H100", 3.35e12),
  ("A100-SXM4-80GB", 2.039e12),
  ("A100", 1.555e12),
  ("L40S", 0.864e12),
  ("L4", 0.3e12),
  ("A10G", 0.6e12),
  ("RTX 4090", 1.008e12),
  ("V100", 0.9e12),
  ("T4", 0.32e12),
)

# Dense bf16 peak FLOP/s by the vendors' datasheets (no sparsity), matched like HBM_BYTES_PER_S.
BF16_PEAK_FLOPS = (
  ("H200", 989e12),
  ("H100 PCIe", 756e12),
  ("H100", 989e12),
  ("A100", 312e12),
  ("L40S", 362e12),
  ("L4", 121e12),
  ("A10G", 70e12),
  ("RTX 4090", 165e12),
)

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "arith_ebpo.py"
PARTS = ("decode", "train_step", "attention", "trainer")
# cudnn vs xla in bf16: the largest difference over the largest value, of the outputs (bf16's
# rounding is 2**-8 = 3.9e-3) and of the gradients of q, k, v (sums of many rounded terms).
OUT_TOL, GRAD_TOL = 1e-2, 5e-2
TRAIN_SHAPE = "0.6b"  # bench/train_step.py's SHAPES: the train step's MFU at Qwen3-0.6B's widths
MODELS = {
  "smollm2-135m": dataclasses.replace(_common.SMOLLM2_135M, **BF16),
  "qwen3-0.6b": dataclasses.replace(_common.QWEN3_0_6B, **BF16),
  "tiny": ModelConfig(  # --dry-run only; one layer: the sampler's per-layer code compiles once
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
    num_kv_heads=2, head_dim=16, **BF16,
  ),
}  # fmt: skip


@dataclasses.dataclass
class Row:
  model: str
  batch: int
  tok_s: float
  roofline_tok_s: float
  compile_s: float

  @property
  def share(self) -> float:
    return self.tok_s / self.roofline_tok_s


def hbm_bandwidth(device: jax.Device, override_gb_s: float | None) -> float:
  if override_gb_s:
    return override_gb_s * 1e9
  for name, rate in HBM_BYTES_PER_S:
    if name in device.device_kind:
      return rate
  raise SystemExit(f"unknown HBM bandwidth for {device.device_kind!r}; pass --hbm-gb-s")


def param_bytes(params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def roofline_tok_s(config: ModelConfig, params, batch: int, context: float, bandwidth: float):
  """`batch` tokens per (weights + KV of `context` tokens per row) read at `bandwidth`."""
  kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
  kv_bytes = batch * context * kv_per_token * jnp.dtype(config.dtype).itemsize
  return batch * bandwidth / (param_bytes(params) + kv_bytes)


def bench_model(name: str, batches, args, bandwidth: float) -> list[Row]:
  config = MODELS[name]
  model = Decoder(config)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  params = nn.meta.unbox(params)
  rows = []
  for batch in batches:
    prompts = np.random.default_rng(batch).integers(0, config.vocab_size, (batch, args.prompt_len))
    ids, mask = jnp.asarray(prompts, jnp.int32), jnp.ones(prompts.shape, bool)

    def run(seed, batch=batch, ids=ids, mask=mask):
      key = jax.random.key(seed)
      out = sampling.generate(model, params, ids, mask, key, max_new_tokens=args.new_tokens)
      return jax.block_until_ready(out.lengths)

    start = time.perf_counter()
    lengths = run(0)
    compile_s = time.perf_counter() - start
    if int(np.asarray(lengths).min()) != args.new_tokens:
      raise RuntimeError(f"{name} batch {batch}: rows ended early ({lengths})")
    best = float("inf")
    for rep in range(args.reps):
      start = time.perf_counter()
      run(rep + 1)
      best = min(best, time.perf_counter() - start)
    context = args.prompt_len + args.new_tokens / 2
    row = Row(
      model=name,
      batch=batch,
      tok_s=batch * args.new_tokens / best,
      roofline_tok_s=roofline_tok_s(config, params, batch, context, bandwidth),
      compile_s=compile_s,
    )
    rows.append(row)
    print(json.dumps(dataclasses.asdict(row) | {"share": round(row.share, 4)}), flush=True)
  return rows


def markdown(rows: list[Row], device: jax.Device, bandwidth: float, args) -> str:
  lines = [
    f"### bench/gpu.py, {datetime.date.today().isoformat()}, {device.device_kind} "
    f"({jax.default_backend()}, HBM {bandwidth / 1e12:.2f} TB/s assumed)",
    "",
    f"bf16, random weights, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
    f"best of {args.reps}; jax {jax.__version__}.",
    "",
    "| model | batch | decode tok/s | roofline tok/s | share | compile s |",
    "| --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in rows:
    lines.append(
      f"| {r.model} | {r.batch} | {r.tok_s:,.0f} | {r.roofline_tok_s:,.0f} | {r.share:.1%} "
      f"| {r.compile_s:.1f} |"
    )
  return "\n".join(lines) + "\n"


def bench_decode(args, device: jax.Device) -> str:
  """Decode throughput of `--models` at `--batches` against the roofline, as markdown."""
  bandwidth = hbm_bandwidth(device, args.hbm_gb_s)
  batches = [int(b) for b in args.batches.split(",")]
  rows = [r for name in args.models.split(",") for r in bench_model(name, batches, args, bandwidth)]
  return markdown(rows, device, bandwidth, args)


def bench_train_step(args, device: jax.Device) -> str:
  """MFU of the trainer's step at the Qwen3-0.6B shape (tiny on a dry run), as markdown."""
  import train_step as train_bench  # bench/train_step.py, beside this file

  peak = next((rate for name, rate in BF16_PEAK_FLOPS if name in device.device_kind), None)
  shape = "smoke" if args.dry_run else TRAIN_SHAPE
  step_args = argparse.Namespace(
    rows=args.train_rows, group_size=8 if args.train_rows % 8 == 0 else 2,
    prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.reps,
    micro_rows=args.train_micro, dtype="bfloat16", quick=args.dry_run, profile=False,
  )  # fmt: skip
  timed = train_bench.time_steps(shape, step_args)
  lines = [
    "| shape | rows x tokens | estimator | step s | TFLOP/s | MFU |",
    "| --- | --- | --- | ---: | ---: | ---: |",
  ]
  for advantage in ("grpo", "ebpo"):
    rate = timed["flops"] / timed[advantage]
    mfu = f"{rate / peak:.1%}" if peak else "n/a"
    tokens = args.prompt_len + args.new_tokens
    lines.append(
      f"| {shape} | {args.train_rows} x {tokens} | {advantage} | {timed[advantage]:.3f} "
      f"| {rate / 1e12:.1f} | {mfu} |"
    )
  return "\n".join(lines) + "\n"


def _best_s(fn, reps: int) -> float:
  """The best of `reps` timed calls of `fn` (compiled beforehand by one untimed call)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def bench_attention(args, device: jax.Device) -> str:
  """cudnn against xla (module docstring) as markdown; RuntimeError past the tolerances."""
  b, t, heads, kv_heads, d = (2, 128, 4, 2, 16) if args.dry_run else (8, 2048, 16, 8, 128)
  rng = np.random.default_rng(0)
  draw = lambda h: jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
  q, k, v = draw(heads), draw(kv_heads), draw(kv_heads)
  mask = jnp.asarray(np.arange(t)[None] >= rng.integers(0, t // 4, (b, 1)))  # left-padded rows
  valid = attention.valid_pairs(mask)
  weights = mask[:, :, None, None].astype(jnp.float32)  # a pad query's output is read by nothing
  emulated = attention.resolve("cudnn", device, "bfloat16")[1]
  results = {}
  for backend in ("xla", "cudnn"):
    config = dataclasses.replace(
      MODELS["tiny"], attention=backend, attention_emulate=emulated and backend == "cudnn"
    )
    forward = jax.jit(lambda q, k, v, valid, c=config: attention.attend(q, k, v, valid, c))
    loss = lambda q, k, v, valid, c=config: (
      attention.attend(q, k, v, valid, c).astype(jnp.float32) * weights
    ).sum()
    backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = np.asarray(forward(q, k, v, valid).astype(jnp.float32) * weights)
    grads = [np.asarray(g.astype(jnp.float32)) for g in backward(q, k, v, valid)]
    times = [_best_s(lambda f=f: f(q, k, v, valid), args.reps) for f in (forward, backward)]
    results[backend] = out, grads, times
  (want, want_grads, _), (got, got_grads, _) = results["xla"], results["cudnn"]
  rel = lambda got, want: float(np.abs(got - want).max() / np.abs(want).max())
  out_diff = rel(got, want)
  grad_diff = max(rel(g, w) for g, w in zip(got_grads, want_grads, strict=True))
  lines = [
    f"| attention (bf16, {b} x {t}, {heads}/{kv_heads} heads of {d}) | emulated | forward ms "
    "| fwd + bwd ms | out diff / max | grad diff / max |",
    "| --- | --- | ---: | ---: | ---: | ---: |",
  ]
  for backend, (_, _, (fwd_s, bwd_s)) in results.items():
    cudnn = backend == "cudnn"
    diffs = f"{out_diff:.2e} | {grad_diff:.2e}" if cudnn else "- | -"
    lines.append(
      f"| {backend} | {emulated and cudnn} | {fwd_s * 1e3:.2f} | {bwd_s * 1e3:.2f} | {diffs} |"
    )
  table = "\n".join(lines) + "\n"
  if not (out_diff < OUT_TOL and grad_diff < GRAD_TOL):
    raise RuntimeError(f"cudnn differs from xla past bf16's tolerances:\n{table}")
  return table


def bench_trainer(args, device: jax.Device) -> str:
  """The default config's first steps (module docstring) as markdown."""
  spec, runs = f"{CONFIG}", [("float32", ""), ("float32", "bfloat16"), ("bfloat16", "")]
  steps = {"sft.num_steps": args.sft_steps, "train.num_steps": args.train_steps}
  if args.dry_run:
    spec, runs, steps = f"{CONFIG}:runlocal", runs[:1], {"sft.num_steps": 0, "train.num_steps": 1}
  lines = [
    f"| {CONFIG.name} | model.dtype | sampling.dtype | attention: train, sampler | steps "
    "| wall s | eval/accuracy |",
    "| --- | --- | --- | --- | --- | ---: | ---: |",
  ]
  for dtype, sampling_dtype in runs:
    keys = {"model.dtype": dtype, "sampling.dtype": sampling_dtype}
    config = cli.load_config(spec, steps | keys)
    dtypes = (dtype, sampling_dtype or dtype)
    resolved = [attention.resolve(config.model.attention, device, d)[0] for d in dtypes]
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      result = trainer.run(config, workdir)
      wall = time.perf_counter() - start
    sampler = sampling_dtype or "(model's)"
    lines.append(
      f"| {'runlocal' if args.dry_run else 'default'} | {dtype} | {sampler} "
      f"| {', '.join(resolved)} | {config.sft.num_steps} + {config.train.num_steps} | {wall:.1f} "
      f"| {result.get('eval/accuracy', float('nan')):.3f} |"
    )
    print(lines[-1], flush=True)
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dry-run", action="store_true", help="tiny shape, batch 2, any backend")
  parser.add_argument("--models", default="smollm2-135m,qwen3-0.6b")
  parser.add_argument("--batches", default="1,4,16,64,256")
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=256)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--hbm-gb-s", type=float, default=None, help="override the HBM bandwidth")
  parser.add_argument("--results", default=None, help="append the markdown table to this file")
  parser.add_argument("--train-rows", type=int, default=64, help="responses per train step")
  parser.add_argument("--train-micro", type=int, default=8, help="rows per micro-batch")
  parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
  parser.add_argument("--sft-steps", type=int, default=2, help="the trainer's warm-start steps")
  parser.add_argument("--train-steps", type=int, default=3, help="the trainer's RL steps")
  args = parser.parse_args()
  parts = args.parts.split(",")
  if not set(parts) <= set(PARTS):
    raise SystemExit(f"--parts={args.parts}: expected some of {','.join(PARTS)}")
  if args.dry_run:
    # One batch: each is its own decode program to compile (~3 CPU-s at the tiny shape).
    args.models, args.batches, args.prompt_len, args.new_tokens, args.reps = "tiny", "2", 8, 8, 1
    args.train_rows, args.train_micro = 8, 4
    args.hbm_gb_s = args.hbm_gb_s or 20.0  # a placeholder: the dry run checks the plumbing only
  device, tables = jax.devices()[0], []
  benches = {
    "decode": bench_decode,
    "train_step": bench_train_step,
    "attention": bench_attention,
    "trainer": bench_trainer,
  }
  failed = []
  for part in (p for p in PARTS if p in parts):  # each table printed as its part ends
    try:
      tables.append(benches[part](args, device))
    except Exception:  # noqa: BLE001  (its traceback shown; the other parts still run)
      traceback.print_exc()
      failed.append(part)
      continue
    print(tables[-1], flush=True)
  table = "\n".join(tables)
  if args.results:
    with open(args.results, "a") as f:
      f.write("\n" + table)
  if failed:
    raise SystemExit(f"bench/gpu.py: {', '.join(failed)} failed (tracebacks above)")


if __name__ == "__main__":
  main()
