"""Multi-turn episodes with a tiny random model: one turn is `sampling.generate`'s sample (so the
loss equals the single-turn loss when no tool is called); observations sit between model turns
with loss mask 0; limits truncate."""

import dataclasses
import functools
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import envs, models, sampling, sharding
from ebpo_jax import keys as keys_lib
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.models import Decoder
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import episodes, scoring
from ebpo_jax.rollouts.options import BatchOptions, EnvOptions, EvalOptions, RolloutOptions
from ebpo_jax.rollouts.prompts import PromptEncoder
from ebpo_jax.rollouts.rollout import SamplerCall
from ebpo_jax.rollouts.worker import RolloutWorker
from ebpo_jax.sampling import DecodeOptions, engine, sequences, turns
from ebpo_jax.tasks import get_task, reward_fns, rewards, tokenizers
from ebpo_jax.tasks.tokenizers import ByteTokenizer
from ebpo_jax.trainer import step as step_lib
from tests.helpers.configs import TINY_MODEL

PROMPTS = [[1, 40, 41, 42, 43], [1, 50]]
G, N = 2, 6


class Answers(envs.Environment):
  """Answers every turn with "ok" until `turns` turns, then ends with `reward`."""

  def __init__(self, turns: int = 1, reward: float | None = 0.5):
    self.turns, self.seen, self.reward = turns, 0, reward

  def step(self, model_text):
    self.seen += 1
    return (None, self.reward, True) if self.seen >= self.turns else ("ok", None, False)


class _ManyStops(ByteTokenizer):
  stop_ids = tuple(range(2, 90))  # turns of a random model end early, at different lengths


class Tagged(Answers):
  """`Answers` whose model turns also end at "<tag>"."""

  stop_strings = ("<tag>",)


class RowTurns(Answers):
  """`Answers` with the row's own number of turns (`row["turns"]`)."""

  def reset(self, row):
    self.turns = row["turns"]


class _Encoder:
  tokenizer = _ManyStops()

  def observation_ids(self, text, after_end_of_turn=True):
    return self.tokenizer.encode(text)


def observations_seen(completions, rows, *, transcripts, **extras):
  """A reward term that reads the whole transcript (top level: the workers import it): the
  number of observations, +100 when the transcript's last model turn is the completion scored."""
  messages = transcripts[0]
  assistant = [m["content"] for m in messages if m["role"] == "assistant"]
  bonus = 100.0 if assistant and assistant[-1] == completions[0] else 0.0
  return [sum(m["role"] == "observation" for m in messages) + bonus]


@pytest.fixture(scope="module")
def setup():
  model = Decoder(dataclasses.replace(TINY_MODEL, vocab_size=259))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  with rewards.RewardPool(1, timeout_s=5.0) as pool:
    yield model, nn.meta.unbox(params), mesh, pool


def _run(setup, turns: int, *, max_tokens: int = 30, key: int = 0, env_class=Answers, encoder=None,
         compact=False, group_size=G, rows=None):  # fmt: skip
  model, params, mesh, pool = setup
  ids, mask = sampling.pad_prompts(PROMPTS, 0, (6,))
  env = EnvOptions(lambda: env_class(turns), max_turns=3, max_tokens=max_tokens,
                   max_observation_tokens=4)  # fmt: skip
  so = DecodeOptions(N, temperature=1.0, top_p=1.0, top_k=0, compact=compact,
                       prompts_per_call=0)  # fmt: skip
  place = functools.partial(sharding.place_rows, mesh=mesh)
  ep = episodes.run_episodes(
    model, params, place(ids), place(mask), jax.random.key(key), rows or [{}] * len(PROMPTS),
    group_size=group_size, greedy=False, encoder=encoder or _Encoder(), pool=pool, env=env, so=so,
    mesh=mesh,
  )  # fmt: skip
  return ep, (model, params, ids, mask)


def test_one_turn_is_the_single_turn_sample(setup):
  ep, (model, params, ids, mask) = _run(setup, turns=1)
  out = sampling.generate(
    model, params, ids, mask, jax.random.key(0), group_size=G, max_new_tokens=N,
    stop_ids=_Encoder.tokenizer.stop_ids, pad_id=0,
  )  # fmt: skip
  lengths = np.asarray(out.lengths)
  stopped = ~np.asarray(out.truncated)
  assert stopped.any()  # some rows stop within N tokens: they reach the environment
  np.testing.assert_array_equal(ep.tokens[:, :N], np.asarray(out.tokens))
  np.testing.assert_array_equal(ep.mask[:, :N], np.asarray(out.mask))
  np.testing.assert_array_equal(ep.loss_mask, ep.mask)  # no observation: every token trained
  np.testing.assert_allclose(ep.logps[:, :N], np.asarray(out.logprobs), atol=1e-6)
  np.testing.assert_array_equal(ep.truncated, ~stopped)
  np.testing.assert_array_equal(ep.env_rewards, np.where(stopped, 0.5, np.nan).astype(np.float32))
  assert (ep.turns == 1).all() and (ep.mask.sum(1) == lengths).all()


