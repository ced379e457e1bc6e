"""ebpo_jax.aot: slice names, the loop correction of the compiler's cost analysis, bad input (the
TPU compiler's verdict on the default job: e2e/test_aot.py)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from ebpo_jax import aot
from ebpo_jax import tpu as tpu_lib
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


# ----------------------------------------------------------------------------- loop correction


def test_count_dots_weights_loop_bodies_by_their_trip_counts():
  w, x = jnp.ones((16, 32)), jnp.ones((8, 16))

  def f(w, x):
    once = x @ w  # 2 * 8 * 16 * 32 = 8192 FLOPs
    scanned = jax.lax.scan(lambda c, _: (c, c @ w), x, None, length=5)[1]  # 5 x 8192
    looped = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w[:, :16]), (0, x))
    return once, scanned, looped  # the while body: 2 * 8 * 16 * 16 = 4096 FLOPs

  count = aot.count_dots(jax.make_jaxpr(f)(w, x).jaxpr, while_trips=7)
  assert count.flops_once == 8192 + 8192 + 4096  # each body once, as the compiler counts
  assert count.flops == 8192 + 5 * 8192 + 7 * 4096
  assert count.bytes == 6 * 4 * (8 * 16 + 16 * 32 + 8 * 32) + 7 * 4 * (8 * 16 + 16 * 16 + 8 * 16)


def test_count_dots_counts_an_unrolled_scan_body_as_often_as_the_compiler_sees_it():
  w, x = jnp.ones((16, 32)), jnp.ones((8, 16))  # c @ w: 8192 FLOPs

  for unroll, copies in ((1, 1), (2, 2), (6, 6), (True, 6)):
    scan = functools.partial(jax.lax.scan, length=6, unroll=unroll)
    f = lambda w, x, scan=scan: scan(lambda c, _: (c, c @ w), x, None)[1]
    count = aot.count_dots(jax.make_jaxpr(f)(w, x).jaxpr, 1)
    assert (count.flops_once, count.flops) == (copies * 8192, 6 * 8192), unroll


def test_count_dots_gives_each_while_loop_its_own_trip_count_in_program_order():
  # The compacting sampler's stages are while loops one after another; in the worst case (no row
  # stops) the first runs to the cap and the later ones never run.
  w, x = jnp.ones((16, 16)), jnp.ones((8, 16))  # c @ w: 4096 FLOPs

  def f(w, x):
    loop = lambda c: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), c)
    return loop(loop((0, x)))

  count = aot.count_dots(jax.make_jaxpr(f)(w, x).jaxpr, while_trips=(7, 0))
  assert (count.flops_once, count.flops) == (2 * 4096, 7 * 4096)


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
