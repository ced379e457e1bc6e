"""The trainer's config and data errors, checked in process before anything compiles; its banner
(the trainer as a process: e2e/test_train.py)."""

import numpy as np
import pytest

from ebpo_jax import data, errors, sharding, trainer
from ebpo_jax.trainer import banner as banner_lib
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import task_rows
from ebpo_jax.trainer.step_options import StepOptions
from tests.helpers.configs import arith_config

# ----------------------------------------------------------------------------- in process

CONFIG_ERRORS = [
  ({"rl.group_size": 1}, "config.rl.group_size=1: must be >= 2"),
  ({"rl.advantage": "ppo"}, "config.rl.advantage='ppo': unknown advantage estimator"),
  ({"rl.ebpo.decay": 1.5}, "config.rl.ebpo.decay=1.5: must lie in (0, 1]"),
  ({"train.batch_size": 12}, "must be divisible by the mesh's data x fsdp = 8"),
  ({"data.order": "random"}, "config.data.order='random'"),
  ({"rl.max_staleness": -1}, "config.rl.max_staleness=-1: must be an int >= 0"),
  ({"rl.max_staleness": True}, "config.rl.max_staleness=True: must be an int >= 0"),
  ({"env.tool_latency_s": -0.1}, "config.env.tool_latency_s=-0.1: must be >= 0"),
  ({"sampling.concurrent_calls": 0}, "config.sampling.concurrent_calls=0: must be >= 1"),
  # The MoE keys, before the workdir is written (they failed as the model was built).
  ({"model.moe_kernel": "cuda"}, "config.model.moe_kernel='cuda': must be one of"),
  ({"model.router_aux_loss_coef": -1.0}, "config.model.router_aux_loss_coef=-1.0: must be"),
  (
    {"model.architecture": "qwen3_moe"},
    "config.model.num_experts=0: must be > 0 for model.architecture='qwen3_moe'",
  ),
  (
    {"model.architecture": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 5},
    "config.model.num_experts_per_tok=5: must lie in [1, model.num_experts=4]",
  ),
  # Values that failed after config.json was written, so that the corrected command was refused
  # (issue 62, item 1): the seed (32 bits: 2**32 would be seed 0's key) and the architecture.
  ({"seed": 2**63}, "config.seed=9223372036854775808: must be an int in [0, 2**32)"),
  ({"model.architecture": "gpt9"}, "config.model.architecture='gpt9': must be one of"),
  # Before the workdir is locked (it left a lock file in a new directory, issue 62).
  ({"workdir.resume_step": -7}, "config.workdir.resume_step=-7: must be >= -1"),
  # Checked before a fresh start too, not only when a resume compares configs (issue 62).
  (
    {"workdir.accept_changes": "rl.grup_size, seed"},
    "config.workdir.accept_changes='rl.grup_size, seed': no config key rl.grup_size",
  ),
]


@pytest.mark.parametrize("overrides, message", CONFIG_ERRORS)
def test_invalid_config_is_one_error_naming_the_key(overrides, message):
  with pytest.raises(errors.ConfigError) as error:
    config_lib.check_config(arith_config(overrides), num_devices=8)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_concurrent_sampler_calls_are_refused_on_more_than_one_process(monkeypatch):
  config = arith_config({"sampling.concurrent_calls": 2})
  config_lib.check_config(config, num_devices=8)  # one process: fine
  monkeypatch.setattr(config_lib.jax, "process_count", lambda: 2)
  with pytest.raises(errors.ConfigError, match="sampling.concurrent_calls=2: must be 1 on more"):
    config_lib.check_config(config, num_devices=8)