def test_observations_sit_between_model_turns_with_loss_mask_zero(setup):
  ep, _ = _run(setup, turns=3, key=1)
  ok = _Encoder.tokenizer.encode("ok")
  for r in range(len(PROMPTS) * G):
    roles = [line.split("]")[0] + "]" for line in ep.transcripts[r].splitlines()]
    n_obs = roles.count("[observation]")
    assert (ep.mask[r] & ~ep.loss_mask[r]).sum() == 2 * n_obs
    assert ep.turns[r] == roles.count("[assistant]") == n_obs + 1 or ep.truncated[r]
    observed = ep.tokens[r][ep.mask[r] & ~ep.loss_mask[r]]
    np.testing.assert_array_equal(observed, ok * n_obs)
    assert (ep.logps[r][~ep.loss_mask[r]] == 0).all()
  assert (ep.mask & ~ep.loss_mask).any()


def test_the_token_limit_truncates(setup):
  ep, _ = _run(setup, turns=3, max_tokens=N + 1, key=1)
  assert (ep.mask.sum(1) <= N + 1).all()
  ended = ep.turns > 1
  assert ended.any() and ep.truncated[ended].all()  # a second turn left no room for a third


def test_reward_functions_see_the_whole_transcript(setup):
  model, params, mesh, pool = setup
  fn = reward_fns.RewardFn("seen", observations_seen, 1.0, f"{__name__}:observations_seen")
  task = get_task("arithmetic", ops=("add",), digits=(1,))
  env = EnvOptions(lambda: Answers(3, None), max_turns=3, max_tokens=30, max_observation_tokens=4)
  so = DecodeOptions(N, temperature=1.0, top_p=1.0, top_k=0, compact=False, prompts_per_call=0)
  scorer = scoring.Scorer(task, pool, [fn], max_new_tokens=N)
  strategy = episodes.MultiTurn(model, _Encoder(), scorer, so, env, mesh)
  ids, mask = sampling.pad_prompts(PROMPTS, 0, (6,))
  rows = [{"prompt": "1+1=", "answer": "2", "cluster": 0}] * len(PROMPTS)
  out = strategy(SamplerCall(params, ids, mask, jax.random.key(1), rows, G, False, True))
  observations = [text.count("[observation] ") for text in out.texts]
  assert max(observations) > 0  # some trajectories read observations
  np.testing.assert_array_equal(out.rewards.reshape(-1), np.add(observations, 100.0))


def test_a_single_turn_completion_is_a_transcript_of_one_model_turn(setup):
  _, _, _, pool = setup
  fn = reward_fns.RewardFn("seen", observations_seen, 1.0, f"{__name__}:observations_seen")
  scorer = scoring.Scorer(get_task("arithmetic", ops=("add",), digits=(1,)), pool, [fn],
                          max_new_tokens=N)  # fmt: skip
  rows = [{"prompt": "1+1=", "answer": "2", "cluster": 0}]
  rewards_, _, errors = scorer.score(["2", "3"], rows, np.ones(2, np.int32), 2, training=True)
  assert errors == 0 and rewards_.tolist() == [[100.0, 100.0]]  # no observation; its own text


def test_an_environments_stop_string_of_several_tokens_ends_the_turn_right_after_it(setup):
  # Rows draw by (key, step, row) alone: with "<tag>" encoded as two tokens that a row drew, each
  # first turn is the turn without the stop string, cut right after the tag's first end.
  free, _ = _run(setup, turns=1)
  row = int(np.argmax(free.mask.sum(1)))
  tag = [int(t) for t in free.tokens[row, 1:3]]
  encoder = _Encoder()
  encoder.tokenizer = _TagTokenizer(tag)
  cut, _ = _run(setup, turns=1, env_class=Tagged, encoder=encoder)
  for r in range(len(PROMPTS) * G):
    drawn = free.tokens[r, : free.mask[r].sum()].tolist()
    ends = [i + 2 for i in range(len(drawn) - 1) if drawn[i : i + 2] == tag]
    n = ends[0] if ends else len(drawn)
    np.testing.assert_array_equal(cut.tokens[r][cut.mask[r]], drawn[:n])
    assert cut.truncated[r] == (free.truncated[r] and not ends)
  assert cut.mask[row].sum() == 3 and not cut.truncated[row]


