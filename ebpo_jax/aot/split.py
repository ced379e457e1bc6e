"""A split slice (`mesh.rollout_devices` = N > 0): the train step compiled on the trainer's
sub-mesh, the sampler on the last N chips (`sharding.make_meshes`, as the trainer splits its
devices), the weight transfer between them modelled from shapes and the slice's links, and the
asynchronous RL step against the synchronous one on the whole slice (compiled too).

The transfer is what the trainer does once per round (`rollouts.worker.call_plan`): the trained
params, in their own dtype, put on the sampler's mesh with each leaf's PartitionSpec, so every
sampler chip receives its shard (the whole weights over 'tensor'). Its time is a model, not a
compile (the compiler sees no program that spans both sub-meshes): the larger of
- the bytes that cross the cut between the two sub-meshes over the cut's links (neighbour chips,
  one on each side, counted from the chips' torus coordinates; wraparound links not counted, so
  the time is an upper bound where the slice has them), and
- one sampler chip's bytes over its own links (`Chip.ici_bandwidth`),
each link carrying `ici_bandwidth / (2 x torus dimensions)`. Beside it, `transfer_min_*`: one copy
of the weights in the sampler's dtype across the cut, then each chip's shard over its own links
(a broadcast on the sampler's side), what a jitted transfer over the union mesh could reach.

The asynchronous step (k = `rl.max_staleness` > 0) is the slower of the train step (with the
copy of its params that the producer samples with, one read and one write of the trained params'
shard at HBM bandwidth) and the rollout round, plus the transfer: counted as not overlapping
either, though the producer thread makes it beside the train step. At k = 0 the two sides run in
turn: their sum.
"""

import math

import jax
import ml_collections

from ebpo_jax import sharding
from ebpo_jax.aot import programs, roofline
from ebpo_jax.aot.topology import Chip, Slice, topology_devices


def cut_links(side: list[jax.Device], other: list[jax.Device]) -> int:
  """Links between chips of `side` and of `other`: pairs one step apart along one torus axis."""
  others = {tuple(d.coords) for d in other}
  links = 0
  for device in side:
    c = tuple(device.coords)
    for axis in range(len(c)):
      for step in (-1, 1):
        links += (*c[:axis], c[axis] + step, *c[axis + 1 :]) in others
  return links


def transfer(trainer: programs.Target, sampler: programs.Target) -> dict:
  """The weight transfer's bytes and modelled time (the module's docstring)."""
  chip = trainer.tpu.chip
  links = cut_links(list(trainer.mesh.devices.flat), list(sampler.mesh.devices.flat))
  link_bandwidth = chip.ici_bandwidth / (2 * chip.dims)
  cut_bandwidth = links * link_bandwidth
  per_chip = programs.shard_bytes(sampler.params)
  total = sampler.mesh.size * per_chip
  itemsize = programs.sampler_dtype(sampler).itemsize
  leaves = jax.tree.leaves(sampler.params)
  one_copy = sum(math.prod(x.shape) * itemsize for x in leaves)
  min_per_chip = one_copy / sampler.mesh.shape["tensor"]
  return {
    "cut_links": links,
    "cut_bandwidth": cut_bandwidth,
    "transfer_bytes_per_chip": per_chip,
    "transfer_bytes": total,
    "transfer_s": max(total / cut_bandwidth, per_chip / chip.ici_bandwidth),
    "transfer_min_bytes": one_copy,
    "transfer_min_s": max(one_copy / cut_bandwidth, min_per_chip / chip.ici_bandwidth),
  }


def _synchronous(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` on the whole slice, synchronous: what the split is compared with."""
  config = config.copy_and_resolve_references()
  config.mesh.rollout_devices = 0
  config.rl.max_staleness = 0
  return config


def check_split(config: ml_collections.ConfigDict, tpu: Slice, prompt_len: int = 0) -> dict:
  """The report of a split slice: `programs.summarize`'s keys for the two sides (the train step on
  the trainer's chips, `mesh` its; the sampler on its own, `sampler_mesh`), `split`
  (the sub-meshes, the transfer, the asynchronous step, `_split_step`) and `synchronous`
  (`programs.check` of the config on the whole slice, synchronous)."""
  train_mesh, sampler_mesh = sharding.make_meshes(dict(config.mesh), topology_devices(tpu))
  trainer = programs.make_target(config, tpu, prompt_len, mesh=train_mesh)
  sampler = programs.make_target(config, tpu, trainer.prompt_len, mesh=sampler_mesh)
  train, rollout = programs.compile_phases(trainer, sampler)
  # Beside a sampler call on its own chips wait only the step's rollouts drawn so far: the train
  # state stays on the trainer's.
  batch = programs.shard_bytes(programs.abstract_step_batch(sampler))
  programs.add_waiting(config, rollout, programs.rounds_per_step(config) * batch)
  report = programs.summarize(config, tpu, trainer.prompt_len, train, rollout)
  report["mesh"], report["sampler_mesh"] = dict(train_mesh.shape), dict(sampler_mesh.shape)
  synchronous = programs.check(_synchronous(config), tpu, trainer.prompt_len)
  report["split"] = {
    "trainer_chips": train_mesh.size,
    "sampler_chips": sampler_mesh.size,
    "trainer_devices": [d.id for d in train_mesh.devices.flat],  # what each side compiled for
    "sampler_devices": [d.id for d in sampler_mesh.devices.flat],
    **transfer(trainer, sampler),
  }
  if report.get("rl_step_roofline_s") is not None:
    report.pop("rl_step_roofline_s_max_refill")  # the sides' sum: not the split's
    step = _split_step(config, tpu.chip, train, rollout, report["split"], synchronous)
    report.update(step)
  report["synchronous"] = synchronous
  return report


def _split_step(config, chip: Chip, train: dict, rollout: dict, split: dict, sync: dict) -> dict:
  """The RL step of the split (the module's docstring), its shares, against its limit and the
  synchronous step on the whole slice."""
  overlapped = config.rl.max_staleness > 0
  copy_s = 2 * train["params_bytes"] / chip.hbm_bandwidth if overlapped else 0.0
  trainer = [(train["roofline_s"], train["roofline_shares"]), (copy_s, {"modelled": 1.0})]
  rounds = programs.round_parts(rollout)
  trainer_s, round_s = sum(s for s, _ in trainer), sum(s for s, _ in rounds)
  longer = trainer if trainer_s >= round_s else rounds
  sides = longer if overlapped else trainer + rounds  # at k = 0 the two sides run in turn
  path = [*sides, (split["transfer_s"], {"modelled": 1.0})]
  step_s = sum(s for s, _ in path)
  split.update(
    {
      "overlapped": overlapped,
      "copy_s": copy_s,
      "trainer_s": trainer_s,
      "round_s": round_s,
      "rl_step_s": step_s,
      "rl_step_min_transfer_s": step_s - split["transfer_s"] + split["transfer_min_s"],
    }
  )
  out = {
    "rl_step_roofline_s": step_s,
    "rl_step_roofline_shares": roofline.weighted_shares(path),
  }
  if "limit_s" in train and "limit_s" in rollout:
    calls = rollout["calls_per_round"] * rollout["limit_s"]
    limit = max(train["limit_s"], calls) if overlapped else train["limit_s"] + calls
    out["rl_step_limit_s"] = limit
    out["rl_step_roofline_to_limit"] = step_s / limit
  if sync.get("rl_step_roofline_s") is not None:
    split["synchronous_rl_step_s"] = sync["rl_step_roofline_s"]
    split["speedup"] = sync["rl_step_roofline_s"] / step_s
  return out
