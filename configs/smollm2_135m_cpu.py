"""RL that a laptop CPU finishes: SmolLM2-135M-Instruct (the packaged model) with LoRA on 2 cores.

The policy is configs/smollm2_135m_ebpo.py's "lora" variant (rank-8 adapters on all seven
projections of the packaged SmolLM2-135M-Instruct) at shapes that 2 CPU cores finish in under an
hour: 8 prompts x G = 8 responses per step, at most 32 new tokens, 20 steps, float32, no KL term
(it would cost a reference forward per step), lr 1e-4.

Task: the easiest curriculum level of three reasoning-gym datasets, one cluster each: `chain_sum`
and `basic_arithmetic` (two 1-digit operands) and `products` (1-digit x 1-digit). Why these: at
temperature 1 the packaged model (a Q4_1 GGUF) is at most 3% avg@8 on every reasoning-gym task and
level measured (results/smollm2.md, "SmolLM2-135M-Instruct on reasoning-gym"); it rarely ends with
the "Answer: <n>" line the verifier reads ("7 + 8 = 15" scores 0.2), and these three are where
its numbers are most often right. The reward is the dataset's own score: 1 for the exact answer,
reasoning-gym's partial credit len(answer) / len(line) for an answer inside a longer final line,
a path from "7 + 8 = 15" to "15". The held-out metric is avg@8 at temperature 1 (full reward only)
at steps 0, 10 and 20, on 24 problems per cluster.

Not a format bonus: with a worked format line in the prompt ('... the last line is: Answer: 5')
and 0.2 x `answer_format` in the reward, the policy learned within 8 steps to answer "Answer: 5"
to everything (format reward 0 -> 1.0, held-out avg@8 0.016 -> 0.019 at step 12).

  # the run (results/smollm2.md has the measured times and accuracies, 2 seeds)
  python -m ebpo_jax.train --config=configs/smollm2_135m_cpu.py --workdir=/tmp/smol_cpu
  python bench/learning_curve.py /tmp/smol_cpu --out smol_cpu.png   # accuracy vs wall time
  # 1 RL step with small shapes (CI runs this)
  python -m ebpo_jax.train --config=configs/smollm2_135m_cpu.py:runlocal --workdir=/tmp/smol_cpu1
"""

import pathlib

import ml_collections

from ebpo_jax import cli

# configs/ is not a package: its siblings are loaded by path, as every config is.
common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))
smollm2 = cli.load_module(pathlib.Path(__file__).with_name("smollm2_135m_ebpo.py"))

_ONE_DIGIT_PAIR = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may be "runlocal" (1 RL step with small shapes)."""
  arg = common.parse_arg(arg, runlocal=False)
  config = smollm2.get_config("lora")
  config.task.name = "reasoning_gym:chain_sum+basic_arithmetic+products"
  config.task.options.levels = 1
  config.task.options.dataset_cfg = {
    name: dict(_ONE_DIGIT_PAIR) for name in ("chain_sum", "basic_arithmetic", "products")
  }
  config.task.num_train = 3_000
  config.task.num_eval = 24  # per cluster: 72 problems x 8 samples
  config.model.dtype = "float32"
  config.model.lora.base_dtype = "float32"  # faster on a CPU than casting a bfloat16 base
  config.rl.group_size = 8
  config.rl.loss.kl_coef = 0.0
  config.train.num_steps = 20
  config.train.batch_size = 8
  config.train.mini_batch_size = 8
  config.train.micro_batch_size = 16
  config.train.learning_rate = 1e-4
  config.sampling.max_new_tokens = 32
  config.sampling.prompts_per_call = 72  # the whole evaluation in one call
  config.sampling.prompt_buckets = (96, 128, 160)
  config.eval.greedy = False
  config.eval.num_samples = 8
  config.eval.every_steps = 10
  config.checkpoint.every_steps = 10
  config.logging.samples_every = 5
  if arg.runlocal:  # its evaluation (2 problems x 3 clusters) in one sampler call
    smollm2.one_cpu_step(config, prompts=2, prompts_per_call=6)
  return config
