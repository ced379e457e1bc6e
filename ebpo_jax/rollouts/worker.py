"""The rollout worker: data rows in, scored and masked trajectories (`Rollout`) out.

`RolloutWorker.rollout` encodes the rows' prompts (`prompts.PromptEncoder`), converts the weights
to the sampler's layout once for the round (`DecodeOptions.decode_params`), cuts the rows into
sampler calls of `sampling.prompts_per_call` prompts, and has its strategy serve each call: one
completion per sample (`SingleTurn`) or a multi-turn episode with an environment
(`episodes.MultiTurn`). Both place the prompts on the mesh once, fetch what the host needs in one
transfer per call, and have the `scoring.Scorer` score it; tokens, masks and the sampler's
log-probs stay on the devices and go to `train_step` from there. The worker reads its settings
from frozen `options.RolloutOptions`, built from the config once (`make_worker`).
"""

import concurrent.futures
import contextlib
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from ebpo_jax import keys as keys_lib
from ebpo_jax import models, sampling, sharding
from ebpo_jax.rollouts import episodes, prompts, scoring
from ebpo_jax.rollouts.options import RolloutOptions
from ebpo_jax.rollouts.rollout import (
  DecodeWeights,
  Rollout,
  SamplerCall,
  concat_rollouts,
  first_rows,
)
from ebpo_jax.tasks import reward_fns as reward_fns_lib
from ebpo_jax.tasks import rewards as rewards_lib


class SingleTurn:
  """The single-turn strategy: `generate` over a call's prompts, G samples each, one transfer of
  the completions to the host, scored as texts."""

  def __init__(self, model, encoder, scorer, decode: sampling.DecodeOptions, mesh: Mesh):
    self.model, self.encoder, self.scorer = model, encoder, scorer
    self.decode, self.mesh = decode, mesh
    self._shapes_seen = set()  # the sampler calls' shapes: a new one compiles (one line says so)

  def __call__(self, call: SamplerCall) -> Rollout:
    tokenizer, group_size = self.encoder.tokenizer, call.group_size
    spec = sharding.row_sharding(call.ids.shape, self.mesh)
    ids, mask = sharding.place_from_host(call.ids, spec), sharding.place_from_host(call.mask, spec)
    self._log_compile(ids.shape, group_size, call.greedy)
    static = self.decode.generate_kwargs(tokenizer, group_size=group_size, greedy=call.greedy)
    out = sampling.generate(
      self.model, call.params, ids, mask, call.key, temperature=self.decode.temperature,
      top_p=self.decode.top_p, mesh=self.mesh, **static,
    )  # fmt: skip
    tokens, lengths = sharding.to_host((out.tokens, out.lengths))
    n = len(call.rows)
    if ids.shape[0] > n:  # a padded call: drop the copies' rows
      ids, mask = first_rows((ids, mask), n)
      out = first_rows(out, n * group_size)
      tokens, lengths = tokens[: n * group_size], lengths[: n * group_size]
    lengths = lengths.astype(np.int32)
    texts = [tokenizer.decode(t[:k].tolist()) for t, k in zip(tokens, lengths, strict=True)]
    rewards, reward_parts, errors = self.scorer.score(
      texts, call.rows, lengths, group_size, training=call.training
    )
    return Rollout(
      rows=call.rows,
      texts=texts,
      rewards=rewards,
      lengths=lengths,
      errors=errors,
      prompt_ids=ids,
      prompt_mask=mask,
      tokens=out.tokens,
      mask=out.mask,
      loss_mask=out.mask,
      old_logps=out.logprobs,
      truncated=out.truncated,
      nonfinite=out.nonfinite,
      reward_parts=reward_parts,
    )

  def _log_compile(self, shape: tuple[int, int], group_size: int, greedy: bool) -> None:
    if (shape, group_size, greedy) not in self._shapes_seen:
      self._shapes_seen.add((shape, group_size, greedy))
      what = "greedy" if greedy else "samples"
      logging.info(
        "compiling the sampler for %d prompts x %d tokens, %d %s each ...",
        *shape, group_size, what,
      )  # fmt: skip


