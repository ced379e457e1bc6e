"""launch/tpu_pod.sh stops when the TPU compiler, run for real on the default job, says the config
does not fit."""

import json
import os
import sys

from tests.helpers.launch import LAUNCH, TPU_VARS, make_executable, run_script


# e2e: the TPU compiler, for real, on the default job (~30 s)
def test_tpu_pod_stops_when_the_tpu_compiler_says_the_config_does_not_fit(tmp_path):
  """A million prompts per sampler call: the sampler's KV cache exceeds a v5e chip's HBM. The
  check reports fits false (the compiler's own out-of-memory verdict) and no gcloud runs."""
  log = tmp_path / "gcloud.log"
  make_executable(tmp_path / "gcloud", f'#!/usr/bin/env bash\necho "gcloud $*" >> "{log}"\n')
  variables = {
    **TPU_VARS,
    "ACCELERATOR_TYPE": "v5litepod-4",
    "CONFIG": "configs/arith_ebpo.py",
    "EXTRA_ARGS": "--config.sampling.prompts_per_call=1000000 --config.train.num_steps=3",
  }
  env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHON": sys.executable}
  result = run_script([LAUNCH / "tpu_pod.sh"], timeout=300, **variables, **env, JAX_PLATFORMS="cpu")
  assert result.returncode == 2, result.stderr[-3000:]
  assert "does not fit v5litepod-4's HBM" in result.stderr
  assert not log.exists()
  (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith('{"topology"')]
  report = json.loads(line)
  assert (report["topology"], report["chips"], report["fits"]) == ("v5e:2x2", 4, False)
  assert report["train_step"]["bytes_per_chip"] < report["hbm_bytes_per_chip"]
  assert report["sampler"]["bytes_per_chip"] > report["hbm_bytes_per_chip"]
  assert "RESOURCE_EXHAUSTED" in report["sampler"]["compile_error"]
