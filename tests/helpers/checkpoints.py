"""A trainer workdir's checkpoints written and restored in process, as the trainer does."""

import pathlib

import jax
import jax.numpy as jnp

from ebpo_jax import advantages, checkpoint, models, sharding, tasks
from ebpo_jax.trainer import optimizer as optimizer_lib
from ebpo_jax.trainer import policy, task_rows
from ebpo_jax.trainer import state as state_lib
from tests.helpers.tiny_step import NUM_CLUSTERS


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
