"""Bad input stops before anything compiles, with one line per problem: config values (each named
with the value received, exit status 2), a typo in a `--config.KEY` override (one line with the
closest key), model files, and data rows the task's tokenizer cannot encode or that are longer
than the largest prompt bucket (`FILE:LINE:`; dropped and counted with `data.skip_bad_rows`)."""

import json
import struct
import types

import jax
import ml_collections
import numpy as np
import pytest

from ebpo_jax import cli, data, errors, models
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts.options import EvalOptions
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import task_rows
from tests.helpers.configs import arith_config

# (override, the start of the message); each failed late or with a traceback before the check.
BAD_VALUES = [
  ({"eval.every_steps": 0}, "config.eval.every_steps=0: must be >= 1"),
  ({"train.log_every": 0}, "config.train.log_every=0: must be >= 1"),
  ({"task.num_eval": 0}, "config.task.num_eval=0: must be >= 1"),
  ({"task.num_train": 0}, "config.task.num_train=0: must be >= 1"),
  ({"rl.loss.dual_clip": 1.0}, "config.rl.loss.dual_clip=1.0: must be > 1"),
  ({"rl.loss.dual_clip": 0.5}, "config.rl.loss.dual_clip=0.5: must be > 1"),
  ({"train.grad_clip": -1.0}, "config.train.grad_clip=-1.0: must be >= 0"),
  ({"train.warmup_steps": -1}, "config.train.warmup_steps=-1: must be >= 0"),
  ({"train.weight_decay": -0.1}, "config.train.weight_decay=-0.1: must be >= 0"),
  ({"checkpoint.every_steps": -1}, "config.checkpoint.every_steps=-1: must be >= 0"),
  ({"checkpoint.every_minutes": -1.0}, "config.checkpoint.every_minutes=-1.0: must be >= 0"),
  ({"checkpoint.every_minutes": float("nan")}, "config.checkpoint.every_minutes=nan: must be >= 0"),
  ({"checkpoint.max_to_keep": 0}, "config.checkpoint.max_to_keep=0: must be >= 1"),
  ({"rewards.workers": -1}, "config.rewards.workers=-1: must be >= 0"),
  ({"rewards.timeout_s": 0.0}, "config.rewards.timeout_s=0.0: must be > 0"),
  ({"sft.num_steps": -1}, "config.sft.num_steps=-1: must be >= 0"),
  ({"sft.batch_size": 0}, "config.sft.batch_size=0: must be >= 1"),
  ({"sft.learning_rate": 0.0}, "config.sft.learning_rate=0.0: must be > 0"),
  ({"eval.num_samples": 0}, "config.eval.num_samples=0: must be >= 1"),
  ({"sampling.top_k": -1}, "config.sampling.top_k=-1: must be >= 0"),
  ({"sampling.compact": None}, "config.sampling.compact=None: must be one of True, False"),
  ({"rl.loss.kl_coef": -1.0}, "config.rl.loss.kl_coef=-1.0: must be >= 0"),
  ({"model.dtype": "float8"}, "config.model.dtype='float8': must be one of"),
  ({"model.lora.dropout": 1.0}, "config.model.lora.dropout=1.0: must lie in [0, 1)"),
  (
    {"rewards.fns": "math_verify, 0.5*no_such_module:f"},
    "config.rewards.fns='math_verify, 0.5*no_such_module:f': reward 'f': cannot import "
    "'no_such_module' (ModuleNotFoundError",
  ),
  (
    {"rewards.fns": "ebpo_jax.tasks.reward_fns:nope"},
    "config.rewards.fns='ebpo_jax.tasks.reward_fns:nope': reward 'nope': module "
    "'ebpo_jax.tasks.reward_fns' has no 'nope'",
  ),
  ({"rewards.fns": "x*exact_match"}, "config.rewards.fns='x*exact_match': term 'x*exact_match': "),
  ({"rewards.fns": "mean=task"}, "config.rewards.fns='mean=task': reward name 'mean' is taken"),
  # Issue 35: a ZeroDivisionError, a late failure, or accepted (the e2e BAD_STARTS run the CLI).
  ({"train.mini_batch_size": 0}, "config.train.mini_batch_size=0: must be >= 1"),
  ({"train.micro_batch_size": -1}, "config.train.micro_batch_size=-1: must be >= 0"),
  ({"model.num_layers": 0}, "config.model.num_layers=0: must be >= 1"),
  ({"model.num_kv_heads": 3}, "config.model.num_kv_heads=3: must divide model.num_heads=2"),
  ({"train.learning_rate": float("inf")}, "config.train.learning_rate=inf: must be finite"),
  ({"rl.loss.clip_low": 2.0}, "config.rl.loss.clip_low=2.0: must lie in [0, 1)"),
  ({"rl.loss.rollout_is": "token"}, "config.rl.loss.rollout_is='token': must be one of none, "),
  ({"rl.loss.rollout_is_cap": 1.0}, "config.rl.loss.rollout_is_cap=1.0: must be finite, > 1"),
  (
    {"sampling.dtype": "float16"},
    "config.sampling.dtype='float16': must be '' (model.dtype), float32",
  ),
  ({"model.rope_theta": 0.0}, "config.model.rope_theta=0.0: must be > 0"),
  ({"model.vocab_size": -5}, "config.model.vocab_size=-5: must be >= 0"),
  ({"seed": -1}, "config.seed=-1: must be an int in [0, 2**32)"),
]


