"""The process set-up of ebpo_jax.process: SIGINT (Ctrl-C) stops a run as SIGTERM does, at a step
boundary with a checkpoint; a second Ctrl-C interrupts at once. An entry point collects garbage
less often than Python's defaults."""

import gc
import os
import signal
import time

import pytest

from ebpo_jax import cli, process


def _raise_and_wait(flag: process.SigtermFlag, signum: int) -> None:
  os.kill(os.getpid(), signum)
  deadline = time.monotonic() + 5.0
  while not flag.requested and time.monotonic() < deadline:
    time.sleep(0.01)


@pytest.mark.parametrize(
  "signum, name, status", [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "SIGINT", 130)]
)
def test_sigint_sets_the_flag_as_sigterm_does(signum, name, status):
  # SIGINT raised KeyboardInterrupt wherever the run was: no checkpoint of the step reached.
  before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a job a shell started in the background
  flag = process.install_sigterm_flag()
  try:
    _raise_and_wait(flag, signum)
    assert flag.requested and flag.requested_anywhere()
    assert (flag.signal_name, flag.exit_status) == (name, status)
    if signum == signal.SIGINT:  # a second Ctrl-C: the user wants out now
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
  finally:
    flag.uninstall()
  assert signal.getsignal(signal.SIGINT) is before  # uninstall restores what it found


def test_an_entry_point_collects_garbage_less_often():
  before = gc.get_threshold()  # the tests' (tests/helpers/environment.py sets the same)
  gc.set_threshold(700, 10, 10)  # Python's defaults
  try:
    with cli.entry_point():
      assert gc.get_threshold() == process.GC_THRESHOLDS
  finally:
    gc.set_threshold(*before)
  assert process.GC_THRESHOLDS[0] > 10 * 700


def test_a_machine_without_a_tpu_starts_jax_without_libtpus_noise():
  # The test extras install libtpu (the aot report's TPU compiler): on a machine without TPU chips
  # its start-up printed six lines of errors above every command (issue 62, item 8).
  import subprocess
  import sys

  import libtpu  # noqa: F401  (installed: else the noise cannot arise and the test says nothing)

  # The tests' own environment says CPU only (JAX_PLATFORMS): a user's does not.
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "JAX_PLATFORMS"}
  code = (
    "import ebpo_jax, jax, os; "
    "print(jax.devices()[0].platform, 'TPU_ACCELERATOR_TYPE' in os.environ)"
  )
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
  assert result.stderr == "", result.stderr
  # Notebooks detect a TPU runtime by TPU_ACCELERATOR_TYPE: it stays unset.
  assert result.stdout.strip() == "cpu False"
