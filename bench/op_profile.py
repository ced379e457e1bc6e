"""Where a compiled step's time goes: a `jax.profiler` trace of XLA:CPU's ops, summed by part.

Each op event of the trace is matched to its HLO instruction, whose `op_name` metadata names the
JAX source (the Decoder's module path, the loss, the optimizer), and the op times are summed over
the parts below. Needs `--xla_cpu_enable_xprof_traceme=true` in XLA_FLAGS before JAX starts its
backend (`enable_op_events`). The times are summed over the CPU threads, so they add up to more
than the wall time of a multi-threaded step.
"""

import collections
import glob
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData

TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
# (part, pattern on the op's JAX source path); the first match names the part.
PARTS = (
  ("optimizer (AdamW, grad norm, skip branch)", r"/cond/|optax|global_norm|clip_by"),
  ("LM head matmuls (forward and backward)", r"jvp\(Decoder\)\)?/(dot_general|transpose)$"),
  ("layer matmuls (projections)", r"/layers/.*_proj/.*(dot_general|transpose)"),
  ("attention (scores, softmax, values)", r"/layers/self_attn/"),
  ("layer elementwise (norms, MLP, residual)", r"/layers/"),
  ("layer loop (slices, stacking, copies)", r"slice|concatenate|dynamic_update|while"),
  ("log-probs, entropy, loss", r"jvp\(\)|transpose\(jvp\(\)\)|policy_loss|logsumexp"),
)
OTHER = "other (advantages, gathers, sequence layout)"


def enable_op_events() -> None:
  """Adds the flag that makes XLA:CPU record one trace event per op (call before JAX runs)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if TRACEME_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {TRACEME_FLAG}".strip()


def op_sources(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> the `op_name` of its metadata (its JAX source path)."""
  pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"")
  return {m.group(1): m.group(2) for m in map(pattern.match, hlo_text.splitlines()) if m}


def part_of(source: str) -> str:
  for part, pattern in PARTS:
    if re.search(pattern, source):
      return part
  return OTHER


def op_times(compiled, *args, steps: int = 2) -> dict[str, float]:
  """Seconds per call by part, from a trace of `steps` calls of the compiled function (its first
  argument is replaced by its output, as a train step's state is)."""
  sources = op_sources(compiled.as_text())
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    state = args[0]
    for _ in range(steps):
      state, out = compiled(state, *args[1:])
      jax.block_until_ready((state, out))
    jax.profiler.stop_trace()
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    profile = ProfileData.from_file(path)
  totals = collections.Counter()
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in sources:
          totals[part_of(sources[event.name])] += event.duration_ns / 1e9 / steps
  if not totals:
    raise RuntimeError(f"no op events in the trace: set {TRACEME_FLAG} before JAX starts")
  return dict(totals)