class _TagTokenizer(_ManyStops):
  """Encodes "<tag>" as the two ids `tag` (a stop string that is several tokens)."""

  def __init__(self, tag):
    super().__init__()
    self.tag = tag

  def encode(self, text):
    return list(self.tag) if text == "<tag>" else super().encode(text)


def test_finished_trajectories_stop_costing_and_the_episodes_are_unchanged(setup, monkeypatch):
  # The first prompt's 8 trajectories end after one turn: with `sampling.compact` the next turns
  # decode only the other prompt's 8 rows (a batch of 8, not 16), drawing as they did.
  sizes = []
  gather = turns.compact
  monkeypatch.setattr(turns, "compact", lambda s, take: sizes.append(len(take)) or
                      gather(s, take))  # fmt: skip
  rows = [{"turns": 1}, {"turns": 3}]
  run = functools.partial(_run, setup, 0, env_class=RowTurns, group_size=8, rows=rows, key=2)
  full, _ = run()
  compacted, _ = run(compact=True)
  assert sizes == [8] and (full.turns[8:] > 1).any()
  for name in ("tokens", "mask", "loss_mask", "truncated", "turns", "env_rewards"):
    np.testing.assert_array_equal(getattr(compacted, name), getattr(full, name), err_msg=name)
  np.testing.assert_allclose(compacted.logps, full.logps, atol=1e-5)  # a batch of 8 rounds anew
  assert compacted.transcripts == full.transcripts


class _RowEncoder(_Encoder):
  def prompts(self, rows):
    return sampling.pad_prompts([PROMPTS[row["i"]] for row in rows], 0, (6,))


def _worker(setup, *, multi_turn: bool, turns: int = 2, concurrent_calls=1) -> RolloutWorker:
  """A RolloutWorker of the tiny policy, one prompt per sampler call, episodes of `Answers(turns)`
  when `multi_turn`."""
  model, _, mesh, pool = setup
  env = EnvOptions(lambda: Answers(turns), max_turns=3, max_tokens=30, max_observation_tokens=4)
  options = RolloutOptions(
    seed=0,
    sampling=DecodeOptions(N, temperature=1.0, top_p=1.0, top_k=0, compact=False,
                           prompts_per_call=1, concurrent_calls=concurrent_calls),
    batch=BatchOptions(G, dynamic_sampling=False, max_refill_rounds=0, overlong_buffer=0,
                       overlong_penalty=0.0),
    eval=EvalOptions(num_samples=1, greedy=True),
    env=env if multi_turn else None,
  )  # fmt: skip
  task = get_task("arithmetic", ops=("add",), digits=(1,))
  scorer = scoring.Scorer(task, pool, max_new_tokens=env.max_tokens)
  return RolloutWorker(model, _RowEncoder(), scorer, options, mesh)


ROWS = [{"prompt": "1+1=", "answer": "2", "cluster": 0, "i": i} for i in range(2)]


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "episodes"])
def test_a_round_converts_the_weights_to_the_samplers_layout_once(setup, monkeypatch, multi_turn):
  """The worker converts the (stacked, rolled-loop) weights once for a round of sampler calls,
  here two calls of one prompt; the episodes once converted them again on every call."""
  model, params, _, _ = setup
  conversions, convert = [], engine.decode_converter
  monkeypatch.setattr(
    engine, "decode_converter", lambda *a, **k: conversions.append(1) or convert(*a, **k)
  )
  worker = _worker(setup, multi_turn=multi_turn)
  rollout = worker.rollout(params, ROWS, jax.random.key(0), group_size=G, greedy=False)
  assert not model.config.unroll_layers and len(conversions) == 1
  assert rollout.rewards.shape == (2, G) and bool(rollout.stats) == multi_turn


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single_turn", "episodes"])
def test_concurrent_sampler_calls_run_at_once_and_give_the_rollouts_of_calls_in_turn(
  setup, multi_turn
):
  """sampling.concurrent_calls = 2: the round's two calls are served at the same time (each waits
  for the other to start: in turn, the first would wait alone and time out), under the caller's
  transfer guard, and the rollout is the one of the calls served one after the other."""
  _, params, _, _ = setup
  key = jax.random.key(3)
  alone = _worker(setup, multi_turn=multi_turn).rollout(params, ROWS, key, group_size=G,
                                                         greedy=False)  # fmt: skip
  worker = _worker(setup, multi_turn=multi_turn, concurrent_calls=2)
  both, serve, guards = threading.Barrier(2, timeout=60), worker.strategy, []

  def meeting(call):
    both.wait()
    guards.append(jax.config.jax_transfer_guard)
    return serve(call)

  worker.strategy = meeting
  with jax.transfer_guard("disallow"):
    together = worker.rollout(params, ROWS, key, group_size=G, greedy=False)
  assert guards == ["disallow", "disallow"]
  assert together.texts == alone.texts
  for name in ("rewards", "tokens", "mask", "loss_mask", "old_logps", "truncated", "prompt_ids"):
    np.testing.assert_array_equal(
      np.asarray(getattr(together, name)), np.asarray(getattr(alone, name))
    )
  timeless = lambda stats: {k: v for k, v in stats.items() if k != "env_time_s"}
  assert timeless(together.stats or {}) == timeless(alone.stats or {})


