"""The supervised warm start: a few steps of prompt -> answer before RL (`config.sft`).

Its batches are `data.make_batches`' grain iterator in the `sampled` order (each a uniform draw
with replacement of `sft.batch_size` training rows, by a generator seeded by `seed`). It keeps its
own checkpoint (params, optimizer state and that iterator's state, in `WORKDIR/warm_start/`):
written when it finishes, so a run that dies before its first RL checkpoint does not redo it, and
when SIGTERM arrives mid-way, so a restarted run continues from that step with the same batches.
The trainer deletes it (`discard`) once the RL checkpoint of step 0, which holds the same params,
is written.
"""

import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import optax
import tqdm

from ebpo_jax import checkpoint, data, files, losses, models, process
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.rollouts.worker import RolloutWorker
from ebpo_jax.sampling import sequences
from ebpo_jax.trainer import optimizer as optimizer_lib
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer.step import completion_logits

WARM_START_DIR = "warm_start"


def discard(workdir: str) -> None:
  """Deletes the warm start's checkpoint (on process 0): a whole copy of the params and the
  optimizer state, no longer needed once an RL checkpoint exists."""
  if jax.process_index() == 0:
    files.remove_tree(files.join(workdir, WARM_START_DIR))


def metrics_resume_step(config: ml_collections.ConfigDict, workdir: str) -> int:
  """The metrics step that a fresh RL start keeps metrics.jsonl's lines up to: the warm start's
  lines of the steps its own checkpoint holds (they are not done again; the later ones are),
  none when it has none."""
  directory = files.join(workdir, WARM_START_DIR)
  done = 0
  if config.sft.num_steps and files.isdir(directory):
    ckpt = checkpoint.Checkpointer(directory, max_to_keep=1)
    done = ckpt.latest_step() or 0
    ckpt.close()
  return metrics_lib.sft_step(done, config.sft.num_steps)


def _abstract_sft_state(optimizer, model: models.Decoder, mesh) -> dict:
  """{"params", "opt_state"} of the warm start as `jax.ShapeDtypeStruct`s with shardings."""
  params = models.build.abstract_params(model, mesh)
  shardings = optimizer_lib.opt_state_shardings(optimizer, params)
  opt_state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(optimizer.init, params),
    shardings,
  )
  return {"params": params, "opt_state": opt_state}


def _batches(config, rows: Sequence[dict]):
  """The warm start's batches of row indices, from the first."""
  sc = config.sft
  return data.make_batches(len(rows), batch_size=sc.batch_size, order="sampled", seed=config.seed)


def _resume_or_start(config, model, mesh, optimizer, ckpt, rows) -> tuple[int, Any, Any, Any]:
  """(steps done, params, opt_state, batches): the warm start's own checkpoint (its batches where
  it stopped), else the initial params and the batches from the first."""
  batches = _batches(config, rows)
  try:
    abstract = _abstract_sft_state(optimizer, model, mesh)
    done, state, _ = ckpt.restore_latest(abstract, data_iter=batches)
  except FileNotFoundError:  # none saved
    pass
  except checkpoint.CorruptCheckpointError as e:  # redoing the warm start is always safe
    print(f"warning: {e}; the warm start starts over", file=sys.stderr)
  else:
    if jax.process_index() == 0:
      print(f"warm start: resumed after step {done} of {config.sft.num_steps}", file=sys.stderr)
    return done, state["params"], state["opt_state"], batches
  params = policy_lib.initial_params(config, model, mesh)
  # A fresh iterator: a checkpoint that failed may have set this one's position.
  return 0, params, optimizer_lib.init_opt_state(optimizer, params), _batches(config, rows)


def warm_start(
  config: ml_collections.ConfigDict,
  model: models.Decoder,
  mesh,
  rows: Sequence[dict],
  worker: RolloutWorker,
  *,
  workdir: str,
  sigterm: process.SigtermFlag,
  writer: metrics_lib.MetricsWriter,
) -> Any:
  """The initial params (`policy.initial_params`) after `config.sft.num_steps` supervised steps
  (AdamW) on the rows' answers, resumed from the warm start's checkpoint in `workdir` if any.
  Each step's loss goes to `writer` as `sft/loss` at step `metrics.sft_step(k, num_steps)`.

  On SIGTERM (`sigterm`, checked every step) it saves its checkpoint and returns early: the
  caller sees `sigterm.requested` and exits.
  """
  sc = config.sft
  if sc.num_steps == 0:
    return policy_lib.initial_params(config, model, mesh)
  optimizer = optax.adamw(sc.learning_rate)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sft_step(params, opt_state, batch):
    def loss_fn(p):
      seqs = sequences.build_sequences(
        batch["prompt_ids"], batch["prompt_mask"], batch["targets"], batch["target_mask"], 1,
        batch["loss_mask"],
      )  # fmt: skip
      logits, routing = completion_logits(model, p, seqs, packed_group_size=None, with_routing=True)
      logps = losses.token_logprobs(logits, seqs["targets"])
      nll = -(logps * seqs["loss_mask"]).sum() / seqs["loss_mask"].sum()
      if routing is None:
        return nll, nll
      # A MoE router's load-balancing term, as in the RL step (sft/loss stays the NLL).
      return nll + model.config.router_aux_loss_coef * models.moe.load_balancing_loss(routing), nll

    (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  ckpt = checkpoint.Checkpointer(files.join(workdir, WARM_START_DIR), max_to_keep=1)
  done, params, opt_state, batches = _resume_or_start(config, model, mesh, optimizer, ckpt, rows)
  quiet = jax.process_index() != 0
  bar = tqdm.trange(
    done, sc.num_steps, initial=done, total=sc.num_steps, desc="warm start", disable=quiet
  )
  for step in bar:
    if sigterm.requested_anywhere():
      if step > done:
        ckpt.save(step, {"params": params, "opt_state": opt_state}, data_iter=batches, force=True)
      ckpt.close()
      return params
    batch_rows = [rows[i] for i in next(batches)]
    prompt_ids, prompt_mask = worker.encoder.prompts(batch_rows)
    width = worker.options.completion_width
    targets, target_mask, loss_mask = worker.encoder.targets(batch_rows, width)
    batch = {
      "prompt_ids": prompt_ids,
      "prompt_mask": prompt_mask,
      "targets": targets,
      "target_mask": target_mask,
      "loss_mask": loss_mask,
    }
    params, opt_state, loss = sft_step(params, opt_state, batch)
    writer.write(metrics_lib.sft_step(step + 1, sc.num_steps), {metrics_lib.SFT_LOSS: loss})
  if done < sc.num_steps:
    state = {"params": params, "opt_state": opt_state}
    ckpt.save(sc.num_steps, state, data_iter=batches, force=True)
    if not quiet:
      print(
        f"warm start: {sc.num_steps} supervised steps, final loss {float(loss):.4f}",
        file=sys.stderr,
      )
  ckpt.close()
  return params
