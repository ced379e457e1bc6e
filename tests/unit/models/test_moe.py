"""Qwen3-MoE (models.moe): logits and greedy tokens against transformers' Qwen3MoeForCausalLM on a
tiny random config, the export round trip, and the grouped experts against a dense reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from ebpo_jax import errors, sampling
from ebpo_jax import models as models_lib
from ebpo_jax.models import ModelConfig, from_pretrained, moe, save_pretrained
from tests.helpers import tiny_step as tiny_step_lib
from tests.helpers.configs import load_config
from tests.helpers.torch_models import randomize_torch_weights

# The tiny config: 2 layers, 8 experts, top-2, hidden 64.
HF_MOE = dict(
  vocab_size=96,
  hidden_size=64,
  intermediate_size=96,
  moe_intermediate_size=32,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  num_experts=8,
  num_experts_per_tok=2,
  norm_topk_prob=True,
  max_position_embeddings=64,
  rms_norm_eps=1e-6,
)
MAX_REL_ERR = 1e-5


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
  """(transformers model, its save_pretrained directory)."""
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_MOE)).eval()
  randomize_torch_weights(model, seed=7)
  path = str(tmp_path_factory.mktemp("qwen3_moe"))
  model.save_pretrained(path)
  return model, path


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def _rel_err(ours, ref) -> float:
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def test_logits_match_transformers_and_every_expert_is_used(hf_moe):
  torch_model, path = hf_moe
  model, params = from_pretrained(path)
  c = model.config
  assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.qk_norm) == (
    "qwen3_moe", 8, 2, True,
  )  # fmt: skip
  ids = np.random.default_rng(0).integers(0, HF_MOE["vocab_size"], (3, 24)).astype(np.int32)
  ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids)))
  err = _rel_err(ours, _torch_logits(torch_model, ids))
  print(f"qwen3_moe: max rel err {err:.2e}")
  assert err <= MAX_REL_ERR, f"max relative error {err:.2e}"
  # The comparison covers all experts: the router sends the 72 tokens to every one of them.
  x = jnp.asarray(np.random.default_rng(1).normal(size=(72, 64)), jnp.float32)
  router = params["layers"]["mlp"]["gate"]["kernel"][0]
  routing = moe.route(x @ router, 2, True)
  assert set(np.asarray(routing.ids).ravel()) == set(range(8))


def test_greedy_tokens_match_transformers_generate(hf_moe):
  torch_model, path = hf_moe
  model, params = from_pretrained(path)
  prompt = np.random.default_rng(2).integers(3, HF_MOE["vocab_size"], (2, 5)).astype(np.int32)
  with torch.no_grad():
    want = torch_model.generate(
      torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=24, do_sample=False,
      min_new_tokens=24, pad_token_id=0,
    )[:, 5:].numpy()  # fmt: skip
  out = sampling.generate(
    model, params, prompt, np.ones_like(prompt, bool), jax.random.key(0),
    max_new_tokens=24, greedy=True,
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  assert len(set(want.ravel())) > 5  # not one token repeated


def test_export_round_trips_through_transformers(hf_moe, tmp_path):
  torch_model, path = hf_moe
  model, params = from_pretrained(path)
  save_pretrained(str(tmp_path), model, params)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
  ids = np.arange(40, dtype=np.int32).reshape(2, 20) % HF_MOE["vocab_size"]
  np.testing.assert_allclose(
    _torch_logits(reloaded, ids), _torch_logits(torch_model, ids), rtol=0, atol=1e-6
  )
  model_again, params_again = from_pretrained(str(tmp_path))
  assert model_again.config == model.config
  jax.tree.map(np.testing.assert_array_equal, params_again, params)


def _dense_experts(x, routing, w_gate, w_up, w_down):
  """Every expert on every token, weighted by the routing (0 for the experts not chosen)."""
  e = w_gate.shape[0]
  dense_w = (
    jnp.zeros((x.shape[0], e)).at[jnp.arange(x.shape[0])[:, None], routing.ids].add(routing.weights)
  )
  h = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
  return jnp.einsum("tef,efd,te->td", h, w_down, dense_w)


def test_grouped_experts_and_their_gradients_equal_the_dense_computation():
  rng = np.random.default_rng(3)
  t, d, f, e, k = 13, 8, 6, 5, 2
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  weights = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in
             ((e, d, f), (e, d, f), (e, f, d))]  # fmt: skip
  routing = moe.route(jnp.asarray(rng.normal(size=(t, e)), jnp.float32), k, True)
  np.testing.assert_allclose(np.asarray(routing.weights.sum(-1)), 1.0, rtol=1e-6)

  def loss(fn, x, *w):
    return jnp.sum(jnp.sin(fn(x, routing, *w)))

  ours = jax.grad(functools.partial(loss, moe.grouped_experts), argnums=(0, 1, 2, 3))(x, *weights)
  dense = jax.grad(functools.partial(loss, _dense_experts), argnums=(0, 1, 2, 3))(x, *weights)
  np.testing.assert_allclose(
    np.asarray(moe.grouped_experts(x, routing, *weights)),
    np.asarray(_dense_experts(x, routing, *weights)), rtol=1e-5, atol=1e-6,
  )  # fmt: skip
  for a, b in zip(ours, dense, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_moe_configs_that_the_decoder_cannot_run_are_refused():
  hf = lambda **kwargs: transformers.Qwen3MoeConfig(**HF_MOE, **kwargs).to_dict()
  base = ModelConfig.from_hf(hf())
  with pytest.raises(ValueError, match="dense layers between MoE layers are not supported"):
    ModelConfig.from_hf(hf(decoder_sparse_step=2))
  with pytest.raises(ValueError, match="experts take no adapters"):
    dataclasses.replace(base, lora_rank=4)  # the default targets include gate, up, down
  dataclasses.replace(base, lora_rank=4, lora_targets=("q", "k", "v", "o"))
  with pytest.raises(ValueError, match="num_experts_per_tok=9 must lie in"):
    dataclasses.replace(base, num_experts_per_tok=9)
  assert ModelConfig.from_hf(base.to_hf()) == base


def test_the_load_balancing_loss_equals_transformers_aux_loss_over_the_valid_tokens(hf_moe):
  torch_model, path = hf_moe
  model, params = from_pretrained(path)
  ids = np.random.default_rng(4).integers(3, HF_MOE["vocab_size"], (2, 12)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  mask[0, :4] = False  # a left-padded row: its pad tokens count in neither
  as_long = lambda x: torch.as_tensor(x, dtype=torch.long)
  with torch.no_grad():
    out = torch_model(as_long(ids), attention_mask=as_long(mask), output_router_logits=True)
  _, state = model.apply(
    {"params": params}, jnp.asarray(ids), attention_mask=jnp.asarray(mask),
    mutable=["intermediates"],
  )  # fmt: skip
  stats = moe.collect(state["intermediates"])
  assert stats.counts.shape == (2, 8) and np.asarray(stats.tokens).tolist() == [20.0, 20.0]
  assert float(moe.load_balancing_loss(stats)) == pytest.approx(float(out.aux_loss), rel=1e-5)
  assert float(moe.load_max(stats)) >= 1.0


MOE_STEP = {
  "model.architecture": "qwen3_moe",
  "model.num_experts": 4,
  "model.num_experts_per_tok": 2,
  "model.moe_intermediate_size": 16,
}


def test_the_train_step_adds_the_router_loss_and_trains_the_router():
  steps = {
    coef: tiny_step_lib.tiny_steps({**MOE_STEP, "model.router_aux_loss_coef": coef}, 1)
    for coef in (0.0, 1.0)
  }
  batch, state = steps[0.0].batch(), steps[0.0].fresh_state()
  results = {coef: step(batch, state) for coef, step in steps.items()}
  metrics = {coef: jax.device_get(r[1]) for coef, r in results.items()}
  aux = metrics[1.0]["moe/aux_loss"]
  assert aux == pytest.approx(metrics[0.0]["moe/aux_loss"]) and 0 < aux < 4  # k=2 of E=4
  assert metrics[1.0]["loss"] - metrics[0.0]["loss"] == pytest.approx(aux, rel=1e-4)
  router = lambda s: s.params["layers"]["mlp"]["gate"]["kernel"]
  for new, _, _ in results.values():  # the policy loss alone moves the router too
    assert float(jnp.abs(router(new) - router(state)).max()) > 0


def test_the_moe_train_step_sharded_over_8_devices_equals_one_device():
  # The experts' weights split over fsdp (their embed axis) and tensor (their mlp axis), the rows
  # over fsdp: the compiler partitions the grouped matmuls; the step's numbers are one device's.
  runs = [
    tiny_step_lib.tiny_steps({**MOE_STEP, **mesh}, devices)
    for mesh, devices in (({}, 1), ({"mesh.fsdp": 4, "mesh.tensor": 2}, 8))
  ]
  one, eight = [jax.device_get(step(step.batch(), step.fresh_state())[1]) for step in runs]
  for key in ("loss", "moe/aux_loss", "moe/load_max", "grad_norm"):
    assert eight[key] == pytest.approx(one[key], rel=1e-5), key


def test_lora_on_a_moe_policys_experts_is_one_config_error_naming_the_key():
  config = load_config("configs/arith_moe.py:runlocal", {"model.lora.rank": 4})
  with pytest.raises(errors.ConfigError) as error:
    models_lib.build.make_model(config, vocab_size=18)
  message = str(error.value)
  assert message.startswith("config.model.lora.targets='q,k,v,o,gate,up,down': ")
  assert "\n" not in message
  assert "experts take no adapters" in message
  config.model.lora.targets = "q,k,v,o"
  model = models_lib.build.make_model(config, vocab_size=18)
  assert model.config.lora_targets == ("q", "k", "v", "o")


def test_the_megablox_kernel_interpreted_equals_ragged_dot_with_its_gradients():
  rng = np.random.default_rng(5)
  t, d, f, e, k = 21, 16, 8, 6, 2  # 42 rows: padded to the kernel's tile of 48
  x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
  weights = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in
             ((e, d, f), (e, d, f), (e, f, d))]  # fmt: skip
  routing = moe.route(jnp.asarray(rng.normal(size=(t, e)), jnp.float32), k, True)

  def value_and_grads(kernel):
    experts = functools.partial(moe.grouped_experts, kernel=kernel, interpret=True)
    loss = lambda x, *w: jnp.sum(jnp.sin(experts(x, routing, *w)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, *weights)

  (want, want_grads), (got, got_grads) = value_and_grads("ragged_dot"), value_and_grads("megablox")
  assert float(got) == pytest.approx(float(want), rel=1e-5)
  for a, b in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_megablox_train_step_per_shard_on_8_devices_equals_ragged_dot_on_one():
  # A Pallas kernel is not partitioned by the compiler: under a mesh it runs per shard
  # (moe._per_shard: tokens over the rows' axes, the experts' width over tensor, summed).
  runs = [
    tiny_step_lib.tiny_steps({**MOE_STEP, **over}, devices)
    for over, devices in (
      ({}, 1),
      ({"mesh.fsdp": 4, "mesh.tensor": 2, "model.moe_kernel": "megablox"}, 8),
    )
  ]
  sharded = runs[1]
  assert (sharded.model.config.moe_kernel, sharded.model.config.moe_interpret) == ("megablox", True)
  traced = sharded.step.trace(sharded.fresh_state(), sharded.place(sharded.batch()))
  assert "shard_map" in str(traced.jaxpr)
  one, eight = [jax.device_get(step(step.batch(), step.fresh_state())[1]) for step in runs]
  for key in ("loss", "moe/aux_loss", "grad_norm"):
    assert eight[key] == pytest.approx(one[key], rel=1e-5), key
