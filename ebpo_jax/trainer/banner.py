"""What a run says as it starts: devices and mesh, parameter count, workdir, config, and whether it
resumes; logged at INFO (absl, stderr), which `cli.entry_point` shows for the project's lines."""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh

from ebpo_jax import models


def config_name(filename: str, overrides: Mapping[str, Any]) -> str:
  """`FILE.py[:ARG]` and its `--config.KEY=VALUE` overrides, as the command line gave them."""
  return " ".join([filename, *(f"--config.{k}={v}" for k, v in sorted(overrides.items()))])


def count_params(params: Any) -> int:
  """Number of scalars in a params pytree (arrays or `jax.ShapeDtypeStruct`s)."""
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


def count_adapters(params: Any) -> int:
  """Number of scalars in the LoRA adapters of a params pytree (0 without adapters)."""
  return count_params(models.lora.split(params)[0])


def parameters_line(num_params: int, *, lora_rank: int = 0, trained_params: int = 0) -> str:
  """`parameters: N (N M)`; under LoRA (`lora_rank > 0`) also how many of them are trained (the
  adapters, `trained_params`) and how many frozen (the base)."""
  line = f"parameters: {num_params:,} ({num_params / 1e6:.1f}M)"
  if lora_rank > 0:
    frozen = num_params - trained_params
    line += (
      f", LoRA rank {lora_rank}: {trained_params:,} trained ({trained_params / 1e6:.1f}M, "
      f"{trained_params / num_params:.1%}), {frozen:,} frozen"
    )
  return line


def startup_lines(
  *,
  mesh: Mesh,
  num_params: int,
  workdir: str,
  config: str,
  resume_step: int | None,
  lora_rank: int = 0,
  trained_params: int = 0,
  rollout_mesh: Mesh | None = None,
) -> list[str]:
  """The banner: one line each for devices, mesh, parameters (under LoRA: trained and frozen;
  `parameters_line`), workdir, config and the start."""
  devices = jax.devices()
  kind = devices[0].device_kind
  start = "starting fresh" if resume_step is None else f"resuming from step {resume_step}"
  return [
    f"devices: {len(devices)} {devices[0].platform} ({kind}), {jax.process_count()} process(es)",
    "mesh: "
    + _mesh_text(mesh)
    + ("" if rollout_mesh is None else f"; sampler: {_mesh_text(rollout_mesh)}"),
    parameters_line(num_params, lora_rank=lora_rank, trained_params=trained_params),
    f"workdir: {workdir}",
    f"config: {config}",
    start,
  ]


def _mesh_text(mesh: Mesh) -> str:
  sizes = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
  ids = [d.id for d in mesh.devices.flat]
  return sizes if len(ids) == len(jax.devices()) else f"{sizes} on devices {ids[0]}-{ids[-1]}"


def log_startup(**kwargs: Any) -> None:
  """Logs `startup_lines(**kwargs)` at INFO."""
  for line in startup_lines(**kwargs):
    logging.info("%s", line)
