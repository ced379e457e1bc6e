"""The launch scripts as the tests run them: in a clean environment, from the repository root."""

import os
import pathlib
import stat
import subprocess

from tests.helpers import ROOT

LAUNCH = ROOT / "launch"

# Variables the scripts read; the tests' own environment must not leak into them.
SCRIPT_VARS = frozenset(
  {"TPU_NAME", "ZONE", "PROJECT", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "SPOT", "CODE"}
  | {"REPO_URL", "BRANCH", "REPO_DIR", "INSTALL", "JAX_PIP_SPEC", "CONFIG", "WORKDIR"}
  | {"EXTRA_ARGS", "LOG", "DRY_RUN", "DRY_RUN_TPU_EXISTS", "NUM_GPUS", "CUDA_VISIBLE_DEVICES"}
  | {"MEM_FRACTION", "PREALLOCATE", "PYTHON", "GRACE_S", "JAX_COORDINATOR_ADDRESS"}
  | {"JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "XLA_FLAGS", "PRECHECK"}
)

TPU_VARS = {
  "TPU_NAME": "ebpo-test",
  "ZONE": "us-east5-a",
  "PROJECT": "my-proj",
  "ACCELERATOR_TYPE": "v5p-64",
  "WORKDIR": "gs://bucket/runs/arith",
  "CONFIG": "configs/arith_ebpo.py:runlocal",
  "EXTRA_ARGS": "--config.train.num_steps=7 --config.seed=3",
}


def run_script(argv: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
  """`argv` from the repository root, output captured, with `env` and none of SCRIPT_VARS."""
  clean = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
  return subprocess.run(
    [str(a) for a in argv],
    cwd=ROOT,
    env={**clean, **env},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def make_executable(path: pathlib.Path, text: str) -> pathlib.Path:
  """An executable file at `path` holding `text` (a fake command on the scripts' PATH)."""
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return path
