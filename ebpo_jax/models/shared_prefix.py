"""The shared-prefix layout: each prompt and its G completions in one row, the prompt run once.

A GRPO-style batch holds G completions per prompt. Under a causal decoder a prompt's activations do
not depend on its completions, so the training forward need not run each prompt G times: row b of
a packed batch `[B, P + G * N]` holds prompt b (P tokens, left-padded) followed by its G
completions (N tokens each; `sequences.build_packed_sequences`). The per-token parts of a layer
(norms, projections, MLP) run on the packed rows as they are; attention splits them: the prompt
attends causally over itself, and each completion over its prompt's keys (the same P keys for all
G) then its own N keys, causally. The logits at valid positions equal those of the G full
sequences prompt + completion (`sequences.build_sequences`), and the gradient sums over the G uses
of each prompt; at a batch of 8 prompts x G=4 with P = N = 32 the layers run 37.5% fewer tokens.

Logits at masked positions (pads, a completion's tail after it stopped) are not those of the full
layout: a pad query sees no key in either, and the keys it then averages differ. They predict no
token the loss reads. LoRA dropout draws one mask per packed token, so a prompt token is dropped
alike for its G completions (the full layout drops each copy on its own): both are dropout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class PrefixGroups(NamedTuple):
  """The static layout of a packed row: `prompt_len` P tokens, then `group_size` G completions."""

  prompt_len: int
  group_size: int


class GroupedValid(NamedTuple):
  """Attention validity in the packed layout, in the attention backend's form
  (`models.attention.layout`): allowed (query, key) pairs, `prompt` [B, P, P] and `completions`
  [B*G, N, P+N] (whose keys are the prompt's P then the completion's own N), or the same parts'
  query and key token masks."""

  prompt: Any
  completions: Any

  @property
  def groups(self) -> PrefixGroups:
    num_prompts, prompt_len = jax.tree.leaves(self.prompt)[0].shape[:2]
    return PrefixGroups(prompt_len, jax.tree.leaves(self.completions)[0].shape[0] // num_prompts)


def split(x_bt: jax.Array, groups: PrefixGroups) -> tuple[jax.Array, jax.Array]:
  """Packed `[B, P + G*N, ...]` -> (prompts `[B, P, ...]`, completions `[B*G, N, ...]`)."""
  b, t, *rest = x_bt.shape
  g = groups.group_size
  n = (t - groups.prompt_len) // g
  return x_bt[:, : groups.prompt_len], x_bt[:, groups.prompt_len :].reshape(b * g, n, *rest)


def merge(prompts_bp: jax.Array, completions_rn: jax.Array) -> jax.Array:
  """The inverse of `split`: the packed `[B, P + G*N, ...]`."""
  b, p, *rest = prompts_bp.shape
  packed = completions_rn.reshape(b, -1, *rest)
  return jnp.concatenate([prompts_bp, packed.astype(prompts_bp.dtype)], axis=1)


def prefixed(prompts_bksd: jax.Array, completions_rknd: jax.Array) -> jax.Array:
  """Heads-first keys (or values) of each completion's attention: its prompt's `[B, Hkv, P, D]`
  (repeated for the G completions) then its own `[B*G, Hkv, N, D]` -> `[B*G, Hkv, P + N, D]`."""
  g = completions_rknd.shape[0] // prompts_bksd.shape[0]
  return jnp.concatenate([jnp.repeat(prompts_bksd, g, axis=0), completions_rknd], axis=2)


def causal_pairs(key_mask_bs: jax.Array, query_mask_bt: jax.Array) -> jax.Array:
  """`[B, T, S]` bool: the T queries are the last T of the S keys; a valid query sees the valid
  keys at or before it (the full layout's rule, `attention.valid_pairs`, is T = S)."""
  t, s = query_mask_bt.shape[1], key_mask_bs.shape[1]
  causal_ts = jnp.arange(s)[None, :] <= (s - t) + jnp.arange(t)[:, None]
  return causal_ts[None] & key_mask_bs[:, None, :] & query_mask_bt[:, :, None]


def query_key_masks(attention_mask_bt: jax.Array, groups: PrefixGroups):
  """The packed rows' `(query, key)` token masks from their token mask `[B, P + G*N]`: the
  prompts' (`[B, P]` twice) and the completions' (`[B*G, N]`, `[B*G, P + N]`)."""
  prompt_mask, completion_mask = split(attention_mask_bt, groups)
  keys = jnp.concatenate(
    [jnp.repeat(prompt_mask, groups.group_size, axis=0), completion_mask], axis=1
  )
  return (prompt_mask, prompt_mask), (completion_mask, keys)


def valid_pairs(attention_mask_bt: jax.Array, groups: PrefixGroups) -> GroupedValid:
  """The packed rows' allowed (query, key) pairs from their token mask `[B, P + G*N]`."""
  (prompt_mask, _), (completion_mask, keys) = query_key_masks(attention_mask_bt, groups)
  return GroupedValid(
    prompt=causal_pairs(prompt_mask, prompt_mask),
    completions=causal_pairs(keys, completion_mask),
  )


def predicting_states(x_bte: jax.Array, groups: PrefixGroups) -> jax.Array:
  """The hidden states `[B*G, N, E]` that predict the N completion tokens: the prompt's last one
  (for token 0, the same for the G completions), then completion positions 0 .. N-2."""
  prompts, completions = split(x_bte, groups)
  last = jnp.repeat(prompts[:, -1:], groups.group_size, axis=0)
  return jnp.concatenate([last, completions[:, :-1]], axis=1)
