"""Every config file loads and passes the trainer's checks.

Each of the paper's 18 (model, method) pairs, at G = 4, and G = 8, 16, 32 on one pair, traces the
trainer's train step in process (abstract shapes: nothing compiles) with the metrics its method
promises. All 72 configs pass check_config. (One real RL step per model: e2e/test_configs.py.)"""

import re

import jax
import pytest

from ebpo_jax import models, sharding, tasks
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import state as state_lib
from ebpo_jax.trainer import step as step_lib
from ebpo_jax.trainer import task_rows
from tests.helpers import ROOT
from tests.helpers.configs import config_module

paper = config_module("paper")

# Every (model, method) at the default G = 4, and the other group sizes on one pair.
RUN_ARGS = [f"{model},{method}" for model in paper.MODELS for method in paper.METHODS] + [
  f"qwen3_8b,grpo,g{g}" for g in paper.GROUP_SIZES if g != 4
]

RUN_ARGS += ["qwen3_8b,ebpo_topic,lora32"]  # LoRA: the KL reference is the base, adapters off

ALL_ARGS = [
  f"{model},{method},g{g}"
  for model in paper.MODELS
  for method in paper.METHODS
  for g in paper.GROUP_SIZES
]


def runlocal_model(config):
  """The runlocal config's model over its task's tokenizer, and its mesh."""
  task = tasks.from_config(config.task)
  model = models.build.make_model(config, task_rows.load_tokenizer(config, task).vocab_size)
  return model, sharding.make_mesh(dict(config.mesh))


@pytest.mark.parametrize("arg", RUN_ARGS)
def test_runlocal_variant_traces_the_train_step(arg):
  # jax.eval_shape traces train_step as the trainer jits it (estimator, loss, KL reference, mesh)
  # on abstract shapes: a config the step cannot run fails here, without compiling.
  method = arg.split(",")[1]
  config = paper.get_config(f"{arg},runlocal")
  config_lib.check_config(config, jax.device_count())
  model, mesh = runlocal_model(config)
  params = models.build.abstract_params(model, mesh)
  spec = state_lib.StateSpec.from_config(config, num_clusters=4)
  state = spec.abstract(params)
  options = step_lib.StepOptions.from_config(config, mesh)
  prompt_len, max_new_tokens = max(config.sampling.prompt_buckets), config.sampling.max_new_tokens
  batch = step_lib.abstract_batch(options.layout, prompt_len, max_new_tokens)
  step = step_lib.bound_train_step(model, spec, options, mesh)
  new_state, metrics, aux = jax.eval_shape(step, state, batch)
  assert aux.advantages.shape == (config.train.batch_size, config.rl.group_size)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for key in ("loss", "grad_norm", "entropy", "bad_updates", "reward/mean"):
    assert metrics[key].shape == (), key
  assert ("ebpo/shrinkage_mean" in metrics) == method.startswith("ebpo")
  lora = config.model.lora.rank > 0
  assert (new_state.ref_params is not None) == (config.rl.loss.kl_coef > 0 and not lora)
  assert (new_state.base is not None) == lora  # the frozen base beside the trained adapters
  if lora:
    assert set(jax.tree.leaves(jax.tree.map(lambda x: x.dtype.name, state.params))) == {"float32"}
    assert {x.dtype.name for x in jax.tree.leaves(state.base)} == {"bfloat16"}
  assert config.rl.dynamic_sampling == (method == "dapo")


@pytest.mark.parametrize("model", list(paper.MODELS))
def test_runlocal_model_has_the_architecture_of_the_paper_model(model):
  config = paper.get_config(f"{model},grpo,runlocal")
  runlocal, mesh = runlocal_model(config)
  params = models.build.abstract_params(runlocal, mesh)  # shapes only: nothing is initialised
  spec = paper.MODELS[model]
  attention = params["layers"]["self_attn"]
  layers, hidden, heads, _ = attention["q_proj"]["kernel"].shape
  assert (layers, hidden) == (2, config.model.hidden_size)
  assert (
    heads // attention["k_proj"]["kernel"].shape[2] == spec["num_heads"] // spec["num_kv_heads"]
  )
  assert ("q_norm" in attention) == (spec["architecture"] == "qwen3")
  assert ("lm_head" in params) == (not spec["tie_word_embeddings"])


