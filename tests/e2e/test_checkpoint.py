"""Checkpoints in processes of their own: a restore that fails, on one CPU device (the trainer's
default; with the tests' 8 fake devices orbax's reads do not end the same way), and the clock of
`checkpoint.every_minutes` across two JAX processes."""

import json
import socket
import subprocess
import sys
import textwrap

from tests.helpers import ROOT
from tests.helpers.processes import cpu_env, run_python

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


# Two JAX processes (jax.distributed on CPU, gloo collectives) share one checkpoint directory.
# Process 0's clock says a minute and a half has passed, process 1's says none: the broadcast of
# process 0's elapsed time makes both decide to save (without it process 1 would skip the save
# that process 0 waits in, and the pair would hang until the timeout: checked).
_TWO_PROCESS_CLOCK = textwrap.dedent(
  """
  import json, sys
  import jax, numpy as np
  pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from ebpo_jax import checkpoint
  start = [0.0]
  checkpoint._now = lambda: start[0]
  ckpt = checkpoint.Checkpointer(directory, every_steps=0, every_minutes=1.0)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  state = {"w": jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh, P()))}
  start[0] = 90.0 if pid == 0 else 0.0  # the clocks disagree: process 0's decides
  due = ckpt.save(1, state)
  ckpt.wait()
  start[0] = 100.0 if pid == 0 else 500.0  # 10 s after the save on process 0: not due anywhere
  again = ckpt.save(2, state)
  ckpt.close()
  print(json.dumps({"pid": pid, "processes": jax.process_count(), "saved": [due, again]}))
  """
)


# e2e: two processes on one CPU device each (~15 s)
def test_every_minutes_is_decided_by_process_zeros_clock_on_every_process(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  directory = tmp_path / "checkpoints"
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _TWO_PROCESS_CLOCK, str(pid), str(port), str(directory)],
      cwd=ROOT,
      env=cpu_env(1),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for pid in (0, 1)
  ]
  try:
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err[-3000:]
  reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert [r["processes"] for r in reports] == [2, 2]
  assert [r["saved"] for r in reports] == [[True, False], [True, False]]
  assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["1"]
