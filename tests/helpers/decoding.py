"""The sampler's use of the KV cache, by hand: the decoder's logits from a prefill and then one
token at a time, for comparison with one full forward."""

import numpy as np


def prefill_then_decode(apply, params, ids, positions, mask, cache, *, prefill: int, end: int):
  """(logits [B, end, V], the cache after them) of `apply` (a cached decoder's apply) over tokens
  [0, prefill) at once, then each of [prefill, end) alone."""
  p = slice(0, prefill)
  logits, cache = apply({"params": params}, ids[:, p], positions[:, p], mask[:, p], cache)
  steps = [logits]
  for t in range(prefill, end):
    s = slice(t, t + 1)
    logits, cache = apply({"params": params}, ids[:, s], positions[:, s], mask[:, s], cache)
    steps.append(logits)
  return np.concatenate([np.asarray(x) for x in steps], axis=1), cache
