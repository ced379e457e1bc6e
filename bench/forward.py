"""Forward-pass throughput: our Flax decoder vs transformers' PyTorch model on the same weights.

    python bench/forward.py [--models tiny,smollm2] [--batch 8] [--seq 128] [--seconds 5]
        [--tiny_layers 4] [--torch_threads N]   # smoke runs: 1 layer, 1 thread

Measures full-sequence forward tokens/s (fp32, no cache) for a tiny random Llama and for
SmolLM2-135M-Instruct (converted from the packaged GGUF). The last line is JSON with the
ratios ours / transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402  (bench/_common.py: the tiny shape)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from ebpo_jax.models import from_pretrained, smollm2_135m_instruct  # noqa: E402

# bench/sampler.py's tiny shape (bench/_common.py) with a 4096-token vocabulary and a narrower MLP
TINY = {
  **_common.hf_shape(dataclasses.replace(_common.TINY, vocab_size=4096, intermediate_size=768)),
  "max_position_embeddings": 2048,
}


def tokens_per_second(run: Callable[[], None], tokens: int, seconds: float) -> float:
  """Runs `run` once to warm up (compile), then repeatedly for about `seconds`."""
  run()
  count, start = 0, time.perf_counter()
  while count < 2 or time.perf_counter() - start < seconds:
    run()
    count += 1
  return tokens * count / (time.perf_counter() - start)


def tiny_checkpoint(directory: str, layers: int) -> str:
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**TINY | {"num_hidden_layers": layers})
  model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(directory)
  return directory


def bench_one(path: str, batch: int, seq: int, seconds: float) -> dict:
  ids = np.random.default_rng(0).integers(0, 1000, (batch, seq)).astype(np.int32)
  model, params = from_pretrained(path)
  forward = jax.jit(model.apply)
  ids_jax = jnp.asarray(ids)
  ours = tokens_per_second(
    lambda: forward({"params": params}, ids_jax).block_until_ready(), batch * seq, seconds
  )
  reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  ids_torch = torch.as_tensor(ids, dtype=torch.long)

  def torch_forward():
    with torch.inference_mode():
      reference(ids_torch, use_cache=False)

  theirs = tokens_per_second(torch_forward, batch * seq, seconds)
  return {
    "ours_tok_s": round(ours, 1),
    "transformers_tok_s": round(theirs, 1),
    "ratio": round(ours / theirs, 3),
  }


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--models", default="tiny,smollm2")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--seconds", type=float, default=5.0)
  parser.add_argument("--tiny_layers", type=int, default=TINY["num_hidden_layers"])
  # 0: torch's default. On a few shared cores its OpenMP workers spin against other processes
  # (bench/sampler.py's best_torch_threads): smoke runs take 1.
  parser.add_argument("--torch_threads", type=int, default=0)
  args = parser.parse_args()
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    tiny = lambda: tiny_checkpoint(tmp, args.tiny_layers)
    paths = {"tiny": tiny, "smollm2": smollm2_135m_instruct}
    for name in args.models.split(","):
      if name not in paths:
        raise SystemExit(f"--models: unknown model {name!r}; expected some of {sorted(paths)}")
      results[name] = bench_one(paths[name](), args.batch, args.seq, args.seconds)
      print(f"{name}: {results[name]}", flush=True)
  summary = {
    "bench": "forward",
    "backend": jax.default_backend(),
    "batch": args.batch,
    "seq": args.seq,
    "torch_threads": torch.get_num_threads(),
    **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items()},
    "ratio": round(float(np.exp(np.mean([np.log(r["ratio"]) for r in results.values()]))), 3),
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
