"""Export of LoRA adapters: a PEFT adapter directory that `peft.PeftModel.from_pretrained` loads
with our logits, and a merged model (adapters folded into the kernels) that transformers loads
with the same logits; `export --format=peft|merged` on a LoRA run's checkpoint."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from ebpo_jax import export, models
from ebpo_jax.models import hf_io, lora, peft_io
from ebpo_jax.trainer import policy
from tests.helpers.configs import arith_config, hf_shape
from tests.helpers.exports import (
  assert_same_logits,
  jitted_logits,
  load_peft_model,
  max_abs_diff,
  random_ids,
  torch_model_logits,
)
from tests.helpers.torch_models import randomize_torch_weights

SHAPE = {
  **hf_shape(),
  "vocab_size": 96,
  # heads * head_dim = 64 != hidden 32: o_proj's flattened input differs from its output
  "head_dim": 16,
  "max_position_embeddings": 64,
}

CASES = {  # case: (architecture, LoRA targets)
  "llama_all": ("Llama", lora.TARGETS),
  "llama_q_v": ("Llama", ("q", "v")),
  "qwen2_all": ("Qwen2", lora.TARGETS),  # q/k/v biases beside the adapters
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """{architecture: tiny random HF directory} written by transformers."""
  dirs = {}
  for i, arch in enumerate(("Llama", "Qwen2")):
    model = getattr(transformers, f"{arch}ForCausalLM")(
      getattr(transformers, f"{arch}Config")(**SHAPE)
    )
    randomize_torch_weights(model, seed=i)
    dirs[arch] = tmp_path_factory.mktemp(arch.lower())
    model.save_pretrained(dirs[arch])
  return dirs


def _trained_lora(base_dir, targets, seed=0):
  """(LoRA Decoder, full params): the base read from `base_dir`, adapters with random A and B
  (as after training) on `targets`; drawn with numpy (no init to compile)."""
  base_model, base = models.from_pretrained(str(base_dir))
  config = dataclasses.replace(base_model.config, lora_rank=4, lora_alpha=8.0, lora_targets=targets)
  model = models.Decoder(config)
  shapes = lora.split(nn.meta.unbox(hf_io.abstract_params(model)))[0]
  rng = np.random.default_rng(seed)

  def draw(path, x):  # A [layers, in, r] at std 1/sqrt(in), as lora.delta inits it; B at 0.1
    std = 0.1 if path[-1].key == lora.B_NAME else x.shape[-2] ** -0.5
    return jnp.asarray(rng.normal(0.0, std, x.shape), jnp.float32)

  return model, lora.combine(jax.tree_util.tree_map_with_path(draw, shapes), base)


def _hf_model(path):
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _adapted_modules(peft_model) -> list[str]:
  """The module names (q_proj, ...) PEFT put a loaded adapter on, one per layer and target."""
  return sorted(
    name.split(".")[-4]
    for name in peft_model.state_dict()
    if name.endswith("lora_A.default.weight") or name.endswith("lora_A.weight")
  )


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_and_merged_model_load_in_transformers_with_our_logits(
  case, hf_dirs, tmp_path
):
  arch, targets = CASES[case]
  base_dir = hf_dirs[arch]
  model, params = _trained_lora(base_dir, targets)
  ids = random_ids(model.config.vocab_size)
  ours = jitted_logits(model, params, ids)
  base_logits = jitted_logits(lora.base_model(model), lora.split(params)[1], ids)
  assert max_abs_diff(ours, base_logits) > 0.1  # the adapters do act

  peft_io.save_adapter(str(tmp_path / "adapter"), model.config, params, base_model=str(base_dir))
  adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
  assert adapter_config["base_model_name_or_path"] == str(base_dir)
  peft_model = load_peft_model(base_dir, tmp_path / "adapter")
  names = [f"{t}_proj" for t in targets]
  assert _adapted_modules(peft_model) == sorted(names * model.config.num_layers)
  peft_logits = torch_model_logits(peft_model, ids)
  assert_same_logits(ours, peft_logits)

  merged_model = lora.base_model(model)
  models.save_pretrained(str(tmp_path / "merged"), merged_model, lora.merge(params, model.config))
  assert "lora" not in (tmp_path / "merged" / "config.json").read_text().lower()
  merged_logits = torch_model_logits(_hf_model(tmp_path / "merged"), ids)
  assert_same_logits(ours, merged_logits)
  assert_same_logits(peft_logits, merged_logits)


def test_peft_tensors_are_torch_linear_layout_per_layer(hf_dirs):
  model, params = _trained_lora(hf_dirs["Llama"], ("q", "o"))
  tensors = dict(peft_io.peft_tensors(params))
  assert len(tensors) == 2 * 2 * 2  # layers x targets x (A, B)
  prefix = "base_model.model.model.layers.1.self_attn."
  o_a, o_b = tensors[prefix + "o_proj.lora_A.weight"], tensors[prefix + "o_proj.lora_B.weight"]
  assert o_a.shape == (4, 64) and o_b.shape == (32, 4)  # [r, heads*head_dim], [hidden, r]
  ours = params["layers"]["self_attn"]["o_proj"]
  np.testing.assert_array_equal(o_a, np.asarray(ours[lora.A_NAME][1]).T)
  np.testing.assert_array_equal(o_b, np.asarray(ours[lora.B_NAME][1]).T)
  with pytest.raises(ValueError, match="no LoRA adapters"):
    peft_io.adapter_config(lora.base_model(model).config)


# ----------------------------------------------------------------------------- export of a run


def test_export_of_a_lora_run_as_peft_and_merged(
  lora_run_from_a_model_directory, tiny_llama_dir, tmp_path
):
  run_dir, model, params = lora_run_from_a_model_directory
  ids = random_ids(model.config.vocab_size, (1, 12))
  ours = jitted_logits(model, params, ids)
  base_logits = torch_model_logits(_hf_model(tiny_llama_dir), ids)
  scale = float(np.max(np.abs(ours)))
  assert max_abs_diff(ours, base_logits) > 0.1 * scale  # the adapters do act

  summary = export.export(str(run_dir), str(tmp_path / "peft"), format="peft")
  assert summary["source_model"] == str(tiny_llama_dir)
  out_files = {p.name for p in (tmp_path / "peft").iterdir()}
  assert out_files == {"adapter_config.json", "adapter_model.safetensors", *summary["copied"]}
  assert "tokenizer.json" in summary["copied"]
  peft_logits = torch_model_logits(load_peft_model(tiny_llama_dir, tmp_path / "peft"), ids)
  assert_same_logits(ours, peft_logits)

  summary = export.export(str(run_dir), str(tmp_path / "merged"))  # merged is the default
  assert "lora" not in (tmp_path / "merged" / "config.json").read_text().lower()
  assert "tokenizer.json" in summary["copied"]
  merged_logits = torch_model_logits(_hf_model(tmp_path / "merged"), ids)
  assert_same_logits(ours, merged_logits)
  assert_same_logits(peft_logits, merged_logits)


@pytest.mark.parametrize(
  "overrides, error",
  [
    ({}, "full fine-tuning run"),
    ({"model.lora.rank": 4}, "random-init base"),
    ({"model.lora.rank": 4, "model.init_from": "/runs/warm"}, "checkpoint of run /runs/warm"),
  ],
)
def test_peft_export_needs_a_lora_run_on_a_model_directory(overrides, error):
  with pytest.raises(policy.PolicyError, match=f"--format=peft: .*{error}.*--format=merged"):
    export.check_peft_base(arith_config(overrides), "RUN")


def test_the_loading_recipe_reads_the_base_as_the_run_did(tiny_llama_dir):
  # A run on a bfloat16 base (model.lora.base_dtype) trained on the rounded base and computed in
  # float32: PEFT users load BASE in bfloat16, then cast (in bfloat16 the logits were 1.41 off, a
  # float32 base 0.19; tests/e2e/test_lora_export.py runs the recipes).
  lora_cfg = {"model.lora.rank": 4, "sft.num_steps": 0, "model.path": str(tiny_llama_dir)}
  recipe = lambda overrides, format: export.loading_recipe(
    arith_config({**lora_cfg, **overrides}), "/out", format=format
  )
  assert recipe({}, "peft").splitlines() == [
    f"base = AutoModelForCausalLM.from_pretrained('{tiny_llama_dir}', dtype=torch.float32)",
    "model = PeftModel.from_pretrained(base, '/out')",
  ]
  assert recipe({"model.lora.base_dtype": "bfloat16"}, "peft").splitlines()[0] == (
    f"base = AutoModelForCausalLM.from_pretrained('{tiny_llama_dir}', dtype=torch.bfloat16)"
    ".to(torch.float32)"
  )
  assert recipe({"model.dtype": "bfloat16"}, "merged") == (
    "model = AutoModelForCausalLM.from_pretrained('/out', dtype=torch.bfloat16)"
  )
  bf16_base = arith_config({**lora_cfg, "model.lora.base_dtype": "bfloat16"})
  assert "rounded to bfloat16" in export.merged_rounding_note(bf16_base, "")
  assert export.merged_rounding_note(bf16_base, "float32") == ""
