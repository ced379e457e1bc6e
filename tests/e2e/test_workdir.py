"""The workdir under two trainer processes: the second one stops on the lock, a changed config
stops a run, a restart with nothing to restore starts afresh."""

import shutil
import time

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
  # Nothing to restore (checkpoints deleted, or a kill before checkpoint 0): a fresh start, and
  # metrics.jsonl holds its lines only.
  shutil.rmtree(tmp_path / "checkpoints")
  again = run_trainer(tmp_path, "--config.train.num_steps=0")
  assert again.returncode == 0, again.stderr[-3000:]
  assert logged_steps(tmp_path) == [0]
