"""A trainer workdir's checkpoints written and restored in process, as the trainer does; and a
small state of plain weights for the Checkpointer's own tests."""

import functools
import pathlib

import jax
import jax.numpy as jnp

from ebpo_jax import checkpoint, models, sharding, tasks
from ebpo_jax.trainer import policy, task_rows
from ebpo_jax.trainer import state as state_lib
from tests.helpers.tiny_step import NUM_CLUSTERS


def restore_run_state(workdir, config, step: int) -> state_lib.TrainState:
  """Checkpoint `step` of a trainer `workdir` run under `config` (on this process's 8 devices),
  as the trainer restores it: into the abstract state, without the LoRA base."""
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.from_config(config.task)
  model = models.build.make_model(config, task_rows.load_tokenizer(config, task).vocab_size)
  spec = state_lib.StateSpec.from_config(config, len(task.cluster_names))
  abstract = spec.abstract(models.build.abstract_params(model, mesh))
  with checkpoint.Checkpointer(pathlib.Path(workdir) / "checkpoints", read_only=True) as ckpt:
    state, _ = ckpt.restore(step, state_lib.checkpointed(abstract))
  return state


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
  copy = jax.tree.map(jnp.copy, params)  # the spec's `create` donates its params
  state = state_lib.StateSpec.from_config(config, NUM_CLUSTERS).create(copy)
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
    ckpt.save(step, state_lib.checkpointed(state), config=config.to_dict(), force=True)
  return model, params


def weights(seed: float, size: int) -> dict:
  """A small state to checkpoint: `size` float32 weights (arange + `seed`) and the step `seed`."""
  return {"w": jnp.arange(size, dtype=jnp.float32) + seed, "step": jnp.int32(seed)}


def weights_abstract(size: int) -> dict:
  """The shapes and dtypes of `weights(_, size)` on the first device: what a restore fills."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes = jax.eval_shape(functools.partial(weights, size=size), 0.0)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
