"""The trainer's run: RL with verifiable rewards (GRPO family, EBPO) on a decoder language model.

`run(config, workdir, rewards=...)` is the Python entry point (notebooks, scripts): it checks the
config and the rows before anything compiles, claims the workdir and trains; `python -m
ebpo_jax.train` is the same run from the command line. `train` reads top to bottom: mesh, task and
data, model and optimizer, the step function, then resume (restore into abstract shapes) or start
fresh (build params, warm start, state, step-0 evaluation and checkpoint), then the loop. Each RL
step samples G responses per prompt, scores them on the host and hands the batch to `train_step`
(ebpo_jax/trainer/step.py), one pure jitted function.
"""

import collections
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jax
import ml_collections
import numpy as np
import tqdm
from absl import logging

from ebpo_jax import (
  checkpoint,
  data,
  errors,
  files,
  jsonable,
  models,
  process,
  sharding,
)
from ebpo_jax import keys as keys_lib
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import pipeline as pipeline_lib
from ebpo_jax.rollouts.rollout import Rollout
from ebpo_jax.rollouts.worker import RolloutWorker, make_worker
from ebpo_jax.tasks import reward_fns as reward_fns_lib
from ebpo_jax.trainer import banner as banner_lib
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import task_rows
from ebpo_jax.trainer import warm_start as warm_start_lib
from ebpo_jax.trainer import workdir as workdir_lib
from ebpo_jax.trainer.step import StepOptions, jit_train_step


def run(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  rewards: Sequence[Any] = (),
  name: str = "",
) -> dict:
  """Trains (or resumes) under `config` in `workdir`; returns the last evaluation's metrics.

  `rewards`: the training reward as Python functions instead of `config.rewards.fns`, each a
  function or a `(function, weight)` pair (`reward_fns.spec_of`: a module's top-level function,
  which the scorer processes import by its path; a lambda, a nested function or one defined in a
  notebook's `__main__` is refused with one line). A bad config value or data row raises a
  `errors.BadInput` of one line before anything compiles (the command line prints it as
  `error: ...`). `name`: the config as a command line gave it, for the startup banner.
  """
  if rewards:
    if config.rewards.fns:
      raise errors.ConfigError(
        f"config.rewards.fns={config.rewards.fns!r} and rewards=[...] both given: use one"
      )
    try:
      spec = reward_fns_lib.spec_of(rewards)
    except ValueError as e:
      raise errors.ConfigError(f"rewards=[...]: {e}") from None
    config = config.copy_and_resolve_references()
    config.rewards.fns = spec
  config_lib.check_config(config, jax.device_count())
  config_lib.check_training(config)
  models.check_model_path(config)  # a missing or truncated model file: one line
  _check_init_from(config)
  # Bad rows stop here (one line per row), before config.json is written: the workdir is left as
  # it was, and the corrected command runs on it.
  inputs = task_rows.load_task_and_rows(config)
  with workdir_lib.claim(workdir, config):  # locked; config.json checked against this config
    return train(config, workdir, inputs, name=name)


def _check_init_from(config: ml_collections.ConfigDict) -> None:
  """`model.init_from` names a run with a complete checkpoint (before the workdir is claimed)."""
  if config.model.init_from:
    try:
      policy_lib.checkpoint_step(config.model.init_from, None)
    except policy_lib.PolicyError as e:
      raise errors.ConfigError(f"config.model.init_from={config.model.init_from!r}: {e}") from None


