"""One whole RL step (rollout + reward + update), ours vs tunix's GRPOLearner (for bench/peers.py).

Both sides get the same Hugging Face Llama weights, the same prompts (BOS + P-1 words of the bench
vocabulary), G samples each at temperature 1 (no top-k/top-p, no stop token: exactly N new tokens),
the same reward (1 if the completion holds the word `REWARD_WORD`), GRPO advantages, PPO-clip 0.2
with sequence-mean-token-mean aggregation, one update per step (num_iterations=1, the whole batch
as one mini-batch) with the same optimizer (global-norm clip 1, AdamW 1e-4, no weight decay), and
optionally a k3 KL penalty to the frozen start model.

Ours: what ebpo_jax.train runs per step: `rollouts.batch.collect_batch` (the trainer's rollout
worker, scored in-process) then the jitted `step.jit_train_step`, metrics fetched. Rollout =
collect_batch; train = the step (which computes the reference log-probs under KL).
Tunix 0.1.7: `GRPOLearner.train` over a one-batch dataset per step (its `close` deferred to the
end), actor, reference and vanilla-sampler rollout on one CPU mesh. Rollout = `RLCluster.generate` +
`_compute_rewards` (timed by wrapping them; both return host values, so nothing is left pending);
train = the rest of the step (under KL the reference log-probs, which tunix dispatches before the
advantages and `update_actor` waits for; advantages; `update_actor`; its loop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
import optax
import train_step as train_step_bench  # bench/train_step.py, beside this file

from ebpo_jax import cli, models, sharding
from ebpo_jax import keys as keys_lib
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import worker as worker_lib
from ebpo_jax.trainer import state as state_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD_WORD = "w7"
PAD, BOS, EOS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class RLShape:
  prompts: int = 8  # B
  group_size: int = 4  # G
  prompt_len: int = 32  # P, BOS included
  new_tokens: int = 32  # N
  learning_rate: float = 1e-4
  grad_clip: float = 1.0
  clip_eps: float = 0.2
  kl_coef: float = 0.04  # the KL runs' coefficient (k3 on both sides)


def words(ids) -> str:
  """Token ids as text of the bench vocabulary: id i is the word `w{i}`."""
  return " ".join(f"w{int(i)}" for i in ids)


def ids_of(text: str) -> list[int]:
  return [int(w[1:]) for w in text.split()]


def reward_of(text: str) -> float:
  return float(REWARD_WORD in text.split())


class OurWords:
  """ebpo_jax's tokenizer protocol (tasks/tokenizers.py) over the bench vocabulary; no stop id."""

  pad_id, bos_id, eos_id = PAD, BOS, EOS
  stop_ids: tuple[int, ...] = ()

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return ids_of(text)

  def prompt_ids(self, text: str, system_prompt=None, history=(), tools=()) -> list[int]:
    """BOS + the prompt's words (no system prompt, history or tools: one-turn bench prompts)."""
    del system_prompt, history, tools
    return [BOS, *ids_of(text)]

  def decode(self, ids) -> str:
    return words(i for i in ids if i not in (PAD, BOS))


class TunixWords:
  """tunix's tokenizer protocol (methods encode, decode, bos_id, eos_id, pad_id)."""

  def encode(self, text: str, **_) -> list[int]:
    return ids_of(text)

  def decode(self, ids, **_) -> str:
    return words(ids)

  def bos_id(self) -> int:
    return BOS

  def eos_id(self) -> int:
    return EOS

  def pad_id(self) -> int:
    return PAD


def _score(response: str, row: dict) -> float:
  return reward_of(response)


class WordTask:
  """The attributes of a tasks.Task that the rollout worker reads: one cluster, the reward word."""

  name, cluster_names, system_prompt = "bench_words", ["all"], None
  score = staticmethod(_score)

  def format_prompt(self, row: dict) -> str:
    return row["prompt"]


def prompt_texts(rl: RLShape, vocab: int, seed: int) -> list[str]:
  """B prompts of P-1 random words (each side prepends BOS)."""
  rng = np.random.default_rng(seed)
  return [words(rng.integers(3, vocab, rl.prompt_len - 1)) for _ in range(rl.prompts)]


# ----------------------------------------------------------------------------- ours


def our_config(path: str, rl: RLShape, kl: bool):
  config = cli.load_config(os.path.join(ROOT, "configs/arith_ebpo.py"))
  config.model.path = path
  config.rl.advantage = "grpo"
  config.rl.group_size = rl.group_size
  config.rl.num_iterations = 1
  config.rl.loss.clip_low = config.rl.loss.clip_high = rl.clip_eps
  config.rl.loss.aggregation = "seq-mean-token-mean"
  config.rl.loss.kl_coef = rl.kl_coef if kl else 0.0
  config.rl.loss.kl_kind = "k3"
  config.train.batch_size = config.train.mini_batch_size = rl.prompts
  config.train.micro_batch_size = 0
  config.train.learning_rate = rl.learning_rate
  config.train.grad_clip = rl.grad_clip
  config.train.weight_decay = 0.0
  config.sampling.max_new_tokens = rl.new_tokens
  config.sampling.temperature, config.sampling.top_p, config.sampling.top_k = 1.0, 1.0, 0
  config.sampling.prompt_buckets = (rl.prompt_len,)
  config.rewards.workers = 0
  config.mesh.data, config.mesh.fsdp = 1, -1
  return config


