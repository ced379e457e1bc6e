"""Per-chip memory, FLOPs and roofline step time of the paper's configs, from the TPU compiler.

    python bench/memory.py --results=/tmp/memory.jsonl        # every model x method at G = 4, 32
    python bench/memory.py --results=/tmp/memory.jsonl --write=/tmp/tables.md  # + the tables
    python bench/memory.py --configs="qwen3_8b,dapo,g32" --results=/tmp/one.jsonl  # some rows
    python bench/memory.py --configs="qwen3_8b,grpo,g4,lora32" --results=/tmp/lora.jsonl  # LoRA
    python bench/memory.py --results=/tmp/memory.jsonl --tables_only  # the tables; no compiles
    python bench/memory.py --quick            # CI smoke run: a runlocal config on v5p:2x2x1

Everything is `ebpo_jax.aot`'s (`python -m ebpo_jax.aot` compiles one config): the trainer's jitted
train step and one sampler call, compiled by the TPU compiler (libtpu) for `--topology` (default
v5p-64, the paper configs' slice) with abstract sharded inputs; see that module's docstring for
what is counted. This script adds the sweep: the sampler program depends on the model, G and
`sampling.*`, not on the method (`sampling.DecodeOptions`), so it is compiled once per
model x G and each method adds its own waiting state and rollouts; and the largest
`sampling.prompts_per_call` that fits each model x G for every method: a first guess scales the
configured call's bytes (all but the params and the code) with the prompts; one more sampler
compile there gives a second point, and the line through the two compiled points the answer.

Results go to the `--results` JSON-lines file one line at a time; a rerun keeps the lines already
there (a run cut short resumes). The last line of stdout is the JSON list of the rows.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from ebpo_jax import cli  # noqa: E402
from ebpo_jax.aot import programs as aot  # noqa: E402
from ebpo_jax.aot import topology as tpu_lib  # noqa: E402

GB = 1e9
PAPER = os.path.join(ROOT, "configs", "paper.py")
GROUP_SIZES = (4, 32)


def load_paper():
  return cli.load_module(PAPER)


def default_configs() -> list[str]:
  """Every paper model x method at G = 4 and 32."""
  paper = load_paper()
  models, methods = paper.MODELS, paper.METHODS
  return [f"{m},{method},g{g}" for g in GROUP_SIZES for m in models for method in methods]


def _load(path: str) -> dict:
  if not path or not os.path.exists(path):
    return {}
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {r["key"]: r for r in rows}


def _append(path: str, row: dict) -> None:
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(row) + "\n")


def _log(message: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sampler_row(arg: str, tpu: tpu_lib.Slice, prompts_per_call: int = 0) -> dict:
  """The sampler call of `arg`'s model x G (optionally at another `prompts_per_call`)."""
  config = cli.load_config(f"{PAPER}:{arg}")
  if prompts_per_call:
    config.sampling.prompts_per_call = prompts_per_call
  return aot.compile_sampler(aot.make_target(config, tpu))


def train_row(arg: str, tpu: tpu_lib.Slice, sampler: dict) -> dict:
  """The train step of `arg`, and the sampler's bytes with this method's waiting state."""
  config = cli.load_config(f"{PAPER}:{arg}")
  target = aot.make_target(config, tpu)
  train = aot.compile_train_step(target)
  sampler = dict(sampler)
  aot.add_waiting(config, sampler, aot.resident_while_sampling(target, train))
  return aot.summarize(config, tpu, target.prompt_len, train, sampler)


def first_guess(sampler: dict, resident: int, usable: int, rows_multiple: int) -> int:
  """The most prompts per call if all of the configured call's bytes but the params and the code
  grew in proportion to the prompts (the KV cache, the prefill's and the decode's buffers)."""
  p0, b0 = sampler["prompts_per_call"], sampler["program_bytes_alone"]
  fixed = sampler["argument_bytes"] + sampler["code_bytes"]
  return int(p0 * (usable - resident - fixed) / (b0 - fixed)) // rows_multiple * rows_multiple


def most_prompts(
  arg: str, tpu: tpu_lib.Slice, first: dict, resident: int, rows_multiple: int
) -> dict:
  """The largest prompts per call whose sampler fits beside `resident` bytes: one compile at the
  first guess gives a second point, and the line through both compiled points the prediction.
  "Confirmed" is the largest count that compiled and fit."""
  p0, b0 = first["prompts_per_call"], first["program_bytes_alone"]
  usable = tpu.chip.usable_hbm_bytes
  guess = first_guess(first, resident, usable, rows_multiple)
  second = sampler_row(arg, tpu, guess)
  b1 = second["bytes_per_chip"]  # from the compiler's message when it did not fit
  fits = second.get("compile_error") is None and b1 + resident <= usable
  per_prompt = (b1 - b0) / (guess - p0) if b1 is not None and guess != p0 else None
  predicted = None
  if per_prompt:
    predicted = p0 + int((usable - resident - b0) / per_prompt) // rows_multiple * rows_multiple
  return {
    "max_prompts_per_call": predicted,
    "confirmed_prompts_per_call": guess if fits else p0,
    "compiled_at": guess,
    "bytes_at_compiled": None if b1 is None else b1 + resident,
    "bytes_per_prompt": per_prompt,
  }


