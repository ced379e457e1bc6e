"""The workdir under two trainer processes: the second one stops on the lock, a changed config
stops a run, deleted checkpoints stop it, workdir.fresh starts over, workdir.resume_step goes
back to a retained checkpoint."""

import shutil
import time

from ebpo_jax import metrics as metrics_lib
from ebpo_jax.trainer import workdir as workdir_lib
from tests.helpers.processes import run_trainer
from tests.helpers.runs import logged_steps

# ----------------------------------------------------------------------------- the trainer


def test_two_trainers_a_changed_config_and_a_restart_with_nothing_to_restore(tmp_path):
  # num_steps=0: the warm start, the step-0 evaluation and checkpoint (the lock is held meanwhile).
  first = run_trainer(tmp_path, "--config.train.num_steps=0", wait=False)
  try:
    lock_path = tmp_path / workdir_lib.LOCK_FILE
    deadline = time.monotonic() + 120
    while not (lock_path.exists() and f'"pid": {first.pid}' in lock_path.read_text()):
      assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
      time.sleep(0.2)
    second = run_trainer(tmp_path, "--config.train.num_steps=0", timeout=60)
    assert second.returncode != 0
    errors = second.stderr.strip().splitlines()
    assert len(errors) == 1 and f"pid {first.pid}" in errors[0], second.stderr[-2000:]
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
  finally:
    first.kill()
  assert logged_steps(tmp_path) == [0]  # written once: the second run wrote nothing
  changed = run_trainer(tmp_path, "--config.train.num_steps=0", "--config.rl.group_size=2")
  assert changed.returncode != 0
  assert changed.stderr.strip().splitlines() == [
    f"error: {tmp_path}/config.json: the run used another config: rl.group_size (4 -> 2); "
    "resume with the same values, use another --workdir, or accept the change with "
    "--config.workdir.accept_changes=rl.group_size"
  ]
  # Checkpoints deleted under the run's metrics: one line and exit 2, not a silent fresh start.
  shutil.rmtree(tmp_path / "checkpoints")
  lost = run_trainer(tmp_path, "--config.train.num_steps=0")
  assert lost.returncode == 2
  assert lost.stderr.strip().splitlines() == [
    f"error: {tmp_path} holds a run (metrics.jsonl up to step 0) but no checkpoint in "
    f"{tmp_path}/checkpoints to resume from: put its checkpoints back, or start over with "
    f"--config.workdir.fresh=True (the old run moves to {tmp_path}/previous.<n>/)"
  ]
  # workdir.fresh: the old run moves to previous.1/, the new one starts (another config too).
  again = run_trainer(
    tmp_path,
    "--config.train.num_steps=0",
    "--config.rl.group_size=2",
    "--config.workdir.fresh=True",
  )
  assert again.returncode == 0, again.stderr[-3000:]
  assert logged_steps(tmp_path) == [0] and logged_steps(tmp_path / "previous.1") == [0]
  assert (tmp_path / "checkpoints" / "0").is_dir()


def _untimed(workdir) -> list[dict]:
  """The run's metrics lines without their wall-clock timings."""
  timings = metrics_lib.TIMING_KEYS
  return [
    {k: v for k, v in m.items() if k not in timings} for m in metrics_lib.read_metrics(workdir)
  ]


def test_resume_step_goes_back_to_a_retained_checkpoint(arith_run, tmp_path):
  # arith_run's workdir (checkpoints every 2 steps, 2 kept: 2 and 4), sent back to checkpoint 2
  # with checkpoints by the clock only (every_steps=0, every_minutes: far less than a step), so
  # one at every step, 3 kept: steps 3 and 4 again, their metrics equal the straight run's,
  # checkpoint 4 moved aside, 3 (the clock's) and 4 written anew beside the retained 2.
  reference, _ = arith_run  # on 8 devices, as this run
  shutil.copytree(reference, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"))
  checkpoints = tmp_path / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4]
  args = (
    "--config.train.num_steps=4",
    "--config.checkpoint.max_to_keep=3",
    "--config.checkpoint.every_steps=0",
    "--config.checkpoint.every_minutes=0.000001",
  )
  again = run_trainer(tmp_path, *args, "--config.workdir.resume_step=2", devices=8)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"later checkpoints 4 moved to {tmp_path}/checkpoints.dropped" in again.stderr
  assert _untimed(tmp_path) == _untimed(reference)
  assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 3, 4]
  assert sorted(p.name for p in (tmp_path / "checkpoints.dropped").iterdir()) == ["4"]
