"""The supervised warm start: a few steps of prompt -> answer before RL (`config.sft`)."""

import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
import tqdm

from ebpo_jax import models, sampling
from ebpo_jax.trainer import rollouts as rollouts_lib
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer.step import completion_logprobs


def _targets(sampler: rollouts_lib.Sampler, rows: Sequence[dict], max_len: int):
  """The rows' answers (the task's target format + EOS) as `(ids, mask)` [N, max_len]."""
  tokenizer = sampler.tokenizer
  targets = np.full((len(rows), max_len), tokenizer.pad_id, np.int32)
  target_mask = np.zeros((len(rows), max_len), bool)  # pad may equal EOS: mask by length
  for i, row in enumerate(rows):
    ids = tokenizer.encode(sampler.task.format_target(row))[: max_len - 1] + [tokenizer.eos_id]
    targets[i, : len(ids)] = ids
    target_mask[i, : len(ids)] = True
  return targets, target_mask


def warm_start(
  config: ml_collections.ConfigDict,
  model: models.Decoder,
  params: Any,
  rows: Sequence[dict],
  sampler: rollouts_lib.Sampler,
) -> Any:
  """`params` after `config.sft.num_steps` supervised steps (AdamW) on the rows' answers."""
  sc = config.sft
  if sc.num_steps == 0:
    return params
  optimizer = optax.adamw(sc.learning_rate)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sft_step(params, opt_state, batch):
    def loss_fn(p):
      seqs = sampling.build_sequences(
        batch["prompt_ids"], batch["prompt_mask"], batch["targets"], batch["target_mask"], 1
      )
      logps = completion_logprobs(model, p, seqs)
      return -(logps * seqs["loss_mask"]).sum() / seqs["loss_mask"].sum()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = state_lib.init_opt_state(optimizer, params)
  rng = np.random.default_rng(config.seed)
  for _ in tqdm.trange(sc.num_steps, desc="warm start", disable=jax.process_index() != 0):
    batch_rows = [rows[i] for i in rng.integers(0, len(rows), sc.batch_size)]
    prompt_ids, prompt_mask = sampler.prompts(batch_rows)
    targets, target_mask = _targets(sampler, batch_rows, config.sampling.max_new_tokens)
    batch = {
      "prompt_ids": prompt_ids,
      "prompt_mask": prompt_mask,
      "targets": targets,
      "target_mask": target_mask,
    }
    params, opt_state, loss = sft_step(params, opt_state, batch)
  if jax.process_index() == 0:
    print(
      f"warm start: {sc.num_steps} supervised steps, final loss {float(loss):.4f}", file=sys.stderr
    )
  return params
