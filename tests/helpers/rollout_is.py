"""NumPy reference of the rollout correction (`losses.rollout_is_weights`), shared by the loss and
train-step tests."""

import numpy as np


def np_rollout_is(logps, sampler, mask, mode, cap):
  """NumPy float64 reference of losses.rollout_is_weights: (weights, clipped) per token."""
  d = np.where(mask, np.asarray(logps, np.float64) - np.asarray(sampler, np.float64), 0.0)
  r = np.exp(d)
  if mode == "none":
    w, clipped = np.ones_like(d), np.zeros(d.shape, bool)
  elif mode == "token_tis":
    w, clipped = np.minimum(r, cap), r > cap
  else:  # the geometric mean of each sequence's ratios over its masked tokens
    geo = np.exp(d.sum(-1) / np.maximum(mask.sum(-1), 1))
    kept = (geo >= 1 / cap) & (geo <= cap)
    w = np.repeat(kept[:, None], d.shape[1], 1).astype(np.float64)
    clipped = ~np.repeat(kept[:, None], d.shape[1], 1)
  return np.where(mask, w, 0.0), clipped
