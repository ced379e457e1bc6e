"""ebpo_jax.aot: slice names and bad input (the TPU compiler's verdict on the default job:
e2e/test_aot.py; the cost counting: test_roofline.py)."""

import itertools
import types

import jax
import jax.numpy as jnp
import pytest

from ebpo_jax import cli
from ebpo_jax.aot import programs as aot
from ebpo_jax.aot import report as aot_report
from ebpo_jax.aot import split
from ebpo_jax.aot import topology as tpu_lib
from tests.helpers import ROOT
from tests.helpers.processes import run_python

# ----------------------------------------------------------------------------- slice names


@pytest.mark.parametrize(
  ("name", "generation", "shape", "accelerator_type"),
  [
    ("v5p-64", "v5p", (2, 4, 4), "v5p-64"),  # TensorCores: 32 chips
    ("v5p-8", "v5p", (2, 2, 1), "v5p-8"),
    ("v4-32", "v4", (2, 2, 4), "v4-32"),
    ("v5e-16", "v5e", (4, 4), "v5litepod-16"),  # chips
    ("v5litepod-16", "v5e", (4, 4), "v5litepod-16"),  # gcloud's spelling
    ("v5e-1", "v5e", (1, 1), "v5litepod-1"),
    ("v6e-8", "v6e", (2, 4), "v6e-8"),
    ("v5p:4x4x2", "v5p", (4, 4, 2), "v5p-64"),
    ("v5e:2x2", "v5e", (2, 2), "v5litepod-4"),
  ],
)
def test_parse_slice(name, generation, shape, accelerator_type):
  tpu = tpu_lib.parse_slice(name)
  assert (tpu.generation, tpu.shape, tpu.accelerator_type) == (generation, shape, accelerator_type)
  assert tpu.topology == f"{generation}:{'x'.join(map(str, shape))}"


@pytest.mark.parametrize("name", ["v7-8", "v5p-63", "v5p-6", "tpu", "v5e:2x2x2", "v5p:2x2", ""])
def test_unknown_slices_name_the_known_ones(name):
  with pytest.raises(ValueError, match="--topology=") as error:
    tpu_lib.parse_slice(name)
  if ":" not in name:
    assert "v5p-64" in str(error.value) and "v5e-16" in str(error.value)


def test_every_known_slice_parses_back():
  for name in tpu_lib.known_slices():
    assert tpu_lib.parse_slice(name).accelerator_type.replace("v5litepod", "v5e") == name


@pytest.mark.parametrize(
  ("flags", "message"),
  [
    (["--topology=v9-8"], "error: --topology='v9-8': unknown slice; known: v4-8,"),
    (["--topology=v5e-4", "--config.rl.group_size=1"], "error: config.rl.group_size=1: must be"),
    (["--topology=v5e-4", "--config.rl.group_sise=4"], "error: "),  # a typo'd key
  ],
)
def test_bad_input_exits_with_one_line(flags, message):
  result = run_python(["-m", "ebpo_jax.aot", "--config=configs/arith_ebpo.py", *flags], timeout=120)
  assert result.returncode == 2  # cli.BAD_INPUT_STATUS, as every entry point
  assert result.stderr.strip().splitlines()[-1].startswith(message)
  assert "Traceback" not in result.stderr


