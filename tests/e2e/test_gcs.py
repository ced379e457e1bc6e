"""Trainer runs on a bucket, against the storage emulator: a run whose `data.path` and
`model.path` are on the bucket; two processes (launch/local_multiprocess.sh) training into a gs://
workdir and resuming from it, equal to one process on local disk."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from ebpo_jax import checkpoint, files, models, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.configs import arith_config
from tests.helpers.environment import CACHE_VARIABLE
from tests.helpers.gcs import upload
from tests.helpers.processes import cpu_env, run_trainer

# ----------------------------------------------------------------------------- the trainer


def _metrics(workdir) -> list[dict]:
  """metrics.jsonl of a run (local or gs://) without the timings."""
  lines = files.read_text(files.join(workdir, "metrics.jsonl")).splitlines()
  records = [json.loads(line) for line in lines]
  return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def test_a_run_on_bucket_data_and_model_matches_the_run_on_local_copies(
  tiny_llama_dir, gcs_dir, tmp_path, monkeypatch
):
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / "cache"))  # the trainer's mirrors
  task = tasks.get_task("arithmetic", ops=("add",), digits=(1, 2))
  rows = [
    {"prompt": r["prompt"], "answer": r["answer"], "cluster": task.cluster_names[r["cluster"]]}
    for r in task.rows("train", 32, 0)
  ]
  data = tmp_path / "rows.jsonl"
  files.write_lines(data, map(json.dumps, rows))
  sources = {
    "local": (data, tiny_llama_dir),
    "bucket": (upload(data, f"{gcs_dir}/rows.jsonl"), upload(tiny_llama_dir, f"{gcs_dir}/llama")),
  }
  for name, (data_path, model_path) in sources.items():
    result = run_trainer(
      tmp_path / name,
      f"--config.data.path={data_path}",
      f"--config.eval.path={data_path}",  # 32 rows: too few to hold some out of training
      f"--config.model.path={model_path}",
      "--config.sft.num_steps=0",
      "--config.train.num_steps=2",
      "--config.task.num_eval=2",
      "--config.eval.every_steps=100",
      "--config.checkpoint.every_steps=100",
      devices=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]
  local, bucket = _metrics(tmp_path / "local"), _metrics(tmp_path / "bucket")
  assert [m["step"] for m in bucket] == [m["step"] for m in local] == [0, 1, 2]
  for want, have in zip(local, bucket, strict=True):
    assert have.keys() == want.keys()
    for key, value in want.items():
      assert have[key] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), key
  assert len(files.walk_files(tmp_path / "cache")) > 0  # the bucket's model was mirrored


# ----------------------------------------------------------------------------- several hosts

TWO_PROCESS_RUN = (
  f"--config={ROOT}/configs/arith_ebpo.py:runlocal",
  "--config.sft.num_steps=0",
  "--config.checkpoint.every_steps=2",
  "--config.eval.every_steps=2",
  "--config.rewards.workers=0",
  "--config.rl.loss.entropy_coef=0.01",  # the random model's rewards are all 0: this moves it
  "--config.mesh.data=1",
  "--config.mesh.fsdp=8",
  "--config.mesh.tensor=1",
  "--config.logging.plots=False",
)