def train(
  config: ml_collections.ConfigDict, workdir: str, inputs: task_rows.Inputs, *, name: str = ""
) -> dict:
  """Trains (or resumes) under `config` in `workdir` on `inputs` (`task_rows.load_task_and_rows`'
  task, rows and evaluation rows, with their clusters); returns the last evaluation. `name`: the
  config as the command line gave it, for the startup banner."""
  started = time.perf_counter()
  sigterm = process.install_sigterm_flag()  # the whole run, the warm start included
  mesh, rollout_mesh = sharding.make_meshes(dict(config.mesh))

  # ---- Task and data.
  task, tokenizer, rows = inputs.task, inputs.tokenizer, inputs.rows
  cluster_names = inputs.cluster_names
  batches = data.make_batches(
    rows, batch_size=config.train.batch_size, order=config.data.order, seed=config.seed
  )

  # ---- Model, the state it trains (optimizer, estimator) and the jitted step.
  model = models.build.make_model(config, tokenizer.vocab_size)
  spec = state_lib.StateSpec.from_config(config, len(cluster_names))
  abstract_params = models.build.abstract_params(model, mesh)
  shardings = spec.shardings(abstract_params)
  traces = collections.Counter()  # jit traces of the train step: 1 means no recompile
  options = StepOptions.from_config(config, mesh)
  step_fn = jit_train_step(
    model, spec, options, mesh, shardings, on_trace=lambda: traces.update(["step"])
  )

  # ---- The run's resources: every exit (the end, too many bad steps, SIGTERM, an error) closes
  # the writer, then the checkpointer (waiting for a pending save), then the verifier pool.
  with contextlib.ExitStack() as resources:
    worker = make_worker(
      model, task, tokenizer, config, mesh if rollout_mesh is None else rollout_mesh
    )
    resources.enter_context(worker.scorer.pool)
    ckpt = resources.enter_context(_checkpointer(config, workdir))
    pipeline = _pipeline(config, worker, rows, batches, shardings.params, mesh)
    if pipeline is not None:
      resources.callback(pipeline.close)

    # ---- Resume first; else a fresh state (warm start, step-0 evaluation and checkpoint).
    latest, state = None, None
    if ckpt.all_steps():  # the newest checkpoint that restores and verifies
      abstract = spec.abstract(abstract_params)
      latest, state = _restore(ckpt, abstract, config, model, mesh, batches)
    _log_banner(config, (mesh, rollout_mesh), abstract_params, workdir, name, latest)
    writer = resources.enter_context(_metrics_writer(config, workdir, latest))
    r = _Run(
      config=config,
      rows=rows,
      cluster_names=cluster_names,
      eval_rows=inputs.eval_rows,
      eval_cluster_names=inputs.eval_cluster_names,
      batches=batches,
      worker=worker,
      step_fn=step_fn,
      traces=traces,
      ckpt=ckpt,
      writer=writer,
      sigterm=sigterm,
      started=started,
      pipeline=pipeline,
      mesh=mesh,
    )
    last_eval = {}
    if latest is None:
      state, last_eval = _start(r, model, mesh, workdir, spec)
    warm_start_lib.discard(workdir)
    last_eval = _loop(r, state, last_eval)

  # ---- The end (the last save waited for): the summary and the plots.
  if jax.process_index() == 0:
    names = inputs.eval_cluster_names
    counts = collections.Counter(names[row["cluster"]] for row in inputs.eval_rows)
    counted = {name: counts[name] for name in names if counts[name]}
    finish(workdir, counted, plots=config.logging.plots)
  return last_eval


# ----------------------------------------------------------------------------- helpers of run


@dataclasses.dataclass(frozen=True)
class _Run:
  """What the loop's helpers share: the run's config, rows, rollout worker, step and resources."""

  config: ml_collections.ConfigDict
  rows: list[dict]
  cluster_names: list[str]
  eval_rows: list[dict]
  eval_cluster_names: list[str]  # eval_rows' clusters (its source's): eval/accuracy/<name>
  batches: Iterator
  worker: RolloutWorker
  step_fn: Callable
  traces: collections.Counter
  ckpt: checkpoint.Checkpointer
  writer: metrics_lib.MetricsWriter
  sigterm: process.SigtermFlag
  started: float  # time.perf_counter() at the run's start
  pipeline: pipeline_lib.Pipeline | None = None  # rl.max_staleness > 0: the batches in flight
  mesh: Any = None  # the trainer's mesh (the worker's is the sampler's, on a split)


def _log_banner(config, meshes, abstract_params, workdir: str, name: str, latest) -> None:
  banner_lib.log_startup(
    mesh=meshes[0],
    rollout_mesh=meshes[1],
    num_params=banner_lib.count_params(abstract_params),
    lora_rank=config.model.lora.rank,
    trained_params=banner_lib.count_adapters(abstract_params),
    workdir=workdir,
    config=name,
    resume_step=latest,
  )


def _pipeline(config, worker, rows, batches, params_sharding, mesh) -> pipeline_lib.Pipeline | None:
  """The producer of an asynchronous run (`rl.max_staleness` > 0), else None."""
  if not config.rl.max_staleness:
    return None
  return pipeline_lib.Pipeline(
    worker,
    rows,
    batches,
    staleness=config.rl.max_staleness,
    num_steps=config.train.num_steps,
    num_refill_rounds=config.rl.max_refill_rounds,
    transfer_guard=config.train.transfer_guard,
    params_sharding=params_sharding,
    batch_mesh=mesh,
  )


