"""A checkpoint is restored only as saved: its checksums must be there and verify, for the state's
arrays, the data iterator's position and the saved config; one that does not is moved to
`<directory>.unusable/` and the one before restores (ebpo_jax.checkpoint)."""

import functools
import json
import shutil

import grain
import numpy as np
import pytest

from ebpo_jax import checkpoint, data
from tests.helpers.checkpoints import weights, weights_abstract

_CONFIG = {"seed": 0, "rl": {"group_size": 4}}
_state = functools.partial(weights, size=64)  # _state(seed): 64 weights and the step
_abstract = functools.partial(weights_abstract, 64)


def _batches():
  """The trainer's own iterator (a grain DatasetIterator over row indices)."""
  return data.make_batches([{"cluster": 0}] * 10, batch_size=2, order="shuffle", seed=0)


def _two_checkpoints(directory) -> list:
  """Checkpoints 1 and 2, each with the iterator advanced once more; the batches that follow
  checkpoint 1."""
  batches = _batches()
  with checkpoint.Checkpointer(directory) as ckpt:
    next(batches)
    ckpt.save(1, _state(1.0), data_iter=batches, config=_CONFIG)
    ckpt.wait()
    after_1 = [np.asarray(next(batches)) for _ in range(3)]
    ckpt.save(2, _state(2.0), data_iter=batches, config=_CONFIG)
  return after_1


def _edit_json(path, edit) -> None:
  path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _damage(step_dir, kind: str) -> None:
  if kind == "checksums gone":
    shutil.rmtree(step_dir / "checksums")
  elif kind == "checksums file gone":
    (step_dir / "checksums" / "metadata").unlink()
  elif kind == "iterator moved":  # valid JSON, another position: batches would repeat or skip
    (path,) = (step_dir / "data_iter").glob("process_*.json")
    _edit_json(path, lambda state: {**state, "next_index": state["next_index"] + 3})
  elif kind == "config changed":  # valid JSON, another experiment
    _edit_json(step_dir / "config" / "metadata", lambda c: {**c, "rl": {"group_size": 2}})


DAMAGES = {
  "checksums gone": "has no checksums",
  "checksums file gone": "has no checksums",
  "iterator moved": "the checksum of the data iterator state differs",
  "config changed": "the checksum of the config differs",
}


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_a_checkpoint_that_does_not_verify_is_moved_aside(tmp_path, capsys, kind):
  directory = tmp_path / "ckpt"
  after_1 = _two_checkpoints(directory)
  _damage(directory / "2", kind)
  resumed = _batches()
  with checkpoint.Checkpointer(directory) as ckpt:
    step, state, config = ckpt.restore_latest(_abstract(), data_iter=resumed)
    assert step == 1 and int(state["step"]) == 1 and config == _CONFIG
    assert ckpt.all_steps() == [1]
  for want in after_1:  # the iterator at checkpoint 1's position
    np.testing.assert_array_equal(next(resumed), want)
  assert (tmp_path / "ckpt.unusable" / "2").is_dir()
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert f"checkpoint 2 (CorruptCheckpointError: checkpoint 2 in {directory} " in err[0]
  assert DAMAGES[kind] in err[0] and "resuming from step 1" in err[0]


@pytest.mark.parametrize("kind", ["checksums gone", "config changed"])
def test_a_checkpoint_alone_that_does_not_verify_is_never_read(tmp_path, kind):
  directory = tmp_path / "ckpt"
  _two_checkpoints(directory)
  _damage(directory / "2", kind)
  with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
    with pytest.raises(checkpoint.CorruptCheckpointError, match=DAMAGES[kind]):
      ckpt.restore(2, _abstract())
    with pytest.raises(checkpoint.CorruptCheckpointError, match=DAMAGES[kind]):
      ckpt.saved_config(2)
    if kind == "checksums gone":
      with pytest.raises(checkpoint.CorruptCheckpointError, match=DAMAGES[kind]):
        ckpt.restore_params(2, _abstract()["w"])
    assert ckpt.saved_config(1) == _CONFIG


def test_an_iterator_state_of_bytes_is_covered_too(tmp_path):
  # grain's DataLoader iterators hand their state over as bytes, not as a dict.
  loader = grain.DataLoader(
    data_source=list(range(20)),
    sampler=grain.samplers.IndexSampler(20, shuffle=True, seed=0, num_epochs=1),
    worker_count=0,
  )
  batches = iter(loader)
  next(batches)
  directory = tmp_path / "ckpt"
  with checkpoint.Checkpointer(directory) as ckpt:
    ckpt.save(1, _state(1.0), data_iter=batches)
  (path,) = (directory / "1" / "data_iter").glob("process_*.json")
  _edit_json(path, lambda state: {**state, "last_seen_indices": {"0": 5}})
  with (
    checkpoint.Checkpointer(directory, read_only=True) as ckpt,
    pytest.raises(checkpoint.CorruptCheckpointError, match="data iterator"),
  ):
    ckpt.restore(1, _abstract(), data_iter=iter(loader))


def test_restore_and_drop_later_moves_the_later_checkpoints_aside(tmp_path, capsys):
  directory = tmp_path / "ckpt"
  after_1 = _two_checkpoints(directory)
  resumed = _batches()
  with checkpoint.Checkpointer(directory) as ckpt:
    state, config = ckpt.restore_and_drop_later(1, _abstract(), data_iter=resumed)
    assert int(state["step"]) == 1 and config == _CONFIG and ckpt.all_steps() == [1]
    assert ckpt.save(2, _state(5.0), force=True)  # the run's new step 2, not skipped as existing
  for want in after_1:
    np.testing.assert_array_equal(next(resumed), want)
  assert (tmp_path / "ckpt.dropped" / "2" / "state").is_dir()
  assert capsys.readouterr().err.strip() == (
    f"resuming from checkpoint 1: later checkpoints 2 moved to {directory}.dropped"
  )
