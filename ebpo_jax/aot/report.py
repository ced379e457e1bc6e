"""The human-readable lines `python -m ebpo_jax.aot` prints above its JSON report."""

import sys

from ebpo_jax.aot.topology import GIB


def _gb(n: float | None) -> str:
  return "?" if n is None else f"{n / 1e9:.2f} GB"


_SOURCE_NAMES = {
  "compiler": "compiler",
  "jaxpr_dots": "jaxpr matmuls",
  "kernel_bodies": "kernel bodies",
  "modelled": "modelled",
}


def _shares(shares: dict | None) -> str:
  """Where a ratio's numerator comes from: `measured by the compiler 9%, counted from kernel
  bodies 88%, ...` (the parts above 0)."""
  if not shares:
    return ""
  parts = [f"{_SOURCE_NAMES.get(k, k)} {v:.0%}" for k, v in shares.items() if v >= 0.005]
  return f" [numerator: {', '.join(parts)}]"


def progress(name: str, verdict: str, chips: int, seconds: float) -> None:
  """One line on stderr as a program's compile ends (a large config compiles for minutes)."""
  print(f"aot: {name} {verdict} for {chips} chips in {seconds:.0f} s", file=sys.stderr, flush=True)


def describe(report: dict) -> str:
  """The human-readable lines above the JSON."""
  usable = report["hbm_bytes_per_chip"]
  lines = [
    f"{report['slice']} ({report['topology']}, {report['chips']} chips), mesh {report['mesh']}, "
    f"prompt bucket {report['prompt_len']}; HBM per chip the compiler allows: "
    f"{usable / GIB:.2f} GiB = {_gb(usable)}"
  ]
  for name, p in (("train step", report["train_step"]), ("sampler call", report["sampler"])):
    if p.get("compile_error"):
      lines.append(f"{name}: does not fit: {p['compile_error']}")
      continue
    lines.append(
      f"{name}: {_gb(p['bytes_per_chip'])} per chip = arguments {_gb(p['argument_bytes'])} + "
      f"outputs {_gb(p['output_bytes'])} - aliased {_gb(p['alias_bytes'])} + temporaries "
      f"{_gb(p['temp_bytes'])} + code {_gb(p['code_bytes'])}"
      + (f" + waiting {_gb(p['resident_bytes'])}" if "resident_bytes" in p else "")
    )
    if p.get("costs_error"):
      lines.append(f"  no costs: {p['costs_error']}")
      continue
    counted = (
      f"loop bodies x{p['loop_factor_flops']:.0f} FLOPs, x{p['loop_factor_bytes']:.0f} bytes by "
      "trip counts"
      if "loop_factor_flops" in p
      else "the prefill + the decode loop's trips x one step"
    )
    lines.append(
      f"  {p['flops'] / 1e12:.1f} TFLOP ({p['kernel_flops'] / 1e12:.1f} in kernels) and "
      f"{_gb(p['bytes_accessed'])} accessed per chip ({counted}); "
      f"{sum(c['count'] for c in p['collectives'].values()):.0f} collectives sending "
      f"{_gb(p['collective_bytes'])}; compiled in {p['compile_s']:.0f} s"
    )
    lines.append(
      f"  compute {p['compute_s']:.2f} s, HBM {p['hbm_s']:.2f} s, ICI {p['collective_s']:.2f} s: "
      f"roofline {p['roofline_s']:.2f} s, {p['bound']}-bound, "
      f"{p['roofline_to_compute'] or 0:.2f}x the compute time"
    )
    if "decode_step" in p:
      lines.extend(_sampler_lines(p))
    elif "limit_s" in p:
      lines.append(
        f"  limit from the model's shapes {p['limit_s']:.2f} s (each prompt once per group; "
        f"the program runs {p['flops_to_limit']:.2f}x its FLOPs): roofline "
        f"{p['roofline_to_limit']:.2f}x the limit, a work ratio"
        + _shares(p.get("roofline_to_limit_shares"))
      )
  train = report["train_step"]
  if "params_bytes" in train:
    lines.append(
      f"train state per chip: trained params {_gb(train['params_bytes'])} + optimizer state "
      f"{_gb(train['opt_state_bytes'])} + KL reference {_gb(train['ref_params_bytes'])} + "
      f"frozen LoRA base {_gb(train['base_bytes'])} (+ prior, counters)"
    )
  if "split" in report:
    lines.extend(_split_lines(report))
  elif "rl_step_roofline_s" in report:
    lines.append(
      f"RL step roofline: {report['rl_step_roofline_s']:.0f} s (train step + "
      f"the weights' conversion + {report['sampler']['calls_per_round']} sampler calls; up to "
      f"{report['rl_step_roofline_s_max_refill']:.0f} s with every refill round)"
      + (
        f"; at the limits {report['rl_step_limit_s']:.0f} s: "
        f"{report['rl_step_roofline_to_limit']:.2f}x"
        + _shares(report.get("rl_step_roofline_shares"))
        if "rl_step_limit_s" in report
        else ""
      )
    )
  verdict = "fits" if report["fits"] else "DOES NOT FIT"
  headroom = report["headroom_bytes"]
  lines.append(f"{verdict}: headroom {_gb(headroom)} per chip" if headroom is not None else verdict)
  return "\n".join(lines)


