"""The trainer end to end on the tiny arithmetic config (as a process: nothing imports
ebpo_jax.train): CLI, metrics, resume (also under LoRA), SIGTERM, 1 device == 8, unverifiable
checkpoints, the non-finite policy. Bad config values and rows files: e2e/test_input_checks.py."""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from ebpo_jax import checkpoint
from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.checkpoints import restore_run_state
from tests.helpers.configs import arith_config
from tests.helpers.processes import run_module, run_trainer
from tests.helpers.runs import ARITH_LOGGING, LORA_RUN, logged_steps

REQUIRED_KEYS = {
  "step",
  "reward/mean",
  "adv/zero_frac",
  "ebpo/shrinkage_mean",
  "entropy",
  "kl",
  "loss",
  "grad_norm",
  "clipfrac",
  "response_len/mean",
  "reward/errors",
  "mismatch/kl",
  "mismatch/max_abs",
  "mismatch/ratio_out_frac",
}


def read(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(lines: list[dict]) -> list[dict]:
  """Metrics without wall-clock timings, which differ between runs by nature."""
  return [{k: v for k, v in m.items() if k not in metrics_lib.TIMING_KEYS} for m in lines]


def test_cli_run_writes_metrics_checkpoints_and_summary(arith_run):
  workdir, result = arith_run
  lines = read(workdir)
  train_lines = [m for m in lines if "reward/mean" in m]
  assert [m["step"] for m in train_lines] == [1, 2, 3, 4]
  assert set(train_lines[0]) >= REQUIRED_KEYS, REQUIRED_KEYS - set(train_lines[0])
  assert {"reward/mean/add_1", "reward/mean/add_2"} & set(train_lines[0])  # per cluster
  # env/time_s: multi-turn runs only; async/*: rl.max_staleness > 0 only
  unlogged = {metrics_lib.ENV_TIME_S, *metrics_lib.ASYNC_TIMING_KEYS}
  assert set(metrics_lib.TIMING_KEYS) - unlogged <= set(train_lines[0])
  evals = [m for m in lines if "eval/accuracy" in m]
  assert [m["step"] for m in evals] == [0, 2, 4]
  assert any(k.startswith("eval/accuracy/") for k in evals[0])
  elapsed = [m[metrics_lib.TIME_ELAPSED_S] for m in evals]  # the x axis of accuracy vs wall time
  assert 0 < elapsed[0] < elapsed[1] < elapsed[2]
  assert 0.0 <= train_lines[0]["adv/zero_frac"] <= 1.0
  # float32 sampler and trainer on the CPU: their log-probs agree to rounding.
  assert all(m["mismatch/kl"] < 1e-5 and m["mismatch/max_abs"] < 1e-5 for m in train_lines)
  assert (workdir / "checkpoints").is_dir()
  assert "held-out accuracy" in result.stdout
  assert (workdir / "plots" / "overview.png").stat().st_size > 1000
  # One compile of the train step for the whole run: a retrace would show up here.
  assert train_lines[-1]["compiles/train_step"] == 1
  # The startup banner and the compile lines reach stderr (absl INFO); other libraries' INFO
  # lines (orbax logs every save) do not.
  said = re.findall(r"^I\d{4} [\d:.]+ +\d+ (\S+):\d+\] (.*)$", result.stderr, re.MULTILINE)
  ours = {p.name for p in (ROOT / "ebpo_jax").rglob("*.py")}
  assert {"banner.py", "loop.py"} <= {where for where, _ in said} <= ours, said
  lines = [line for _, line in said]
  for expected in [
    "devices: 8 cpu (cpu), 1 process(es)",
    "mesh: data=1 x fsdp=8 x tensor=1",
    f"workdir: {workdir}",
    "starting fresh",
    "compiling the train step (the first call; once per run) ...",
  ]:
    assert expected in lines, (expected, lines)
  assert any(re.fullmatch(r"parameters: [\d,]+ \(\d+\.\dM\)", line) for line in lines), lines
  config = next(line for line in lines if line.startswith("config: "))  # the file, as typed
  assert config.startswith("config: configs/arith_ebpo.py:runlocal --config.") and config.endswith(
    " --config.train.num_steps=4"
  ), config
  assert any(line.startswith("compiling the sampler for ") for line in lines), lines


def test_kill_9_and_sigterm_at_four_moments_then_resume_equals_a_straight_run(arith_run, tmp_path):
  # One workdir, stopped four times, each restart going further: SIGKILL after the step-0
  # evaluation line (no checkpoint yet: the warm start's own one is all there is), SIGKILL while
  # checkpoint 2 is being written, SIGTERM after the training line of step 3 (it saves checkpoint
  # 3, off the every-2-steps cadence, and exits 143). The last run finishes; its metrics equal the
  # uninterrupted run's, line for line, none twice.
  reference, _ = arith_run
  checkpoints = tmp_path / "checkpoints"

  def stopped_at(moment: str, status: int):
    args = ("--config=configs/arith_ebpo.py:runlocal", f"--workdir={tmp_path}")
    result = run_module(
      "tests/helpers/killed_trainer.py", moment, *args, "--config.train.num_steps=4", devices=8
    )
    assert result.returncode == status, result.stderr[-3000:]
    assert (status != 143) or "SIGTERM: the checkpoint of step 3 is the latest" in result.stderr
    return [(m["step"], "eval/accuracy" in m) for m in read(tmp_path) if m["step"] >= 0]

  assert stopped_at("eval:0", -signal.SIGKILL) == [(0, True)]
  assert not checkpoints.exists() or not checkpoint.Checkpointer(checkpoints).all_steps()
  assert stopped_at("save:2", -signal.SIGKILL) == [(0, True), (1, False), (2, True)]
  assert any(p.name.startswith("2.orbax-checkpoint-tmp") for p in checkpoints.iterdir())
  assert not (tmp_path / "warm_start").exists()  # once checkpoint 0 was written
  assert stopped_at("term:3", 143) == [(0, True), (1, False), (2, True), (3, False)]
  assert checkpoint.Checkpointer(checkpoints).all_steps()[-2:] == [2, 3]
  finished = run_trainer(tmp_path, "--config.train.num_steps=4", devices=8)
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert "] resuming from step 3\n" in finished.stderr  # the banner says so
  assert comparable(read(tmp_path)) == comparable(read(reference))


def test_a_lora_run_stopped_and_resumed_equals_a_straight_run(lora_run, tmp_path):
  # lora_run's LoRA run (a KL term to the base, adapter dropout) stopped by SIGTERM after the
  # training line of step 1 (it saves checkpoint 1, off the every-2-steps cadence, and exits 143),
  # then resumed to step 2 with the base rebuilt from the seed: its metrics equal the straight
  # run's, line for line, and its last checkpoint (adapters, their Adam moments, prior, rng) the
  # straight run's, bit for bit.
  reference, _ = lora_run
  overrides = [f"--config.{k}={v}" for k, v in LORA_RUN.items()]
  overrides.append("--config.train.num_steps=2")
  args = ("--config=configs/arith_ebpo.py:runlocal", f"--workdir={tmp_path}", *overrides)
  stopped = run_module("tests/helpers/killed_trainer.py", "term:1", *args)
  assert stopped.returncode == 143, stopped.stderr[-3000:]
  assert [m["step"] for m in read(tmp_path)] == [0, 1]
  finished = run_trainer(tmp_path, *overrides)
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert "] resuming from step 1\n" in finished.stderr
  assert comparable(read(tmp_path)) == comparable(read(reference))
  config = arith_config(LORA_RUN)
  ours, straight = restore_run_state(tmp_path, config, 2), restore_run_state(reference, config, 2)
  assert ours.base is None and ours.ref_params is None  # neither is in a checkpoint
  for name in ("step", "params", "opt_state", "prior", "rng", "bad_steps"):
    a, b = getattr(ours, name), getattr(straight, name)
    assert jax.tree.structure(a) == jax.tree.structure(b), name
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  # The checkpoint's arrays of rank >= 2 are the adapters (A and B of 7 projections) and their
  # two Adam moments: no base weight (kernel, embedding, norm) is saved.
  with checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True) as ckpt:
    saved = ckpt.saved_arrays(2)
  weights = [path for path, (shape, _) in saved.items() if len(shape) >= 2]
  assert len(weights) == 3 * 14, weights
  assert all(path.endswith(("['lora_a']", "['lora_b']")) for path in weights), weights
  assert not any("kernel" in path or "embed" in path or "norm" in path for path in saved)


