"""Test setup: 8 fake CPU devices (set before jax is imported), CPU only, no network, programs
compiled without most of XLA's optimizations (they compile more than they run); and the
fixtures several test files share: the config loader, the tiny arithmetic config, and one compiled
tiny train step.

Tiers: `python -m pytest -m "not e2e"` runs the unit tests; tests marked `e2e` start the trainer,
evaluate, export, ablate or the launch scripts as processes, run the notebook or a real model.
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag` (it aborts a process on an unknown one): asked of a
  new process, once per session (pytest-xdist's workers inherit XLA_FLAGS from the controller)."""
  probe = [sys.executable, "-c", "import jax; jax.devices()"]
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


# XLA:CPU's older fusion emitters (LLVM IR written directly, not through MLIR) compile the tests'
# small programs in a third to a half less time (bench/RESULTS.md, "The test suite's time"); their
# code rounds differently and runs slower, so they are for tests only, which compare runs made
# alike. The processes the tests start keep the flag (`cpu_env`). XLA plans to remove that route:
# without it, the tests compile as before.
OLD_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "XLA_FLAGS" not in os.environ:
  _flags = ["--xla_force_host_platform_device_count=8"]
  if _xla_accepts(OLD_FUSION_EMITTERS):
    _flags.append(OLD_FUSION_EMITTERS)
  os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# gcsfs asks the Storage Control API for each bucket's layout (hierarchical or not); the storage
# emulator (fixture gcs_emulator) has no such API, and gcsfs would log a warning per call.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# The tests' programs take longer to compile than to run (small models, a few steps): JAX's switch
# for that case (LLVM at -O0 without its expensive passes; float32 as before) takes the sum of
# the tests' durations from about 3,400 to 2,000 s (bench/RESULTS.md). The processes the tests
# start inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

from ebpo_jax import cli, process  # noqa: E402  (imports jax: after the variables above)

process.size_cpu_thread_pools()  # as the entry points do: 8 devices on 2 cores abort without it

import atexit  # noqa: E402
import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ebpo_jax import advantages, checkpoint, files, models, sharding, tasks  # noqa: E402
from ebpo_jax.trainer import optimizer as optimizer_lib  # noqa: E402
from ebpo_jax.trainer import policy, task_rows  # noqa: E402
from ebpo_jax.trainer import state as state_lib  # noqa: E402
from ebpo_jax.trainer import step as step_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARITH = "configs/arith_ebpo.py:runlocal"

# The tiny train step's shapes: B prompts x G responses, prompts of P tokens, N completion tokens,
# a vocabulary of V tokens (the arithmetic task's characters fit in 18).
B, G, P, N, V = 8, 4, 6, 5, 18
NUM_CLUSTERS = 2
TINY_OVERRIDES = {
  "rl.group_size": G,
  "train.batch_size": B,
  "train.mini_batch_size": B,
  "mesh.data": 1,
  "mesh.fsdp": -1,
  "mesh.tensor": 1,
  # Smaller than the runlocal decoder (3 layers, d=64): compiles in less time, same code paths.
  "model.num_layers": 1,
  "model.hidden_size": 32,
  "model.intermediate_size": 64,
  "model.head_dim": 16,
}