def _restore(ckpt, abstract, config, model, mesh, batches) -> tuple[int, state_lib.TrainState]:
  """(step, state) of the newest checkpoint that restores and verifies (`workdir.resume_step`:
  that one, the later ones moved aside), the data iterator at its position; one line and exit
  status 2 when none does."""
  abstract_state, step = state_lib.checkpointed(abstract), config.workdir.resume_step
  try:
    if step >= 0:
      state, _ = ckpt.restore_and_drop_later(step, abstract_state, data_iter=batches)
      latest = step
    else:
      latest, state, _ = ckpt.restore_latest(abstract_state, data_iter=batches)
  except checkpoint.CorruptCheckpointError as e:
    raise errors.BadInput(str(e)) from None  # cli.entry_point: `error: ...`, exit status 2
  if abstract.base is not None:  # LoRA: the checkpoint holds the adapters, not the base
    state = state.replace(base=policy_lib.lora_base(config, model, mesh))
  return latest, state


def _metrics_writer(config, workdir: str, latest: int | None) -> metrics_lib.MetricsWriter:
  # metrics.jsonl keeps only the lines of the steps restored, always: on a fresh start, those of
  # the warm start's steps that its own checkpoint holds.
  if latest is None:
    latest = warm_start_lib.metrics_resume_step(config, workdir)
  return metrics_lib.MetricsWriter(
    workdir,
    enabled=jax.process_index() == 0,
    resume_step=latest,
    hparams=jsonable.to_data(config),  # TensorBoard's hparams, wandb's config
    wandb=metrics_lib.wandb_options(config.logging),
  )


def _evaluate(r: _Run, state: state_lib.TrainState) -> dict:
  eval_key = keys_lib.step_keys(state.rng, state.step).eval
  params = state_lib.policy_params(state)
  return rollout_batch.evaluate_accuracy(
    r.worker, params, r.eval_rows, r.eval_cluster_names, eval_key
  )


def _checkpointer(config, workdir: str) -> checkpoint.Checkpointer:
  return checkpoint.Checkpointer(
    files.join(workdir, workdir_lib.CHECKPOINTS_DIR),
    max_to_keep=config.checkpoint.max_to_keep,
    every_steps=config.checkpoint.every_steps,
    every_minutes=config.checkpoint.every_minutes,
  )


def _start(r: _Run, model, mesh, workdir: str, spec) -> tuple[state_lib.TrainState, dict]:
  """A fresh state (the warm start's params), its step-0 evaluation and checkpoint: (state, the
  evaluation)."""
  params = warm_start_lib.warm_start(
    r.config, model, mesh, r.rows, r.worker, workdir=workdir, sigterm=r.sigterm, writer=r.writer
  )
  if r.sigterm.requested_anywhere():
    _exit_on_signal(r.sigterm, "the warm start saved its own checkpoint")
  state = spec.create(params)
  last_eval = _evaluate(r, state)
  r.writer.write(0, {**last_eval, metrics_lib.TIME_ELAPSED_S: time.perf_counter() - r.started})
  config = r.config
  r.ckpt.save(
    0,
    state_lib.checkpointed(state),
    data_iter=r.batches,
    config=config.to_dict(),
    force=True,
    before_write=r.writer.sync,  # metrics.jsonl durable before the checkpoint commits
  )
  r.writer.flush()
  if r.sigterm.requested_anywhere():
    _exit_on_signal(r.sigterm, "saved the checkpoint of step 0")
  r.ckpt.wait()  # checkpoint 0 is written: the warm start's own one is no longer needed
  return state, last_eval