def test_one_device_matches_eight(arith_run, tmp_path):
  reference, _ = arith_run  # on 8 devices
  result = run_trainer(tmp_path, "--config.train.num_steps=4", devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  ours, ref = comparable(read(tmp_path)), comparable(read(reference))
  assert [m["step"] for m in ours] == [m["step"] for m in ref]
  for a, b in zip(ours, ref, strict=True):
    assert a.keys() == b.keys()
    for key in a:
      if isinstance(a[key], float):
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), key


def test_a_workdir_whose_every_checkpoint_fails_to_verify_stops_with_one_line_and_status_2(
  arith_run, tmp_path
):
  # The session run's workdir with every checkpoint's checksums gone: none may be read unverified,
  # so none restores; the run stops with one line and the bad-input status 2 (it was 1).
  workdir = tmp_path / "run"
  shutil.copytree(arith_run[0], workdir, ignore=shutil.ignore_patterns("lock"))
  steps = checkpoint.Checkpointer(workdir / "checkpoints").all_steps()
  assert steps
  for step in steps:
    shutil.rmtree(workdir / "checkpoints" / str(step) / "checksums")
  result = run_trainer(workdir, "--config.train.num_steps=4", *ARITH_LOGGING, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: no checkpoint in") and "restores" in last, last


def test_non_finite_steps_in_a_row_abort_with_a_clear_message(tmp_path):
  # An infinite overlong penalty over the whole completion (buffer = max_new_tokens): every reward
  # is -inf, so every advantage, loss and update is non-finite and skipped (the params stay
  # finite). The run stops after max_bad_steps = 3 steps in a row with one line, keeping the last
  # good checkpoint: with a save due every step and only one kept, the bad steps 1 and 2 were
  # saved and rotated step 0 out; a skipped update is never checkpointed. No warm start: the
  # rewards are -inf whatever the model says.
  result = run_trainer(
    tmp_path,
    "--config.sft.num_steps=0",
    "--config.rl.overlong_buffer=4",
    "--config.rl.overlong_penalty=inf",
    "--config.train.num_steps=6",
    "--config.train.max_bad_steps=3",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.max_to_keep=1",
  )
  assert result.returncode != 0
  message = result.stderr.strip().splitlines()[-1]
  assert "non-finite loss or grad norm in 3 steps in a row" in message
  assert "train.max_bad_steps=3" in message
  assert checkpoint.Checkpointer(tmp_path / "checkpoints").all_steps() == [0]
  assert logged_steps(tmp_path) == [0, 1, 2, 3]  # the line of step 3, which stopped it, too


def _wait_for_warm_start_progress(proc, timeout: float = 240) -> str:
  """The trainer's stderr up to a warm-start progress bar showing >= 1 step done."""
  fd = proc.stderr.fileno()
  os.set_blocking(fd, False)
  seen, deadline = "", time.time() + timeout
  while time.time() < deadline and not re.search(r"warm start:.*\| *[1-9]\d*/", seen):
    with contextlib.suppress(BlockingIOError):  # nothing new yet
      seen += os.read(fd, 65536).decode(errors="replace")
    time.sleep(0.05)
  os.set_blocking(fd, True)
  return seen


def test_sigterm_in_the_warm_start_saves_it_and_the_restart_continues_it(tmp_path):
  # One device: no cross-device rendezvous that a loaded 2-core machine can time out (item 11);
  # no RL step: the warm start, the step-0 evaluation and checkpoint are what is tested.
  args = ("--config.sft.num_steps=300", "--config.train.num_steps=0")
  proc = run_trainer(tmp_path, *args, devices=1, wait=False)
  _wait_for_warm_start_progress(proc)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-3000:]
  assert "SIGTERM" in err
  (done,) = checkpoint.Checkpointer(tmp_path / "warm_start").all_steps()
  assert 0 < done < 300
  resumed = run_trainer(tmp_path, *args, devices=1)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"warm start: resumed after step {done} of 300" in resumed.stderr
  assert checkpoint.Checkpointer(tmp_path / "checkpoints").all_steps() == [0]
  assert not (tmp_path / "warm_start").exists()  # checkpoint 0 holds all it held
