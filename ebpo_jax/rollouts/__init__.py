"""From a batch of prompts to scored, masked trajectories (below the trainer, above the sampler).

- `worker`: `RolloutWorker`, one call for single-turn completions and multi-turn episodes (its
  two strategies, `SingleTurn` and `episodes.MultiTurn`); `make_worker` builds it from a config.
- `rollout`: what a rollout is (`Rollout`), one sampler call (`SamplerCall`), a round's weights in
  the sampler's layout (`DecodeWeights`).
- `episodes`: multi-turn episodes (model turns on the devices, environment steps in the pool).
- `batch`: a step's training batch (DAPO's dynamic sampling), the in-training evaluation, the
  scored batches of `evaluate` and `difficulty`.
- `scoring`: `Scorer`, the task's verifier or the reward functions, in the verifier pool.
- `prompts`: `PromptEncoder`, the one prompt encoder (rollouts, row checks, warm start).
- `options`: `RolloutOptions`, what the rollouts read of a config, frozen once.
"""