def _loop(r: _Run, state: state_lib.TrainState, last_eval: dict) -> dict:
  """The RL steps from `state.step` to `train.num_steps`; returns the last evaluation. A step
  whose update was skipped (non-finite loss, grad norm or logits) is never checkpointed, so it
  cannot rotate the last good checkpoint out; its save, if one was due, is made at the next good
  step. The count of bad steps in a row lives in the state; too many in a row exit (the last
  good checkpoint kept) after the line of the step that made them too many."""
  config, save_owed = r.config, False
  start, num_steps = int(state.step), config.train.num_steps
  bar = tqdm.trange(
    start, num_steps, initial=start, total=num_steps, desc="rl", disable=jax.process_index() != 0
  )
  if r.pipeline is not None and start < num_steps:
    with jax.transfer_guard(config.train.transfer_guard):
      r.pipeline.fill(
        state, start
      )  # the batches in flight at this step, sampled (again, on a resume)
  for step in bar:
    # Every host<->device transfer in the loop is explicit (place_from_host, to_host, device_get):
    # under train.transfer_guard="disallow" (the default) any other one is an error.
    with jax.transfer_guard(config.train.transfer_guard):
      state, logged, samples, bad_in_a_row = _rl_step(r, state, step, first=step == start)
      if (step + 1) % config.eval.every_steps == 0 or step + 1 == num_steps:
        last_eval = _evaluate(r, state)
        logged.update(last_eval)
      too_many_bad = bad_in_a_row >= config.train.max_bad_steps
      _log_step(r, step + 1, logged, samples, always=too_many_bad)
      if too_many_bad:
        sys.exit(
          f"error: non-finite loss or grad norm in {bad_in_a_row} steps in a row "
          f"(train.max_bad_steps={config.train.max_bad_steps}); last good checkpoint kept"
        )
      bar.set_postfix(
        reward=f"{logged[metrics_lib.REWARD_MEAN]:.3f}",
        acc=f"{last_eval.get(metrics_lib.EVAL_ACCURACY, float('nan')):.3f}",
      )
      stop = r.sigterm.requested_anywhere()  # every process saves and stops at the same step
      if bad_in_a_row > 0:
        save_owed = True
      elif _save(r, step + 1, state, force=step + 1 == num_steps or stop or save_owed):
        r.writer.flush()  # TensorBoard's events too (metrics.jsonl: synced above)
        save_owed = False
      if stop:
        _exit_on_signal(r.sigterm, f"the checkpoint of step {r.ckpt.latest_step()} is the latest")
  return last_eval


def _save(r: _Run, step: int, state, *, force: bool) -> bool:
  """`Checkpointer.save` of the state after `step` steps, at the trainer's data position (before
  the draws of the batches in flight, under `rl.max_staleness`)."""
  saving = r.pipeline.saving() if r.pipeline is not None else contextlib.nullcontext()
  with saving:
    return r.ckpt.save(
      step,
      state_lib.checkpointed(state),
      data_iter=r.batches,
      config=r.config.to_dict(),
      force=force,
      before_write=r.writer.sync,  # metrics.jsonl durable before the checkpoint commits
    )


def _rl_step(r: _Run, state, step: int, *, first: bool):
  """One RL step: sample and score a batch (or, under `rl.max_staleness`, take the oldest batch in
  flight while the next is made), run the train step; (state, the step's logged metrics, its
  sample completions table when due or None, bad steps in a row)."""
  config = r.config
  t0 = time.perf_counter()
  if r.pipeline is None:
    keys = keys_lib.step_keys(state.rng, state.step, config.rl.max_refill_rounds)
    batch, rollout, logged = rollout_batch.collect_batch(
      r.worker, state_lib.policy_params(state), keys, r.rows, r.batches
    )
    r.worker.scorer.check_step()  # rewards.max_error_frac: never train on failed calls' zeros
    batch = sharding.to_mesh(batch, r.mesh, rows=True)  # from the sampler's devices, if split
  else:
    before, transfer_s = r.pipeline.copy_params(state.params)
    launched = time.perf_counter()
    r.pipeline.start_next(state, step, before)
    made = r.pipeline.next_batch()
    batch, rollout, logged = made.batch, made.rollout, dict(made.logs)
  t1 = time.perf_counter()
  if first:
    logging.info("compiling the train step (the first call; once per run) ...")
  state, step_metrics, aux = r.step_fn(state, batch)
  step_metrics, advantages_bg, bad_in_a_row = jax.device_get(
    (step_metrics, aux.advantages, state.bad_steps)
  )
  if r.pipeline is not None:
    trained_s = time.perf_counter() - launched
    trainer_wait_s, made_s = r.pipeline.wait()
    state = state.replace(behind=pipeline_lib.behind_after(state.behind, before))
    idle_s = max(0.0, trained_s - made_s) if made_s else 0.0
    logged.update(_async_metrics(r, step, transfer_s, trainer_wait_s, idle_s))
  t2 = time.perf_counter()
  logged.update(host_metrics(step_metrics, rollout, r.cluster_names))
  logged.update(
    {
      metrics_lib.TIME_STEP_S: t2 - t0,
      metrics_lib.TIME_SAMPLE_S: t1 - t0 if r.pipeline is None else made.seconds,
      metrics_lib.TIME_UPDATE_S: t2 - t1,
      metrics_lib.TIME_TOKENS_PER_S: logged[metrics_lib.ROLLOUT_TOKENS] / (t2 - t0),
      metrics_lib.COMPILES_TRAIN_STEP: r.traces["step"],
    }
  )
  samples, every = None, config.logging.samples_every
  if every and (step + 1) % every == 0:
    num = config.logging.num_samples
    samples = rollout_batch.sample_rows(rollout, advantages_bg, r.cluster_names, num)
  return state, logged, samples, bad_in_a_row