class RolloutWorker:
  """Samples and scores data rows with the policy's jitted sampler: single-turn completions, or
  multi-turn episodes when `options.env` is set (one call either way). Under LoRA the adapters
  are applied on the fly (merging them once per step was no faster, and holds a second base:
  results/lora.md)."""

  def __init__(
    self,
    model: models.Decoder,
    encoder: prompts.PromptEncoder,
    scorer: scoring.Scorer,
    options: RolloutOptions,
    mesh: Mesh,
  ):
    self.model, self.encoder, self.scorer = model, encoder, scorer
    self.options, self.mesh = options, mesh
    if options.env is None:
      self.strategy = SingleTurn(model, encoder, scorer, options.sampling, mesh)
    else:
      self.strategy = episodes.MultiTurn(
        model, encoder, scorer, options.sampling, options.env, mesh
      )

  def rollout(
    self,
    params,
    rows: Sequence[dict],
    key: jax.Array,
    *,
    group_size: int,
    greedy: bool,
    training: bool = False,
  ) -> Rollout:
    """`group_size` scored completions of each row, `sampling.prompts_per_call` rows per sampler
    call (0: all at once). A short last call is padded with copies of its last prompt, so every
    call has one shape (one compile); the copies' completions are dropped. `params`: the
    policy's (converted here, once for the round) or a round's `DecodeWeights` (`call_plan`).
    `training`: scored with the reward functions (when configured), else with the task's
    verifier."""
    rows = list(rows)
    prompt_ids, prompt_mask = self.encoder.prompts(rows)
    weights, chunk, plan = self.call_plan(params, len(rows), key)
    calls = []
    for start, call_key in plan:
      ids, mask = prompt_ids[start : start + chunk], prompt_mask[start : start + chunk]
      fill = np.full(chunk - len(ids), len(ids) - 1)
      ids, mask = np.concatenate([ids, ids[fill]]), np.concatenate([mask, mask[fill]])
      call_rows = rows[start : start + chunk]
      calls.append(
        SamplerCall(weights.params, ids, mask, call_key, call_rows, group_size, greedy, training)
      )
    return concat_rollouts(self._serve(calls), self.mesh)

  def _serve(self, calls: list[SamplerCall]) -> list[Rollout]:
    """The strategy's rollout of each call, in order: `sampling.concurrent_calls` at a time, each
    in a thread under this thread's transfer guard (the outputs are the calls' own, whatever the
    timing)."""
    workers = min(self.options.sampling.concurrent_calls, len(calls))
    if workers <= 1:
      return [self.strategy(call) for call in calls]
    guard = jax.config.jax_transfer_guard  # thread-local: this thread's, set again in each

    def serve(call: SamplerCall) -> Rollout:
      with jax.transfer_guard(guard) if guard else contextlib.nullcontext():
        return self.strategy(call)

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sampler") as pool:
      return list(pool.map(serve, calls))

  def call_plan(self, params, num_rows: int, key: jax.Array):
    """`(weights, chunk, [(start, key)])` of `num_rows` rows sampled `sampling.prompts_per_call`
    (0: all) at a time: `weights`, the round's `DecodeWeights` (`params` converted once by
    `DecodeOptions.decode_params`, or kept when they are DecodeWeights already), and call i
    samples rows `[start, start + chunk)` with its key."""
    chunk = self.options.sampling.prompts_per_call or num_rows
    starts = range(0, num_rows, chunk)
    key = sharding.to_mesh(key, self.mesh)  # the trainer's key, on a split mesh
    keys = [key] if len(starts) == 1 else keys_lib.split_keys(key, len(starts))
    if not isinstance(params, DecodeWeights):
      params = sharding.to_mesh(params, self.mesh)  # the sampler's own devices (a split mesh)
      params = DecodeWeights(self.options.sampling.decode_params(params, self.model.config))
    return params, chunk, list(zip(starts, keys, strict=True))


def make_worker(model, task, tokenizer, config: ml_collections.ConfigDict, mesh) -> RolloutWorker:
  """The RolloutWorker of `config` (the one place the rollouts read it): its options, the prompt
  encoder, a scorer with its own verifier pool (`worker.scorer.pool.close()`) and
  `config.rewards.fns`, and `model` computing in `sampling.dtype` (default: the model's own; its
  `model.attention` resolved at that dtype)."""
  options = RolloutOptions.from_config(config)
  encoder = prompts.PromptEncoder.from_config(config, task, tokenizer)
  fns = reward_fns_lib.load(config.rewards.fns)
  pool = rewards_lib.RewardPool(config.rewards.workers, config.rewards.timeout_s)
  scorer = scoring.Scorer(
    task,
    pool,
    fns,
    max_new_tokens=options.completion_width,
    max_error_frac=config.rewards.max_error_frac,
  )
  # Its attention resolved again at that dtype, for the device the policy was built for.
  dtype, device = options.sampling.dtype, mesh.devices.flat[0]
  worker_model = models.build.with_compute_dtype(model, dtype, config.model, device)
  return RolloutWorker(worker_model, encoder, scorer, options, mesh)