@pytest.mark.parametrize("overrides, message", BAD_VALUES, ids=lambda v: str(v)[:40])
def test_bad_config_value_is_one_line_naming_the_key(overrides, message):
  with pytest.raises(errors.ConfigError) as error:
    config_lib.check_config(arith_config(overrides), num_devices=8)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"task.name": "nope"}, "config.task.name='nope': unknown task 'nope'; known: arithmetic"),
    ({"task.options.ops": ("pow",)}, "config.task.options: task 'arithmetic': "),
  ],
)
def test_a_bad_task_name_or_option_is_one_config_line(overrides, message):
  from ebpo_jax import tasks

  with pytest.raises(errors.ConfigError) as error:
    tasks.from_config(arith_config(overrides).task)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_lora_refuses_a_warm_start_in_training_only():
  # A LoRA run warm-starts nothing; evaluate reads a LoRA run's adapters under the experiment's
  # own config (whose SFT steps it ignores), so only the trainer's check refuses the pair.
  config = arith_config({"model.lora.rank": 4, "sft.num_steps": 5})
  config_lib.check_config(config, num_devices=8)
  with pytest.raises(errors.ConfigError, match=r"^config.sft.num_steps=5: must be 0 with LoRA"):
    config_lib.check_training(config)
  config_lib.check_training(arith_config({"model.lora.rank": 4, "sft.num_steps": 0}))


def test_bad_input_exits_with_status_2_and_one_line(capsys):
  with pytest.raises(SystemExit) as exit_info, cli.entry_point():
    raise errors.ConfigError("config.train.log_every=0: must be >= 1")
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == "error: config.train.log_every=0: must be >= 1\n"


def _model_dir(tmp_path, *, truncate: int = 0):
  """A model directory: config.json and a model.safetensors of one tensor, cut short by
  `truncate` bytes."""
  header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
  blob = struct.pack("<Q", len(header)) + header + bytes(16)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / "model.safetensors").write_bytes(blob[: len(blob) - truncate])
  return tmp_path


@pytest.mark.parametrize(
  "truncate, message", [(4, "truncated"), (40, "truncated"), (200, "not a safetensors file")]
)
def test_truncated_weights_file_is_named(tmp_path, truncate, message):
  model_dir = _model_dir(tmp_path, truncate=truncate)
  with pytest.raises(errors.ConfigError) as error:
    models.check_model_path(arith_config({"model.path": str(model_dir)}))
  text = str(error.value)
  assert f"{model_dir / 'model.safetensors'}: {message}" in text and "\n" not in text


def test_missing_model_directory_is_named(tmp_path):
  with pytest.raises(errors.ConfigError, match="^config.model.path='/nonexistent': no such"):
    models.check_model_path(arith_config({"model.path": "/nonexistent"}))
  (tmp_path / "config.json").write_text("{")
  with pytest.raises(errors.ConfigError, match="config.json: not JSON"):
    models.check_model_path(arith_config({"model.path": str(tmp_path)}))


def test_intact_model_directory_passes_the_file_check(tmp_path):
  models.check_model_path(arith_config({"model.path": str(_model_dir(tmp_path))}))


