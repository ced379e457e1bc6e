"""Tests for ebpo_jax.checkpoint: sharded round trip, data iterator resume, retention,
interrupted saves, SIGTERM flag."""

import functools
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import flax
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import checkpoint, process
from tests.helpers import ROOT
from tests.helpers.checkpoints import weights, weights_abstract


class Prior(NamedTuple):
  count: jax.Array  # [K]
  mean: jax.Array  # [K]


@flax.struct.dataclass
class TrainState:
  params: dict
  opt_state: optax.OptState
  prior: Prior
  rng: jax.Array
  step: jax.Array


_TX = optax.adamw(1e-3)


def _init_state(seed: int = 0) -> TrainState:
  params = {"w": jnp.arange(64.0).reshape(8, 8) + seed, "b": jnp.full((8,), 0.5 + seed)}
  opt_state = _TX.init(params)
  # A non-trivial optimizer state.
  _, opt_state = _TX.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
  prior = Prior(count=jnp.array([1.0, 2.0, 3.0, 0.0]), mean=jnp.array([0.1, 0.5, 0.9, 0.0]) + seed)
  return TrainState(params, opt_state, prior, jax.random.key(seed + 7), jnp.int32(seed))


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _sharded_abstract(spec_2d: P, spec_1d: P):
  mesh = _mesh()

  def with_sharding(x):
    spec = {2: spec_2d, 1: spec_1d}.get(x.ndim, P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree.map(with_sharding, jax.eval_shape(_init_state))


_STATES = {}  # shardings -> the state built into them


def _make_state(abstract):
  """`_init_state()` built straight into `abstract`'s shardings, once per layout in a process (a
  compile each; the tests only read the state)."""
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  layout = tuple(jax.tree.leaves(shardings))
  if layout not in _STATES:
    _STATES[layout] = jax.jit(_init_state, out_shardings=shardings)()
  return _STATES[layout]


def _assert_states_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  got_rng, want_rng = got.rng, want.rng
  assert jax.dtypes.issubdtype(got_rng.dtype, jax.dtypes.prng_key)
  assert jax.random.key_impl(got_rng) == jax.random.key_impl(want_rng)
  np.testing.assert_array_equal(jax.random.key_data(got_rng), jax.random.key_data(want_rng))
  for g, w in zip(
    jax.tree.leaves(got.replace(rng=0)), jax.tree.leaves(want.replace(rng=0)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert np.asarray(g).dtype == np.asarray(w).dtype


def test_sharded_round_trip_restores_requested_shardings(tmp_path):
  assert jax.device_count() == 8
  saved_abstract = _sharded_abstract(P("data", "model"), P("model"))
  state = _make_state(saved_abstract)
  config = {"seed": 3, "rl": {"group_size": 4, "advantage": "ebpo"}, "mesh": (2, 4)}
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(5, state, config=config)
  # A new process-like reader, restoring onto a different layout than the one saved.
  wanted = _sharded_abstract(P(None, "data"), P("data"))
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() == 5
    restored, restored_config = ckpt.restore(None, wanted)
  _assert_states_equal(restored, state)
  assert isinstance(restored.prior, Prior) and isinstance(restored, TrainState)
  got_shardings = jax.tree.map(lambda x: x.sharding, restored)
  want_shardings = jax.tree.map(lambda a: a.sharding, wanted)
  for g, w in zip(jax.tree.leaves(got_shardings), jax.tree.leaves(want_shardings), strict=True):
    assert g == w
  assert restored.params["w"].sharding.spec == P(None, "data")
  assert restored_config == {
    "seed": 3,
    "rl": {"group_size": 4, "advantage": "ebpo"},
    "mesh": [2, 4],
  }


def test_grain_iterator_resumes_at_the_same_element(tmp_path):
  dataset = grain.MapDataset.range(200).shuffle(seed=11).map(lambda x: x * 3).batch(4)
  abstract = _sharded_abstract(P(), P())
  state = _make_state(abstract)
  data_iter = iter(dataset)
  for _ in range(5):
    next(data_iter)
  expected = [next(data_iter) for _ in range(3)]
  # Rewind to the save point.
  data_iter = iter(dataset)
  for _ in range(5):
    next(data_iter)
  with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=True) as ckpt:
    ckpt.save(5, state, data_iter=data_iter)
    # The position is captured at save time: advancing now must not change what was saved.
    for _ in range(7):
      next(data_iter)
  resumed = iter(dataset)
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
    _, config = ckpt.restore(5, abstract, data_iter=resumed)
  assert config is None
  for want in expected:
    np.testing.assert_array_equal(next(resumed), want)


def test_keeps_the_last_n_and_every_steps(tmp_path):
  abstract = _sharded_abstract(P(), P())
  state = _make_state(abstract)
  with checkpoint.Checkpointer(tmp_path / "a", max_to_keep=2) as ckpt:
    for step in range(1, 6):
      assert ckpt.save(step, state)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  with checkpoint.Checkpointer(tmp_path / "b", max_to_keep=None, every_steps=3) as ckpt:
    # Multiples of 3 (not orbax's "the first save always"); `force` overrides.
    saved = [step for step in range(1, 8) if ckpt.save(step, state)]
    assert saved == [3, 6]
    assert ckpt.save(7, state, force=True)
    assert not ckpt.save(7, state, force=True)  # already there: no error, nothing written
    ckpt.wait()
    assert ckpt.all_steps() == [3, 6, 7]


def test_every_minutes_saves_at_the_first_step_after_the_interval(tmp_path, monkeypatch):
  clock = [1000.0]  # seconds
  monkeypatch.setattr(checkpoint, "_now", lambda: clock[0])
  state = _make_state(_sharded_abstract(P(), P()))
  ticks = {1: 20, 2: 20, 3: 30, 4: 5, 5: 60, 6: 200, 7: 1, 8: 1, 9: 1, 10: 1}  # step -> s taken

  def saved_steps(ckpt):
    saved = []
    for step, seconds in ticks.items():
      clock[0] += seconds
      if ckpt.save(step, state):
        saved.append(step)
    return saved

  with checkpoint.Checkpointer(
    tmp_path / "t", max_to_keep=None, every_steps=0, every_minutes=1.0
  ) as ckpt:
    saved = saved_steps(ckpt)
    # 20+20+30 = 70 s at step 3; then 5+60 at step 5; 200 at step 6; then 4 s: nothing.
    assert saved == [3, 5, 6]
  # Both cadences: whichever comes first (every_steps=4: step 4 and 8; clock: 3, 6).
  clock[0] = 0.0
  with checkpoint.Checkpointer(
    tmp_path / "b", max_to_keep=None, every_steps=4, every_minutes=1.0
  ) as ckpt:
    assert saved_steps(ckpt) == [3, 4, 5, 6, 8]
  with checkpoint.Checkpointer(tmp_path / "n", every_steps=0) as ckpt:  # both off: forced only
    assert not ckpt.save(1, state) and ckpt.save(2, state, force=True)


def test_restore_errors_are_clear(tmp_path):
  abstract = _sharded_abstract(P(), P())
  with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
      ckpt.restore(None, abstract)
    ckpt.save(1, _make_state(abstract))
    with pytest.raises(FileNotFoundError, match="step 2"):
      ckpt.restore(2, abstract)
    with pytest.raises(ValueError, match="no data iterator"):
      ckpt.restore(1, abstract, data_iter=iter(grain.MapDataset.range(3)))
    with pytest.raises(TypeError, match="not JSON-able"):
      ckpt.save(2, _make_state(abstract), config={"fn": print})


_KILLED_SAVE = textwrap.dedent(
  """
  import os, signal, sys, time
  import jax, jax.numpy as jnp
  from ebpo_jax import checkpoint, process
  ckpt = checkpoint.Checkpointer(sys.argv[1])
  ckpt.save(1, {"w": jnp.full((4,), 1.0)})
  ckpt.wait()
  # 64 MB: the asynchronous write is still running when the process dies below, once its
  # temporary directory exists (orbax's thread creates it a moment after save returns).
  ckpt.save(2, {"w": jnp.full((4,), 2.0), "big": jnp.ones((4096, 4096))})
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not any(
    n.startswith("2.orbax-checkpoint-tmp") for n in os.listdir(sys.argv[1])
  ):
    time.sleep(0.001)
  os.kill(os.getpid(), signal.SIGKILL)
  """
)


def test_checkpoint_killed_mid_save_is_never_latest(tmp_path):
  directory = tmp_path / "ckpt"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.run(
    [sys.executable, "-c", _KILLED_SAVE, str(directory)],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  leftovers = sorted(os.listdir(directory))
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.orbax-checkpoint-tmp") for name in leftovers), leftovers
  abstract = {
    "w": jax.ShapeDtypeStruct(
      (4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
  }
  with checkpoint.Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() == 1
    restored, _ = ckpt.restore(None, abstract)
    np.testing.assert_array_equal(restored["w"], [1.0] * 4)
    # The half-written step can be written again, and then is the latest.
    assert ckpt.save(2, {"w": jnp.full((4,), 2.0)})
    ckpt.wait()
    assert ckpt.latest_step() == 2
  assert not any("tmp" in name for name in os.listdir(directory))


def test_temporary_directory_is_ignored(tmp_path):
  # The state orbax leaves when a process dies mid-write: a `<step>.orbax-checkpoint-tmp` dir.
  directory = tmp_path / "ckpt"
  abstract = _sharded_abstract(P(), P())
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(3, _make_state(abstract))
  partial = directory / "9.orbax-checkpoint-tmp"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "garbage").write_text("half")
  with checkpoint.Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() == 3 and ckpt.all_steps() == [3]
    restored, _ = ckpt.restore(None, abstract)
  assert int(restored.step) == 0


def test_sigterm_sets_the_flag_instead_of_exiting():
  flag = process.install_sigterm_flag()
  try:
    assert not flag.requested
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while not flag.requested and time.monotonic() < deadline:
      time.sleep(0.01)
    assert flag.requested
    assert flag.requested_anywhere()
  finally:
    flag.uninstall()
  assert signal.getsignal(signal.SIGTERM) is not flag._handle


# ----------------------------------------------------------------------------- corruption


_weights = functools.partial(weights, size=32768)  # _weights(seed): a 128 KiB weight chunk
_weights_abstract = functools.partial(weights_abstract, 32768)


def _flip_bytes_of_largest_file(step_dir, count: int = 4096) -> None:
  """Inverts `count` bytes in the middle of the largest file under `step_dir` (the weight chunk)."""
  paths = [p for p in step_dir.rglob("*") if p.is_file()]
  largest = max(paths, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  middle = len(data) // 2
  data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
  largest.write_bytes(bytes(data))


def _two_checkpoints(directory) -> None:
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, _weights(1.0))
    ckpt.save(2, _weights(2.0))


def test_flipped_bytes_in_a_weight_chunk_are_detected(tmp_path):
  directory = tmp_path / "ckpt"
  _two_checkpoints(directory)
  _flip_bytes_of_largest_file(directory / "2" / "state")
  with (
    checkpoint.Checkpointer(directory) as ckpt,
    pytest.raises(checkpoint.CorruptCheckpointError, match="checkpoint 2"),
  ):
    ckpt.restore(2, _weights_abstract())


@pytest.mark.parametrize("damage", ["flip", "truncate_metadata"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, damage):
  directory = tmp_path / "ckpt"
  _two_checkpoints(directory)
  if damage == "flip":
    _flip_bytes_of_largest_file(directory / "2" / "state")
  else:  # every metadata file of the state item cut in half: orbax raises a long traceback
    for path in (directory / "2" / "state").rglob("*"):
      if path.is_file() and path.stat().st_size < 4096:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with checkpoint.Checkpointer(directory) as ckpt:
    step, state, _ = ckpt.restore_latest(_weights_abstract())
    assert step == 1 and int(state["step"]) == 1
    np.testing.assert_array_equal(state["w"], np.arange(32768, dtype=np.float32) + 1.0)
    # The corrupt step is moved aside (not deleted: a transient read error must not destroy
    # it), so the run's next save of step 2 is not skipped as existing.
    assert ckpt.all_steps() == [1]
    ckpt.save(2, _weights(2.0))
  aside = tmp_path / "ckpt.unusable" / "2"
  assert sorted(p.name for p in aside.iterdir()) == sorted(
    p.name for p in (directory / "2").iterdir()
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "checkpoint 2" in err[0] and "step 1" in err[0], err
  assert f"moved to {aside.parent};" in err[0]


def test_a_restore_attempt_collects_the_garbage_it_made_not_the_processes(tmp_path):
  # A failed attempt's abandoned reads are collected while their reports are silenced. A full
  # collection traversed every object of the process (a trainer's or a test's: millions, about 1 s)
  # for each attempt; the objects older than the attempt are left out of it.
  directory = tmp_path / "ckpt"
  _two_checkpoints(directory)
  _flip_bytes_of_largest_file(directory / "2" / "state")
  freed = []

  class Old:  # garbage made before the restore: a cycle that only a collection frees
    def __del__(self):
      freed.append(True)

  gc.disable()  # no automatic collection in between: only the restore's own
  try:
    old = Old()
    old.cycle = old
    del old
    with checkpoint.Checkpointer(directory) as ckpt:
      assert ckpt.restore_latest(_weights_abstract())[0] == 1  # checkpoint 2 failed
    assert not freed and gc.get_freeze_count() == 0
    gc.collect()
    assert freed
  finally:
    gc.enable()


def test_before_write_is_called_once_a_save_is_due_before_anything_is_written(tmp_path):
  # The trainer syncs metrics.jsonl with it: no checkpoint commits ahead of its metrics.
  calls = []
  with checkpoint.Checkpointer(tmp_path / "ckpt", every_steps=2) as ckpt:

    def before_write():
      calls.append((ckpt.all_steps(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())))

    assert not ckpt.save(1, _weights(1.0), before_write=before_write)  # not due: not called
    assert ckpt.save(2, _weights(2.0), before_write=before_write)
    assert not ckpt.save(2, _weights(2.0), force=True, before_write=before_write)  # saved
  assert calls == [([], [])]


def test_no_checkpoint_that_restores_is_one_clear_error(tmp_path):
  directory = tmp_path / "ckpt"
  _two_checkpoints(directory)
  for step in ("1", "2"):
    _flip_bytes_of_largest_file(directory / step / "state")
  with (
    checkpoint.Checkpointer(directory) as ckpt,
    pytest.raises(checkpoint.CorruptCheckpointError, match="no checkpoint .* restores"),
  ):
    ckpt.restore_latest(_weights_abstract())


@flax.struct.dataclass
class _ParamsState:
  params: dict
  step: jax.Array


def test_restore_params_verifies_the_params_it_reads(tmp_path):
  directory = tmp_path / "ckpt"
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, _ParamsState(params=_weights(1.0), step=jnp.int32(1)))
  abstract = _weights_abstract()
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    np.testing.assert_array_equal(ckpt.restore_params(1, abstract)["w"], _weights(1.0)["w"])
  _flip_bytes_of_largest_file(directory / "1" / "state")
  with (
    checkpoint.Checkpointer(directory, read_only=True) as ckpt,
    pytest.raises(checkpoint.CorruptCheckpointError, match=r"checkpoint 1 .*state.params\['w'\]"),
  ):
    ckpt.restore_params(1, abstract)


def _refusal(read) -> str:
  with pytest.raises(checkpoint.FormatError) as error:
    read()
  message = str(error.value)
  assert "\n" not in message, message
  return message


def test_a_checkpoint_of_another_format_is_refused_with_what_to_do(tmp_path, monkeypatch):
  directory = tmp_path / "ckpt"
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, _ParamsState(params=_weights(1.0), step=jnp.int32(1)), config={"seed": 0})
  shutil.rmtree(directory / "1" / "meta")  # no format number: an ebpo-jax before them wrote it
  params = _weights_abstract()
  state = _ParamsState(params=params, step=jax.ShapeDtypeStruct((), jnp.int32))
  with checkpoint.Checkpointer(directory) as ckpt:
    for read in (
      lambda: ckpt.restore_latest(state),
      lambda: ckpt.restore(1, state),
      lambda: ckpt.restore_params(1, params),
      lambda: ckpt.saved_config(1),
    ):
      message = _refusal(read)
      assert f"checkpoint 1 in {directory}: written by an older ebpo-jax" in message
      assert f"(checkpoint format absent, this one reads {checkpoint.FORMAT})" in message
      assert "start a fresh workdir" in message
    assert ckpt.all_steps() == [1]  # refused, not moved aside as unusable
  monkeypatch.setattr(checkpoint, "FORMAT", checkpoint.FORMAT - 1)
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(2, _ParamsState(params=_weights(2.0), step=jnp.int32(2)))
  monkeypatch.undo()
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    message = _refusal(lambda: ckpt.restore(2, state))
  assert f"(checkpoint format {checkpoint.FORMAT - 1}, this one reads {checkpoint.FORMAT})" in (
    message
  )