def _group(arg: str) -> tuple[str, int]:
  """The model x G (x LoRA rank, x runlocal) part of a paper.py argument, and G: what the sampler
  program depends on (LoRA adds the adapters' matmuls to it)."""
  v = load_paper().parse_arg(arg)
  lora = f",lora{v.lora_rank}" if v.lora_rank else ""
  return f"{v.model},g{v.group_size}{lora}" + (",runlocal" if v.runlocal else ""), v.group_size


def sweep(args, tpu: tpu_lib.Slice) -> list[dict]:
  """Every config of `args.configs`; sampler compiled once per model x G."""
  done = _load(args.results)
  groups: dict[str, list[str]] = {}
  for arg in args.configs:
    groups.setdefault(_group(arg)[0], []).append(arg)
  for group, group_args in groups.items():
    group_size = _group(group_args[0])[1]
    sampler_key = f"sampler:{group}"
    if sampler_key not in done:
      _log(f"{group}: compiling the sampler call")
      row = sampler_row(group_args[0], tpu)
      row["program_bytes_alone"] = row["bytes_per_chip"]
      done[sampler_key] = {"key": sampler_key, "group_size": group_size, "sampler": row}
      _append(args.results, done[sampler_key])
    sampler = done[sampler_key]["sampler"]
    for arg in group_args:
      if arg in done:
        continue
      _log(f"{arg}: compiling the train step")
      report = train_row(arg, tpu, sampler)
      done[arg] = {"key": arg, "group_size": group_size, **report}
      _append(args.results, done[arg])
      _log(f"{arg}: fits {report['fits']}, needs {_gb(max_bytes(report))} GB per chip")
  for group, group_args in groups.items():  # after every config's row: the slowest part
    group_size = _group(group_args[0])[1]
    sampler = done[f"sampler:{group}"]["sampler"]
    max_key = f"max_prompts:{group}"
    if args.max_prompts and max_key not in done:
      resident = max(done[a]["sampler"]["resident_bytes"] for a in group_args)
      rows_multiple = 8  # prompts over the 8 data x fsdp shards, else the prefill is replicated
      _log(f"{group}: the largest prompts_per_call")
      found = most_prompts(group_args[0], tpu, sampler, resident, rows_multiple)
      done[max_key] = {"key": max_key, "group_size": group_size, "resident_bytes": resident}
      done[max_key].update(found)
      _append(args.results, done[max_key])
  return list(done.values())


def max_bytes(report: dict) -> int | None:
  needed = [report[p]["bytes_per_chip"] for p in ("train_step", "sampler")]
  return None if None in needed else max(needed)


def _gb(n) -> str:
  return "-" if n is None else f"{n / GB:.1f}"


def _tflop(p: dict) -> str:
  return "-" if p.get("flops") is None else f"{p['flops'] / 1e12:.0f}"


def _train_cell(t: dict) -> str:
  if "argument_bytes" not in t:
    return f"{_gb(t['bytes_per_chip'])} (does not compile: out of HBM)"
  parts = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes")
  a, o, al, tmp, code = (_gb(t[k]) for k in parts)
  return f"{_gb(t['bytes_per_chip'])} ({a} + {o} - {al} + {tmp} + {code})"


def _sampler_cell(s: dict, group_size: int) -> str:
  rows = f"{s['prompts_per_call']} x {group_size} rows"
  parts = f"{_gb(s['program_bytes'])} + {_gb(s['resident_bytes'])}"
  return f"{_gb(s['bytes_per_chip'])} ({parts}; {rows})"


def _times_cell(p: dict) -> str:
  """A program's compute / HBM / ICI-bound seconds, its roofline over the compute time and, for
  the train step, over the limit counted from the model's shapes (roofline.train_step_limit)."""
  if p.get("compute_s") is None:
    return "-"
  times = f"{p['compute_s']:.0f} / {p['hbm_s']:.0f} / {p['collective_s']:.0f}"
  if p.get("limit_s") is None:
    return f"{times} ({p['roofline_to_compute']:.2f}x)"
  return f"{times} ({p['roofline_to_compute']:.2f}x; {p['roofline_to_limit']:.2f}x the limit)"


def _roofline_cell(r: dict) -> str:
  t, s = r["train_step"], r["sampler"]
  if r.get("rl_step_roofline_s") is None:
    return "-"
  calls = s["calls_per_round"]
  return f"{r['rl_step_roofline_s']:.0f} ({t['roofline_s']:.0f} + {calls} x {s['roofline_s']:.1f})"