@pytest.mark.parametrize("arg", ["qwen3_8b,ebpo_topic,lora32", "qwen3_14b,dapo,g32,lora64"])
def test_lora_variants_change_only_the_adapters_and_the_learning_rate(arg):
  lora = paper.get_config(arg)
  full = paper.get_config(arg.rsplit(",", 1)[0]).to_dict()
  rank = int(arg.rsplit(",lora", 1)[1])
  assert lora.model.lora.to_dict() == {
    "rank": rank,
    "alpha": 32.0,
    "targets": "q,k,v,o,gate,up,down",
    "dropout": 0.0,
    "base_dtype": "bfloat16",
  }
  assert lora.train.learning_rate == pytest.approx(10 * full["train"]["learning_rate"]) == 1e-5
  lora.model.lora, lora.train.learning_rate = full["model"]["lora"], full["train"]["learning_rate"]
  assert lora.to_dict() == full
  config_lib.check_config(lora, paper.TARGET_DEVICES)
  config_lib.check_config(paper.get_config(f"{arg},runlocal"), 8)


@pytest.mark.parametrize("arg", ALL_ARGS)
def test_full_and_runlocal_configs_pass_the_trainer_checks(arg):
  full = paper.get_config(arg)
  config_lib.check_config(full, paper.TARGET_DEVICES)
  assert config_lib._data_shards(full, paper.TARGET_DEVICES) == 8  # fsdp 8 x tensor 4
  # The rows per sampler call the TPU compiler fits (results/memory.md), at every G
  model, g = arg.split(",")[0], full.rl.group_size
  assert full.sampling.prompts_per_call * g == paper.SAMPLER_ROWS[model]
  # G = 4: micro-batches of whole groups over the 8 batch shards (each prompt once per group)
  assert g != 4 or (full.train.micro_batch_size // g) % 8 == 0
  config_lib.check_config(paper.get_config(f"{arg},runlocal"), 8)


def test_full_configs_hold_the_paper_hyperparameters():
  config = paper.get_config("qwen3_8b,ebpo_topic")
  tc, rl, loss = config.train, config.rl, config.rl.loss
  assert (tc.learning_rate, tc.schedule, tc.weight_decay, tc.grad_clip) == (
    1e-6,
    "constant",
    0.01,
    1.0,
  )
  assert (tc.batch_size, tc.mini_batch_size, rl.num_iterations, rl.group_size) == (512, 128, 1, 4)
  assert (loss.clip_low, loss.clip_high, loss.dual_clip) == (0.2, 0.2, 3.0)
  assert (loss.kl_coef, loss.kl_kind, loss.entropy_coef, loss.aggregation) == (
    0.001,
    "k3",
    0.0,
    "token-mean",
  )
  assert (config.sampling.temperature, config.sampling.top_p) == (1.0, 1.0)
  assert config.sampling.max_new_tokens == 8192
  assert max(config.sampling.prompt_buckets) == 4096
  assert (rl.advantage, rl.ebpo.mode, rl.ebpo.normalize, rl.ebpo.decay) == (
    "ebpo",
    "running",
    "batch",
    1.0,
  )
  assert config.data.order == "clustered" and rl.ebpo.per_cluster
  assert (config.model.dtype, config.model.param_dtype, config.model.remat) == (
    "bfloat16",
    "float32",
    "full",
  )
  assert config.model.path == "/data/models/Qwen3-8B" and config.model.chat_template
  assert config.eval.num_samples == 16 and not config.eval.greedy
  assert paper.get_config("qwen3_14b,ebpo_topic,g16").rl.group_size == 16


def test_methods_change_only_what_they_define():
  base = paper.get_config("llama31_8b,ebpo_topic").to_dict()
  naive = paper.get_config("llama31_8b,ebpo_naive")
  assert (naive.data.order, naive.rl.ebpo.per_cluster) == ("shuffle", False)
  diff = paper.get_config("llama31_8b,ebpo_diff")
  assert (diff.data.order, diff.rl.ebpo.per_cluster) == ("curriculum", False)
  assert "llama31_8b" in diff.data.path  # the model's own pass rates
  grpo = paper.get_config("llama31_8b,grpo")
  assert grpo.rl.advantage == "grpo" and grpo.rl.loss.to_dict() == base["rl"]["loss"]
  dr_grpo = paper.get_config("llama31_8b,dr_grpo")
  assert dr_grpo.rl.advantage == "dr_grpo"
  assert dr_grpo.rl.loss.aggregation == "seq-mean-token-sum-norm"
  dapo = paper.get_config("llama31_8b,dapo")
  assert (dapo.rl.loss.clip_low, dapo.rl.loss.clip_high, dapo.rl.loss.kl_coef) == (0.2, 0.28, 0.0)
  assert dapo.rl.dynamic_sampling and dapo.rl.max_refill_rounds >= 1
  assert (dapo.rl.overlong_buffer, dapo.rl.overlong_penalty) == (1638, 1.0)
  assert dapo.rl.loss.aggregation == "token-mean"
  for config in (naive, diff, grpo, dr_grpo, dapo):  # the shared recipe is untouched
    assert config.train.to_dict() == base["train"]
    assert config.sampling.to_dict() == base["sampling"]
    assert config.model.to_dict() == base["model"]
    assert not config.rl.dynamic_sampling or config is dapo


@pytest.mark.parametrize(
  ("arg", "message"),
  [
    ("", "expected MODEL,METHOD"),
    ("qwen3_8b", "expected MODEL,METHOD"),
    ("qwen2_7b,grpo", "unknown MODEL 'qwen2_7b'"),
    ("qwen3_8b,ppo", "unknown METHOD 'ppo'"),
    ("qwen3_8b,grpo,g3", "unknown group size g3"),
    ("qwen3_8b,grpo,g64", "unknown group size g64"),
    ("qwen3_8b,grpo,runlocal,runlocal", "runlocal given twice"),
    ("qwen3_8b,grpo,g8,g16", "g given twice"),
    ("qwen3_8b,grpo,ppo", "unknown argument 'ppo'.*known: model, method, g<int>, lora<int>"),
    ("qwen3_8b,grpo,lora", "unknown argument 'lora'"),  # the paper's variant names the rank
    ("qwen3_8b,grpo,lora=-1", "LoRA rank lora-1"),
  ],
)
def test_bad_arguments_name_the_part(arg, message):
  with pytest.raises(ValueError, match=message):
    paper.get_config(arg)


@pytest.mark.parametrize(
  "name",
  sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem not in ("paper", "common")),
)
def test_other_configs_load_and_pass_the_trainer_checks(name):
  module = config_module(name)
  config_lib.check_config(module.get_config(), 1)  # full configs: one device (a GPU) at least
  # runlocal: CI's 8 fake devices; the SmolLM2 one runs on one CPU device (tests/test_smollm2.py)
  config_lib.check_config(module.get_config("runlocal"), 1 if name.startswith("smollm2") else 8)
  with pytest.raises(ValueError, match="unknown argument"):
    module.get_config("no_such_variant")


