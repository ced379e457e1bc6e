"""Peers in one process: our sampler vs tunix 0.1.7 and transformers' `generate`, and one whole RL
step (rollout + reward + update) vs tunix's GRPOLearner.

  python bench/peers.py                     # both parts, 5 repeats (about 15 min on 2 busy cores)
  python bench/peers.py --parts=sampler     # or --parts=rl
  python bench/peers.py --quick             # CI smoke run: small shapes, 1 repeat
  python bench/peers.py --quick --ours_only # our side alone, no peer installed (CI's default run)

Needs the `peers` extra and tunix, installed apart (setup.py's PEERS_REQUIRES says why):
`pip install -e '.[peers]' && pip install --no-deps google-tunix==0.1.7`.

Sampler: tok/s of `batch x new_tokens` sampled tokens, at temperature 1 with no top-k/top-p and no
stop token (exactly `new_tokens` each), from the same prompts (BOS + random ids, no padding) and the
same weights: a Hugging Face Llama directory that ours (`ebpo_jax.models.from_pretrained`), tunix
(`tunix.models.llama3`, its vanilla `tunix.generate.sampler.Sampler`) and transformers all load.
Shapes: `tiny` (4 layers, d=256, 4 query / 2 kv heads of 64, MLP 768, vocab 512, untied, RoPE base
1e6; random init) at batch 16, 32 prompt + 64 new tokens; `smollm2-135m` (SmolLM2-135M-Instruct
itself: 30 layers, d=576, 9/3 heads of 64, MLP 1536, vocab 49152, tied) at batch 16, 32 + 32.
Before timing, ours and tunix's prompt logits are compared (ours matches transformers in
tests/unit/models/test_model_io.py): tunix 0.1.7's Llama3 always applies RoPE base 1e6, so they
agree at every position for `tiny` and at the first only for SmolLM2 (base 1e5; same cost either
way). transformers runs with the faster of 1 thread and torch's default (bench/sampler.py's probe).

RL step: bench/peers_rl.py says what each side runs and how its time is split into rollout and
train. 8 prompts x G=4, 32 prompt + 32 new tokens, the tiny model in float32, AdamW, once with no
KL and once with a k3 KL penalty to the frozen start model.

Every engine is warmed up first (compilation; its time is printed apart); then each repeat runs
every engine once, round-robin, so load drift hits all alike; medians count. Prints a table, then
last one JSON line: per sampler shape our tok/s over each peer's (> 1: we are faster); for the RL
step our seconds over tunix's (< 1: we are faster), without and with KL (`_kl`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import peers_rl  # noqa: E402
import sampler as sampler_bench  # noqa: E402

from ebpo_jax.models import from_pretrained, smollm2_135m_instruct  # noqa: E402

TUNIX_ROPE_THETA = 1_000_000.0
# bench/sampler.py's tiny Llama with the issue's vocabulary and MLP width. tunix 0.1.7's Llama3
# applies RoPE with base 1e6 whatever its config says (Attention.block calls apply_rope without
# rope_theta): at 1e6 the three engines compute the same function.
TINY_HF = dict(
  sampler_bench.TINY_HF, vocab_size=512, intermediate_size=768, rope_theta=TUNIX_ROPE_THETA
)


@dataclasses.dataclass(frozen=True)
class SamplerCase:
  name: str
  batch: int
  prompt_len: int  # BOS included
  new_tokens: int


def _median(xs) -> float:
  return float(np.median(xs))


def ratio_range(numerators, denominators) -> str:
  """min-max of the per-repeat ratios (a repeat's runs are adjacent in time): the noise."""
  ratios = np.asarray(numerators) / np.asarray(denominators)
  return f"{ratios.min():.2f}-{ratios.max():.2f}"


def hf_config(path: str) -> dict:
  with open(os.path.join(path, "config.json")) as f:
    return json.load(f)


def round_robin(runs: dict, repeats: int) -> dict[str, list]:
  """Each repeat calls every run once, in turn; their results by name."""
  results = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      results[name].append(run())
  return results


# ----------------------------------------------------------------------------- sampler


def check_same_logits(model, params, tunix_model, prompts: np.ndarray, rope_theta: float) -> str:
  """Max |ours - tunix| of the prompts' logits (a full causal forward), at every position when the
  RoPE base is the one tunix applies (TUNIX_ROPE_THETA), else at the first (no rotation there);
  raises above 1e-3: the two loaded different weights."""
  ids = jnp.asarray(prompts)
  ours = jax.jit(lambda p: model.apply({"params": p}, ids))(params)
  b, t = ids.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  theirs, _ = tunix_model(ids, positions, None, causal)
  upto = t if rope_theta == TUNIX_ROPE_THETA else 1
  diff = float(jnp.abs(ours[:, :upto] - theirs[:, :upto].astype(jnp.float32)).max())
  if not diff < 1e-3:
    raise RuntimeError(f"ours and tunix's logits differ by up to {diff}: not the same weights")
  return f"{diff:.0e} ({'all positions' if upto == t else 'position 0: RoPE base differs'})"


def tunix_sampler(model, hf: dict, prompts: np.ndarray, new_tokens: int):
  """A call of tunix's vanilla sampler over `prompts` [B, P] (BOS first) as text, seeded."""
  from tunix.generate import sampler as tunix_sampling

  cache = tunix_sampling.CacheConfig(
    cache_size=prompts.shape[1] + new_tokens,
    num_layers=hf["num_hidden_layers"],
    num_kv_heads=hf["num_key_value_heads"],
    head_dim=hf["head_dim"],
  )
  engine = tunix_sampling.Sampler(model, peers_rl.TunixWords(), cache)
  texts = [peers_rl.words(row[1:]) for row in prompts]  # its tokenizer step prepends BOS

  def run(seed: int) -> None:
    out = engine(
      input_strings=texts,
      max_generation_steps=new_tokens,
      max_prompt_length=prompts.shape[1],
      temperature=1.0,
      top_p=1.0,  # None would be greedy
      top_k=None,
      eos_tokens=[hf["vocab_size"]],  # an id never sampled: no stop token
      seed=seed,
    )
    lengths = {len(t) for t in out.tokens}
    if lengths != {new_tokens}:
      raise RuntimeError(f"tunix produced completions of lengths {lengths}")

  return run


def _timer(fn):
  def run(*args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start

  return run


def case_prompts(case: SamplerCase, hf: dict) -> np.ndarray:
  """The case's prompts [B, P]: BOS, then random ids (every engine gets the same)."""
  rng = np.random.default_rng(case.batch)
  prompts = rng.integers(3, hf["vocab_size"], (case.batch, case.prompt_len), np.int32)
  prompts[:, 0] = peers_rl.BOS
  return prompts


def bench_sampler(case: SamplerCase, path: str, repeats: int) -> dict:
  """Median tok/s of ours, tunix and transformers on `case`, and each one's warm-up seconds."""
  hf = hf_config(path)
  prompts = case_prompts(case, hf)
  model, params = from_pretrained(path)
  torch_model = sampler_bench.load_torch(path)
  ours = _timer(sampler_bench._ours(model, params, prompts, case.new_tokens))
  tunix_model = peers_rl.tunix_llama(path, hf, peers_rl.cpu_mesh())
  logit_diff = check_same_logits(model, params, tunix_model, prompts, model.config.rope_theta)
  tunix = _timer(tunix_sampler(tunix_model, hf, prompts, case.new_tokens))
  theirs = _timer(sampler_bench._theirs(torch_model, prompts, case.new_tokens))
  warmup = {"ours": ours(0), "tunix": tunix(0), "transformers": theirs()}
  candidates = {1, sampler_bench.DEFAULT_TORCH_THREADS}  # 1 and torch's default (docstring)
  threads = sampler_bench.best_torch_threads(torch_model, prompts, candidates)
  seeds = iter(range(1, 10**6))
  runs = {
    "ours": lambda: ours(next(seeds)),
    "tunix": lambda: tunix(next(seeds)),
    "transformers": theirs,
  }
  seconds = round_robin(runs, repeats)
  tokens = case.batch * case.new_tokens
  row = {f"{k}_tok_s": tokens / _median(v) for k, v in seconds.items()}
  ranges = {
    f"over_{peer}_range": ratio_range(seconds[peer], seconds["ours"])
    for peer in ("tunix", "transformers")
  }
  warmups = {f"{k}_warmup_s": v for k, v in warmup.items()}
  return row | ranges | warmups | {"torch_threads": threads, "logit_diff_vs_tunix": logit_diff}


# ----------------------------------------------------------------------------- RL step


def bench_rl(path: str, rl: peers_rl.RLShape, repeats: int) -> dict:
  """Median seconds {rollout, train, step} of ours and tunix, without and with KL; warm-up apart."""
  hf = hf_config(path)
  engines = {}
  for kl in (False, True):
    tag = "_kl" if kl else ""
    engines[f"ours{tag}"] = peers_rl.OurRL(path, rl, hf["vocab_size"], kl)
    engines[f"tunix{tag}"] = peers_rl.TunixRL(path, hf, rl, kl)
  try:
    warmup = {name: engine.step()["step"] for name, engine in engines.items()}
    steps = round_robin({name: engine.step for name, engine in engines.items()}, repeats)
  finally:
    for engine in engines.values():
      engine.close()
  medians = {
    name: {part: _median([s[part] for s in runs]) for part in runs[0]}
    for name, runs in steps.items()
  }
  ranges = {
    f"{part}{tag}": ratio_range(
      *([s[part] for s in steps[f"{side}{tag}"]] for side in ("ours", "tunix"))
    )
    for tag in ("", "_kl")
    for part in ("rollout", "train", "step")
  }
  return {"medians": medians, "ranges": ranges, "warmup_s": warmup}


# ----------------------------------------------------------------------------- report


def print_sampler(rows: dict[SamplerCase, dict], repeats: int) -> None:
  print(
    f"\nsampler tok/s, median of {repeats}, and the range of the per-repeat ratios (warm-up s"
    " apart; > 1: ours faster)"
  )
  header = (
    f"{'shape':13} {'batch':>5} {'P+N':>6} {'ours':>8} {'tunix':>8} {'transf.':>8}"
    f" {'/tunix':>7} {'/transf.':>8} {'range /tunix':>12} {'/transf.':>9}"
    "   warm-up s ours/tunix/transf. (torch threads)"
  )
  print(header)
  print("-" * len(header))
  for case, r in rows.items():
    over_tunix = r["ours_tok_s"] / r["tunix_tok_s"]
    over_transformers = r["ours_tok_s"] / r["transformers_tok_s"]
    print(
      f"{case.name:13} {case.batch:>5} {case.prompt_len:>3}+{case.new_tokens:<2} "
      f"{r['ours_tok_s']:>8.0f} {r['tunix_tok_s']:>8.0f} {r['transformers_tok_s']:>8.0f}"
      f" {over_tunix:>7.2f} {over_transformers:>8.2f}"
      f" {r['over_tunix_range']:>12} {r['over_transformers_range']:>9}"
      f"   {r['ours_warmup_s']:.1f}/{r['tunix_warmup_s']:.1f}/{r['transformers_warmup_s']:.1f}"
      f" ({r['torch_threads']}); max |logit diff| vs tunix {r['logit_diff_vs_tunix']}"
    )


def print_rl(result: dict, rl: peers_rl.RLShape, repeats: int) -> None:
  print(
    f"\nRL step: {rl.prompts} prompts x G={rl.group_size}, {rl.prompt_len}+{rl.new_tokens} tokens,"
    f" tiny model fp32, AdamW; median s of {repeats}, range of the per-repeat ratios"
    " (< 1: ours faster)"
  )
  header = f"{'KL':4} {'part':8} {'ours s':>8} {'tunix s':>8} {'ours/tunix':>10} {'range':>10}"
  print(header)
  print("-" * len(header))
  m = result["medians"]
  for tag in ("", "_kl"):
    for part in ("rollout", "train", "step"):
      ours, tunix = m[f"ours{tag}"][part], m[f"tunix{tag}"][part]
      spread = result["ranges"][f"{part}{tag}"]
      print(
        f"{'yes' if tag else 'no':4} {part:8} {ours:>8.3f} {tunix:>8.3f} {ours / tunix:>10.2f}"
        f" {spread:>10}"
      )
  update, update_kl = m["tunix"]["update"], m["tunix_kl"]["update"]
  print(
    f"tunix's update_actor alone: {update:.3f} s, with KL {update_kl:.3f} s (with KL it also waits"
    " for the reference log-probs, dispatched just before it)"
  )
  warm = ", ".join(f"{k} {v:.1f}" for k, v in result["warmup_s"].items())
  print(f"warm-up step (compiles), s: {warm}")


def bench_ours_only(cases, paths: dict, rl: peers_rl.RLShape, parts: set, repeats: int) -> dict:
  """Our side of both parts alone, no peer installed: our sampler's median tok/s per shape and our
  RL step's median seconds {rollout, train, step} without and with KL. The project's own code of
  this comparison, which CI smoke-runs (`--ours_only`); the ratios need the peers."""
  out = {}
  for case in cases if "sampler" in parts else ():
    path = paths[case.name]()
    model, params = from_pretrained(path)
    ours = _timer(
      sampler_bench._ours(model, params, case_prompts(case, hf_config(path)), case.new_tokens)
    )
    ours(0)  # compiles
    seconds = [ours(seed) for seed in range(1, repeats + 1)]
    out[f"sampler_{case.name}_tok_s"] = round(case.batch * case.new_tokens / _median(seconds), 1)
  if "rl" in parts:
    vocab = hf_config(paths["tiny"]())["vocab_size"]
    for kl in (False, True):
      engine = peers_rl.OurRL(paths["tiny"](), rl, vocab, kl)
      try:
        engine.step()  # compiles
        steps = [engine.step() for _ in range(repeats)]
      finally:
        engine.close()
      for part in ("rollout", "train", "step"):
        out[f"rl_{part}_s{'_kl' if kl else ''}"] = round(_median([s[part] for s in steps]), 4)
  return {"ours_only": out}


def summary(sampler_rows: dict, rl_result: dict | None) -> dict:
  out = {}
  if sampler_rows:
    out["sampler"] = {
      case.name: {
        "sampler_over_tunix": round(r["ours_tok_s"] / r["tunix_tok_s"], 3),
        "sampler_over_transformers": round(r["ours_tok_s"] / r["transformers_tok_s"], 3),
      }
      for case, r in sampler_rows.items()
    }
  if rl_result:
    m = rl_result["medians"]
    for tag in ("", "_kl"):
      for part, key in (("step", "rl_step"), ("train", "train"), ("rollout", "rollout")):
        out[f"{key}_over_tunix{tag}"] = round(m[f"ours{tag}"][part] / m[f"tunix{tag}"][part], 3)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--parts", default="sampler,rl", help="comma-separated: sampler, rl")
  parser.add_argument("--quick", action="store_true", help="CI smoke run: small shapes, 1 repeat")
  parser.add_argument(
    "--ours_only", action="store_true", help="our side alone (no peers needed): no ratios"
  )
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  if not parts <= {"sampler", "rl"}:
    parser.error(f"--parts={args.parts!r}: each of sampler, rl")
  cases = [SamplerCase("tiny", 16, 32, 64), SamplerCase("smollm2-135m", 16, 32, 32)]
  rl = peers_rl.RLShape()
  if args.quick:
    args.repeats = 1
    cases = [SamplerCase("tiny", 4, 8, 8)]
    rl = peers_rl.RLShape(prompts=2, group_size=2, prompt_len=8, new_tokens=8)
  print(
    f"jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} CPUs, "
    f"load {os.getloadavg()[0]:.1f}",
    flush=True,
  )
  sampler_rows, rl_result = {}, None
  with tempfile.TemporaryDirectory() as tmp:
    tiny = sampler_bench.tiny_checkpoint(tmp, TINY_HF)
    paths = {"tiny": lambda: tiny, "smollm2-135m": smollm2_135m_instruct}
    if args.ours_only:
      print(json.dumps(bench_ours_only(cases, paths, rl, parts, args.repeats)))
      return
    if "sampler" in parts:
      for case in cases:
        sampler_rows[case] = bench_sampler(case, paths[case.name](), args.repeats)
        print(f"  {case.name}: {sampler_rows[case]}", flush=True)
      print_sampler(sampler_rows, args.repeats)
    if "rl" in parts:
      rl_result = bench_rl(tiny, rl, args.repeats)
      print_rl(rl_result, rl, args.repeats)
  print(f"load at the end {os.getloadavg()[0]:.1f}")
  print(json.dumps(summary(sampler_rows, rl_result)))


if __name__ == "__main__":
  main()