# ----------------------------------------------------------------------------- data rows

GOOD = b'{"prompt": "1+1=", "answer": "2"}\n'


def _rows_file(tmp_path, lines: list[bytes]):
  path = tmp_path / "rows.jsonl"
  path.write_bytes(b"".join(lines))
  return path


def _bad_rows(tmp_path):
  """Lines 2, 3 and 5 are bad for the arithmetic task's 18-token vocabulary and buckets (6, 8)."""
  return _rows_file(
    tmp_path,
    [
      GOOD,
      '{"prompt": "1+\u00e9=", "answer": "2"}\n'.encode(),  # not in the vocabulary
      b'{"prompt": "1+1+1+1+1=", "answer": "5"}\n',  # BOS + 10 tokens > 8
      GOOD,
      b'{"prompt": "1+\xff=", "answer": "2"}\n',  # not UTF-8
    ],
  )


def test_every_bad_row_is_one_line_before_compiling(tmp_path):
  path = _bad_rows(tmp_path)
  config = arith_config({"data.path": str(path), "sampling.prompt_buckets": (6, 8)})
  with pytest.raises(data.DataError) as error:
    task_rows.load_task_and_rows(config)
  lines = str(error.value).splitlines()
  assert len(lines) == 3, lines
  assert lines[0].startswith(f"{path}:2: prompt: character 'é' is not in the vocabulary")
  assert lines[1].startswith(f"{path}:3: prompt: 11 tokens, longer than the largest prompt bucket")
  assert lines[2].startswith(f"{path}:5: not UTF-8 text")


def test_skip_bad_rows_drops_and_counts_them(tmp_path, capsys):
  path = _bad_rows(tmp_path)
  config = arith_config(
    {
      "data.path": str(path),
      "eval.path": str(path),  # two good rows: too few to hold some out of training
      "sampling.prompt_buckets": (6, 8),
      "data.skip_bad_rows": True,
    }
  )
  rows = task_rows.load_task_and_rows(config).rows
  assert [row["prompt"] for row in rows] == ["1+1=", "1+1="]
  assert f"{path}: dropped 3 bad rows of 5 (data.skip_bad_rows=True); first: {path}:2:" in (
    capsys.readouterr().err
  )


def test_task_rows_too_long_for_the_buckets_are_named():
  config = arith_config({"sampling.prompt_buckets": (4,)})
  with pytest.raises(data.DataError, match=r"arithmetic train row 0: prompt: \d+ tokens, longer"):
    task_rows.load_task_and_rows(config)


# ----------------------------------------------------------------------------- verifier errors


def test_in_training_evaluation_counts_verifier_errors():
  """The in-training evaluation logs its failed verifier calls (they scored 0 unseen)."""
  rollout = types.SimpleNamespace(rewards=np.array([[1.0], [0.0], [0.0]]), errors=2)
  config = ml_collections.ConfigDict({"eval": {"greedy": True, "num_samples": 1}})
  sampler = types.SimpleNamespace(
    options=types.SimpleNamespace(eval=EvalOptions.from_config(config)),
    rollout=lambda *args, **kwargs: rollout,
  )
  rows = [{"cluster": 0}, {"cluster": 1}, {"cluster": 1}]
  result = rollout_batch.evaluate_accuracy(sampler, None, rows, ["a", "b"], key=None)
  assert result[metrics_lib.EVAL_VERIFIER_ERRORS] == 2
  assert metrics_lib.EVAL_VERIFIER_ERRORS in metrics_lib.KEYS


