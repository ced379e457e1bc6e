"""What a start on a workdir that holds a run does (ebpo_jax.trainer.workdir.claim, in process):
the checkpoint's own config compared when config.json is gone; checkpoints gone under a run's
metrics stop the start; workdir.fresh moves the old run aside; workdir.resume_step names a
retained checkpoint."""

import json
import shutil

import pytest

from ebpo_jax import files
from ebpo_jax.trainer import workdir as workdir_lib
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.configs import arith_config


def _claim(workdir, overrides=None) -> None:
  with workdir_lib.claim(str(workdir), arith_config(overrides)):
    pass


def _refusal(workdir, overrides=None) -> str:
  with pytest.raises(workdir_lib.WorkdirError) as error:
    _claim(workdir, overrides)
  message = str(error.value)
  assert "\n" not in message, message
  return message


def _metrics(workdir, steps) -> None:
  lines = [json.dumps({"step": step, "loss": 1.0}) for step in steps]
  (workdir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
  """A workdir holding checkpoints 0 and 2 of arith_config() and nothing else."""
  workdir = tmp_path_factory.mktemp("checkpointed")
  for step in (0, 2):
    save_checkpoint(workdir, arith_config(), step=step)
  return workdir


@pytest.fixture
def workdir(checkpointed, tmp_path):
  """This test's own copy of the `checkpointed` workdir (tmp_path/w), to start on."""
  return shutil.copytree(checkpointed, tmp_path / "w")


def test_without_config_json_the_checkpoints_config_is_compared(workdir):
  message = _refusal(workdir, {"rl.group_size": 2})
  assert message == (
    f"{workdir}/checkpoints/2: the run used another config: rl.group_size (4 -> 2); resume "
    "with the same values, use another --workdir, or accept the change with "
    "--config.workdir.accept_changes=rl.group_size"
  )
  assert not (workdir / workdir_lib.CONFIG_FILE).exists()
  _claim(workdir, {"train.num_steps": 9})  # a safe key: resumes, and config.json is written
  assert json.loads((workdir / workdir_lib.CONFIG_FILE).read_text())["train"]["num_steps"] == 9


def test_checkpoints_gone_under_a_runs_metrics_stop_the_start(tmp_path):
  workdir = tmp_path / "w"
  _claim(workdir)
  _metrics(workdir, [0, 2, 4])
  message = _refusal(workdir)
  assert f"{workdir} holds a run (metrics.jsonl up to step 4) but no checkpoint" in message
  assert "--config.workdir.fresh=True" in message
  (workdir / "checkpoints").mkdir()  # emptied: the same
  assert "no checkpoint" in _refusal(workdir)
  # A run killed between its step-0 metrics line and checkpoint 0 (checkpoints/ made, empty):
  # nothing was lost, the start begins afresh.
  _metrics(workdir, [0])
  _claim(workdir)
  (workdir / "checkpoints").rmdir()  # its folder gone too: someone deleted it
  assert "no checkpoint" in _refusal(workdir)


def test_fresh_moves_the_old_run_aside(workdir):
  _claim(workdir)
  _metrics(workdir, [0, 2])
  before = sorted(p.name for p in workdir.iterdir() if p.name != workdir_lib.LOCK_FILE)
  _claim(workdir, {"workdir.fresh": True, "rl.group_size": 2})  # another config: a new run
  previous = workdir / "previous.1"
  assert sorted(p.name for p in previous.iterdir()) == before
  assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["0", "2"]
  kept = {p.name for p in workdir.iterdir()}
  assert kept == {"previous.1", workdir_lib.LOCK_FILE, workdir_lib.CONFIG_FILE, "format.json"}
  assert json.loads((workdir / workdir_lib.CONFIG_FILE).read_text())["rl"]["group_size"] == 2
  _claim(workdir, {"workdir.fresh": True})  # again: the next number, previous.1 untouched
  assert (workdir / "previous.2" / workdir_lib.CONFIG_FILE).exists()
  assert sorted(p.name for p in previous.iterdir()) == before


def test_resume_step_names_a_retained_checkpoint(workdir):
  message = _refusal(workdir, {"workdir.resume_step": 1})
  assert message == (
    f"config.workdir.resume_step=1: no checkpoint of step 1 in {workdir}/checkpoints "
    "(retained: 0, 2)"
  )
  assert "workdir.fresh" in _refusal(workdir, {"workdir.resume_step": 0, "workdir.fresh": True})
  assert ">= -1" in _refusal(workdir, {"workdir.resume_step": -2})
  _claim(workdir, {"workdir.resume_step": 0})


def test_fresh_on_a_bucket(gcs_dir):
  for name in (workdir_lib.CONFIG_FILE, "metrics.jsonl", "checkpoints/0/state/x", "lock"):
    files.write_atomic(files.join(gcs_dir, name), name)
  previous = workdir_lib.move_run_aside(gcs_dir)
  assert previous == files.join(gcs_dir, "previous.1")
  assert files.listdir(gcs_dir) == ["lock", "previous.1"]
  assert files.walk_files(previous) == ["checkpoints/0/state/x", "config.json", "metrics.jsonl"]
  assert files.read_text(files.join(previous, "metrics.jsonl")) == "metrics.jsonl"
  assert workdir_lib.move_run_aside(gcs_dir) is None  # nothing left to move