def test_a_split_mesh_is_refused_on_more_than_one_process(monkeypatch):
  # jax moves arrays between disjoint device sets of several processes only where both sides'
  # shardings are the same (and on some runtimes): the sampler's are not the trainer's, so the
  # first weight transfer failed after the warm start instead of before anything ran.
  config = arith_config({"mesh.rollout_devices": 4, "mesh.fsdp": -1, "train.batch_size": 4})
  config_lib.check_config(config, num_devices=8)  # one process: fine
  monkeypatch.setattr(config_lib.jax, "process_count", lambda: 2)
  with pytest.raises(errors.ConfigError, match="mesh.rollout_devices=4: must be 0 on more than"):
    config_lib.check_config(config, num_devices=8)


def test_a_staleness_implies_the_trainers_own_old_log_probs():
  assert not StepOptions.from_config(arith_config({}), None).recompute_old_logps
  assert StepOptions.from_config(arith_config({"rl.max_staleness": 2}), None).recompute_old_logps


def test_a_split_mesh_gives_the_sampler_the_last_devices_and_the_banner_says_so():
  mesh, rollouts = sharding.make_meshes({"data": 1, "fsdp": -1, "tensor": 2, "rollout_devices": 4})
  assert [d.id for d in mesh.devices.flat] == [0, 1, 2, 3]
  assert [d.id for d in rollouts.devices.flat] == [4, 5, 6, 7]
  assert dict(rollouts.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
  lines = banner_lib.startup_lines(
    mesh=mesh, rollout_mesh=rollouts, num_params=1, workdir="w", config="c", resume_step=None
  )
  assert lines[1] == (
    "mesh: data=1 x fsdp=2 x tensor=2 on devices 0-3; sampler: data=2 x fsdp=1 x tensor=2 "
    "on devices 4-7"
  )
  assert sharding.make_meshes({"fsdp": -1})[1] is None
  with pytest.raises(errors.ConfigError, match=r"mesh.rollout_devices=8: must lie in \[0, 8\)"):
    config_lib.check_config(arith_config({"mesh.rollout_devices": 8}), num_devices=8)


def test_a_missing_init_from_run_stops_before_the_workdir_is_touched(tmp_path):
  workdir = tmp_path / "run"
  config = arith_config({"model.init_from": str(tmp_path / "nonexistent")})
  with pytest.raises(errors.BadInput) as error:
    trainer.run(config, str(workdir))
  assert str(error.value).startswith("config.model.init_from=") and "\n" not in str(error.value)
  assert "no checkpoints/ directory" in str(error.value)
  assert not workdir.exists()  # the corrected command then starts here as on a new workdir


def test_malformed_data_row_names_file_and_line(tmp_path):
  rows = tmp_path / "rows.jsonl"
  rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
  with pytest.raises(data.DataError, match=f"{rows}:2:"):
    task_rows.load_task_and_rows(arith_config({"data.path": str(rows)}))


# ----------------------------------------------------------------------------- the CLI


def test_banner_says_how_many_parameters_lora_trains():
  assert banner_lib.parameters_line(134_515_008) == "parameters: 134,515,008 (134.5M)"
  # SmolLM2-135M with rank-8 adapters on its 7 projections: 30 layers x 8 x (1152 + 768 x 2 +
  # 1152 + 2112 x 3) = 2,442,240 adapter scalars beside the 134,515,008 of the base.
  assert banner_lib.parameters_line(136_957_248, lora_rank=8, trained_params=2_442_240) == (
    "parameters: 136,957,248 (137.0M), LoRA rank 8: 2,442,240 trained (2.4M, 1.8%), "
    "134,515,008 frozen"
  )
  stacked = {  # a scanned layer stack of 3 layers: kernel [3, 4, 6], adapters at rank 2
    "q_proj": {
      "kernel": np.zeros((3, 4, 6)),
      "lora_a": np.zeros((3, 4, 2)),
      "lora_b": np.zeros((3, 2, 6)),
    },
    "norm": {"scale": np.zeros(4)},
  }
  assert banner_lib.count_params(stacked) == 72 + 24 + 36 + 4
  assert banner_lib.count_adapters(stacked) == 24 + 36
  assert banner_lib.count_adapters({"q_proj": {"kernel": np.zeros((4, 6))}}) == 0