def test_smollm2_lora_variant():
  module = config_module("smollm2_135m_ebpo")
  full, lora = module.get_config("runlocal"), module.get_config("runlocal,lora")
  assert (lora.model.lora.rank, lora.model.lora.alpha, lora.model.lora.base_dtype) == (
    8,
    32.0,
    "bfloat16",
  )
  assert lora.model.lora.targets == "q,k,v,o,gate,up,down"
  assert lora.train.learning_rate == pytest.approx(10 * full.train.learning_rate) == 2e-5
  lora.model.lora, lora.train.learning_rate = full.model.lora, full.train.learning_rate
  assert lora.to_dict() == full.to_dict()  # the runlocal shapes are untouched
  config_lib.check_config(module.get_config("lora"), 1)
  config_lib.check_config(module.get_config("math,lora"), 1)


def test_arith_hard_variant_shortens_the_warm_start_and_widens_the_evaluation():
  # The hard regime (configs/arith_ebpo.py:hard): the same task, model and RL recipe; a warm start
  # that stops before add_2's transition, more held-out prompts per cluster, fewer RL steps.
  module = config_module("arith_ebpo")
  default, hard = module.get_config().to_dict(), module.get_config("hard")
  assert tasks.from_config(hard.task).cluster_names == ["add_1", "add_2"]
  assert hard.sft.num_steps == 200 < default["sft"]["num_steps"]
  assert hard.task.num_eval == 256 > default["task"]["num_eval"]
  assert hard.train.num_steps == 100 < default["train"]["num_steps"]
  hard.sft.num_steps = default["sft"]["num_steps"]
  hard.task.num_eval = default["task"]["num_eval"]
  hard.train.num_steps = default["train"]["num_steps"]
  assert hard.to_dict() == default  # nothing else changed
  config_lib.check_config(module.get_config("hard"), 1)
  # runlocal's sizes override the regime's: "hard,runlocal" is the runlocal smoke run (trained by
  # the tests of configs/arith_ebpo.py:runlocal, e.g. tests/e2e/test_train.py).
  assert module.get_config("hard,runlocal").to_dict() == module.get_config("runlocal").to_dict()


# ----------------------------------------------------------------------------- configs/common.py

common = config_module("common")

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "common")

# Every variant of every experiment: the paper's 72, and each other config's arguments.
RESOLVED_ARGS = [
  (name, arg) for name in EXPERIMENTS if name != "paper" for arg in (None, "runlocal")
]

RESOLVED_ARGS += [("smollm2_135m_ebpo", "math"), ("smollm2_135m_ebpo", "math,runlocal")]

RESOLVED_ARGS += [("smollm2_135m_ebpo", "lora"), ("smollm2_135m_ebpo", "runlocal,lora")]

