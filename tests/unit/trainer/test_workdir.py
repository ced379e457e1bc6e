"""The workdir of a run (ebpo_jax.trainer.workdir): its lock, local and on a bucket; its
config.json, compared on resume; metrics.jsonl cut back to what a restart restores; an ablation
reruns a variant whose config changed. In process (two trainer processes: e2e/test_workdir.py)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from ebpo_jax import ablate, files
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.trainer import workdir as workdir_lib
from tests.helpers import ROOT
from tests.helpers.configs import arith_config
from tests.helpers.runs import logged_steps

# ----------------------------------------------------------------------------- the lock


def one_line(error: pytest.ExceptionInfo) -> str:
  message = str(error.value)
  assert "\n" not in message, message
  return message


@pytest.mark.parametrize("remote", [False, True], ids=["local", "gcs"])
def test_a_second_lock_fails_at_once_naming_the_holder(tmp_path, request, remote):
  workdir = request.getfixturevalue("gcs_dir") if remote else str(tmp_path / "w")
  first = workdir_lib.lock(workdir)
  start = time.monotonic()
  with pytest.raises(workdir_lib.WorkdirError) as error:
    workdir_lib.lock(workdir)
  assert time.monotonic() - start < 10
  message = one_line(error)
  assert f"{workdir} is in use by" in message
  assert f"host {socket.gethostname()} pid {os.getpid()}" in message
  first.release()
  workdir_lib.lock(workdir).release()  # free again once released
  if remote:
    assert not files.exists(files.join(workdir, workdir_lib.LOCK_FILE))


@pytest.mark.parametrize("remote", [False, True], ids=["local", "gcs"])
def test_write_new_creates_only_once(tmp_path, request, remote):
  folder = request.getfixturevalue("gcs_dir") if remote else str(tmp_path)
  path = files.join(folder, "once")
  assert files.write_new(path, "first") and not files.write_new(path, "second")
  assert files.read_text(path) == "first"
  files.remove(path)
  files.remove(path)  # gone already: nothing to do
  assert not files.exists(path)


def test_a_local_lock_dies_with_its_process(tmp_path):
  # flock: the OS releases the lock of a killed process; nothing stale is left to break.
  workdir = str(tmp_path / "w")
  code = "import sys,time; from ebpo_jax.trainer import workdir as w; w.lock(sys.argv[1]);"
  holder = subprocess.Popen(
    [sys.executable, "-c", code + "print('locked', flush=True); time.sleep(60)", workdir],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lib.WorkdirError, match=f"pid {holder.pid}"):
      workdir_lib.lock(workdir)
  finally:
    holder.kill()
    holder.wait()
  workdir_lib.lock(workdir).release()


def test_a_stale_lock_on_a_bucket_says_how_to_break_it(gcs_dir):
  lock_path = files.join(gcs_dir, workdir_lib.LOCK_FILE)
  # A run on another machine that was killed (kill -9, preemption) left its lock object.
  stale = {"host": "tpu-worker-0", "pid": 4242, "started": "2026-11-30T01:02:03Z", "token": "x"}
  files.write_atomic(lock_path, json.dumps(stale))
  with pytest.raises(workdir_lib.WorkdirError) as error:
    workdir_lib.lock(gcs_dir)
  message = one_line(error)
  assert "host tpu-worker-0 pid 4242 since 2026-11-30T01:02:03Z" in message
  assert f"delete {lock_path}" in message and "--config.workdir.break_lock=True" in message
  mine = workdir_lib.lock(gcs_dir, break_lock=True)
  assert json.loads(files.read_text(lock_path))["pid"] == os.getpid()
  mine.release()
  assert not files.exists(lock_path)


def test_a_lock_of_a_dead_process_on_this_host_is_broken(gcs_dir):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  lock_path = files.join(gcs_dir, workdir_lib.LOCK_FILE)
  stale = {"host": socket.gethostname(), "pid": dead.pid, "started": "then", "token": "x"}
  files.write_atomic(lock_path, json.dumps(stale))
  taken = workdir_lib.lock(gcs_dir)  # no WorkdirError: the holder's pid is gone on this host
  held = json.loads(files.read_text(lock_path))
  assert held["pid"] == os.getpid() and held["token"] != stale["token"]
  taken.release()
  assert not files.exists(lock_path)


# ----------------------------------------------------------------------------- config.json


def test_config_json_is_written_then_a_changed_key_stops_the_resume(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.check_and_save_config(workdir, arith_config())
  saved = json.loads((tmp_path / workdir_lib.CONFIG_FILE).read_text())
  assert saved["rl"]["group_size"] == 4 and saved["seed"] == 0
  changed = arith_config({"rl.group_size": 2, "seed": 1, "train.batch_size": 16})
  with pytest.raises(workdir_lib.WorkdirError) as error:
    workdir_lib.check_and_save_config(workdir, changed)
  message = one_line(error)
  assert "rl.group_size (4 -> 2), seed (0 -> 1), train.batch_size (8 -> 16)" in message
  assert "--config.workdir.accept_changes=rl.group_size,seed,train.batch_size" in message
  assert json.loads((tmp_path / workdir_lib.CONFIG_FILE).read_text()) == saved


def test_safe_keys_and_accepted_changes_resume(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.check_and_save_config(workdir, arith_config())
  cadence = {"train.num_steps": 9, "eval.every_steps": 3, "checkpoint.every_steps": 3}
  layout = {"train.log_every": 2, "mesh.fsdp": 1, "mesh.data": 8}
  workdir_lib.check_and_save_config(workdir, arith_config({**cadence, **layout}))
  assert json.loads((tmp_path / workdir_lib.CONFIG_FILE).read_text())["train"]["num_steps"] == 9
  with pytest.raises(workdir_lib.WorkdirError, match=r"seed \(0 -> 3\)"):
    workdir_lib.check_and_save_config(workdir, arith_config({"seed": 3}))
  with pytest.raises(workdir_lib.WorkdirError, match=r"^config\.workdir\.accept_changes"):
    workdir_lib.check_and_save_config(
      workdir, arith_config({"seed": 3, "workdir.accept_changes": "sed"})
    )
  workdir_lib.check_and_save_config(
    workdir, arith_config({"seed": 3, "workdir.accept_changes": "seed"})
  )
  workdir_lib.check_and_save_config(workdir, arith_config({"workdir.accept_changes": "all"}))
  assert json.loads((tmp_path / workdir_lib.CONFIG_FILE).read_text())["seed"] == 0


def test_logging_keys_may_change(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.check_and_save_config(workdir, arith_config())
  path = tmp_path / workdir_lib.CONFIG_FILE
  on = {"logging.wandb": True, "logging.wandb_project": "p", "logging.samples_every": 0}
  workdir_lib.check_and_save_config(workdir, arith_config(on))
  workdir_lib.check_and_save_config(workdir, arith_config({"logging.num_samples": 2}))
  assert json.loads(path.read_text())["logging"]["num_samples"] == 2


def test_a_workdir_of_another_format_is_refused_with_what_to_do(tmp_path):
  workdir = str(tmp_path)
  workdir_lib.check_and_save_config(workdir, arith_config())
  format_file = tmp_path / workdir_lib.FORMAT_FILE
  assert json.loads(format_file.read_text()) == {"format": workdir_lib.FORMAT}
  format_file.unlink()  # config.json alone: the workdir of an ebpo-jax before format numbers
  with pytest.raises(workdir_lib.WorkdirError) as error:
    workdir_lib.check_and_save_config(workdir, arith_config())
  message = one_line(error)
  assert f"{workdir}: written by an older ebpo-jax (workdir format absent" in message
  assert "start a fresh workdir" in message
  format_file.write_text(json.dumps({"format": workdir_lib.FORMAT - 1}))
  with pytest.raises(workdir_lib.WorkdirError, match=f"workdir format {workdir_lib.FORMAT - 1}, "):
    workdir_lib.saved_config(workdir)
  assert json.loads(format_file.read_text()) == {"format": workdir_lib.FORMAT - 1}


def test_config_check_on_a_bucket(gcs_dir):
  workdir_lib.check_and_save_config(gcs_dir, arith_config())
  with pytest.raises(workdir_lib.WorkdirError, match=r"rl\.advantage \('ebpo' -> 'grpo'\)"):
    workdir_lib.check_and_save_config(gcs_dir, arith_config({"rl.advantage": "grpo"}))


def test_a_fresh_start_empties_metrics_and_a_resume_cuts_them(tmp_path):
  # A kill between the step-0 evaluation line and checkpoint 0: nothing to restore on restart.
  with metrics_lib.MetricsWriter(tmp_path, resume_step=metrics_lib.FRESH_START) as writer:
    writer.write(0, {"eval/accuracy": 0.5})
  with metrics_lib.MetricsWriter(tmp_path, resume_step=metrics_lib.FRESH_START) as writer:
    writer.write(0, {"eval/accuracy": 0.5})
    writer.write(1, {"loss": 1.0})
  assert logged_steps(tmp_path) == [0, 1]
  with metrics_lib.MetricsWriter(tmp_path, resume_step=0) as writer:
    writer.write(1, {"loss": 1.0})
  assert logged_steps(tmp_path) == [0, 1]


# ----------------------------------------------------------------------------- ablations


def test_an_ablation_reruns_a_variant_whose_config_changed(tmp_path, monkeypatch):
  trained = []

  def fake_train(config, workdir, args, env):
    del env
    assert not files.exists(files.join(workdir, "stale")), "a changed run starts afresh"
    trained.append(os.path.basename(workdir))
    files.write_atomic(files.join(workdir, "stale"), "")
    workdir_lib.save_config(workdir, workdir_lib.resolved_config(config, args))
    files.makedirs(files.join(workdir, workdir_lib.CHECKPOINTS_DIR))  # as a run leaves it

  monkeypatch.setattr(ablate, "_train", fake_train)
  monkeypatch.setattr(ablate, "summarize_run", lambda run_dir, run: {"name": run.name})
  config = f"{ROOT}/configs/arith_ebpo.py:runlocal"
  run = ablate.Run("grpo", 4, 0)
  args = ["--config.train.num_steps=2"]
  ablate._run_one(config, str(tmp_path), run, args, {}, {0: ablate.threading.Lock()})
  assert trained == ["s0", run.name]
  ablate._run_one(config, str(tmp_path), run, args, {}, {0: ablate.threading.Lock()})
  assert trained == ["s0", run.name]  # unchanged: the result is reused
  args = ["--config.train.num_steps=3"]  # the variant's config changed, not the warm start's
  ablate._run_one(config, str(tmp_path), run, args, {}, {0: ablate.threading.Lock()})
  assert trained == ["s0", run.name, run.name]
  # Only the warm start's config changed (a variant runs with sft.num_steps=0): both rerun.
  args.append("--config.sft.num_steps=7")
  ablate._run_one(config, str(tmp_path), run, args, {}, {0: ablate.threading.Lock()})
  assert trained == ["s0", run.name, run.name, "s0", run.name]


def test_a_config_saved_before_a_key_existed_compares_as_its_default():
  # A committed workdir (results/ablation_smollm2_cpu/runs/*) was saved before rl.max_staleness
  # and env.tool_latency_s: it resumes under today's defaults, and a changed value is a change.
  saved = {"rl": {"group_size": 4}, "env": {}}
  new = {"rl": {"group_size": 4, "max_staleness": 0}, "env": {"tool_latency_s": 0.0}}
  assert workdir_lib.changed_keys(saved, new) == {}
  new["rl"]["max_staleness"] = 1
  assert workdir_lib.changed_keys(saved, new) == {"rl.max_staleness": (0, 1)}