class OurRL:
  """The trainer's step: collect_batch (sample + score) then the jitted train_step."""

  def __init__(self, path: str, rl: RLShape, vocab: int, kl: bool, seed: int = 0):
    config = our_config(path, rl, kl)
    self.mesh = sharding.make_mesh(dict(config.mesh))
    model = models.build.make_model(config, vocab)
    self.state, self.step_fn, _ = train_step_bench.fresh_state_and_step(
      config, model, self.mesh, num_clusters=1
    )
    task, tokenizer = WordTask(), OurWords(vocab)
    self.worker = worker_lib.make_worker(model, task, tokenizer, config, self.mesh)
    self.rows = [{"prompt": p, "answer": "", "cluster": 0} for p in prompt_texts(rl, vocab, seed)]
    self.config = config

  def step(self) -> dict[str, float]:
    """One RL step; seconds of {rollout, train, step}."""
    t0 = time.perf_counter()
    keys = keys_lib.step_keys(self.state.rng, self.state.step)
    batches = iter([np.arange(len(self.rows))])
    batch, _, _ = rollout_batch.collect_batch(
      self.worker, state_lib.policy_params(self.state), keys, self.rows, batches
    )
    t1 = time.perf_counter()
    self.state, metrics, _ = self.step_fn(self.state, batch)
    metrics = jax.device_get(metrics)
    t2 = time.perf_counter()
    if not np.isfinite(metrics["loss"]):
      raise RuntimeError(f"ours: non-finite loss {metrics['loss']}")
    return {"rollout": t1 - t0, "train": t2 - t1, "step": t2 - t0}

  def close(self) -> None:
    self.worker.scorer.pool.close()


# ----------------------------------------------------------------------------- tunix


def tunix_llama(path: str, hf: dict, mesh):
  """tunix's Llama3 (flax.nnx) of the HF config `hf`, with the directory's safetensors weights."""
  from tunix.models.llama3 import model as llama3
  from tunix.models.llama3 import params as llama3_params

  rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10_000.0)}
  if rope.get("rope_type", "default") != "default":
    raise ValueError(f"{path}: RoPE scaling {rope} (tunix's Llama3 applies none)")
  config = llama3.ModelConfig(
    num_layers=hf["num_hidden_layers"],
    vocab_size=hf["vocab_size"],
    embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"],
    head_dim=hf["head_dim"],
    num_kv_heads=hf["num_key_value_heads"],
    rope_theta=rope["rope_theta"],
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    weight_tying=hf.get("tie_word_embeddings", False),
  )
  return llama3_params.create_model_from_safe_tensors(path, config, mesh)


def cpu_mesh():
  auto = (jax.sharding.AxisType.Auto,) * 2  # tunix's models constrain shardings the Auto way
  return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[:1])


class _Timers:
  """Wall seconds spent inside wrapped methods since the last reset (any thread)."""

  def __init__(self):
    self.seconds: dict[str, float] = {}

  def wrap(self, obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

    setattr(obj, name, timed)


class TunixRL:
  """tunix's GRPOLearner, one `train` call per step over a one-batch dataset."""

  def __init__(self, path: str, hf: dict, rl: RLShape, kl: bool, seed: int = 0):
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    mesh = cpu_mesh()
    self.actor = tunix_llama(path, hf, mesh)
    reference = tunix_llama(path, hf, mesh) if kl else None
    optimizer = optax.chain(
      optax.clip_by_global_norm(rl.grad_clip), optax.adamw(rl.learning_rate, weight_decay=0.0)
    )
    training = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=10**9
    )
    rollout = base_rollout.RolloutConfig(
      max_tokens_to_generate=rl.new_tokens,
      max_prompt_length=rl.prompt_len,
      kv_cache_size=rl.prompt_len + rl.new_tokens,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
      eos_tokens=[hf["vocab_size"]],  # an id never sampled: no stop token, as ours
    )
    roles = rl_cluster_lib.Role
    cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=training,
      rollout_config=rollout,
    )
    self.cluster = rl_cluster_lib.RLCluster(
      actor=self.actor, reference=reference, tokenizer=TunixWords(), cluster_config=cluster_config
    )
    algo = grpo_learner.GRPOConfig(
      num_generations=rl.group_size,
      num_iterations=1,
      beta=rl.kl_coef if kl else 0.0,
      kl_loss_mode="low_var_kl",  # k3, as ours
      epsilon=rl.clip_eps,
      loss_agg_mode="sequence-mean-token-mean",
    )
    reward = lambda prompts, completions, **_: [reward_of(c) for c in completions]
    self.learner = grpo_learner.GRPOLearner(self.cluster, algo, reward_fns=reward)
    self.timers = _Timers()
    self.timers.wrap(self.cluster, "generate", "generate")
    self.timers.wrap(self.learner, "_compute_rewards", "reward")
    self.timers.wrap(self.cluster, "update_actor", "update")
    self._close, self.cluster.close = self.cluster.close, lambda: None
    self.prompts = prompt_texts(rl, hf["vocab_size"], seed)
    self._state = lambda: nnx.state(self.actor)

  def step(self) -> dict[str, float]:
    self.timers.seconds = {}
    start = time.perf_counter()
    self.learner.train([{"prompts": np.array(self.prompts)}])
    jax.block_until_ready(self._state())
    seconds = time.perf_counter() - start
    spent = self.timers.seconds
    rollout = spent["generate"] + spent["reward"]
    return {"rollout": rollout, "train": seconds - rollout, "step": seconds, **spent}

  def close(self) -> None:
    with contextlib.suppress(Exception):
      self._close()
