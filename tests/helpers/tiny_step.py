"""One compiled tiny train step of the arithmetic config, shared by the train-step tests."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from ebpo_jax import models, sharding
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import step as step_lib
from tests.helpers.configs import ARITH, load_config

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


@dataclasses.dataclass(frozen=True)
class TinyStep:
  """A compiled `train_step` of a tiny random-init decoder on the arithmetic config (shapes
  B, G, P, N, V above; 2 clusters), and what it was built from."""

  config: ml_collections.ConfigDict
  model: models.Decoder
  spec: state_lib.StateSpec  # its optimizer and estimator
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
      "loss_mask": mask,
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
      self._fresh["state"] = self.spec.create(params)
    return self._fresh["state"]

  def place(self, batch: dict) -> dict:
    return jax.device_put(batch, step_lib.batch_shardings(self.options.layout, self.mesh))

  def __call__(self, batch: dict, state: state_lib.TrainState | None = None):
    """One step on the host `batch` from `state` (default: a fresh state)."""
    return self.step(self.fresh_state() if state is None else state, self.place(batch))


def tiny_steps(
  overrides: Mapping[str, Any] | None = None, num_devices: int | None = None
) -> TinyStep:
  """The TinyStep of the tiny config with these overrides on the first `num_devices` devices
  (None: all 8); without arguments the tiny config itself (EBPO, one mini-batch, no
  micro-batches). Compiled once per distinct config (overrides that set a value the config has
  already are none) and device count in a process."""
  config = load_config(ARITH, {**TINY_OVERRIDES, **(overrides or {})})
  key = (config.to_json_best_effort(sort_keys=True), num_devices)
  if key not in _TINY_STEPS:
    _TINY_STEPS[key] = _tiny_step(config, num_devices)
  return _TINY_STEPS[key]


_TINY_STEPS: dict[tuple[str, int | None], TinyStep] = {}


def _tiny_step(config: ml_collections.ConfigDict, num_devices: int | None) -> TinyStep:
  mesh = sharding.make_mesh(dict(config.mesh), jax.devices()[:num_devices])
  model = models.build.make_model(config, V)
  spec = state_lib.StateSpec.from_config(config, NUM_CLUSTERS)
  shardings = spec.shardings(models.build.abstract_params(model, mesh))
  # As the trainer jits it, but nothing donated: tests may share the fresh state.
  options = step_lib.StepOptions.from_config(config, mesh)
  step = step_lib.jit_train_step(model, spec, options, mesh, shardings, donate=False)
  return TinyStep(config, model, spec, mesh, options, step)
