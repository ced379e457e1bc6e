"""The sequence layout shared by the sampler and the trainer: left-padded prompts, then completions.

A prompt of length p, left-padded to width P, has RoPE positions 0 .. p-1 on its real tokens
(`prompt_positions`); completion token n sits at slot P + n, at position p + n, and is predicted by
the logits at slot P + n - 1. Rows are prompt-major: row r = b * G + g holds sample g of prompt b.
The sampler (`sampling.generate`) decodes at these positions and the trainer's forward
(`build_sequences`, or the shared-prefix `build_packed_sequences`) reads the same tokens at them.
"""

import jax
import jax.numpy as jnp


def prompt_positions(mask_bp: jax.Array) -> jax.Array:
  """RoPE positions of left-padded prompts: 0 at the first real token (pads get 0 too)."""
  return jnp.maximum(jnp.cumsum(mask_bp.astype(jnp.int32), axis=-1) - 1, 0)


def build_sequences(
  prompt_ids_bp, prompt_mask_bp, tokens_rn, mask_rn, group_size: int, loss_mask_rn=None
) -> dict:
  """Prompt (left-padded, repeated G times) + completion, with the positions the sampler used.

  Row r = b * G + g holds sample g of prompt b; completion token n sits at slot P + n, at RoPE
  position `prompt_len + n`, and is predicted by the logits at slot P + n - 1. `mask_rn` marks
  the completion's tokens (attention), `loss_mask_rn` those trained (default: all of them; a
  multi-turn trajectory leaves out its observation tokens).
  """
  ids = jnp.repeat(prompt_ids_bp, group_size, axis=0)
  pmask = jnp.repeat(prompt_mask_bp, group_size, axis=0)
  prompt_len = pmask.sum(-1, keepdims=True)
  completion_pos = prompt_len + jnp.arange(tokens_rn.shape[1])[None]
  return {
    "input_ids": jnp.concatenate([ids, tokens_rn], axis=1),
    "positions": jnp.concatenate([prompt_positions(pmask), completion_pos], axis=1).astype(
      jnp.int32
    ),
    "attention_mask": jnp.concatenate([pmask, mask_rn], axis=1),
    "targets": tokens_rn,
    "loss_mask": mask_rn if loss_mask_rn is None else loss_mask_rn,
  }


def build_packed_sequences(
  prompt_ids_bp, prompt_mask_bp, tokens_rn, mask_rn, group_size: int, loss_mask_rn=None
) -> dict:
  """`build_sequences` in the shared-prefix layout (`models.shared_prefix`): row b holds prompt b
  once, then its G completions, each at the positions `build_sequences` gives it. `input_ids`,
  `positions` and `attention_mask` are `[B, P + G*N]`; `targets` and `loss_mask` `[B*G, N]`
  (`loss_mask_rn` as for `build_sequences`)."""
  num_prompts, n = prompt_ids_bp.shape[0], tokens_rn.shape[1]
  packed = lambda x_rn: x_rn.reshape(num_prompts, group_size * n)
  completion_pos = prompt_mask_bp.sum(-1, keepdims=True) + jnp.arange(n)[None]
  positions = [prompt_positions(prompt_mask_bp), jnp.tile(completion_pos, (1, group_size))]
  return {
    "input_ids": jnp.concatenate([prompt_ids_bp, packed(tokens_rn)], axis=1),
    "positions": jnp.concatenate(positions, axis=1).astype(jnp.int32),
    "attention_mask": jnp.concatenate([prompt_mask_bp, packed(mask_rn)], axis=1),
    "targets": tokens_rn,
    "loss_mask": mask_rn if loss_mask_rn is None else loss_mask_rn,
  }
