"""Trainer runs the tests share, and what the tests read from a run's workdir."""

import fcntl
import json
import os
import subprocess

from ebpo_jax import metrics as metrics_lib
from tests.helpers.processes import run_trainer


def logged_steps(workdir) -> list[int]:
  """The step of each RL line of the run's metrics.jsonl, in order (not the warm start's lines,
  at negative steps)."""
  return [r["step"] for r in metrics_lib.read_metrics(workdir) if r["step"] >= 0]


PNG = b"\x89PNG\r\n\x1a\n"  # the first bytes of a plot file

# The logging options of arith_run: tests/e2e/test_logging.py reads its wandb run and sample tables.
ARITH_LOGGING = (
  "--config.logging.wandb=True",
  "--config.logging.wandb_mode=offline",
  "--config.logging.wandb_tags=ebpo,test",
  "--config.logging.samples_every=2",
  "--config.logging.num_samples=6",
)

# The LoRA run of lora_run: rank-4 adapters on every projection of the runlocal decoder (random
# init: no SFT warm start under LoRA), a KL term to the base, adapter dropout, a learning rate
# that moves the adapters in 2 steps, and a seed other than the configs' (the base is random-init
# from it: a tool that rebuilt the base from its own config's seed would build another). The
# random model's rewards are all 0 and at B = 0 the policy is its KL reference, so without the
# entropy term no gradient reaches the adapters: they moved only by the float noise between the
# two forwards, which the compiler's settings can remove (they stayed 0 under
# JAX_DISABLE_MOST_OPTIMIZATIONS). Config overrides, as `configs.arith_config` takes them.
LORA_RUN = {
  "model.lora.rank": 4,
  "model.lora.dropout": 0.1,
  "sft.num_steps": 0,
  "rl.loss.kl_coef": 0.1,
  "rl.loss.entropy_coef": 0.01,
  "train.learning_rate": 0.01,
  "seed": 1,
}


def session_run(tmp_path_factory, name: str, *overrides: str, devices: int = 1):
  """(workdir, CompletedProcess) of the trainer with `overrides`, run once per session by the
  first xdist worker to ask (a file lock in the session's temporary root); the others wait for it
  and read its outputs."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is under the session's own
    root = root.parent
  workdir, done = root / name, root / f"{name}.json"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      result = run_trainer(workdir, *overrides, plots=True, devices=devices)
      assert result.returncode == 0, result.stderr[-3000:]
      outputs = {"args": result.args, "stdout": result.stdout, "stderr": result.stderr}
      done.write_text(json.dumps(outputs))
  outputs = json.loads(done.read_text())
  return workdir, subprocess.CompletedProcess(returncode=0, **outputs)