def table(rows: list[dict]) -> str:
  """The full markdown table (results/memory.md): one line per config."""
  lines = [
    "| config | train step GB/chip (arg + out - alias + temp + code) | train TFLOP/chip "
    "| sampler call GB/chip (program + waiting state and rollouts) | sampler TFLOP/chip "
    "| fits | headroom GB | train step compute / HBM / ICI s (roofline / compute; / limit) "
    "| roofline RL step s (train + calls x sampler) |",
    "|" + "---|" * 9,
  ]
  for r in rows:
    if "train_step" not in r:
      continue
    t, s = r["train_step"], r["sampler"]
    cells = [
      r["key"],
      _train_cell(t),
      _tflop(t),
      _sampler_cell(s, r["group_size"]),
      _tflop(s),
      "yes" if r["fits"] else "**no**",
      _gb(r["headroom_bytes"]),
      _times_cell(t),
      _roofline_cell(r),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


README_METHODS = ("ebpo_topic", "dapo")  # the two memory classes: with a KL reference, and without


def readme_table(rows: list[dict]) -> str:
  """docs/will-it-fit.md's compact table for README_METHODS: GB per chip of both phases, fit,
  roofline."""
  lines = [
    "| config | train step GB/chip | sampling GB/chip (sampler call + waiting) | fits "
    "| train / sampler TFLOP per chip | train step compute / HBM / ICI s | roofline RL step |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    if "train_step" not in r or r["key"].split(",")[1] not in README_METHODS:
      continue
    t, s = r["train_step"], r["sampler"]
    roof = r.get("rl_step_roofline_s")
    cells = [
      r["key"],
      _gb(t["bytes_per_chip"]),
      f"{_gb(s['bytes_per_chip'])} ({_gb(s['program_bytes'])} + {_gb(s['resident_bytes'])})",
      "yes" if r["fits"] else "**no**",
      f"{_tflop(t)} / {_tflop(s)}",
      _times_cell(t),
      "-" if roof is None else f"{roof / 60:.0f} min ({t['bound']}-bound train step)",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def prompts_table(rows: list[dict], usable: int) -> str:
  """The largest prompts per call per model x G, for every method (markdown): the first guess
  from the configured call, and where the search ran, the compiled second point and the line."""
  lines = [
    "| model, G | configured prompts x G rows | first guess (configured call scaled) "
    "| compiled there: GB/chip with the waiting state | largest that fits (line through both) "
    "| GB per extra prompt |",
    "|---|---|---|---|---|---|",
  ]
  by_key = {r["key"]: r for r in rows}
  for r in rows:
    if not r["key"].startswith("sampler:"):
      continue
    group, g = r["key"].split(":", 1)[1], r["group_size"]
    waiting = [x["sampler"]["resident_bytes"] for x in rows if "train_step" in x and _in(x, group)]
    found = by_key.get(f"max_prompts:{group}", {})
    guess = first_guess(r["sampler"], max(waiting, default=0), usable, 8)
    compiled = found.get("bytes_at_compiled")
    cells = [
      group,
      f"{r['sampler']['prompts_per_call']} x {g}",
      str(guess),
      "-" if not found else f"{_gb(compiled)} ({'fits' if compiled <= usable else 'no'})",
      str(found.get("max_prompts_per_call") or "-"),
      f"{found['bytes_per_prompt'] / GB:.3f}" if found.get("bytes_per_prompt") else "-",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _in(row: dict, group: str) -> bool:
  return _group(row["key"])[0] == group


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="", help="paper.py arguments separated by ';'")
  parser.add_argument("--topology", default="v5p-64")
  parser.add_argument("--results", default="", help="JSON-lines file of the rows (resumable)")
  parser.add_argument("--write", default="", help="also write the markdown tables to this file")
  parser.add_argument("--no_max_prompts", dest="max_prompts", action="store_false")
  parser.add_argument("--quick", action="store_true", help="a runlocal config on v5p:2x2x1")
  parser.add_argument(
    "--tables_only", action="store_true", help="the tables of the --results file; no compiles"
  )
  args = parser.parse_args()
  jax.config.update("jax_platforms", "cpu")
  if args.quick:
    args.configs, args.topology = "qwen3_8b,ebpo_topic,g4,runlocal", "v5p:2x2x1"
    args.max_prompts = False
  args.configs = [c for c in args.configs.split(";") if c] or default_configs()
  tpu = tpu_lib.parse_slice(args.topology)
  rows = list(_load(args.results).values()) if args.tables_only else sweep(args, tpu)
  order = {key: i for i, key in enumerate(default_configs())}
  rows.sort(key=lambda r: order.get(r["key"], len(order)))  # model x method at G = 4, then 32
  prompts = prompts_table(rows, tpu.chip.usable_hbm_bytes)
  tables = "\n\n".join((table(rows), prompts, readme_table(rows)))
  print(tables, end="\n\n")
  if args.write:
    with open(args.write, "w") as f:
      f.write(tables + "\n")
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