def _train(processes: int, workdir, num_steps: int, cwd, env: dict) -> subprocess.CompletedProcess:
  """TWO_PROCESS_RUN for `num_steps` from `cwd` in `env` (8 CPU devices: processes.cpu_env): 2
  processes x 4 devices by launch/local_multiprocess.sh (the emulator's variables pass through it),
  or one process on the 8. Their compiled programs go to the session's compilation cache
  (environment.CACHE_VARIABLE), which the session's other trainer runs share: the one-process
  run's sampler programs are those of every default-job run on 8 devices (arith_run's, say)."""
  env = env | {
    "PYTHONPATH": str(ROOT),  # cwd may be elsewhere
    "JAX_COMPILATION_CACHE_DIR": os.environ[CACHE_VARIABLE],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  if processes == 1:
    launcher = [sys.executable, "-m", "ebpo_jax.train"]
  else:
    launcher = [ROOT / "launch" / "local_multiprocess.sh", str(processes)]
    env.update(PYTHON=sys.executable)
  args = [*TWO_PROCESS_RUN, f"--workdir={workdir}", f"--config.train.num_steps={num_steps}"]
  return subprocess.run(
    launcher + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
  )


NOISE = "mismatch/"


def _same_metrics(got: list[dict], expected: list[dict]) -> None:
  """Line for line the same keys and values (to float32 reduction-order noise), timings aside."""
  assert [m["step"] for m in got] == [m["step"] for m in expected]
  for want, have in zip(expected, got, strict=True):
    assert have.keys() == want.keys()
    keys = sorted(k for k in want if not k.startswith(("time/", NOISE)))
    np.testing.assert_allclose(
      [have[k] for k in keys], [want[k] for k in keys], rtol=1e-5, atol=1e-7, err_msg=str(keys)
    )
    # The sampler-trainer mismatch of a float32 run is itself float noise (about 1e-7 here), and
    # two processes sum in another order than one: equal to the bound it stays under, 1e-5.
    noise = sorted(k for k in want if k.startswith(NOISE))
    np.testing.assert_allclose([have[k] for k in noise], [want[k] for k in noise], atol=1e-5)


def test_two_processes_train_into_a_bucket_resume_from_it_and_equal_one_process(gcs_dir, tmp_path):
  """launch/local_multiprocess.sh 2 into a gs:// workdir, stopped after step 2 and resumed from
  the bucket to step 3: process 0 writes metrics.jsonl (each line once), both processes write
  their shards of every checkpoint, and the metrics equal one process's on local disk."""
  workdir, cwd = files.join(gcs_dir, "run"), tmp_path / "cwd"
  cwd.mkdir()
  env = cpu_env(8)
  single = _train(1, tmp_path / "one", 3, ROOT, env)
  assert single.returncode == 0, single.stderr[-3000:]
  for num_steps in (2, 3):
    result = _train(2, workdir, num_steps, cwd, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    assert "[rank 0] " in result.stdout and "[rank 1] " in result.stdout
    lines = files.read_text(files.join(workdir, "metrics.jsonl")).splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(num_steps + 1))
    assert len(set(lines)) == len(lines)
  expected = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").open()]
  # env/time_s: multi-turn runs only; async/*: rl.max_staleness > 0 only
  unlogged = {metrics_lib.ENV_TIME_S, *metrics_lib.ASYNC_TIMING_KEYS}
  assert set(metrics_lib.TIMING_KEYS) - unlogged <= set(expected[1])
  _same_metrics([json.loads(line) for line in lines], expected)
  assert expected[1]["grad_norm"] > 0  # the update did something that both runs had to agree on
  assert os.listdir(cwd) == []  # nothing written locally (no folder named "gs:")
  written = files.walk_files(workdir)
  assert [name for name in written if name.endswith(".jsonl")] == ["metrics.jsonl"]
  assert sum("tfevents" in name for name in written) == 2  # process 0's, one per run
  for rank in (0, 1):  # every process wrote its shards of the last checkpoint
    assert any(name.startswith(f"checkpoints/3/state/ocdbt.process_{rank}/") for name in written)
  checkpoints = files.join(workdir, "checkpoints")
  assert [n for n in files.listdir(checkpoints) if n.isdigit()] == ["2", "3"]  # max_to_keep=2

  # The 2-process checkpoint restores in this process (8 devices, another layout of processes).
  config = arith_config({"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1})
  model = models.build.make_model(config, tasks.get_task("arithmetic").tokenizer.vocab_size)
  mesh = sharding.make_mesh(dict(config.mesh))
  with checkpoint.Checkpointer(checkpoints) as ckpt:
    at_2 = jax.tree.leaves(ckpt.restore_params(2, models.build.abstract_params(model, mesh)))
    at_3 = jax.tree.leaves(ckpt.restore_params(3, models.build.abstract_params(model, mesh)))
  assert all(np.isfinite(np.asarray(x)).all() for x in at_3)
  assert any(not np.array_equal(a, b) for a, b in zip(at_2, at_3, strict=True))  # step 3 trained