def _load(spec: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  path, colon, arg = spec.partition(":")
  return cli.load_config(f"{ROOT / path}{colon}{arg}", overrides)


@pytest.fixture(scope="session")
def load_config() -> Callable[..., ml_collections.ConfigDict]:
  """`load_config("configs/NAME.py[:ARG]", {"dotted.key": value})` from the repository root."""
  return _load


@pytest.fixture(scope="session")
def arith_config() -> Callable[..., ml_collections.ConfigDict]:
  """`arith_config({"dotted.key": value})`: configs/arith_ebpo.py:runlocal with overrides."""
  return functools.partial(_load, ARITH)


@dataclasses.dataclass(frozen=True)
class TinyStep:
  """A compiled `train_step` of a tiny random-init decoder on the arithmetic config (shapes
  B, G, P, N, V above; 2 clusters), and what it was built from."""

  config: ml_collections.ConfigDict
  model: models.Decoder
  optimizer: Any
  estimator: advantages.Estimator
  mesh: jax.sharding.Mesh
  options: step_lib.StepOptions
  step: Callable  # jitted (state, batch) -> (state, metrics, aux) as the trainer's; not donated
  _fresh: dict = dataclasses.field(default_factory=dict, repr=False)
  B, G, P, N, V = B, G, P, N, V

  def batch(self, seed: int = 0) -> dict:
    """A host batch of `train_step` (step.abstract_batch) with a left-padded prompt and early stops;
    prompts 0-3 are cluster 0, 4-7 cluster 1."""
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[0, :2] = False  # a left-padded prompt
    mask = np.ones((B * G, N), bool)
    mask[::3, 3:] = False  # some completions stopped early
    return {
      "prompt_ids": rng.integers(3, V, (B, P)).astype(np.int32),
      "prompt_mask": prompt_mask,
      "tokens": rng.integers(3, V, (B * G, N)).astype(np.int32),
      "completion_mask": mask,
      "old_logps": np.log(rng.uniform(0.05, 0.3, (B * G, N))).astype(np.float32),
      "truncated": np.zeros(B * G, bool),
      "nonfinite": np.zeros(B * G, bool),
      "rewards": rng.integers(0, 2, (B, G)).astype(np.float32),
      "cluster_ids": np.array([0] * 4 + [1] * 4, np.int32),
    }

  def fresh_state(self) -> state_lib.TrainState:
    """The step-0 state (built once: the step does not donate it, so tests may share it)."""
    if not self._fresh:
      params = models.build.init_params(self.config, self.model, self.mesh)
      args = (self.config, self.optimizer, self.estimator, NUM_CLUSTERS)
      self._fresh["state"] = state_lib.create_state(*args, params)
    return self._fresh["state"]

  def place(self, batch: dict) -> dict:
    return jax.device_put(batch, step_lib.batch_shardings(self.options.layout, self.mesh))

  def __call__(self, batch: dict, state: state_lib.TrainState | None = None):
    """One step on the host `batch` from `state` (default: a fresh state)."""
    return self.step(self.fresh_state() if state is None else state, self.place(batch))


@pytest.fixture(scope="session")
def tiny_steps() -> Callable[..., TinyStep]:
  """`tiny_steps({"dotted.key": value}, num_devices=None)`: the TinyStep of the tiny config with
  these overrides on the first `num_devices` devices (None: all 8), compiled once per distinct
  arguments in the session."""
  cache: dict[tuple, TinyStep] = {}

  def get(overrides: Mapping[str, Any] | None = None, num_devices: int | None = None) -> TinyStep:
    key = (tuple(sorted((overrides or {}).items())), num_devices)
    if key not in cache:
      config = _load(ARITH, {**TINY_OVERRIDES, **dict(key[0])})
      mesh = sharding.make_mesh(dict(config.mesh), jax.devices()[:num_devices])
      model = models.build.make_model(config, V)
      optimizer = optimizer_lib.make_optimizer(config)
      estimator = advantages.from_config(config.rl)
      shardings = state_lib.state_shardings(
        config, optimizer, estimator, NUM_CLUSTERS, models.build.abstract_params(model, mesh)
      )
      # As the trainer jits it, but nothing donated: tests may share the fresh state.
      options = step_lib.StepOptions.from_config(config, mesh)
      step = step_lib.jit_train_step(
        model, optimizer, estimator, options, mesh, shardings, donate=False
      )
      cache[key] = TinyStep(config, model, optimizer, estimator, mesh, options, step)
    return cache[key]

  return get


@pytest.fixture(scope="session")
def tiny_step(tiny_steps) -> TinyStep:
  """The TinyStep of the tiny config itself (EBPO, one mini-batch, no micro-batches)."""
  return tiny_steps()


# ----------------------------------------------------------------------------- the trainer's CLI


# One compilation cache for the whole session: made by the first process that imports this file
# (pytest-xdist's controller, before it starts the workers, which inherit the variable; or the one
# process without xdist) and removed when that process exits. The workers' trainer processes then
# reuse each other's programs too (concurrent processes on one cache, as the ablation's runs).
_CACHE_VARIABLE = "EBPO_JAX_TEST_XLA_CACHE"
if _CACHE_VARIABLE not in os.environ:
  os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="ebpo_jax_xla_cache_")
  atexit.register(shutil.rmtree, os.environ[_CACHE_VARIABLE], ignore_errors=True)
