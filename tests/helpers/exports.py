"""An exported model against ours: logits of both sides and their distance."""

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch
import transformers

MAX_REL_ERR = 1e-4
# fp32 on both sides: the logits of our decoder and of torch agree to ~1e-6 (O(1) logits).
MAX_ABS_DIFF = 1e-4


def our_logits(model, params, ids: np.ndarray) -> np.ndarray:
  """Our decoder's logits of `ids`."""
  return np.asarray(model.apply({"params": params}, ids))


def jitted_logits(model, params, ids) -> np.ndarray:
  """Our decoder's logits of `ids` (int32), by one jitted apply."""
  return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids, jnp.int32)))


def torch_logits(path, ids: np.ndarray) -> np.ndarray:
  """The logits of the transformers model that `path` holds, in float32."""
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return torch_model_logits(hf, ids)


def torch_model_logits(hf_model, ids) -> np.ndarray:
  """A torch model's logits of `ids`."""
  with torch.no_grad():
    return hf_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def load_peft_model(base_dir, adapter_dir):
  """The transformers model of `base_dir` (float32) with PEFT's adapter of `adapter_dir` on it."""
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
  return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def random_ids(vocab_size: int, shape=(2, 12)) -> np.ndarray:
  """Token ids in [3, vocab_size) from seed 0."""
  return np.random.default_rng(0).integers(3, vocab_size, shape)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
  """The largest absolute difference, relative to the largest reference value."""
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.max(np.abs(a - b)))


def assert_same_logits(ours: np.ndarray, theirs: np.ndarray, what: str = "") -> None:
  """The two sides' logits agree to MAX_ABS_DIFF (`what`, and the difference, if they do not)."""
  diff = max_abs_diff(ours, theirs)
  assert diff < MAX_ABS_DIFF, (what, diff)
