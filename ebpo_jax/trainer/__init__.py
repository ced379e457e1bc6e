"""The trainer's parts, used by the entry points (train, evaluate, export, ablate, difficulty).

config     loading a config file (`load_config`), checking every value before compiling, the
           entry points' frame (`entry_point`: bad input -> one line)
state      `TrainState`, the optimizer, building the model, a fresh or an abstract state, the
           step's named PRNG streams (`step_keys`)
step       the pure `train_step` (advantages, then PPO-clip updates) and its one jit
rollouts   host rollouts (`Sampler` -> `Rollout`): sampling, DAPO refill, the in-training
           evaluation
rollout_options  what the rollouts read of the config, frozen once (`RolloutOptions`)
scoring    `Scorer`: the task's verifier or the reward functions, in the verifier pool
prompts    `PromptEncoder`: the one prompt encoder (rollouts, row checks, warm start)
task_rows  the task, its tokenizer and its rows, each checked before anything compiles
warm_start the supervised warm start before RL (batches: `data.make_batches`, order `sampled`)
policy     a policy for evaluate/export/difficulty: a run's checkpoint or a model directory
"""
