"""Processes the tests start: Python from the repository root, on CPU devices."""

import os
import subprocess
import sys

from ebpo_jax import process
from tests.helpers import ROOT
from tests.helpers.configs import ARITH
from tests.helpers.environment import CACHE_VARIABLE


def run_python(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
  """`python ARGS` from the repository root, output captured, on XLA's own CPU devices: this
  process's environment without XLA_FLAGS (no fake device count)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )


def cpu_env(devices: int) -> dict[str, str]:
  """This process's environment for a process on `devices` CPU devices (`process.
  fake_cpu_devices_env`: XLA_FLAGS's other flags, the tests' compiler flags, kept)."""
  return process.fake_cpu_devices_env(devices) | {"JAX_PLATFORMS": "cpu"}


def run_module(module: str, *args: str, devices: int = 1, timeout: float = 300, wait: bool = True):
  """`python -m MODULE ARGS` (`python MODULE ARGS` for a `.py` path) on `devices` CPU devices
  from the repository root: the CompletedProcess (output captured), or with `wait=False` the
  running Popen. One device unless the test is about sharding: a process on 8 fake devices costs
  about a third more CPU (results/suite_time.md). The processes of a session
  share a persistent compilation cache (their sampler, evaluation and train-step programs mostly
  repeat; environment.CACHE_VARIABLE): about 3x faster."""
  env = cpu_env(devices) | {
    "JAX_COMPILATION_CACHE_DIR": os.environ[CACHE_VARIABLE],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  cmd = [sys.executable, *([module] if module.endswith(".py") else ["-m", module]), *args]
  if not wait:
    return subprocess.Popen(
      cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
  return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_trainer(workdir, *overrides: str, config: str = ARITH, plots: bool = False, **kwargs):
  """`python -m ebpo_jax.train --config=CONFIG --workdir=WORKDIR OVERRIDES` by `run_module`: the
  trainer as a process (tests never import ebpo_jax.train). Without the end-of-run plots unless
  `plots` (about 4 s of drawing a run; the tests that read them ask for them)."""
  switch = f"--config.logging.plots={plots}"
  return run_module(
    "ebpo_jax.train", f"--config={config}", f"--workdir={workdir}", switch, *overrides, **kwargs
  )


def on_pythonpath(monkeypatch, directory, **modules: str) -> None:
  """Writes each source of `modules` to DIRECTORY/NAME.py and puts `directory` first on the
  PYTHONPATH of the processes the test starts (a reward module only they import, say)."""
  for name, source in modules.items():
    (directory / f"{name}.py").write_text(source)
  path = os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])
  monkeypatch.setenv("PYTHONPATH", path)