_SESSION_CACHE = os.environ[_CACHE_VARIABLE]


def cpu_env(devices: int) -> dict[str, str]:
  """This process's environment for a process on `devices` CPU devices (`process.
  fake_cpu_devices_env`: XLA_FLAGS's other flags, the fusion emitters above, kept)."""
  return process.fake_cpu_devices_env(devices) | {"JAX_PLATFORMS": "cpu"}


def run_module(module: str, *args: str, devices: int = 8, timeout: float = 300, wait: bool = True):
  """`python -m MODULE ARGS` (`python MODULE ARGS` for a `.py` path) on `devices` CPU devices
  from the repository root: the CompletedProcess (output captured), or with `wait=False` the
  running Popen. The processes of a session share a persistent compilation cache (their sampler,
  evaluation and train-step programs mostly repeat): about 3x faster."""
  env = cpu_env(devices) | {
    "JAX_COMPILATION_CACHE_DIR": _SESSION_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  cmd = [sys.executable, *([module] if module.endswith(".py") else ["-m", module]), *args]
  if not wait:
    return subprocess.Popen(
      cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
  return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_trainer(workdir, *overrides: str, config: str = ARITH, **kwargs):
  """`python -m ebpo_jax.train --config=CONFIG --workdir=WORKDIR OVERRIDES` by `run_module`."""
  return run_module(
    "ebpo_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides, **kwargs
  )


@pytest.fixture(scope="session")
def module_cli() -> Callable[..., Any]:
  """`run_module` above: an entry point (evaluate, export, ...) as a process."""
  return run_module


@pytest.fixture(scope="session")
def cpu_process_env() -> Callable[[int], dict[str, str]]:
  """`cpu_env` above: the environment of a process the test starts itself."""
  return cpu_env


@pytest.fixture(scope="session")
def trainer_cli() -> Callable[..., Any]:
  """`run_trainer` above: the trainer as a process (tests never import ebpo_jax.train)."""
  return run_trainer


# The logging options of arith_run: tests/e2e/test_logging.py reads its wandb run and sample tables.
ARITH_LOGGING = (
  "--config.logging.wandb=True",
  "--config.logging.wandb_mode=offline",
  "--config.logging.wandb_tags=ebpo,test",
  "--config.logging.samples_every=2",
  "--config.logging.num_samples=6",
)


def _session_run(tmp_path_factory, name: str, *overrides: str):
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
      result = run_trainer(workdir, *overrides)
      assert result.returncode == 0, result.stderr[-3000:]
      outputs = {"args": result.args, "stdout": result.stdout, "stderr": result.stderr}
      done.write_text(json.dumps(outputs))
  outputs = json.loads(done.read_text())
  return workdir, subprocess.CompletedProcess(returncode=0, **outputs)


@pytest.fixture(scope="session")
def arith_run(tmp_path_factory):
  """(workdir, CompletedProcess) of 4 RL steps of configs/arith_ebpo.py:runlocal on 8 devices
  (eval and checkpoints every 2 steps; sample tables every 2 steps and wandb offline:
  ARITH_LOGGING), shared by the trainer's and the tools' e2e tests (which only read it)."""
  return _session_run(tmp_path_factory, "arith_run", "--config.train.num_steps=4", *ARITH_LOGGING)


# The LoRA run of lora_run: rank-4 adapters on every projection of the runlocal decoder (random
# init: no SFT warm start under LoRA), a KL term to the base, adapter dropout, a learning rate
# that moves the adapters in 4 steps, and a seed other than the configs' (the base is random-init
# from it: a tool that rebuilt the base from its own config's seed would build another). The
# random model's rewards are all 0 and at B = 0 the policy is its KL reference, so without the
# entropy term no gradient reaches the adapters: they moved only by the float noise between the
# two forwards, which the compiler's settings can remove (they stayed 0 under
# JAX_DISABLE_MOST_OPTIMIZATIONS).
LORA_RUN = {
  "model.lora.rank": 4,
  "model.lora.dropout": 0.1,
  "sft.num_steps": 0,
  "rl.loss.kl_coef": 0.1,
  "rl.loss.entropy_coef": 0.01,
  "train.learning_rate": 0.01,
  "seed": 1,
}


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
  """(workdir, CompletedProcess) of 4 RL steps of configs/arith_ebpo.py:runlocal with LORA_RUN, on
  8 devices (eval and checkpoints every 2 steps); shared, read only, like arith_run."""
  overrides = [f"--config.{k}={v}" for k, v in LORA_RUN.items()]
  return _session_run(tmp_path_factory, "lora_run", *overrides, "--config.train.num_steps=4")


@pytest.fixture(scope="session")
def lora_overrides() -> dict[str, Any]:
  """The config overrides of lora_run (LORA_RUN), as `arith_config` takes them."""
  return dict(LORA_RUN)


def restore_run_state(workdir, config, step: int) -> state_lib.TrainState:
  """Checkpoint `step` of a trainer `workdir` run under `config` (on this process's 8 devices),
  as the trainer restores it: into the abstract state, without the LoRA base."""
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.from_config(config.task)
  model = models.build.make_model(config, task_rows.load_tokenizer(config, task).vocab_size)
  optimizer = optimizer_lib.make_optimizer(config)
  estimator = advantages.from_config(config.rl)
  abstract_params = models.build.abstract_params(model, mesh)
  abstract = state_lib.abstract_state(
    config, optimizer, estimator, len(task.cluster_names), abstract_params
  )
  with checkpoint.Checkpointer(pathlib.Path(workdir) / "checkpoints", read_only=True) as ckpt:
    state, _ = ckpt.restore(step, state_lib.checkpointed(abstract))
  return state


@pytest.fixture(scope="session")
def run_state() -> Callable[..., state_lib.TrainState]:
  """`restore_run_state` above: a checkpoint of a trainer workdir, restored in process."""
  return restore_run_state


# ----------------------------------------------------------------------------- TensorBoard


def read_event_files(logdir) -> list[list]:
  """The events of each tensorboardX event file in `logdir` (local or gs://), oldest file first:
  TFRecord framing (length, its CRC, the event, its CRC) read by hand, no TensorFlow."""
  from tensorboardX.proto import event_pb2

  names = sorted(n for n in files.listdir(logdir) if n.startswith("events.out.tfevents."))
  per_file = []
  for name in names:  # events.out.tfevents.<time>.<host>: oldest first
    data, events, pos = files.read_bytes(files.join(logdir, name)), [], 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
      pos += 12 + length + 4
    per_file.append(events)
  return per_file


@pytest.fixture(scope="session")
def tensorboard_events() -> Callable[..., list[list]]:
  """`read_event_files` above: [[Event] per event file] of a TensorBoard log directory."""
  return read_event_files


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(workdir: pathlib.Path, config, *, step: int = 0, perturb: float = 0.0):
  """A run's checkpoint at `step` written without training: the state the trainer creates, with
  its trained params (under LoRA the adapters only) shifted by `perturb` * noise (so that they
  differ from the model they started from). Returns (model, the policy's full params)."""
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.from_config(config.task)
  model = models.build.make_model(config, task_rows.load_tokenizer(config, task).vocab_size)
  params = policy.initial_params(config, model, mesh)
  if perturb:
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(params))))
    # Under LoRA the base is not checkpointed (a load rebuilds it): only the adapters move.
    lora = models.build.lora_enabled(config)
    moves = models.lora.adapter_mask(params) if lora else jax.tree.map(lambda _: True, params)
    params = jax.tree.map(
      lambda x, m: x + perturb * jax.random.normal(next(keys), x.shape, x.dtype) if m else x,
      params,
      moves,
    )
  optimizer = optimizer_lib.make_optimizer(config)
  estimator = advantages.from_config(config.rl)
  copy = jax.tree.map(jnp.copy, params)  # create_state donates its params
  state = state_lib.create_state(config, optimizer, estimator, NUM_CLUSTERS, copy)
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
    ckpt.save(step, state_lib.checkpointed(state), config=config.to_dict(), force=True)
  return model, params