def _async_metrics(r: _Run, step: int, transfer_s, trainer_wait_s, idle_s) -> dict:
  """`async/*` of a fixed-lag step: the batch's staleness (every row of it sampled with the policy
  of step max(0, step - k)), the trainer's wait for the producer, the producer's idle time (the
  train step's time less that of the batch made beside it), the params copy."""
  staleness = float(min(step, r.pipeline.staleness))
  return {
    metrics_lib.ASYNC_STALENESS_MEAN: staleness,
    metrics_lib.ASYNC_STALENESS_MAX: staleness,
    metrics_lib.ASYNC_TRAINER_WAIT_S: trainer_wait_s,
    metrics_lib.ASYNC_ROLLOUT_WAIT_S: idle_s,
    metrics_lib.ASYNC_TRANSFER_S: transfer_s,
  }


def _log_step(
  r: _Run, step: int, logged: dict, samples: list[dict] | None, *, always: bool = False
) -> None:
  """The metrics line of step `step` (every `train.log_every` steps, with each evaluation, and
  `always` for the step that stops the run) and its sample completions table."""
  logged[metrics_lib.TIME_ELAPSED_S] = time.perf_counter() - r.started
  if always or step % r.config.train.log_every == 0 or metrics_lib.EVAL_ACCURACY in logged:
    r.writer.write(step, logged)
  if samples is not None:
    r.writer.write_samples(step, samples)


def _exit_on_signal(flag: process.SigtermFlag, saved: str) -> NoReturn:
  """Exits with the status of a process ended by the signal received (143 for SIGTERM, 130 for
  SIGINT; the run's ExitStack then waits for the pending save and closes the metrics: a remote
  writer uploads its lines)."""
  print(f"{flag.signal_name or 'SIGTERM'}: {saved}; exiting", file=sys.stderr)
  sys.exit(flag.exit_status)


def host_metrics(step_metrics: dict, rollout: Rollout, cluster_names) -> dict:
  """Device metrics as floats (a vector [K] becomes one key per cluster name); per-cluster mean
  rewards."""
  per_cluster, out = metrics_lib.per_cluster, {}
  for key, value in step_metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      out[key] = float(value)
    else:
      out.update({per_cluster(key, c): float(v) for c, v in zip(cluster_names, value, strict=True)})
  clusters = np.array([row["cluster"] for row in rollout.rows])
  for k, name in enumerate(cluster_names):
    if (clusters == k).any():
      out[per_cluster(metrics_lib.REWARD_MEAN, name)] = float(rollout.rewards[clusters == k].mean())
  return out


def finish(workdir: str, counts: Mapping[str, int], *, plots: bool) -> None:
  """The end-of-run summary: accuracy per evaluation cluster (`counts`: its prompts) before and
  after RL, with binomial standard errors, and the plots (`plots`)."""
  acc = metrics_lib.EVAL_ACCURACY
  records = metrics_lib.read_metrics(files.join(workdir, metrics_lib.METRICS_FILE))
  history = [m for m in records if acc in m]
  if not history:
    return
  first, last = history[0], history[-1]
  print(f"held-out accuracy, step {first['step']} -> step {last['step']}")
  print(metrics_lib.accuracy_table(first, last, counts))
  if plots:
    drawn = metrics_lib.plot_metrics(workdir)
    print(f"{len(drawn)} plots in {files.join(workdir, metrics_lib.PLOTS_DIR)}/")
