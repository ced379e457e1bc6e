"""A run that starts from another run's params (`model.init_from`, as an ablation's variants start
from their seed's warm start): under LoRA, from that run's adapters on the base it trained on."""

import jax
import numpy as np

from ebpo_jax import models, sharding, tasks
from ebpo_jax.trainer import policy, task_rows
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.configs import arith_config


def _initial_params(config):
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.from_config(config.task)
  model = models.build.make_model(config, task_rows.load_tokenizer(config, task).vocab_size)
  return policy.initial_params(config, model, mesh)


def _assert_equal(got, want) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_lora_run_from_a_lora_run_starts_from_its_adapters_on_its_model(
  lora_run_from_a_model_directory, tiny_llama_dir
):
  run_dir, _, params = lora_run_from_a_model_directory
  config = arith_config(
    {"model.path": str(tiny_llama_dir), "model.lora.rank": 4, "model.init_from": str(run_dir)}
  )
  _assert_equal(_initial_params(config), params)


def test_a_lora_run_from_a_lora_run_on_a_random_base_takes_that_runs_base(tmp_path):
  # The random base comes from the warm run's seed, not from this run's own.
  warm = {"model.lora.rank": 4, "seed": 3}
  _, params = save_checkpoint(tmp_path, arith_config(warm), perturb=0.5)
  config = arith_config({"model.lora.rank": 4, "seed": 0, "model.init_from": str(tmp_path)})
  _assert_equal(_initial_params(config), params)


def test_a_random_init_compiles_once_per_model_and_mesh_whatever_the_seed():
  # A process builds the same model's params more than once (a LoRA run's base and adapters, a
  # run and its reference, an evaluation): each build after the first reuses the compiled init,
  # which is mostly threefry's hashing and the slowest program to compile at a tiny model's size.
  config = arith_config({"model.lora.rank": 4})
  mesh = sharding.make_mesh(dict(config.mesh))
  model = models.build.make_model(config, tasks.get_task("arithmetic").tokenizer.vocab_size)
  first = models.build.fresh_adapters(config, model, mesh)
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    other = arith_config({"model.lora.rank": 4, "seed": 7})
    again = models.build.make_model(other, tasks.get_task("arithmetic").tokenizer.vocab_size)
    second = models.build.fresh_adapters(other, again, mesh)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert "/jax/core/compile/backend_compile_duration" not in compiles
  a, b = jax.tree.leaves(first), jax.tree.leaves(second)
  assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))  # another seed
