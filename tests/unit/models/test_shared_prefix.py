"""The shared-prefix forward (models.shared_prefix): each prompt run once for its G completions
gives the full layout's logits and gradients, on every decoder variant; and train_step's update
through it equals the update through the full layout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import losses, models, sharding
from ebpo_jax.models import Decoder, ModelConfig, PrefixGroups
from ebpo_jax.models.decoder import unstack_layers
from ebpo_jax.sampling import sequences
from ebpo_jax.trainer import step as step_lib
from tests.helpers.configs import arith_config
from tests.helpers.lora import trained_lora
from tests.helpers.tiny_decoder import BASE, init_params
from tests.helpers.tiny_step import tiny_steps

B, G, P, N = 3, 2, 6, 5
# Each variant compiles two gradient programs (seconds), so features that touch different parts
# of the decoder share one: the unrolled layer loop with remat "dots" (remat recomputes the same
# forward in the backward pass: the unrolled loop's forward is the one without it), one kv head
# (the attention's head grouping) with Qwen3's q/k norm (applied per head before it).
VARIANTS = {
  "scanned_rolled": BASE,
  "remat_full": dataclasses.replace(BASE, remat="full"),
  "unrolled_remat_dots": dataclasses.replace(BASE, remat="dots", unroll_layers=True),
  "lora": dataclasses.replace(BASE, lora_rank=4, lora_alpha=8.0),
  "qwen3_qk_norm_one_kv_head": dataclasses.replace(BASE, architecture="qwen3", num_kv_heads=1),
  "qwen2_bias_tied": dataclasses.replace(BASE, architecture="qwen2", tie_word_embeddings=True),
}


def _params(config: ModelConfig):
  """Random params with every leaf perturbed: norm scales, biases and LoRA B (zero or one at
  init) then act, so a stream that skipped one would show."""
  return init_params(config, seed=0, noise=0.1)


def _batch(seed: int = 0) -> dict:
  """Left-padded prompts of 6, 3 and 1 tokens; completions of 5, 2, 4, 1, 5, 3 tokens (masked
  tails, pad id 0)."""
  rng = np.random.default_rng(seed)
  prompt_mask = np.arange(P)[None] >= (P - np.array([6, 3, 1]))[:, None]
  completion_mask = np.arange(N)[None] < np.array([5, 2, 4, 1, 5, 3])[:, None]
  ids = lambda mask: np.where(mask, rng.integers(1, BASE.vocab_size, mask.shape), 0)
  return {
    "prompt_ids": ids(prompt_mask).astype(np.int32),
    "prompt_mask": prompt_mask,
    "tokens": ids(completion_mask).astype(np.int32),
    "completion_mask": completion_mask,
  }


def _layouts(batch: dict) -> tuple[dict, dict]:
  args = (batch["prompt_ids"], batch["prompt_mask"], batch["tokens"], batch["completion_mask"], G)
  return sequences.build_sequences(*args), sequences.build_packed_sequences(*args)


def test_packed_sequences_hold_each_prompt_once_then_its_completions():
  ids = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]])
  tokens = jnp.array([[11, 12], [13, 2], [14, 15], [16, 17]])
  seqs = sequences.build_packed_sequences(ids, ids > 0, tokens, tokens > 0, group_size=2)
  np.testing.assert_array_equal(seqs["input_ids"][0], [0, 0, 5, 6, 11, 12, 13, 2])
  # Prompt 0 has 2 real tokens at positions 0, 1; each of its completions continues at 2, 3.
  np.testing.assert_array_equal(seqs["positions"][0], [0, 0, 0, 1, 2, 3, 2, 3])
  np.testing.assert_array_equal(seqs["positions"][1], [0, 1, 2, 3, 4, 5, 4, 5])
  np.testing.assert_array_equal(seqs["attention_mask"][0], [0, 0, 1, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(seqs["targets"], tokens)


def _logps_and_grads(model: Decoder, params, layouts: list[tuple[dict, int | None]]):
  """For each (seqs, packed_group_size) of `layouts`: (grads of the completions' total log-prob,
  logits [R, N, V]) through the trainer's `completion_logits`, which takes either layout (the
  caller names it). One program for all of them: one compile."""

  def grads_and_logits(p, seqs, packed_group_size):
    def total_logp(p):
      logits = step_lib.completion_logits(model, p, seqs, packed_group_size=packed_group_size)
      logps = losses.token_logprobs(logits, seqs["targets"])
      return jnp.where(seqs["loss_mask"], logps, 0.0).sum(), logits

    return jax.grad(total_logp, has_aux=True)(p)

  return jax.jit(lambda p: [grads_and_logits(p, *layout) for layout in layouts])(params)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shared_prefix_logits_and_grads_equal_the_full_layout(name):
  config = VARIANTS[name]
  model, params = Decoder(config), _params(config)
  full, packed = _layouts(_batch())
  assert packed["input_ids"].shape == (B, P + G * N)
  layouts = [(full, None), (packed, G)]
  (grads_full, logits_full), (grads_shared, logits_shared) = _logps_and_grads(
    model, params, layouts
  )
  assert logits_shared.shape == logits_full.shape == (B * G, N, config.vocab_size)
  assert logits_shared.dtype == np.float32
  # Compared where a completion token is predicted (a masked position predicts nothing).
  valid = np.asarray(full["loss_mask"])
  np.testing.assert_allclose(logits_shared[valid], logits_full[valid], rtol=1e-5, atol=1e-5)
  for path, a in jax.tree_util.tree_flatten_with_path(grads_shared)[0]:
    b = _leaf(grads_full, path)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _leaf(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def test_shared_prefix_on_the_per_layer_decoder_and_with_lora_dropout():
  config = dataclasses.replace(VARIANTS["lora"], lora_dropout=0.5)
  params = _params(config)
  full, packed = _layouts(_batch(seed=1))
  valid = np.asarray(full["loss_mask"])
  # The decoder and the layout are static.
  logits = jax.jit(
    step_lib.completion_logits, static_argnums=0, static_argnames="packed_group_size"
  )
  # The per-layer decoder, as the scanned one.
  per_layer = Decoder(config, scan_layers=False)
  want = logits(Decoder(config), params, full, packed_group_size=None)
  got = logits(per_layer, jax.jit(unstack_layers)(params), packed, packed_group_size=G)
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
  # Dropout: each prompt token is dropped once for its G completions (not G times), so the
  # logits are not the full layout's; they are finite, change with the key, and differ from the
  # forward without dropout.
  dropped = [
    logits(Decoder(config), params, packed, packed_group_size=G, dropout_key=jax.random.key(s))
    for s in (0, 1)
  ]
  assert np.isfinite(np.asarray(dropped[0])).all()
  assert np.abs(np.asarray(dropped[0] - dropped[1]))[valid].max() > 1e-3
  assert np.abs(np.asarray(dropped[0] - want))[valid].max() > 1e-3


def test_a_kv_cache_is_refused_with_the_packed_layout():
  from ebpo_jax.models import init_cache

  # Traced, not run (the refusal is the trace's): nothing to compile.
  model = Decoder(BASE, scan_layers=False)
  params = jax.eval_shape(lambda: unstack_layers(_params(BASE)))
  ids = jnp.ones((2, P + G * N), jnp.int32)
  with pytest.raises(ValueError, match="no KV cache"):
    jax.eval_shape(
      lambda p: model.apply(
        {"params": p}, ids, cache=init_cache(BASE, 2, 32), prefix_groups=PrefixGroups(P, G)
      ),
      params,
    )


# ----------------------------------------------------------------------------- the train step


def test_the_shared_prefix_runs_when_micro_batches_hold_whole_groups():
  one, eight = (sharding.make_mesh({"data": 1, "fsdp": -1}, jax.devices()[:n]) for n in (1, 8))

  def uses(overrides, mesh):
    config = arith_config({"rl.group_size": 4, "train.batch_size": 8, **overrides})
    return step_lib.StepLayout.from_config(config, mesh).shared_prefix

  whole = {"train.mini_batch_size": 8, "train.micro_batch_size": 0}
  assert uses(whole, None) and uses(whole, one)
  assert uses(whole, eight)  # 8 prompts and 32 rows, each over the 8 devices
  assert not uses({**whole, "rl.num_iterations": 2}, one)  # shuffled epochs split groups
  assert not uses({**whole, "train.micro_batch_size": 2}, one)  # half a group per micro-batch
  assert not uses({**whole, "rl.group_size": 1}, one)  # nothing shared
  # 2 prompts per micro-batch cannot split over 8 devices as its 8 rows do.
  assert uses({**whole, "train.micro_batch_size": 8}, one)
  assert not uses({**whole, "train.micro_batch_size": 8}, eight)


def _jitted_step(tiny, options):
  abstract_params = models.build.abstract_params(tiny.model, tiny.mesh)
  shardings = tiny.spec.shardings(abstract_params)
  return step_lib.jit_train_step(tiny.model, tiny.spec, options, tiny.mesh, shardings, donate=False)


@pytest.mark.parametrize("lora", [False, True], ids=["full_params", "lora"])
def test_a_train_step_through_the_shared_prefix_equals_the_full_layout(lora, monkeypatch):
  # Two mini-batches of 4 prompts, each in two micro-batches of 2 prompts (8 rows), a KL to the
  # reference: the prompts must follow their rows through every split.
  overrides = {"train.mini_batch_size": 4, "train.micro_batch_size": 8, "rl.loss.kl_coef": 0.1}
  if lora:
    overrides["model.lora.rank"] = 4
  tiny = tiny_steps(overrides, num_devices=1)
  assert tiny.options.layout.shared_prefix
  packed_calls = []
  build_packed = sequences.build_packed_sequences
  monkeypatch.setattr(
    sequences,
    "build_packed_sequences",
    lambda *args: packed_calls.append(1) or build_packed(*args),
  )
  state = tiny.fresh_state()
  # The policy away from its reference (the base, or the step-0 copy): the KL term acts.
  moved = trained_lora(state.params) if lora else jax.tree.map(lambda x: 1.1 * x, state.params)
  state = state.replace(params=moved)
  batch = tiny.place(tiny.batch(seed=3))
  shared_state, shared_metrics, shared_aux = _jitted_step(tiny, tiny.options)(state, batch)
  assert packed_calls and shared_aux.layout.shared_prefix  # traced through the shared prefix
  full_layout = dataclasses.replace(tiny.options.layout, shared_prefix=False)
  full_options = dataclasses.replace(tiny.options, layout=full_layout)
  full_state, full_metrics, full_aux = _jitted_step(tiny, full_options)(state, batch)
  assert len(packed_calls) == 1 and not full_aux.layout.shared_prefix  # the full layout ran
  for key, value in full_metrics.items():
    np.testing.assert_allclose(shared_metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  assert float(full_metrics["grad_norm"]) > 0 and float(full_metrics["kl"]) > 1e-6
  for path, a in jax.tree_util.tree_flatten_with_path(shared_state.params)[0]:
    b = _leaf(full_state.params, path)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # The update moved the params by ~lr; the two layouts agree far below that.
  moved = max(float(np.abs(np.asarray(a - b)).max()) for a, b in zip(
    jax.tree.leaves(shared_state.params), jax.tree.leaves(state.params), strict=True))  # fmt: skip
  assert moved > 1e-5
