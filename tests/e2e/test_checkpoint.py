"""A checkpoint restore that fails, in a process of its own on one CPU device (the trainer's
default; with the tests' 8 fake devices orbax's reads do not end the same way)."""

import json
import textwrap

from tests.helpers.processes import run_python

# Saves checkpoints 1 to 9 of 16 arrays, cuts the weight chunk of each but the first to 10 bytes,
# restores the latest (8 failed attempts: whether orbax leaves reads behind is a race, about one
# attempt in two) and prints the restored step and what reached sys.unraisablehook meanwhile (and
# at a collection).
_TRUNCATED_CHUNKS = """
import gc, json, pathlib, sys
import jax, jax.numpy as jnp
from ebpo_jax import checkpoint

reported = []
sys.unraisablehook = lambda unraisable: reported.append(repr(unraisable.object)[:80])
weights = lambda s: {f"w{i}": jnp.arange(32768, dtype=jnp.float32) + s + i for i in range(16)}
device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
abstract = jax.tree.map(
  lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), jax.eval_shape(weights, 0.0)
)
directory = pathlib.Path(sys.argv[1])
with checkpoint.Checkpointer(directory, max_to_keep=None) as ckpt:
  for step in range(1, 10):
    ckpt.save(step, weights(float(step)))
for step in range(2, 10):
  chunk = max((p for p in (directory / str(step) / "state").rglob("*") if p.is_file()),
              key=lambda p: p.stat().st_size)
  chunk.write_bytes(chunk.read_bytes()[:10])
with checkpoint.Checkpointer(directory, max_to_keep=None) as ckpt:
  step, _, _ = ckpt.restore_latest(abstract)
gc.collect()
print(json.dumps({"step": step, "reported": reported}))
"""


def test_truncated_chunks_are_one_warning_line_without_orbax_tracebacks(tmp_path):
  # When one array read fails, orbax abandons the others, and Python reported each abandoned
  # coroutine through sys.unraisablehook ("Exception ignored in: <coroutine object
  # _read_array_index_and_device_put ...>" and a traceback with the TensorStore spec: about 130
  # lines under the trainer's one warning line).
  result = run_python(["-c", textwrap.dedent(_TRUNCATED_CHUNKS), str(tmp_path / "ckpt")])
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out == {"step": 1, "reported": []}
  warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
  assert len(warnings) == 1 and "checkpoint 9" in warnings[0], result.stderr[-3000:]