def test_weight_sized_gathers_are_those_of_a_weight_whole_or_its_tensor_shard():
  sds = jax.ShapeDtypeStruct
  params = {
    "layers": {
      "q_proj": sds((36, 4096, 32, 128), jnp.float32),
      "scale": sds((36, 4096), jnp.float32),
    },
    "embed_tokens": sds((151_936, 4096), jnp.float32),
  }
  target = types.SimpleNamespace(mesh=types.SimpleNamespace(shape={"tensor": 4}), params=params)
  q, q_shard, logits = 4096 * 32 * 128, 4096 * 8 * 128, 128 * 151_936
  ops = [
    {"kind": "all-gather", "elements": [q_shard // 8, q_shard]},  # an async start: (in, out)
    {"kind": "all-gather", "elements": [q]},
    {"kind": "all-gather", "elements": [logits]},  # the vocab-split logits: not a weight
    {"kind": "all-reduce", "elements": [q]},  # a reduction, not a gather
    {"kind": "all-gather", "elements": [4096]},  # the size of a norm scale: vectors are not counted
  ]
  assert aot.weight_sized_gathers(target, ops) == ops[:2]


def test_a_sampler_part_that_does_not_fit_alone_leaves_the_call_uncosted(monkeypatch):
  # The call fits; its prefill, compiled alone to cost it, does not: the report says so and keeps
  # the call's memory, with no costs (and no RL step roofline), instead of failing.
  whole = {"bytes_per_chip": 50e9, "argument_bytes": 1e9, "output_bytes": 1e9, "alias_bytes": 0,
           "temp_bytes": 48e9, "code_bytes": 0, "compile_s": 1.0, "prompts_per_call": 64,
           "calls_per_round": 8}  # fmt: skip
  # compile_program's result for a program that does not fit, and two that compiled
  error = {"bytes_per_chip": 120e9, "compile_error": "RESOURCE_EXHAUSTED: 112G", "flops": None,
           "roofline_s": None}  # fmt: skip
  part = dict(bytes_per_chip=1, copy_bytes=0, collective_bytes=0, roofline_s=1.0, compile_s=1)
  results = iter([whole, error, part, part])
  monkeypatch.setattr(aot, "sampler_program", lambda target: None)
  monkeypatch.setattr(aot, "sampler_part_programs", lambda target: (None, None))
  monkeypatch.setattr(aot, "rollout_layout_program", lambda target: None)
  monkeypatch.setattr(aot, "compile_program", lambda program, target: next(results))
  sampler = aot.compile_sampler(types.SimpleNamespace(tpu=None))
  assert sampler["bytes_per_chip"] == 50e9 and sampler["roofline_s"] is None
  assert "prefill, compiled alone, does not fit: RESOURCE_EXHAUSTED" in sampler["costs_error"]
  train = dict(
    bytes_per_chip=40e9, argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
    code_bytes=0, flops=1e12, kernel_flops=0, bytes_accessed=1e9, collectives={},
    collective_bytes=0, compile_s=1, compute_s=2.0, hbm_s=1.0, collective_s=0, roofline_s=2.0,
    bound="compute", roofline_to_compute=1.0,
  )  # fmt: skip
  config = cli.load_config(str(ROOT / "configs" / "arith_ebpo.py"))
  report = aot.summarize(config, tpu_lib.parse_slice("v5p-8"), 8, train, sampler)
  assert report["fits"] and "rl_step_roofline_s" not in report
  assert "  no costs: the sampler's prefill" in aot_report.describe(report)


# ----------------------------------------------------------------------------- a split slice


def _chips(shape):
  """Chips of a torus in the order of the TPU topology's devices: x fastest."""
  coords = itertools.product(*map(range, reversed(shape)))
  return [types.SimpleNamespace(coords=c[::-1]) for c in coords]


def test_the_links_between_a_split_slices_sides_are_its_neighbour_pairs():
  chips = _chips((2, 4, 4))  # v5p-64's torus; the sampler takes the last 16: z in {2, 3}
  assert {d.coords[2] for d in chips[16:]} == {2, 3}
  assert split.cut_links(chips[:16], chips[16:]) == 2 * 4  # the plane z = 1 | 2; no wraparound
  by_x = sorted(chips, key=lambda d: d.coords[0])
  assert split.cut_links(by_x[:16], by_x[16:]) == 4 * 4  # x = 0 | 1
  corner, rest = chips[:1], chips[1:]
  assert split.cut_links(corner, rest) == split.cut_links(rest, corner) == 3
