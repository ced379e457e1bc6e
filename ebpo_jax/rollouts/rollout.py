"""What a rollout is: `Rollout`, N prompts x G scored trajectories; `SamplerCall`, the one call a
rollout strategy serves (`worker.SingleTurn`, `episodes.MultiTurn`); `DecodeWeights`, a round's
weights in the sampler's layout."""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ebpo_jax import sharding


@dataclasses.dataclass(frozen=True)
class Rollout:
  """N prompts x G scored completions; rows are prompt-major (`n * G + g`)."""

  # On the host (NumPy / Python), the same on every process.
  rows: list[dict]  # [N] the data rows
  texts: list[str]  # [N*G] decoded completions
  rewards: np.ndarray  # [N, G] float32: the task's verifier, or the weighted sum of rewards.fns
  lengths: np.ndarray  # [N*G] int32 completion lengths (the stop token included)
  errors: int  # failed verifier (or reward function) calls
  # On the devices (global arrays, rows over the mesh's batch axes).
  prompt_ids: jax.Array  # [N, P] int32, left-padded
  prompt_mask: jax.Array  # [N, P] bool
  tokens: jax.Array  # [N*G, T] int32: completions, or multi-turn trajectories (`episodes`)
  mask: jax.Array  # [N*G, T] bool: their tokens
  loss_mask: jax.Array  # [N*G, T] bool: the tokens trained (a trajectory's model tokens)
  old_logps: jax.Array  # [N*G, T] float32: log-probs of the sampling policy at temperature 1
  truncated: jax.Array  # [N*G] bool: no stop token within max_new_tokens (or env.max_tokens)
  nonfinite: jax.Array  # [N*G] bool: the sampler met non-finite logits (the step is bad)
  # On the host: each reward function's values {name: [N, G] float32, NaN where it returned None}
  # (training rollouts with rewards.fns; else empty).
  reward_parts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  # Multi-turn rollouts: the episodes' sums (`episodes.episode_metrics`); else empty.
  stats: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def group_size(self) -> int:
    return self.rewards.shape[1]

  def device_fields(self) -> dict[str, jax.Array]:
    return {f: getattr(self, f) for f in DEVICE_FIELDS}


DEVICE_FIELDS = (
  "prompt_ids",
  "prompt_mask",
  "tokens",
  "mask",
  "loss_mask",
  "old_logps",
  "truncated",
  "nonfinite",
)


@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """The policy's weights in the sampler's layout for one round of sampler calls
  (`RolloutWorker.call_plan` converts once; a round given these converts nothing)."""

  params: Any


class SamplerCall(NamedTuple):
  """One sampler call of a round: host prompts `ids`/`mask` [M, P] (M >= len(rows): a short last
  call is padded with copies of its last prompt, whose completions the strategy drops), the
  weights already in the sampler's layout (converted once per round), and how to sample."""

  params: Any  # in the sampler's layout (`DecodeWeights.params`)
  ids: np.ndarray  # [M, P] int32, left-padded
  mask: np.ndarray  # [M, P] bool
  key: jax.Array
  rows: list[dict]  # [N <= M] the call's data rows
  group_size: int
  greedy: bool
  training: bool  # scored with the reward functions (when configured), else the task's verifier


def concat_rollouts(parts: Sequence[Rollout], mesh: Mesh) -> Rollout:
  """Rollouts of disjoint prompts (same prompt width) as one; the device rows in the step's
  layout (`sharding.row_sharding`)."""
  if len(parts) == 1:
    return parts[0]
  device = _concat_rows(tuple(p.device_fields() for p in parts), mesh)
  return Rollout(
    rows=[row for p in parts for row in p.rows],
    texts=[t for p in parts for t in p.texts],
    rewards=np.concatenate([p.rewards for p in parts]),
    lengths=np.concatenate([p.lengths for p in parts]),
    errors=sum(p.errors for p in parts),
    **device,
    reward_parts={
      k: np.concatenate([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts
    },
    stats={k: sum(p.stats[k] for p in parts) for k in parts[0].stats},
  )


# Small device ops of the host loop, jitted so that Python ints stay static (the loop runs under
# `jax.transfer_guard("disallow")`: an eager op with a Python scalar would be a transfer).


@functools.partial(jax.jit, static_argnums=1)
def _concat_rows(trees: tuple[dict, ...], mesh: Mesh) -> dict:
  return sharding.constrain_rows(jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees), mesh)


@functools.partial(jax.jit, static_argnums=1)
def first_rows(tree: Any, n: int) -> Any:
  """The first n rows of every array of `tree`."""
  return jax.tree.map(lambda x: x[:n], tree)
