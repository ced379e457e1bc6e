"""The base config: every key any experiment uses, each documented once, and `parse_arg`; and
`runlocal` and `tiny_runlocal_batches`, groups of keys that several experiments set alike.

Not an experiment itself: each `configs/<exp>.py` starts from `get_config()` here and overrides
what its experiment changes. The values are those of the default main job,
configs/arith_ebpo.py. Keys the trainer reads only for random-init models (`model.architecture`,
`model.tie_word_embeddings`, `model.rope_theta`) default to a plain Llama-style decoder.
"""

from typing import NoReturn

import ml_collections
from ml_collections.config_dict import placeholder


def get_config() -> ml_collections.ConfigDict:
  """The base config (the default job's values); experiments override what they change."""
  config = ml_collections.ConfigDict()
  config.seed = 0  # int; the run's only seed: data order, init, sampling, derived by fold_in/split

  config.task = ml_collections.ConfigDict()  # the prompts and their verifier
  config.task.name = "arithmetic"  # in tasks.TASKS: arithmetic | math | jsonl | reasoning_gym:A+B
  config.task.num_train = 20_000  # training prompts drawn from the task (when data.path is "")
  config.task.num_eval = 128  # in-training evaluation: at most this many prompts per cluster
  # The tasks' constructor keywords, every built-in task's here so that each is settable from the
  # command line (`--config.task.options.path=F`); an experiment sets entries, never replaces the
  # whole. A task takes those its constructor names and that are not None (None: its own default).
  config.task.options = ml_collections.ConfigDict()  # keywords of the tasks (ebpo_jax.tasks)
  config.task.options.ops = ("add",)  # arithmetic: operations among add, sub, mul
  config.task.options.digits = (1, 2)  # arithmetic: operand digit counts
  config.task.options.clusters = placeholder(tuple)  # arithmetic: cluster names (add_1, ...)
  config.task.options.path = placeholder(str)  # jsonl, math: the rows file (JSONL/Parquet)
  config.task.options.eval_path = placeholder(str)  # jsonl: the eval rows' file; None: a split
  config.task.options.source = placeholder(str)  # math: a named source (champ) without a path
  config.task.options.levels = placeholder(int)  # reasoning_gym: difficulty levels per dataset
  config.task.options.dataset_cfg = placeholder(object)  # reasoning_gym: {dataset: {kwarg: v}}
  config.task.options.eval_fraction = placeholder(float)  # share of prompts held out for eval
  config.task.options.instruction = placeholder(str)  # jsonl: appended; math: {prompt} template
  config.task.options.tool_fraction = placeholder(float)  # arith_tool: warm-start rows using calc

  config.data = ml_collections.ConfigDict()  # the training rows and their order
  # JSONL/Parquet of {prompt, answer, cluster?, difficulty?}, or a directory that Hugging Face
  # datasets' save_to_disk wrote; local or gs://
  config.data.path = ""  # training rows; "": the task's rows
  config.data.split = "train"  # the split read when data.path is a DatasetDict directory
  # The columns of data.path and eval.path (renamed to prompt, answer, cluster in the rows).
  config.data.prompt_column = "prompt"  # the prompt (GSM8K: question)
  config.data.answer_column = "answer"  # the answer, a string
  config.data.cluster_column = "cluster"  # the cluster, if any (none: every row in cluster 0)
  config.data.answer_regex = ""  # answer = its last match (group 1 if any); GSM8K: ####\s*(.+)
  # Without eval.path, the in-training evaluation measures rows of data.path held out of training:
  # this share of its prompts (by a hash of the prompt text, not the seed).
  config.data.eval_fraction = 0.1  # in (0, 1): the held-out share of data.path's prompts
  config.data.order = "shuffle"  # shuffle | clustered (cluster runs) | curriculum (easy -> hard)
  config.data.skip_bad_rows = False  # drop (and count) rows the tokenizer or buckets reject

  config.model = ml_collections.ConfigDict()  # the policy (and its frozen KL reference)
  config.model.path = ""  # HF directory or packaged:NAME; "": random-init decoder of this shape
  config.model.init_from = ""  # trainer workdir: start from its latest checkpoint's params
  config.model.architecture = "llama"  # llama | qwen2 | qwen3 | qwen3_moe; random-init models only
  config.model.tie_word_embeddings = True  # lm_head shares the embedding; random-init models only
  config.model.rope_theta = 10_000.0  # RoPE base frequency; random-init models only
  config.model.hidden_size = 64  # shape keys: random-init models only (a model.path has its own)
  config.model.intermediate_size = 192  # MLP width
  config.model.num_layers = 3  # decoder layers
  config.model.num_heads = 2  # query heads
  config.model.num_kv_heads = 2  # key/value heads (GQA: divides num_heads)
  config.model.head_dim = 32  # per-head width
  # Mixture of experts (architecture qwen3_moe, models.moe; random-init models only): every layer's
  # MLP a sparse block of num_experts SwiGLU experts, num_experts_per_tok of them per token.
  config.model.num_experts = 0  # experts per block; 0: dense
  config.model.num_experts_per_tok = 2  # experts per token (top k)
  config.model.moe_intermediate_size = 64  # an expert's MLP width
  # The router's load-balancing loss weight; None: the model directory's (HF's 0.001 if unset),
  # 0.001 for a random-init MoE.
  config.model.router_aux_loss_coef = placeholder(float)  # None | >= 0
  config.model.moe_kernel = "auto"  # the experts: auto (megablox on TPU) | ragged_dot | megablox
  config.model.vocab_size = 0  # model.path's vocabulary, for ebpo_jax.aot without the directory
  config.model.dtype = "float32"  # compute dtype: float32 | bfloat16
  config.model.param_dtype = "float32"  # master-weight dtype: float32 | bfloat16
  config.model.remat = "none"  # per-layer rematerialisation: none | full | dots | dots_no_batch
  # One rolled loop (False) compiles in a fraction of the time: the choice for deep models on TPU.
  config.model.unroll_layers = True  # training's layer loop unrolled (faster on XLA:CPU)
  # Without a KV cache (training, reference log-probs, prefill); auto is splash on TPU, cudnn on
  # NVIDIA GPUs at bfloat16/float16 (cuDNN refuses float32), xla elsewhere; a kernel off its
  # platform is emulated (ebpo_jax.models.attention).
  config.model.attention = "auto"  # attention backend: auto | xla | splash | cudnn
  config.model.attention_block = 512  # splash's largest block, a multiple of 128; shorter: smaller
  config.model.chat_template = True  # a model directory's chat template wraps the prompts
  config.model.lora = ml_collections.ConfigDict()  # LoRA adapters (ebpo_jax.models.lora)
  config.model.lora.rank = 0  # adapter rank; 0: no adapters, full fine-tuning
  config.model.lora.alpha = 16.0  # adapter output scaled by alpha / rank
  config.model.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated projections to adapt
  # Dropout on each adapter's input, in the policy-gradient loss's forward only (not in sampling,
  # evaluation or the KL reference): > 0 makes the PPO ratio differ from 1 on the first iteration.
  config.model.lora.dropout = 0.0  # adapter input dropout rate in [0, 1); 0: off
  config.model.lora.base_dtype = ""  # base weights' dtype under LoRA; "": model.param_dtype

  config.sft = ml_collections.ConfigDict()  # supervised warm start on the answers, before RL
  config.sft.num_steps = 450  # optimizer steps; 0: no warm start
  config.sft.batch_size = 128  # prompts per step
  config.sft.learning_rate = 1e-3  # AdamW, constant

  config.train = ml_collections.ConfigDict()  # the RL loop and its AdamW optimizer
  config.train.num_steps = 200  # RL steps (each: sample, score, advantages, updates)
  config.train.batch_size = 32  # prompts per RL step (x rl.group_size responses)
  config.train.mini_batch_size = 32  # prompts per optimizer update; divides batch_size
  config.train.micro_batch_size = 0  # rows (responses) per gradient-accumulation chunk; 0: whole
  config.train.learning_rate = 1e-4  # peak learning rate, > 0
  config.train.warmup_steps = 0  # optimizer updates of linear warmup from 0
  config.train.schedule = "constant"  # after warmup: constant | cosine (to 0 at the last update)
  config.train.weight_decay = 0.0  # AdamW decoupled weight decay
  config.train.grad_clip = 1.0  # global-norm gradient clipping
  config.train.max_bad_steps = 5  # abort after this many non-finite updates in a row (skipped)
  config.train.log_every = 1  # RL steps between metrics.jsonl lines
  config.train.transfer_guard = "disallow"  # RL loop's jax.transfer_guard: disallow | log | allow

  config.rl = ml_collections.ConfigDict()  # the RL objective
  config.rl.group_size = 8  # G: responses sampled per prompt, >= 2
  config.rl.advantage = "ebpo"  # grpo | dr_grpo | rloo | js_shrinkage | ebpo
  config.rl.eps = 1e-6  # epsilon of the estimators that divide by a std (grpo, js_shrinkage, ebpo)
  config.rl.num_iterations = 1  # PPO epochs over each step's batch, >= 1
  config.rl.dynamic_sampling = False  # DAPO: drop groups whose rewards are all equal, refill
  config.rl.max_refill_rounds = 0  # extra rollout rounds per step to refill dropped groups
  config.rl.overlong_buffer = 0  # DAPO soft overlong penalty over the last N tokens; 0: off
  config.rl.overlong_penalty = 1.0  # the penalty at max_new_tokens (linear over the buffer)
  config.rl.ebpo = ml_collections.ConfigDict()  # the EBPO estimator (EBPO.md)
  config.rl.ebpo.mode = "running"  # running (paper, Algorithm 1) | batch (authors' released code)
  config.rl.ebpo.decay = 1.0  # in (0, 1]: weight of the prior's old statistics; 1: the paper
  config.rl.ebpo.per_cluster = True  # one prior per cluster; False: one global prior
  config.rl.ebpo.normalize = "batch"  # batch (paper) | none | group | cluster
  config.rl.loss = ml_collections.ConfigDict()  # PPO-clip policy loss (ebpo_jax.losses)
  config.rl.loss.clip_low = 0.2  # ratio clip below: 1 - clip_low
  config.rl.loss.clip_high = 0.2  # ratio clip above: 1 + clip_high (DAPO's clip-higher: 0.28)
  config.rl.loss.dual_clip = 3.0  # dual-clip bound of negative advantages, > 1
  config.rl.loss.aggregation = "token-mean"  # | seq-mean-token-mean | seq-mean-token-sum-norm
  config.rl.loss.kl_coef = 0.0  # KL to the frozen start model; 0: no reference model
  config.rl.loss.kl_kind = "k3"  # KL estimator: k1 | k2 | k3
  config.rl.loss.entropy_coef = 0.0  # entropy bonus; 0: off
  # The sampler-trainer mismatch correction (docs/configs.md#sampler-trainer-mismatch): weights on
  # the policy-gradient terms from the first-pass / sampler probability ratio of each token.
  config.rl.loss.rollout_is = "none"  # none | token_tis (min(r, cap)) | seq_mask (geo. mean ratio)
  config.rl.loss.rollout_is_cap = 2.0  # token_tis: the weights' cap; seq_mask: kept in [1/cap, cap]
  # The ratio PPO's surrogate clips (docs/configs.md#sequence-level-ratios-gspo). GSPO is
  # sequence with aggregation=seq-mean-token-mean; its levels clip with seq_clip_*, not clip_*.
  config.rl.loss.ratio_level = "token"  # token (PPO) | sequence (GSPO) | sequence_token
  config.rl.loss.seq_clip_low = 3e-4  # a sequence ratio's clip below: 1 - seq_clip_low (GSPO's)
  config.rl.loss.seq_clip_high = 4e-4  # ... above: 1 + seq_clip_high (GSPO's)
  # PPO's old log-probs from the train step's first pass (its params before any update; verl's
  # default), not the sampler's. Free with one update per step (that update's forward); else one
  # forward more per step (bench/recompute.py). A correction (rl.loss.rollout_is) implies it.
  config.rl.recompute_old_logps = False  # True: old log-probs the trainer's, not the sampler's
  # Asynchronous RL (docs/async.md): the batch trained at step t is sampled with the policy of
  # step max(0, t - k), by the schedule, never by timing; the sampler, environments and rewards of
  # the next batches run while the trainer trains. 0: synchronous. k > 0 implies
  # rl.recompute_old_logps (the sampler's policy is k steps behind; rl.loss.rollout_is weighs it).
  config.rl.max_staleness = 0  # k >= 0

  config.sampling = ml_collections.ConfigDict()  # rollouts
  config.sampling.temperature = 1.0  # > 0
  # The sampler's compute dtype: "" is model.dtype; bfloat16 under a float32 trainer makes the
  # sampler's log-probs differ from the trainer's (mismatch/* metrics; rl.loss.rollout_is).
  config.sampling.dtype = ""  # "" | float32 | bfloat16
  config.sampling.top_p = 1.0  # nucleus mass in (0, 1]; 1: off
  config.sampling.top_k = 0  # keep the k most likely tokens; 0: off
  config.sampling.max_new_tokens = 4  # response length cap, tokens
  config.sampling.prompts_per_call = 0  # prompts per sampler call (0: all); bounds the KV cache
  # Up to this many of a round's sampler calls at once, each in a thread: one call's host work
  # (environment steps and their tools, reward functions, detokenizing) waits while another's
  # decodes. The same rollouts as one at a time (each call its own rows and key); n calls' KV
  # caches on the device at once. Pays for multi-turn episodes with slow tools: docs/async.md.
  config.sampling.concurrent_calls = 1  # >= 1
  config.sampling.prompt_buckets = (6, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # tokens
  # False: one decode loop over all rows to the end. True: fewer row-steps, the same tokens, one
  # loop body per stage (~2x the sampler's compile time): ebpo_jax/sampling/loop.py. It pays for
  # long, uneven responses (5x useful tok/s on a long tail, results/speed.md): the real-model
  # configs turn it on; this job's 4-token answers would only compile longer.
  config.sampling.compact = False  # decode in halving batches of the running rows (multi-turn:
  # between turns, only the running trajectories' rows go on, in halving batches)
  # Each round of sampler calls decodes from one copy of the weights in the compute dtype, made
  # before the round and freed after it. True: split over 'tensor' only, replicated over the rows'
  # axes (data, fsdp), so no decode step gathers a weight; False: split as in training (less
  # memory, every decode step gathers the fsdp shards): docs/will-it-fit.md.
  config.sampling.replicate_weights = True  # the round's weights replicated over data and fsdp

  # Multi-turn episodes (ebpo_jax/envs): each model turn ends at a stop token (at most
  # sampling.max_new_tokens); the environment answers, its observation's tokens are appended (loss
  # mask 0), and the model's next turn continues from the KV cache. A trajectory trains as one
  # sequence.
  config.env = ml_collections.ConfigDict()  # the environment of multi-turn rollouts
  config.env.name = ""  # "": single-turn; tool (ToolEnvironment) | package.module:Class
  config.env.tools = ""  # comma-separated tools: a built-in (calc) or package.module:function
  config.env.max_turns = 3  # model turns per trajectory
  config.env.max_tokens = 64  # trajectory tokens after the prompt (model + observations)
  config.env.max_observation_tokens = 16  # an observation's tokens beyond this are cut
  config.env.options = ml_collections.ConfigDict()  # the environment's constructor keywords
  # A slow tool to measure with: each turn that steps environments waits this long (the calls of a
  # turn concurrently, as an I/O-bound tool service answers them: a sandbox pool, a search API).
  config.env.tool_latency_s = 0.0  # seconds >= 0

  config.rewards = ml_collections.ConfigDict()  # scoring the responses
  # Scorer processes. 0: the task's verifier scores in this process, and rewards.fns (user code)
  # in one worker, so that a crash kills a worker, never the trainer.
  config.rewards.workers = 0  # scorer processes (ebpo_jax/tasks/rewards.py)
  # A function that times out workers + 1 times in a row (twice with one worker) is not called
  # again in that batch: its other calls score 0, counted in reward/errors.
  config.rewards.timeout_s = 5.0  # seconds per response before it scores 0
  # A training step whose failed reward calls (raised, hung, crashed, no number) exceed this share
  # of its calls stops the run with one line naming the function and its first error.
  config.rewards.max_error_frac = 0.5  # in [0, 1]; 1: never stop (failed calls score 0)
  # The training reward as a weighted sum of reward functions (ebpo_jax/tasks/reward_fns.py), terms
  # `[NAME=][WEIGHT*]FN`, FN a built-in (task, exact_match, math_verify, answer_format,
  # length_penalty) or package.module:function: "math_verify, 0.5*my_rewards:brevity".
  config.rewards.fns = ""  # "": the task's verifier is the reward; each term logs reward/NAME

  config.eval = ml_collections.ConfigDict()  # held-out evaluation
  config.eval.every_steps = 25  # RL steps between evaluations (and at step 0 and the last)
  config.eval.greedy = True  # argmax decoding (when num_samples is 1); False: sampled
  config.eval.num_samples = 1  # k responses per problem; eval/accuracy is avg@k (full reward)
  # The evaluation's rows (in training and `ebpo_jax.evaluate`), read as data.path is (a
  # DatasetDict: name its split's folder), labelled by their own clusters.
  config.eval.path = ""  # "": data.path's held-out rows (data.eval_fraction), else the task's

  config.logging = ml_collections.ConfigDict()  # samples and wandb (metrics.jsonl + TB: always)
  config.logging.samples_every = 10  # RL steps between sample completion tables; 0: none
  config.logging.num_samples = 16  # completions per table: the batch's first (whole groups)
  config.logging.plots = True  # WORKDIR/plots/*.png at the end of the run (0.3-0.5 s each)
  config.logging.wandb = False  # also log to Weights & Biases (pip install -e '.[wandb]')
  config.logging.wandb_project = "ebpo-jax"  # wandb project
  config.logging.wandb_entity = ""  # wandb team or user; "": your default entity
  config.logging.wandb_run_name = ""  # "": the workdir's base name
  config.logging.wandb_tags = ""  # comma-separated tags: "ebpo,g8"
  config.logging.wandb_mode = ""  # online | offline | disabled; "": $WANDB_MODE, else online

  config.checkpoint = ml_collections.ConfigDict()  # WORKDIR/checkpoints/
  # A checkpoint when either cadence is due (0 turns one off; both 0: only step 0, the last step and
  # SIGTERM's). Time: at the first step boundary every_minutes after the last save (process 0's
  # clock decides for all processes), so a run killed without notice loses at most every_minutes
  # plus one step; by steps, at most every_steps steps.
  config.checkpoint.every_steps = 50  # RL steps between checkpoints
  config.checkpoint.every_minutes = 0.0  # minutes between checkpoints (0: off); e.g. 30 on spot VMs
  config.checkpoint.max_to_keep = 2  # newest checkpoints kept

  config.workdir = ml_collections.ConfigDict()  # this start on --workdir (ebpo_jax.trainer.workdir)
  config.workdir.break_lock = False  # take over a bucket workdir's lock left by a dead run
  # Steps and evaluation, logging and checkpoint cadence may change on a resume; other changes from
  # WORKDIR/config.json stop it unless accepted here.
  config.workdir.accept_changes = ""  # comma-separated dotted keys, or "all"
  # fresh: the run the workdir holds (config, metrics, checkpoints, plots) moves to
  # WORKDIR/previous.<n>/, never deleted. resume_step: later checkpoints move to
  # WORKDIR/checkpoints.dropped/, later metrics lines are dropped. Pass each once: a relaunch with
  # it does it again.
  config.workdir.fresh = False  # start over in a workdir that holds a run
  config.workdir.resume_step = -1  # resume from this retained checkpoint; -1: the latest

  config.mesh = ml_collections.ConfigDict()  # device mesh; the product is the device count
  config.mesh.data = 1  # data-parallel replicas
  config.mesh.fsdp = -1  # parameter/data sharding; -1: all remaining devices
  config.mesh.tensor = 1  # tensor parallelism (heads, MLP, vocabulary)
  # The sampler on devices of its own (docs/async.md): the last N devices sample (rows over them,
  # weights replicated, 'tensor' kept where it divides N), the mesh above is over the others; the
  # weights move to them once per round, each batch back. 0: the sampler shares the mesh.
  config.mesh.rollout_devices = 0  # N >= 0
  return config


# Groups of keys several experiments set alike (`cfg`, not `config`: each key's one `config.` line
# is in get_config above).
def runlocal(
  cfg: ml_collections.ConfigDict, *, num_train: int, num_eval: int, num_steps: int, every_steps: int
) -> None:
  """The frame of an experiment's `runlocal` variant (seconds on a CPU): `num_steps` RL steps on
  `num_train` training prompts, `num_eval` held-out prompts per cluster, an evaluation and a
  checkpoint every `every_steps` steps."""
  cfg.task.num_train, cfg.task.num_eval = num_train, num_eval
  cfg.train.num_steps = num_steps
  cfg.eval.every_steps = cfg.checkpoint.every_steps = every_steps


def tiny_runlocal_batches(cfg: ml_collections.ConfigDict) -> None:
  """The runlocal batches of the tiny random-init decoder's jobs (configs/arith_ebpo.py and
  arith_tool.py): a warm start of 5 steps of 16 prompts, then 8 prompts x G = 4 per RL step in
  mini-batches of 4."""
  cfg.sft.num_steps, cfg.sft.batch_size = 5, 16
  cfg.train.batch_size, cfg.train.mini_batch_size = 8, 4
  cfg.rl.group_size = 4


def parse_arg(
  arg: str | None, /, **defaults: bool | int | float | str
) -> ml_collections.ConfigDict:
  """The `ARG` of `--config=configs/NAME.py:ARG` as a ConfigDict of `defaults`' keys and types.

  After big_vision's `bvcc.parse_arg`. `arg` is comma-separated parts, each one of:
    KEY=VALUE   sets KEY, VALUE converted to the type of its default (bool: true/false/1/0)
    KEY         a bool default's name: sets it True ("runlocal")
    KEYN        an int default's name and digits: sets it to N ("g8" with `g=4`)
    WORD        the next str default not yet set, in `defaults`' order (positional names:
                "qwen3_8b,grpo" with `model="", method=""`)
  Unset keys keep their defaults. An unknown part, or a key given twice, raises ValueError naming
  the known options.
  """
  known = ", ".join(f"{k}<int>" if type(v) is int else k for k, v in defaults.items())

  def fail(message: str) -> NoReturn:
    raise ValueError(f"config argument {arg!r}: {message} (known: {known or 'none'}; or KEY=VALUE)")

  values, given = dict(defaults), set()
  for part in (p.strip() for p in (arg or "").split(",")):
    if not part:
      continue
    free = [k for k, v in defaults.items() if type(v) is str and k not in given]
    if "=" in part:
      key, value = (s.strip() for s in part.split("=", 1))
      if key not in defaults:
        fail(f"unknown key {key!r}")
    elif type(defaults.get(part)) is bool:
      key, value = part, "true"
    elif (key := part.rstrip("0123456789")) != part and type(defaults.get(key)) is int:
      value = part[len(key) :]
    elif free:
      key, value = free[0], part
    else:
      fail(f"unknown argument {part!r}")
    if key in given:
      fail(f"{key} given twice")
    given.add(key)
    kind = type(defaults[key])
    if kind is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        fail(f"{key}={value!r} is not a bool")
      values[key] = value.lower() in ("true", "1")
    else:
      try:
        values[key] = kind(value)
      except ValueError:
        fail(f"{key}={value!r} is not a {kind.__name__}")
  return ml_collections.ConfigDict(values)
