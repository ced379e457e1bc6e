"""What the jitted RL step (`trainer.step`) reads of a run's config, frozen once: the loss's
options, the batch's layout and the step's, and the aux it returns beside the metrics."""

import dataclasses

import flax
import jax
import ml_collections
import optax
from jax.sharding import Mesh

from ebpo_jax import sharding
from ebpo_jax.losses import LossOptions
from ebpo_jax.trainer.optimizer import learning_rate_schedule


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """How the step cuts its batch: B prompts x G completions (rows r = b * G + g), `mini_rows`
  rows per optimizer update, `micro_rows` per gradient-accumulation chunk, `epochs` PPO epochs,
  and whether the forward runs each prompt once per group (`shared_prefix`)."""

  num_prompts: int
  group_size: int
  mini_rows: int
  micro_rows: int
  epochs: int
  shared_prefix: bool

  @property
  def num_rows(self) -> int:
    return self.num_prompts * self.group_size

  @property
  def num_updates(self) -> int:
    """Optimizer updates per step: `epochs` x mini-batches."""
    return self.epochs * self.num_rows // self.mini_rows

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, mesh: Mesh | None) -> "StepLayout":
    """The layout of `config.train` / `config.rl` on `mesh`. The shared prefix runs when every
    micro-batch holds whole groups of G > 1: one PPO epoch (`rl.num_iterations == 1`: rows are
    taken in order, unshuffled), micro-batch rows a multiple of G, and, with a mesh, a
    micro-batch's prompts split over the same devices as its rows. Otherwise each row runs its
    prompt and completion in full (the same math, more work)."""
    rl, tc = config.rl, config.train
    g = rl.group_size
    mini_rows = tc.mini_batch_size * g
    micro_rows = tc.micro_batch_size or mini_rows
    shared = rl.num_iterations == 1 and g > 1 and micro_rows % g == 0
    if shared and mesh is not None:
      spec = lambda num: sharding.row_sharding((num,), mesh).spec
      shared = spec(micro_rows // g) == spec(micro_rows)
    return cls(tc.batch_size, g, mini_rows, micro_rows, rl.num_iterations, shared)


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """Everything `train_step` reads of the config, as static values (one compile per set)."""

  loss: LossOptions
  layout: StepLayout
  schedule: optax.Schedule  # the learning rate by update count (`optimizer.learning_rate`)
  recompute_old_logps: bool = False  # rl.recompute_old_logps: PPO's old log-probs the step's own

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, mesh: Mesh | None) -> "StepOptions":
    return cls(
      loss=LossOptions.from_config(config.rl.loss),
      layout=StepLayout.from_config(config, mesh),
      schedule=learning_rate_schedule(config),
      # k > 0: the sampler's policy is k steps behind the trainer's (rollouts.pipeline)
      recompute_old_logps=bool(config.rl.recompute_old_logps) or config.rl.max_staleness > 0,
    )

  @property
  def old_from_first_pass(self) -> bool:
    """Whether PPO's old log-probs are the step's first pass (its params before any update), not
    the sampler's: with `recompute_old_logps`, and with the rollout correction (verl's decoupled
    mode: the correction handles the sampler, PPO's ratio the update's movement)."""
    return self.recompute_old_logps or self.loss.rollout_is != "none"

  def first_pass_forward(self, lora_dropout: float) -> bool:
    """Whether the step runs a forward of its own before the updates for the first pass (no
    dropout): when it needs the first pass and its first update's forward is not it for every
    row (more than one update, or LoRA dropout). With one update and no dropout, that update's
    forward is the first pass at no extra cost (its log-probs, gradient stopped, are the old
    ones: TRL's way); the mismatch metrics always come from it when there is no forward apart."""
    one_clean_update = self.layout.num_updates == 1 and lora_dropout == 0
    return self.old_from_first_pass and not one_clean_update


class StepAux(flax.struct.PyTreeNode):
  """What the step hands the host beside its metrics."""

  advantages: jax.Array  # [B, G] float32: the sample completions table's (logging.samples_every)
  layout: StepLayout = flax.struct.field(pytree_node=False)  # the layout the step ran
