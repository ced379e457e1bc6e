"""Compacting decode vs the plain loop on long-tailed response lengths (useful tokens per second).

  python bench/compact.py            # tiny shape, 16 prompts x G=4, log-normal lengths (~8 minutes)
  python bench/compact.py --quick    # CI smoke run: one layer, short lengths, one repeat

The model is the tiny shape of bench/sampler.py (4 layers, d=256, 4/2 heads, 259 tokens), random,
with its stop token's probability set through the model itself (`HazardDecoder`, bench-only): at
completion token n the stop token gets probability h(n) (a table passed in the params, so both
cases below run the same two compiled programs), the hazard of a discretised log-normal
length (median `--median`, sigma `--sigma`), the other tokens share the rest as the random model
says. So the sampler draws the lengths: long-tailed, capped at `--cap` tokens (rows that reach it
are truncated). A second, short-tailed case gives every row the same length (`--median`): there
compacting has nothing to drop and must cost ~nothing. Both modes draw the same tokens for the
same key (checked); each repeat times plain and compacting back to back (alternating which goes
first) with one fresh key, and the median over repeats counts. Useful tokens per second: the sum
of completion lengths / wall time. Prints the length distribution, a table, then last a JSON line
(`compact_over_plain`: the median of the repeats' time ratios; goal >= 1.5).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402  (bench/_common.py: the tiny shape, the table)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ebpo_jax import sampling  # noqa: E402
from ebpo_jax.models import Decoder, ModelConfig  # noqa: E402

# bench/sampler.py's tiny shape (bench/_common.py), with room for 4096 positions
TINY = dataclasses.replace(_common.TINY, max_position_embeddings=4096)
STOP_ID = 2  # ByteTokenizer's end-of-sequence id (any id works: its logit is set by the hazard)
STOP_TABLE = "stop_logodds"  # the hazard table's entry in the params: data, not a constant


class HazardDecoder(Decoder):
  """The decoder, with its stop token's probability at completion token n set to a given hazard:
  stop logit = logsumexp(other logits) + log(h / (1 - h)), the log-odds for n = 0 .. cap - 1 read
  from `params[STOP_TABLE]`. Prompts are `prompt_len` tokens, no padding, so the logits at
  position p predict completion token p - prompt_len + 1."""

  prompt_len: int = 1

  def __call__(self, input_ids, positions=None, attention_mask=None, cache=None):
    out = super().__call__(input_ids, positions, attention_mask, cache)
    logits_btv, new_cache = out if cache is not None else (out, None)
    table = self.variables["params"][STOP_TABLE]
    n_bt = jnp.clip(positions - self.prompt_len + 1, 0, table.shape[0] - 1)
    others = logits_btv.at[..., STOP_ID].set(-jnp.inf)
    stop = jax.nn.logsumexp(others, axis=-1) + table[n_bt]
    logits_btv = logits_btv.at[..., STOP_ID].set(stop)
    return logits_btv if cache is None else (logits_btv, new_cache)


def lognormal_logodds(median: float, sigma: float, cap: int) -> tuple[float, ...]:
  """Log-odds of h(n) = P(L = n + 1 | L > n), L a log-normal length rounded up to whole tokens."""
  cdf = lambda x: 0.5 * (1 + math.erf(math.log(x / median) / (sigma * math.sqrt(2)))) if x else 0.0
  hazards = [(cdf(n + 1) - cdf(n)) / max(1 - cdf(n), 1e-12) for n in range(cap)]
  return tuple(_logodds(h) for h in hazards)


def fixed_logodds(length: int, cap: int) -> tuple[float, ...]:
  """Every row stops at exactly `length` tokens."""
  return tuple(_logodds(float(n == length - 1)) for n in range(cap))


def _logodds(h: float) -> float:
  h = min(max(h, 1e-9), 1 - 1e-9)
  return math.log(h / (1 - h))


@functools.cache
def random_params(config: ModelConfig) -> dict:
  """The random model's params (key 0), the same for every table: initialised once (each init
  is a program to compile)."""
  init = jax.jit(Decoder(config).init)
  return nn.meta.unbox(init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])


def build(logodds, args):
  """The hazard model (the same module for every table: one compile per mode) and its params."""
  model = HazardDecoder(args.model, prompt_len=args.prompt_len)
  return model, {**random_params(args.model), STOP_TABLE: jnp.asarray(logodds, jnp.float32)}


def sampler(model, params, args, compact: bool):
  prompts = np.random.default_rng(0).integers(
    3, args.model.vocab_size, (args.prompts, args.prompt_len)
  )
  ids, mask = jnp.asarray(prompts, jnp.int32), jnp.ones(prompts.shape, bool)

  def run(seed: int):
    out = sampling.generate(
      model, params, ids, mask, jax.random.key(seed), group_size=args.group_size,
      max_new_tokens=args.cap, stop_ids=(STOP_ID,), compact=compact,
    )  # fmt: skip
    return np.asarray(jax.block_until_ready(out).lengths), np.asarray(out.tokens)

  return run


def _timed(fn):
  start = time.perf_counter()
  result = fn()
  return time.perf_counter() - start, result


def bench_case(name: str, logodds, args, reps: int) -> dict:
  """Runs both modes once (the first case compiles one program each; later cases, the same
  shapes with another table, reuse them), then times them back to back, `reps` keys."""
  model, params = build(logodds, args)
  runs = {
    "plain": sampler(model, params, args, False),
    "compact": sampler(model, params, args, True),
  }
  first_s, compiles = {}, {}
  for mode, run in runs.items():
    before = sampling.compile_count()
    first_s[mode] = _timed(lambda run=run: run(0))[0]
    compiles[mode] = sampling.compile_count() - before
  seconds, lengths = {m: [] for m in runs}, []
  for rep in range(reps):
    outs = {}
    for mode in ("plain", "compact")[:: 1 if rep % 2 else -1]:  # each goes first every other rep
      elapsed, outs[mode] = _timed(lambda mode=mode, rep=rep: runs[mode](rep + 1))
      seconds[mode].append(elapsed)
    for a, b in zip(outs["plain"], outs["compact"], strict=True):
      np.testing.assert_array_equal(a, b)  # the same tokens for the same key
    lengths.append(outs["plain"][0])
  lengths = np.concatenate(lengths)
  useful = lengths.sum() / reps  # tokens per call, on average
  tok_s = {m: useful / float(np.median(s)) for m, s in seconds.items()}
  # The first call compiles and runs (key 0): its time less a timed run's, roughly the compile.
  compile_s = {m: first_s[m] - float(np.median(s)) for m, s in seconds.items()}
  ratio = float(np.median(np.divide(seconds["plain"], seconds["compact"])))
  return {
    "case": name,
    "median_len": float(np.median(lengths)),
    "p90_len": float(np.percentile(lengths, 90)),
    "max_len": int(lengths.max()),
    "truncated_share": float((lengths == args.cap).mean()),
    "plain_tok_s": tok_s["plain"],
    "compact_tok_s": tok_s["compact"],
    "compact_over_plain": ratio,
    "compile_s": compile_s,
    "compiles_per_call": compiles,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="CI smoke run: short lengths, 1 repeat")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--group_size", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--median", type=float, default=64.0)
  parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
  parser.add_argument("--cap", type=int, default=512, help="max_new_tokens")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--same_reps", type=int, default=9, help="repeats of the same-length case")
  args = parser.parse_args()
  args.model = TINY
  if args.quick:  # 16 rows: two stages (16, 8); one layer (the sampler unrolls the layers)
    args.prompts, args.median, args.cap, args.reps, args.same_reps = 4, 4.0, 32, 1, 1
    args.model = dataclasses.replace(TINY, num_layers=1)
  cases = [
    bench_case("long_tail", lognormal_logodds(args.median, args.sigma, args.cap), args, args.reps),
    bench_case("same_length", fixed_logodds(int(args.median), args.cap), args, args.same_reps),
  ]
  rows = args.prompts * args.group_size
  print(
    f"\ncompacting decode: tiny shape, {args.model.num_layers} layers, {args.prompts} prompts"
    f" x G={args.group_size} = {rows} rows,"
    f" prompt {args.prompt_len}, cap {args.cap}; median of {args.reps} (same length:"
    f" {args.same_reps}) back-to-back repeats; {_common.host()}"
  )
  header = (
    "case         median  p90  max  trunc  plain tok/s  compact tok/s  compact/plain"
    "  ~compile s plain/compact  compiles/call"
  )
  lines = [
    f"{c['case']:<12} {c['median_len']:>6.0f} {c['p90_len']:>4.0f} {c['max_len']:>4}"
    f"  {c['truncated_share']:>5.1%}  {c['plain_tok_s']:>11.0f}  {c['compact_tok_s']:>13.0f}"
    f"  {c['compact_over_plain']:>13.2f}  {c['compile_s']['plain']:>10.1f} /"
    f" {c['compile_s']['compact']:>5.1f}  {c['compiles_per_call']['plain']} /"
    f" {c['compiles_per_call']['compact']}"
    for c in cases
  ]
  _common.print_table(header, lines)
  long_tail, same = cases
  summary = {
    "rows": rows,
    "cap": args.cap,
    "median_len": long_tail["median_len"],
    "p90_len": long_tail["p90_len"],
    "max_len": long_tail["max_len"],
    "plain_tok_s": round(long_tail["plain_tok_s"], 1),
    "compact_tok_s": round(long_tail["compact_tok_s"], 1),
    "compact_over_plain": round(long_tail["compact_over_plain"], 3),
    "same_length_compact_over_plain": round(same["compact_over_plain"], 3),
    "compile_s": {m: round(s, 1) for m, s in long_tail["compile_s"].items()},
  }
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
