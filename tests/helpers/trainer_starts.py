"""Many trainer command lines for the price of one Python start: `starts(argvs)` runs
`python tests/helpers/trainer_starts.py`, which imports the trainer's libraries once, then runs
`python -m ebpo_jax.train ARGV` for each argv in a forked child (the real entry point: absl's
flags, `cli.entry_point`, `main`) and reports each child's exit status and output (stdout and
stderr together). An argv may name another entry point first (`["-m", "ebpo_jax.evaluate",
*ARGV]`). For bad starts that must stop before anything compiles: a child still running after
`TIMEOUT_S` is killed and reported with status None."""

import json
import os
import pathlib
import runpy
import signal
import sys
import tempfile
import time
import traceback

TIMEOUT_S = 60.0


def starts(argvs: list[list[str]], *, devices: int = 1) -> list[dict]:
  """[{"status": int | None, "stderr": str}] of `python -m ebpo_jax.train ARGV` per argv (of
  `python -m MODULE ARGV` for an argv `["-m", MODULE, *ARGV]`); "stderr" holds stdout too."""
  from tests.helpers.processes import run_module

  result = run_module(__file__, json.dumps(argvs), devices=devices, timeout=TIMEOUT_S * len(argvs))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout)


def _child(argv: list[str], err_path: str) -> None:
  fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  module = "ebpo_jax.train"
  if argv[:1] == ["-m"]:
    module, argv = argv[1], argv[2:]
  sys.argv = [module, *argv]
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
  except SystemExit as e:  # as the interpreter reports it: a string is printed, status 1
    code = e.code if isinstance(e.code, int) else (e.code is not None)
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr)
  except BaseException:
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(code))


def _run(argv: list[str]) -> dict:
  with tempfile.NamedTemporaryFile(suffix=".err") as err:
    pid = os.fork()
    if pid == 0:
      _child(argv, err.name)
    deadline, status = time.monotonic() + TIMEOUT_S, None
    while time.monotonic() < deadline:
      done, code = os.waitpid(pid, os.WNOHANG)
      if done:
        status = os.waitstatus_to_exitcode(code)
        break
      time.sleep(0.05)
    else:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
    return {"status": status, "stderr": pathlib.Path(err.name).read_text()}


if __name__ == "__main__":
  # What ebpo_jax.train imports, imported once here (not ebpo_jax.train itself: each child runs
  # it as __main__, defining its flags afresh). No JAX backend starts before the fork.
  import ebpo_jax.rollouts.worker  # noqa: F401
  import ebpo_jax.trainer.loop  # noqa: F401
  import ebpo_jax.trainer.step  # noqa: F401
  import ebpo_jax.trainer.warm_start  # noqa: F401

  print(json.dumps([_run(argv) for argv in json.loads(sys.argv[1])]))