@pytest.fixture(scope="session")
def checkpoint_writer() -> Callable[..., tuple]:
  """`save_checkpoint` above: a trainer workdir with one checkpoint, in process."""
  return save_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
  """A random tiny Llama (transformers, 2 layers, d=16) with SmolLM2's tokenizer files."""
  import torch
  import transformers

  path = tmp_path_factory.mktemp("tiny_llama")
  smollm2 = models.smollm2_135m_instruct()
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
    vocab_size=49152,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=True,
  )
  transformers.LlamaForCausalLM(hf_config).save_pretrained(path)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(smollm2, name), path / name)
  return path


@pytest.fixture(scope="session")
def run_from_a_model_directory(arith_config, checkpoint_writer, tiny_llama_dir, tmp_path_factory):
  """A run's checkpoint (params perturbed) of a model that started from `tiny_llama_dir`."""
  run_dir = tmp_path_factory.mktemp("run_from_hf")
  config = arith_config({"model.path": str(tiny_llama_dir)})
  model, params = checkpoint_writer(run_dir, config, perturb=0.05)
  return run_dir, model, params


@pytest.fixture(scope="session")
def lora_run_from_a_model_directory(
  arith_config, checkpoint_writer, tiny_llama_dir, tmp_path_factory
):
  """(run_dir, model, full params) of a LoRA run's checkpoint (adapters perturbed) on the base
  `tiny_llama_dir`."""
  run_dir = tmp_path_factory.mktemp("lora_run")
  config = arith_config({"model.path": str(tiny_llama_dir), "model.lora.rank": 4})
  model, params = checkpoint_writer(run_dir, config, perturb=0.5)
  return run_dir, model, params


