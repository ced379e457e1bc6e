"""Decode throughput and train-step MFU on a GPU, bf16.

  PYTHONPATH=. python bench/gpu.py                   # SmolLM2-135M, Qwen3-0.6B shapes, batch 1..256
  PYTHONPATH=. python bench/gpu.py --results results/gpu.md  # also append a dated table there
  PYTHONPATH=. python bench/gpu.py --dry-run         # tiny shape, batch 2, any backend (smoke test)

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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import _common  # bench/_common.py, beside this file
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import sampling
from ebpo_jax.models import Decoder, ModelConfig

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
  args = parser.parse_args()
  if args.dry_run:
    # One batch: each is its own decode program to compile (~3 CPU-s at the tiny shape).
    args.models, args.batches, args.prompt_len, args.new_tokens, args.reps = "tiny", "2", 8, 8, 1
    args.train_rows, args.train_micro = 8, 4
    args.hbm_gb_s = args.hbm_gb_s or 20.0  # a placeholder: the dry run checks the plumbing only
  device = jax.devices()[0]
  bandwidth = hbm_bandwidth(device, args.hbm_gb_s)
  batches = [int(b) for b in args.batches.split(",")]
  rows = []
  for name in args.models.split(","):
    rows.extend(bench_model(name, batches, args, bandwidth))
  table = markdown(rows, device, bandwidth, args) + "\n" + bench_train_step(args, device)
  print(table)
  if args.results:
    with open(args.results, "a") as f:
      f.write("\n" + table)


if __name__ == "__main__":
  main()
