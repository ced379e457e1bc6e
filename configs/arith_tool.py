"""Multi-turn RL with a tool: 3- and 4-digit multiplication with a `calc` tool, tiny decoder.

The model cannot multiply such numbers itself; it can call the built-in `calc` tool
(`<tool_call>{"name": "calc", "arguments": {"expression": "123*456"}}</tool_call>`), read the
`<tool_response>` that the environment appends (tokens out of the loss) and copy the result. The
warm start's transcripts (800 steps) call the tool in 40% of the rows and answer directly (in
effect, guess) in the others, of which only the first digit is trained, so greedy decoding mostly
starts out without the tool; RL on whole trajectories (EBPO, 50 steps) finds that the tool pays:
held-out greedy accuracy 0.34 -> 0.65 at step 10 and 0.67 at step 50 for seed 0 (199 CPU-s in
all), and up by at least 20 points on each of seeds 0-2 (results/arith_tool.md).

  python -m ebpo_jax.train --config=configs/arith_tool.py --workdir=/tmp/arith_tool
  python -m ebpo_jax.train --config=configs/arith_tool.py:runlocal --workdir=/tmp/arith_tool_local

`:smollm2` (or "smollm2,runlocal": one step; tests/e2e/test_arith_tool.py runs it on a tiny Llama
with SmolLM2's tokenizer): the same episodes with the packaged SmolLM2-135M-Instruct, no warm
start; its chat template wraps the prompt and each tool response (a `tool` message, then the next
assistant turn's header); the template ignores `tools=`, so the calc tool's schema goes into the
system prompt (`tool_calls.tools_system_prompt`). Its turns end at its end-of-turn token or right
after `</tool_call>` (5 tokens in its vocabulary).

Results and timing: results/arith_tool.md.
"""

import pathlib

import ml_collections

from ebpo_jax import cli

common = cli.load_module(pathlib.Path(__file__).with_name("common.py"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the config; `arg` may hold "smollm2" (the packaged chat model) and "runlocal" (a few
  steps, seconds on a CPU)."""
  arg = common.parse_arg(arg, runlocal=False, smollm2=False)
  config = common.get_config()
  config.task.name = "arith_tool"
  config.task.options.ops = ("mul",)
  config.task.options.digits = (3, 4)
  config.task.options.tool_fraction = 0.4  # a minority: greedy decoding starts without the tool
  config.task.num_eval = 64  # per cluster
  config.env.name = "tool"
  config.env.tools = "calc"
  config.env.max_turns = 3
  config.env.max_tokens = 32  # a call (<= 11 tokens), its response (<= 10), the answer, EOS
  config.env.max_observation_tokens = 12
  config.sampling.max_new_tokens = 12  # per model turn
  config.rewards.workers = 1  # the environment steps (and their tools) run in it
  config.sft.num_steps = 800  # copying numbers into the call and out of its response
  config.sft.batch_size = 64
  config.sft.learning_rate = 2e-3
  config.train.num_steps = 50
  config.train.batch_size = 16
  config.train.mini_batch_size = 16
  config.train.learning_rate = 5e-4
  config.rl.group_size = 8
  config.eval.every_steps = 10
  config.checkpoint.every_steps = 20
  if arg.smollm2:
    config.model.path = "packaged:smollm2-135m-instruct"
    config.model.unroll_layers = False  # 30 layers: the rolled loop compiles faster
    config.sft.num_steps = 0  # an instruct model: no warm start
    config.train.learning_rate = 1e-5
    config.env.max_tokens = 192
    config.env.max_observation_tokens = 32  # the template's tool message and assistant header
    config.sampling.max_new_tokens = 64
    config.sampling.prompt_buckets = (224,)  # the tool schema in the system prompt: 207-209
  if arg.runlocal and arg.smollm2:  # one RL step, as small as it runs
    common.runlocal(config, num_train=8, num_eval=1, num_steps=1, every_steps=1)
    config.train.batch_size = config.train.mini_batch_size = 1
    config.rl.group_size = 2
    config.env.update(max_turns=2, max_tokens=16, max_observation_tokens=12)
    config.sampling.max_new_tokens = 4
  elif arg.runlocal:
    common.runlocal(config, num_train=256, num_eval=4, num_steps=2, every_steps=2)
    common.tiny_runlocal_batches(config)
    # Every demonstration calls the tool, and long enough a warm start that the policy does too:
    # the RL steps then train on episodes with observations (tests/e2e/test_arith_tool.py).
    config.task.options.tool_fraction = 1.0
    config.sft.num_steps = 100
  return config