def test_the_training_batch_trains_the_episodes_model_tokens_only(setup):
  """The step's batch from multi-turn rollouts: its loss mask is the episodes' (model tokens), not
  their attention mask: each "[observation] ok" of a transcript is 2 tokens attended and not
  trained, and the sampler's log-probs there are 0 (a batch built from the attention mask, or a
  re-tokenized observation, would not count so)."""
  _, params, _, _ = setup
  worker = _worker(setup, multi_turn=True, turns=3)
  keys = keys_lib.step_keys(jax.random.PRNGKey(1), jnp.int32(0))
  batch, rollout, logs = rollout_batch.collect_batch(
    worker, params, keys, ROWS, iter([np.arange(len(ROWS))])
  )
  attended, trained = np.asarray(batch["completion_mask"]), np.asarray(batch["loss_mask"])
  observations = np.array([text.count("[observation] ok") for text in rollout.texts])
  assert observations.sum() > 0  # some trajectories read observations
  np.testing.assert_array_equal((attended & ~trained).sum(1), 2 * observations)
  assert not (trained & ~attended).any()
  assert (np.asarray(batch["old_logps"])[~trained] == 0).all()
  observed = np.asarray(batch["tokens"])[attended & ~trained]
  np.testing.assert_array_equal(observed, _Encoder.tokenizer.encode("ok") * observations.sum())
  assert logs[metrics_lib.MASKED_FRAC] == pytest.approx(
    (attended & ~trained).sum() / attended.sum()
  )


def test_stored_log_probs_equal_a_fresh_forward_of_the_stored_chat_tokens(setup):
  """With SmolLM2's tokenizer and chat template (observations as tool messages, then the
  assistant's header): the trainer's forward of the stored trajectories gives the log-probs the
  sampler stored at every model token, so the tokens stored are those the cache was fed (a
  re-tokenized observation would shift every later turn's)."""
  _, _, mesh, pool = setup
  tokenizer = tokenizers.HFTokenizer(models.smollm2_135m_instruct())
  task = get_task("arithmetic", ops=("add",), digits=(1,))
  encoder = PromptEncoder(task, tokenizer, buckets=(64,))
  model = Decoder(dataclasses.replace(TINY_MODEL, vocab_size=tokenizer.vocab_size))
  params = jax.jit(model.init)(jax.random.key(2), jnp.zeros((1, 4), jnp.int32))["params"]
  params = nn.meta.unbox(params)
  # A head that draws the end-of-turn id or "o" (the sign of one direction of the last hidden
  # state), nothing else: turns end after a few tokens, so observations come between them.
  w = 10.0 * jax.random.normal(jax.random.key(4), (model.config.hidden_size,))
  head = jnp.zeros_like(params["lm_head"])
  params["lm_head"] = head.at[:, tokenizer.eos_id].set(w).at[:, tokenizer.encode("o")[0]].set(-w)
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "cluster": 0} for a, b in ((1, 1), (2, 5))]
  ids, mask = encoder.prompts(rows)
  env = EnvOptions(lambda: Answers(3), max_turns=3, max_tokens=48, max_observation_tokens=16)
  so = DecodeOptions(8, temperature=1.0, top_p=1.0, top_k=0, compact=False, prompts_per_call=0)
  place = functools.partial(sharding.place_rows, mesh=mesh)
  ep = episodes.run_episodes(
    model, params, place(ids), place(mask), jax.random.key(3), rows, group_size=G, greedy=False,
    encoder=encoder, pool=pool, env=env, so=so, mesh=mesh,
  )  # fmt: skip
  assert (ep.mask & ~ep.loss_mask).any()  # observations between model turns
  seqs = sequences.build_sequences(ids, mask, ep.tokens, ep.mask, G, ep.loss_mask)
  fresh = step_lib.completion_logprobs(model, params, seqs, packed_group_size=None)
  np.testing.assert_allclose(np.where(ep.loss_mask, fresh, 0.0), ep.logps, atol=1e-4)
