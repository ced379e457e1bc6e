"""EBPO on integer addition with a tiny random-init decoder: the default main job.

A supervised warm start (450 steps) teaches the answer format, 1-digit addition and part of 2-digit
addition; then 200 RL steps with the paper's EBPO advantage (running per-cluster prior, batch
normalisation) raise the held-out greedy accuracy of the hard cluster, add_2. About 1 minute on 2
idle CPU cores (2-3.5 with other jobs running); the trainer ends with the per-cluster before/after
table and WORKDIR/plots/.

  python -m ebpo_jax.train --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo
  python -m ebpo_jax.train --config=configs/arith_ebpo.py:runlocal --workdir=/tmp/arith_local

Any key can be overridden, e.g. `--config.rl.advantage=grpo --config.rl.group_size=4`.

The hard regime, `:hard` (or "hard,runlocal"; runlocal's sizes win): the same task, model and RL
recipe, for estimator ablations at small G on a hard cluster (GRPO's all-fail groups). A warm start
of 200 steps stops before add_2's learning transition (steps 250-550, by seed): held-out greedy
add_2 accuracy 0.027 / 0.066 / 0.078 for seeds 0 / 1 / 2 (256 prompts per cluster, s.e. <= 1.7
points), sampled (T=1) success 2-3%, so about 4% of G=2 groups and 20% of G=8 groups of add_2
hold a success (add_1: 0.43-0.59). Then 100 RL steps: 24-56 s a run with the warm start shared
(`python -m ebpo_jax.ablate`), measured two at a time with another heavy job on the 2 cores.
RL moves add_2 only a few points in that budget (mean gain -0.01 to +0.02, 2 seeds): calibration
and the pilot ablation in results/arith_ebpo_hard.md. No add_3: warm-started
on add_1-add_3, this model's add_3 stays at <= 1.6% greedy and 0.6% sampled after 600 steps.

Why these settings, and this config's results: results/arith_ebpo.md.
"""

import pathlib

import ml_collections

from ebpo_jax import cli

# configs/ is not a package: its sibling common.py is loaded by path, as every config is.
common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may hold "hard" (the hard regime above) and "runlocal" (a few
  steps, seconds on a CPU), e.g. "hard,runlocal"."""
  arg = common.parse_arg(arg, hard=False, runlocal=False)
  config = common.get_config()  # the base config holds this job's values
  if arg.hard:
    config.sft.num_steps = 200  # add_2 stays at <= 10% greedy (its transition: steps 250-550)
    config.task.num_eval = 256  # binomial s.e. <= 2 points at add_2's accuracy of <= 10%
    config.train.num_steps = 100  # RL steps: 24-56 s a run (G 2-8, 2 at a time, busy cores)
  if arg.runlocal:
    common.runlocal(config, num_train=512, num_eval=8, num_steps=3, every_steps=2)
    common.tiny_runlocal_batches(config)
  return config