# ----------------------------------------------------------------------------- a storage bucket

GCS_BUCKET = "ebpo-test"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator() -> str:
  """A Google Cloud Storage API on loopback (`gcp-storage-emulator`, started by
  tests/helpers/gcs_emulator.py, in memory, one per xdist worker) with the bucket GCS_BUCKET; this
  process and its children use it (gcsfs and google-cloud-storage follow STORAGE_EMULATOR_HOST,
  tensorstore TENSORSTORE_GCS_HTTP_URL). Returns its URL."""
  port = _free_port()
  url = f"http://localhost:{port}"
  server = subprocess.Popen(
    [
      sys.executable,
      str(
        ROOT / "tests" / "helpers" / "gcs_emulator.py"
      ),  # the emulator with GCS's generation headers
      "start",
      "--host=localhost",
      f"--port={port}",
      "--in-memory",
      f"--default-bucket={GCS_BUCKET}",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.monotonic() + 30
  while True:
    try:
      socket.create_connection(("localhost", port), timeout=1).close()
      break
    except OSError:
      if server.poll() is not None or time.monotonic() > deadline:
        server.kill()
        raise RuntimeError(f"gcp-storage-emulator did not start on port {port}") from None
      time.sleep(0.1)
  emulator_env = {
    "STORAGE_EMULATOR_HOST": url,
    "TENSORSTORE_GCS_HTTP_URL": url,
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
    "GOOGLE_CLOUD_PROJECT": "test",
  }
  saved = {k: os.environ.get(k) for k in emulator_env}
  os.environ.update(emulator_env)
  yield url
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  server.terminate()
  server.wait(timeout=10)


@pytest.fixture
def gcs_dir(gcs_emulator, request) -> str:
  """A fresh `gs://` folder in the emulator's bucket, named after the test."""
  name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
  return f"gs://{GCS_BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def pytest_collection_modifyitems(config, items):
  """The slow tests (e2e, the real model's first) run first: with xdist workers they then run
  beside the fast ones instead of leaving one worker busy at the end."""
  rank = lambda item: (
    item.get_closest_marker("e2e") is None,
    "test_smollm2" not in item.nodeid,
  )
  items.sort(key=rank)


@pytest.fixture(scope="session")
def randomize_torch_weights() -> Callable[..., None]:
  """`randomize(torch_model, seed)`: weights of std 0.2 and norm scales near 1, so a tiny random
  transformers model's logits are O(1) and every term matters in a comparison with ours."""
  import torch  # only the tests that compare with transformers pay for importing it

  def randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
      for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)

  return randomize


@pytest.fixture(scope="session")
def trained_lora() -> Callable[..., Any]:
  """`trained_lora(params, seed=1, scale=0.1)`: `params` (a full tree or the adapters) with every
  LoRA B random, as after training (a fresh B is zero: the adapters would not act), each on its
  old leaf's sharding."""

  def train(params: Any, seed: int = 1, scale: float = 0.1) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
    out = [
      jax.device_put(scale * jax.random.normal(next(keys), x.shape), x.sharding)
      if path[-1].key == models.lora.B_NAME
      else x
      for path, x in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, out)

  return train
