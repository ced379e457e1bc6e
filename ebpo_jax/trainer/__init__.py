"""The trainer's parts, used by the entry points (train, evaluate, export, ablate, difficulty).

config     loading a config file (`load_config`) and checking every value before compiling
state      `TrainState`, the optimizer, building the model, a fresh or an abstract state
step       the pure, jitted `train_step` (advantages, then PPO-clip updates)
rollouts   host rollouts: sampling, scoring, DAPO refill, the in-training evaluation
warm_start the supervised warm start before RL
"""
