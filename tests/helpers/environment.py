"""The tests' process environment, set by tests/conftest.py before jax is imported: 8 fake CPU
devices, CPU only, no network, programs compiled without most of XLA's optimizations (they compile
more than they run) in one codegen part, one compilation cache for the session's processes,
Python's bytecode caches written and garbage collected as the entry points do.

Imports nothing of jax or ebpo_jax at module level: `setup` must run first."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

# XLA:CPU's older fusion emitters (LLVM IR written directly, not through MLIR) compile the tests'
# small programs in a third to a half less time (results/suite_time.md); their
# code rounds differently and runs slower, so they are for tests only, which compare runs made
# alike. The processes the tests start keep the flag (processes.cpu_env). XLA plans to remove that
# route: without it, the tests compile as before.
OLD_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"

# XLA:CPU splits a program's LLVM module in parts compiled on parallel threads; on two cores that
# two xdist workers keep busy, the split only adds work: one part took 8-10% less CPU (a runlocal
# trainer process, two test files, each pair side by side: results/suite_time.md). For tests:
# it changes how a program is compiled, not what it computes.
ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"

# One compilation cache for the whole session: made by the first process that sets up (pytest-
# xdist's controller, before it starts the workers, which inherit the variable; or the one process
# without xdist) and removed when that process exits. The workers' trainer processes then reuse
# each other's programs too (concurrent processes on one cache, as the ablation's runs).
CACHE_VARIABLE = "EBPO_JAX_TEST_XLA_CACHE"


def _xla_accepts(flags: list[str]) -> bool:
  """Whether this jaxlib's XLA knows `flags` (it aborts a process on an unknown one): asked of a
  new process, once per session (pytest-xdist's workers inherit XLA_FLAGS from the controller)."""
  probe = [sys.executable, "-c", "import jax; jax.devices()"]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def _accepted(flags: list[str]) -> list[str]:
  """Those of `flags` this XLA knows: all in one probe, or each alone where one is gone."""
  return flags if _xla_accepts(flags) else [flag for flag in flags if _xla_accepts([flag])]


def setup() -> None:
  """Sets this process's environment for the tests (the processes they start inherit it), then
  sizes XLA:CPU's thread pools as the entry points do. Call it before anything imports jax."""
  # Bytecode caches (__pycache__/, git-ignored), as Python writes them by default: where the
  # environment turns them off (PYTHONDONTWRITEBYTECODE=1, as on this project's machines), each of
  # the suite's ~100 processes compiled ebpo_jax's sources again (about 0.5 s each) and each pytest
  # worker rewrote every test module's asserts again (about 7 s).
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  sys.dont_write_bytecode = False
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "XLA_FLAGS" not in os.environ:
    flags = ["--xla_force_host_platform_device_count=8"]
    flags += _accepted([OLD_FUSION_EMITTERS, ONE_CODEGEN_PART])
    os.environ["XLA_FLAGS"] = " ".join(flags)
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
  # gcsfs asks the Storage Control API for each bucket's layout (hierarchical or not); the storage
  # emulator (fixture gcs_emulator) has no such API, and gcsfs would log a warning per call.
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  # The tests' programs take longer to compile than to run (small models, a few steps): JAX's
  # switch for that case (LLVM at -O0 without its expensive passes; float32 as before) takes the
  # tests' summed durations from about 3,400 to 2,000 s (results/suite_time.md). The processes the
  # tests start inherit it.
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  if CACHE_VARIABLE not in os.environ:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="ebpo_jax_xla_cache_")
    atexit.register(shutil.rmtree, os.environ[CACHE_VARIABLE], ignore_errors=True)

  from ebpo_jax import process  # imports jax: after the variables above

  process.size_cpu_thread_pools()  # 8 devices on 2 cores abort without it
  # As the entry points: a pytest worker's heap (every test module, JAX's caches) is larger than
  # theirs; at Python's default thresholds an e2e worker spent 20% of its CPU collecting.
  process.collect_garbage_less_often()
