"""Processes the tests start: Python from the repository root, on CPU devices."""

import os
import subprocess
import sys

from tests.helpers import ROOT


def run_python(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
  """`python ARGS` from the repository root, output captured, on XLA's own CPU devices: this
  process's environment without XLA_FLAGS (no fake device count)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
  )
