"""Test setup (tests/helpers/environment.py, before jax is imported: 8 fake CPU devices, CPU only,
no network, programs compiled without most of XLA's optimizations), the fixtures several test
files share (session trainer runs, checkpoints, a tiny Llama, a storage bucket) and the order of
the tests. Plain functions and constants the tests share are in tests/helpers/, imported by name.

Tiers: `python -m pytest -m "not e2e"` runs the unit tests (tests/unit/); tests/e2e/ holds the
`e2e` ones, which start the trainer, evaluate, export, ablate or the launch scripts as processes,
run the notebook or a real model.
"""

from tests.helpers import environment

environment.setup()

import gc  # noqa: E402  (after the environment: the modules below import jax)
import pathlib  # noqa: E402
import re  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import gcs, runs  # noqa: E402
from tests.helpers.checkpoints import save_checkpoint  # noqa: E402
from tests.helpers.configs import arith_config  # noqa: E402


@pytest.fixture(scope="session")
def arith_run(tmp_path_factory):
  """(workdir, CompletedProcess) of 4 RL steps of configs/arith_ebpo.py:runlocal on 8 devices
  (eval and checkpoints every 2 steps; sample tables every 2 steps and wandb offline:
  runs.ARITH_LOGGING), shared by the trainer's and the tools' e2e tests (which only read it)."""
  overrides = ("--config.train.num_steps=4", *runs.ARITH_LOGGING)
  return runs.session_run(tmp_path_factory, "arith_run", *overrides, devices=8)


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
  """(workdir, CompletedProcess) of 2 RL steps of configs/arith_ebpo.py:runlocal with
  runs.LORA_RUN, on 1 device (eval and checkpoints every 2 steps: at 0 and 2); shared, read only,
  like arith_run (the sharded LoRA step: e2e/test_train_step.py)."""
  overrides = [f"--config.{k}={v}" for k, v in runs.LORA_RUN.items()]
  return runs.session_run(tmp_path_factory, "lora_run", *overrides, "--config.train.num_steps=2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
  """A random tiny Llama (transformers, 2 layers, d=16) with SmolLM2's tokenizer files."""
  from tests.helpers import torch_models  # only the tests that use it pay for importing torch

  return torch_models.save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def run_from_a_model_directory(tiny_llama_dir, tmp_path_factory):
  """A run's checkpoint (params perturbed) of a model that started from `tiny_llama_dir`."""
  run_dir = tmp_path_factory.mktemp("run_from_hf")
  config = arith_config({"model.path": str(tiny_llama_dir)})
  model, params = save_checkpoint(run_dir, config, perturb=0.05)
  return run_dir, model, params


@pytest.fixture(scope="session")
def lora_run_from_a_model_directory(tiny_llama_dir, tmp_path_factory):
  """(run_dir, model, full params) of a LoRA run's checkpoint (adapters perturbed) on the base
  `tiny_llama_dir`."""
  run_dir = tmp_path_factory.mktemp("lora_run")
  config = arith_config({"model.path": str(tiny_llama_dir), "model.lora.rank": 4})
  model, params = save_checkpoint(run_dir, config, perturb=0.5)
  return run_dir, model, params


@pytest.fixture(scope="session")
def gcs_emulator() -> str:
  """A Google Cloud Storage API on loopback with the bucket gcs.GCS_BUCKET (gcs.running_emulator),
  one per xdist worker, for the session. Returns its URL."""
  with gcs.running_emulator() as url:
    yield url


@pytest.fixture
def gcs_dir(gcs_emulator, request) -> str:
  """A fresh `gs://` folder in the emulator's bucket, named after the test."""
  name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
  return f"gs://{gcs.GCS_BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def pytest_unconfigure(config):
  """pytest's clean-up then collects garbage five times over (to report exceptions raised in
  finalizers), each time traversing every object of the process (JAX's caches, the modules): one
  collection here, then what survives it frozen (kept out of the next ones), gives the same report
  for a fifth of the work (about 2 s less per test process)."""
  gc.collect()
  gc.freeze()


def pytest_collection_modifyitems(config, items):
  """The tests marked `peers` (they need tunix, installed apart) are left out unless `-m` names
  them (`-m e2e` alone would select them). The slow tests (e2e, the real model's first) run first:
  with xdist workers they then run beside the fast ones instead of leaving one worker busy at the
  end."""
  if "peers" not in (config.option.markexpr or ""):
    is_peers = lambda item: item.get_closest_marker("peers") is not None
    config.hook.pytest_deselected(items=[item for item in items if is_peers(item)])
    items[:] = [item for item in items if not is_peers(item)]
  rank = lambda item: (
    item.get_closest_marker("e2e") is None,
    "test_smollm2" not in item.nodeid,
  )
  items.sort(key=rank)
