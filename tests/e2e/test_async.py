"""Asynchronous RL with a fixed lag (rl.max_staleness, rollouts.pipeline) end to end on the tiny
arithmetic config: the schedule decides which policy samples each batch (never timing), and a run
killed at any moment resumes to the uninterrupted run's metrics and params, bit for bit; a mesh
split between the sampler and the trainer (mesh.rollout_devices) keeps each on its own devices."""

import json
import signal
import subprocess
import sys
import textwrap

from ebpo_jax import checkpoint
from tests.e2e.test_train import comparable, read
from tests.helpers import ROOT
from tests.helpers.processes import cpu_env, run_module, run_trainer

ARGS = ("--config.rl.max_staleness=2", "--config.train.num_steps=4")


def _checksums(workdir, step: int) -> dict:
  """The leaf checksums checkpoint `step` verifies against: params, optimizer, prior, the params
  behind (the in-flight batches' policies)."""
  return json.loads((workdir / "checkpoints" / str(step) / "checksums" / "metadata").read_text())


# e2e: 7 trainer processes of the tiny config on 1 device (~60 CPU-s)
def test_k2_killed_at_five_moments_resumes_to_the_straight_runs_metrics_and_params(tmp_path):
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  result = run_trainer(straight, *ARGS)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [m for m in read(straight) if "reward/mean" in m]
  # Steps 1 and 2 train batches sampled with step 0's policy, steps 3 and 4 with steps 1's and 2's.
  assert [m["async/staleness_max"] for m in lines] == [0, 1, 2, 2]
  assert lines[0]["mismatch/max_abs"] < 1e-5 < lines[-1]["mismatch/max_abs"]  # the lag shows

  def stopped_at(moment: str, status: int):
    result = run_module(
      "tests/helpers/killed_trainer.py", moment, "--config=configs/arith_ebpo.py:runlocal",
      f"--workdir={stopped}", "--config.logging.plots=False", *ARGS,
    )  # fmt: skip
    assert result.returncode == status, result.stderr[-3000:]
    return [m["step"] for m in read(stopped) if m["step"] >= 0 and "reward/mean" in m]

  # Killed: as the step-0 evaluation is logged (no checkpoint yet); in the producer thread as it
  # made its 3rd batch (steps 0 and 1 in flight, batch 2 made with step 0's params); in the 2nd
  # params copy after a resume from checkpoint 0 (step 1's weights, batch 3 not started); while
  # checkpoint 2 is written; then SIGTERM after step 3 (it saves 3 and exits 143).
  assert stopped_at("eval:0", -signal.SIGKILL) == []
  assert stopped_at("produce:3", -signal.SIGKILL) == []
  assert stopped_at("transfer:2", -signal.SIGKILL) == [1]
  assert stopped_at("save:2", -signal.SIGKILL) == [1, 2]
  assert stopped_at("term:3", 143) == [1, 2, 3]
  assert checkpoint.Checkpointer(stopped / "checkpoints").all_steps()[-1] == 3
  finished = run_trainer(stopped, *ARGS)
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert comparable(read(stopped)) == comparable(read(straight))
  assert _checksums(stopped, 4) == _checksums(straight, 4)


LORA_ARGS = (
  "--config.rl.max_staleness=1", "--config.train.num_steps=3", "--config.model.lora.rank=4",
  "--config.sft.num_steps=0", "--config.train.learning_rate=1e-2",
  "--config.rl.loss.entropy_coef=0.1",  # a random-init policy's rewards are all 0: a gradient still
)  # fmt: skip


# e2e: 3 trainer processes of the tiny config on 1 device (~30 CPU-s)
def test_a_lora_run_at_k1_samples_with_the_lagged_adapters_and_resumes_exactly(tmp_path):
  # The train step donates its state; the producer samples with the frozen base beside the copied
  # adapters, so the base is passed to the step apart (not donated) and the run's checkpoints
  # hold the adapters behind only.
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  result = run_trainer(straight, *LORA_ARGS)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [m for m in read(straight) if "reward/mean" in m]
  assert [m["async/staleness_max"] for m in lines] == [0, 1, 1]
  assert lines[0]["mismatch/max_abs"] < 1e-5 < lines[-1]["mismatch/max_abs"]  # the lag shows
  behind = [k for k in _checksums(straight, 3)["paths"] if k.startswith(".behind")]
  assert behind and all("lora" in k for k in behind), behind  # adapters only, not the base
  killed = run_module(
    "tests/helpers/killed_trainer.py", "transfer:2", "--config=configs/arith_ebpo.py:runlocal",
    f"--workdir={stopped}", "--config.logging.plots=False", *LORA_ARGS,
  )  # fmt: skip
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  finished = run_trainer(stopped, *LORA_ARGS)
  assert finished.returncode == 0, finished.stderr[-3000:]
  assert comparable(read(stopped)) == comparable(read(straight))
  assert _checksums(stopped, 3) == _checksums(straight, 3)


# The trainer in a process of 8 CPU devices, split 4 + 4, recording the devices that the sampler's
# weights and the train step's state and batch are on.
_SPLIT = textwrap.dedent(
  """
  import json, sys
  import jax
  from ebpo_jax import cli, trainer
  from ebpo_jax.rollouts import worker as worker_lib
  from ebpo_jax.trainer import loop

  seen = {"sampler": set(), "trainer": set()}
  def devices(tree):
    return {d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}
  plan = worker_lib.RolloutWorker.call_plan
  def recorded_plan(self, *args, **kwargs):
    weights, chunk, calls = plan(self, *args, **kwargs)
    seen["sampler"] |= devices(weights.params)
    return weights, chunk, calls
  worker_lib.RolloutWorker.call_plan = recorded_plan
  jit = loop.jit_train_step
  def recorded_jit(*args, **kwargs):
    step = jit(*args, **kwargs)
    def recorded_step(state, batch):
      seen["trainer"] |= devices((state, batch))
      return step(state, batch)
    return recorded_step
  loop.jit_train_step = recorded_jit
  overrides = {"rl.max_staleness": 1, "mesh.rollout_devices": 4, "train.num_steps": 2}
  config = cli.load_config("configs/arith_ebpo.py:runlocal", overrides | {"logging.plots": False})
  trainer.run(config, sys.argv[1])
  print(json.dumps({k: sorted(v) for k, v in seen.items()}))
  """
)


# e2e: one trainer process on 8 CPU devices (~20 s)
def test_a_split_mesh_samples_and_trains_on_disjoint_devices(tmp_path):
  result = subprocess.run(
    [sys.executable, "-c", _SPLIT, str(tmp_path)],
    cwd=ROOT, env=cpu_env(8), capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  seen = json.loads(result.stdout.strip().splitlines()[-1])
  assert seen == {"sampler": [4, 5, 6, 7], "trainer": [0, 1, 2, 3]}
  lines = [m for m in read(tmp_path) if "reward/mean" in m]
  assert [m["async/staleness_max"] for m in lines] == [0, 1]
