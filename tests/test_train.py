"""The trainer end to end on the tiny arithmetic config: CLI, resume, SIGTERM, devices, bad
input."""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ebpo_jax import checkpoint, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arith_ebpo.py")
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
}


def cli(workdir, *overrides, devices: int = 8, timeout: float = 300, wait: bool = True):
  env = dict(
    os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu"
  )
  cmd = [
    sys.executable,
    "-m",
    "ebpo_jax.train",
    f"--config={CONFIG}:runlocal",
    f"--workdir={workdir}",
    *overrides,
  ]
  if not wait:
    return subprocess.Popen(
      cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
  return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def read(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(lines: list[dict]) -> list[dict]:
  """Metrics without wall-clock timings, which differ between runs by nature."""
  return [{k: v for k, v in m.items() if k not in train.TIMING_KEYS} for m in lines]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """The reference: 4 RL steps without interruption (runlocal: eval and checkpoint every 2)."""
  workdir = tmp_path_factory.mktemp("straight")
  result = cli(workdir, "--config.train.num_steps=4")
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, result


def test_cli_run_writes_metrics_checkpoints_and_summary(straight_run):
  workdir, result = straight_run
  lines = read(workdir)
  train_lines = [m for m in lines if "reward/mean" in m]
  assert [m["step"] for m in train_lines] == [1, 2, 3, 4]
  assert set(train_lines[0]) >= REQUIRED_KEYS, REQUIRED_KEYS - set(train_lines[0])
  evals = [m for m in lines if "eval/accuracy" in m]
  assert [m["step"] for m in evals] == [0, 2, 4]
  assert any(k.startswith("eval/accuracy/") for k in evals[0])
  assert 0.0 <= train_lines[0]["adv/zero_frac"] <= 1.0
  assert (workdir / "checkpoints").is_dir()
  assert "held-out accuracy" in result.stdout
  assert list((workdir / "plots").glob("*.png"))
  # One compile of the train step for the whole run: a retrace would show up here.
  assert train_lines[-1]["compiles/train_step"] == 1


def test_resume_gives_the_same_metrics_as_a_straight_run(straight_run, tmp_path):
  reference, _ = straight_run
  first = cli(tmp_path, "--config.train.num_steps=2")
  assert first.returncode == 0, first.stderr[-3000:]
  second = cli(tmp_path, "--config.train.num_steps=4")
  assert second.returncode == 0, second.stderr[-3000:]
  assert comparable(read(tmp_path)) == comparable(read(reference))


def test_sigterm_saves_and_the_run_resumes_exactly(straight_run, tmp_path):
  reference, _ = straight_run
  proc = cli(
    tmp_path, "--config.train.num_steps=4", "--config.checkpoint.every_steps=100", wait=False
  )
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and not (
    metrics.exists() and any('"reward/mean"' in ln for ln in metrics.read_text().splitlines())
  ):
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-3000:]
  assert "SIGTERM" in err
  resumed = cli(tmp_path, "--config.train.num_steps=4")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert comparable(read(tmp_path)) == comparable(read(reference))


def test_one_device_matches_eight(straight_run, tmp_path):
  reference, _ = straight_run
  result = cli(tmp_path, "--config.train.num_steps=4", devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  ours, ref = comparable(read(tmp_path)), comparable(read(reference))
  assert [m["step"] for m in ours] == [m["step"] for m in ref]
  for a, b in zip(ours, ref, strict=True):
    for key in a:
      if isinstance(a[key], float):
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), key


@pytest.mark.parametrize(
  "override, message",
  [
    ("--config.rl.group_size=1", "config.rl.group_size=1: must be >= 2"),
    ("--config.rl.advantage=ppo", "config.rl.advantage='ppo': must be one of"),
    ("--config.rl.ebpo.decay=1.5", "config.rl.ebpo.decay=1.5: must lie in (0, 1]"),
    ("--config.train.batch_size=12", "must be divisible by the mesh's data x fsdp = 8"),
    ("--config.data.order=random", "config.data.order='random'"),
  ],
)
def test_invalid_config_stops_with_one_line_naming_the_key(tmp_path, override, message):
  result = cli(tmp_path, override, timeout=120)
  assert result.returncode != 0
  assert message in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "checkpoints").exists()


def test_malformed_data_row_names_file_and_line(tmp_path):
  rows = tmp_path / "rows.jsonl"
  rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
  result = cli(tmp_path / "run", f"--config.data.path={rows}", timeout=120)
  assert result.returncode != 0
  assert f"{rows}:2:" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_non_finite_steps_in_a_row_abort_with_a_clear_message(tmp_path, monkeypatch):
  # Every update reports itself non-finite (as a NaN loss would): the run stops after
  # max_bad_steps in a row with one line, keeping the last good checkpoint (step 0).
  real_step = train.train_step

  def always_bad(state, batch, **kwargs):
    state, metrics = real_step(state, batch, **kwargs)
    return state, {**metrics, "bad_updates": metrics["bad_updates"] + 1.0}

  monkeypatch.setattr(train, "train_step", always_bad)
  spec = importlib.util.spec_from_file_location("arith_ebpo", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("runlocal")
  config.train.num_steps, config.train.max_bad_steps = 6, 2
  with pytest.raises(SystemExit) as exit_info:
    train.run(config, str(tmp_path))
  message = str(exit_info.value.code)
  assert "non-finite loss or grad norm in 2 steps in a row" in message
  assert "train.max_bad_steps=2" in message
  assert checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step() == 0
