"""Export of a run's policy as a Hugging Face directory: transformers loads it with our logits,
and a run that started from a model directory carries its tokenizer and chat template along."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from ebpo_jax import checkpoint, evaluate, export, models, sharding, tasks, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arith_ebpo.py")
MAX_REL_ERR = 1e-4


def arith_config(**overrides):
  spec = importlib.util.spec_from_file_location("arith_ebpo", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("runlocal")
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def save_run(workdir: pathlib.Path, config, *, perturb: float = 0.0):
  """A run's checkpoint at step 0 without training: the state the trainer would create (params
  shifted by `perturb` * noise, so that they differ from the model they started from)."""
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.get_task(config.task.name, **config.task.options)
  model, params = train.build_model(config, train.load_tokenizer(config, task), mesh)
  if perturb:
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(
      lambda x: x + perturb * jax.random.normal(next(keys), x.shape, x.dtype), params
    )
  state = train.create_state(config, params, train.make_optimizer(config.train, 1), 2)
  with checkpoint.Checkpointer(workdir / "checkpoints") as ckpt:
    ckpt.save(0, state, config=config.to_dict(), force=True)
  return model, params


def our_logits(model, params, ids: np.ndarray) -> np.ndarray:
  return np.asarray(model.apply({"params": params}, ids))


def torch_logits(path, ids: np.ndarray) -> np.ndarray:
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    return hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def test_export_of_a_random_init_run_loads_in_transformers_with_our_logits(tmp_path):
  model, params = save_run(tmp_path / "run", arith_config())
  out = tmp_path / "hf"
  summary = export.export(str(tmp_path / "run"), str(out))
  assert summary["step"] == 0 and summary["source_model"] is None
  ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 12))
  ours = our_logits(model, params, ids)
  assert rel_err(ours, torch_logits(out, ids)) < MAX_REL_ERR


def test_export_of_a_run_from_a_model_directory_keeps_its_tokenizer(tmp_path):
  smollm2 = models.smollm2_135m_instruct()
  source = tmp_path / "tiny_llama"
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(
    vocab_size=49152,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    tie_word_embeddings=True,
  )
  transformers.LlamaForCausalLM(hf_config).save_pretrained(source)
  tokenizer_names = ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
  for name in tokenizer_names:
    shutil.copy(os.path.join(smollm2, name), source / name)
  config = arith_config(**{"model.path": str(source)})
  model, params = save_run(tmp_path / "run", config, perturb=0.05)

  out = tmp_path / "hf"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-m", "ebpo_jax.export", f"--run_dir={tmp_path / 'run'}", f"--out={out}"],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"tokenizer files from {source}" in result.stdout
  copied = export.tokenizer_files(str(out))
  assert copied == export.tokenizer_files(str(source))  # + generation_config.json
  assert set(tokenizer_names) <= set(copied)
  for name in copied:
    assert (out / name).read_bytes() == (source / name).read_bytes()
  # The tokenizer and chat template come back as the source directory's.
  ours_tok = transformers.AutoTokenizer.from_pretrained(out)
  source_tok = transformers.AutoTokenizer.from_pretrained(source)
  messages = [{"role": "user", "content": "What is 2+3?"}]
  assert ours_tok.apply_chat_template(messages, tokenize=False) == (
    source_tok.apply_chat_template(messages, tokenize=False)
  )
  # The weights are the run's (perturbed), not the source model's.
  ids = np.array([ours_tok.encode("Answer: 5 apples and 7 pears")])
  ours = our_logits(model, params, ids)
  assert rel_err(ours, torch_logits(out, ids)) < MAX_REL_ERR
  assert rel_err(ours, torch_logits(source, ids)) > 1e-2


def test_export_without_a_checkpoint_is_one_clear_error(tmp_path):
  with pytest.raises(evaluate.EvalError, match="no checkpoints/ directory"):
    export.export(str(tmp_path), str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists()