def test_in_training_evaluation_is_avg_at_k_of_full_rewards():
  """With `eval.greedy=False` the in-training evaluation samples `eval.num_samples` responses per
  problem (as `python -m ebpo_jax.evaluate` does) and its accuracy is avg@k: the share of
  responses with the full reward, so a partial credit (reasoning-gym's 0.5 for an answer inside a
  longer one) is not counted as half right."""
  rewards = np.array([[1.0, 0.5, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
  calls = []

  def rollout(params, rows, key, *, group_size, greedy):
    calls.append((group_size, greedy))
    return types.SimpleNamespace(rewards=rewards, errors=0)

  config = ml_collections.ConfigDict({"eval": {"greedy": False, "num_samples": 4}})
  options = types.SimpleNamespace(eval=EvalOptions.from_config(config))
  sampler = types.SimpleNamespace(options=options, rollout=rollout)
  rows = [{"cluster": 0}, {"cluster": 1}]
  result = rollout_batch.evaluate_accuracy(sampler, None, rows, ["a", "b"], key=None)
  assert calls == [(4, False)]
  assert result[metrics_lib.EVAL_ACCURACY] == pytest.approx(2 / 8)
  assert result[metrics_lib.per_cluster(metrics_lib.EVAL_ACCURACY, "a")] == pytest.approx(0.5)
  assert result[metrics_lib.per_cluster(metrics_lib.EVAL_ACCURACY, "b")] == 0.0


def test_evaluate_checks_its_rows_file_too(tmp_path):
  from ebpo_jax import tasks

  path = _bad_rows(tmp_path)
  config = arith_config({"eval.path": str(path), "sampling.prompt_buckets": (6, 8)})
  task = tasks.from_config(config.task)
  tokenizer = task_rows.load_tokenizer(config, task)
  with pytest.raises(data.DataError) as error:
    task_rows.eval_rows(config, task, task_rows.row_check(config, task, tokenizer))
  assert [line.split(": ")[0] for line in str(error.value).splitlines()] == [
    f"{path}:{n}" for n in (2, 3, 5)
  ]


def test_truncated_packaged_gguf_file_is_named(tmp_path, monkeypatch):
  from ebpo_jax.models import gguf_io

  gguf_file = tmp_path / "model.gguf"
  gguf_file.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(10))  # cut after the version
  monkeypatch.setattr(gguf_io, "packaged_smollm2_gguf", lambda: str(gguf_file))
  monkeypatch.setenv("EBPO_JAX_CACHE", str(tmp_path / "cache"))  # nothing converted yet
  config = arith_config({"model.path": "packaged:smollm2-135m-instruct"})
  with pytest.raises(errors.ConfigError) as error:
    models.check_model_path(config)
  text = str(error.value)
  assert text.startswith("config.model.path='packaged:smollm2-135m-instruct': ")
  assert f"{gguf_file}: not a readable GGUF file" in text and "\n" not in text


@pytest.mark.parametrize(
  "argv",
  [
    ["train", "--config=configs/arith_ebpo.py:runlocal", "--config.trian.num_steps=3"],
    ["train", "--config", "configs/arith_ebpo.py", "--config.trian.num_steps", "3"],
  ],
)
def test_a_typo_in_an_override_key_is_found_in_either_flag_form(argv):
  problem = cli._unknown_override(argv)
  assert problem is not None and "no config key trian.num_steps; did you mean train.num_steps?" in (
    problem
  )


def test_prompts_per_call_must_split_over_the_data_devices():
  # 206 prompts on data x fsdp = 8 chips: every chip would hold every prompt's prefill.
  config = arith_config({"sampling.prompts_per_call": 206})
  with pytest.raises(errors.ConfigError, match="multiple of the mesh's data x fsdp = 8"):
    config_lib.check_config(config, num_devices=8)
  config_lib.check_config(arith_config({"sampling.prompts_per_call": 208}), num_devices=8)
  config_lib.check_config(config, num_devices=2)  # data x fsdp = 2


def test_a_mesh_that_does_not_fit_the_devices_says_how_to_fit_it():
  # The paper configs' runlocal (tensor = 2) on a laptop's one CPU device: the message says what
  # to set, and how a CPU gets more devices.
  config = cli.load_config("configs/paper.py:qwen3_8b,ebpo_topic,runlocal")
  with pytest.raises(errors.ConfigError) as raised:
    config_lib.check_config(config, num_devices=1)
  message = str(raised.value)
  assert "1 devices are not divisible by 2" in message
  assert "--config.mesh.tensor=1" in message
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in message


def test_the_fake_cpu_devices_hint_is_given_on_a_cpu_only(monkeypatch):
  # On a TPU or GPU host, XLA_FLAGS' CPU device count changes nothing: the hint would mislead.
  config = cli.load_config("configs/paper.py:qwen3_8b,ebpo_topic,runlocal")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(errors.ConfigError) as raised:
    config_lib.check_config(config, num_devices=1)
  assert "--config.mesh.tensor=1" in str(raised.value)
  assert "XLA_FLAGS" not in str(raised.value)