def _sampler_lines(p: dict) -> list[str]:
  step, layout = p["decode_step"], p["rollout_layout"]
  gathers = step["collectives"].get("all-gather", {"count": 0, "largest": 0})
  return [
    f"  limit from the model's shapes {p['limit_s']:.2f} s (weights once per decode step + the "
    f"keys and values written; the program moves {p['bytes_to_limit']:.2f}x its bytes): "
    f"roofline {p['roofline_to_limit']:.2f}x the limit"
    + _shares(p.get("roofline_to_limit_shares")),
    f"  a decode step: {_gb(step['bytes_accessed'])} accessed, "
    f"{sum(c['count'] for c in step['collectives'].values()):.0f} collectives sending "
    f"{_gb(step['collective_bytes'])} ({step['collective_s'] * 1e3:.2f} ms at ICI); "
    f"{gathers['count']:.0f} all-gathers, the largest {gathers['largest'] / 1e6:.2f} MB, "
    f"{len(step['weight_gathers'])} of a weight's size",
    f"  the round's weights in the decode layout: {_gb(layout['copy_bytes'])} per chip, "
    f"converted in {layout['roofline_s']:.3f} s (roofline)",
  ]


def _split_lines(report: dict) -> list[str]:
  """The split's lines: its sub-meshes, the weight transfer, the RL step against the whole slice's
  synchronous one (`aot.split`)."""
  split, sync = report["split"], report["synchronous"]
  lines = [
    f"split: the train step on {split['trainer_chips']} chips (mesh {report['mesh']}), the sampler "
    f"on {split['sampler_chips']} (mesh {report['sampler_mesh']})",
    f"  weight transfer (modelled): {_gb(split['transfer_bytes'])} over {split['cut_links']} links "
    f"between the sides ({_gb(split['transfer_bytes_per_chip'])} per sampler chip): "
    f"{split['transfer_s'] * 1e3:.1f} ms; one copy in the sampler's dtype, broadcast on its side: "
    f"{_gb(split['transfer_min_bytes'])}, {split['transfer_min_s'] * 1e3:.1f} ms",
  ]
  if "rl_step_s" not in split:
    return lines
  how = (
    "the slower of the train step (+ its params' copy) and the round, + the transfer"
    if split["overlapped"]
    else "rl.max_staleness=0: the train step + the round + the transfer, in turn"
  )
  line = (
    f"RL step roofline, split: {split['rl_step_s']:.1f} s ({how}; train step "
    f"{split['trainer_s']:.1f} s, round {split['round_s']:.1f} s)"
  )
  if "synchronous_rl_step_s" in split:
    line += (
      f"; synchronous on all {sync['chips']} chips: {split['synchronous_rl_step_s']:.1f} s, "
      f"{split['speedup']:.2f}x"
    )
  lines.append(line + _shares(report.get("rl_step_roofline_shares")))
  return lines