RESOLVED_ARGS += [("arith_ebpo", "hard"), ("arith_ebpo", "hard,runlocal")]

RESOLVED_ARGS += [("paper", "qwen3_8b,grpo,lora32"), ("paper", "qwen3_8b,grpo,lora32,runlocal")]

RESOLVED_ARGS += [("paper", arg + local) for arg in ALL_ARGS for local in ("", ",runlocal")]

# Keys whose value is a dict (one option), not a section of keys.
DICT_VALUED = {"task.options.dataset_cfg"}


def flat_keys(config, prefix="") -> set[str]:
  """Dotted leaf keys."""
  keys = set()
  for key, value in config.items():
    name = prefix + key
    if hasattr(value, "items") and name not in DICT_VALUED:
      keys |= flat_keys(value, name + ".")
    else:
      keys.add(name)
  return keys


def test_every_key_of_every_experiment_is_in_common():
  base = flat_keys(common.get_config())
  modules = {name: config_module(name) for name in EXPERIMENTS}
  for name, arg in RESOLVED_ARGS:
    extra = flat_keys(modules[name].get_config(arg)) - base
    assert not extra, f"configs/{name}.py:{arg}: keys not in configs/common.py: {sorted(extra)}"


def test_every_experiment_keeps_every_key_of_common():
  # An experiment sets entries and never replaces a section (task.options) whole: what it dropped
  # could not be set from the command line (`--config.task.options.path=F`).
  base = flat_keys(common.get_config())
  modules = {name: config_module(name) for name in EXPERIMENTS}
  for name, arg in RESOLVED_ARGS:
    missing = base - flat_keys(modules[name].get_config(arg))
    assert not missing, f"configs/{name}.py:{arg}: drops keys of configs/common.py: {missing}"


def test_common_documents_every_key_once():
  # Each leaf key is assigned on one line of common.py, and that line ends in a comment.
  lines = (ROOT / "configs" / "common.py").read_text().splitlines()
  assignments = [re.match(r"\s*config\.([\w.]+) = .*", line) for line in lines]
  assigned = [m.group(1) for m in assignments if m]
  assert sorted(assigned) == sorted(set(assigned)), "a key is assigned twice in common.py"
  assert flat_keys(common.get_config()) <= set(assigned)
  undocumented = [m.group(0) for m in assignments if m and "  # " not in m.group(0)]
  assert not undocumented, undocumented


@pytest.mark.parametrize(
  ("arg", "expected"),
  [
    (None, {"model": "", "method": "", "g": 4, "runlocal": False, "lr": 1e-4}),
    ("runlocal", {"model": "", "method": "", "g": 4, "runlocal": True, "lr": 1e-4}),
    (
      "qwen3_8b,grpo,g8,runlocal",
      {"model": "qwen3_8b", "method": "grpo", "g": 8, "runlocal": True},
    ),
    ("g16, qwen3_8b ,,grpo", {"model": "qwen3_8b", "method": "grpo", "g": 16, "runlocal": False}),
    ("method=dapo,model=x,g=32,runlocal=false,lr=3e-4", {"method": "dapo", "g": 32, "lr": 3e-4}),
    ("runlocal=1", {"runlocal": True}),
  ],
)
def test_parse_arg(arg, expected):
  parsed = common.parse_arg(arg, model="", method="", g=4, runlocal=False, lr=1e-4)
  assert {k: parsed[k] for k in expected} == expected
  assert type(parsed.g) is int and type(parsed.lr) is float and type(parsed.runlocal) is bool


@pytest.mark.parametrize(
  ("arg", "message"),
  [
    ("math", "unknown argument 'math' .*known: runlocal; or KEY=VALUE"),
    ("runlocal,runlocal", "runlocal given twice"),
    ("steps=3", "unknown key 'steps'"),
    ("runlocal=maybe", "runlocal='maybe' is not a bool"),
    ("runlocal4", "unknown argument 'runlocal4'"),
  ],
)
def test_parse_arg_rejects_what_it_does_not_know(arg, message):
  with pytest.raises(ValueError, match=message):
    common.parse_arg(arg, runlocal=False)


def test_configs_load_by_path_from_any_directory(tmp_path, monkeypatch):
  # configs/ is not a package: each file loads common.py next to itself, under either loader.
  from absl import flags
  from ml_collections import config_flags

  expected = paper.get_config("qwen3_8b,dapo,g8,runlocal").to_dict()
  for cwd, path in ((ROOT, "configs/paper.py"), (tmp_path, str(ROOT / "configs/paper.py"))):
    monkeypatch.chdir(cwd)
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values)
    flag_values(["prog", f"--config={path}:qwen3_8b,dapo,g8,runlocal"])
    config = flag_values.config
    assert config.to_dict() == expected
