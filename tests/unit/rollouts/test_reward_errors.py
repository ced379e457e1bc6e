"""`rewards.max_error_frac`: a training step whose reward calls fail beyond it stops the run with
one line naming the function and its first error (before: the step trained on the zeros the failed
calls scored, and the run exited 0). A reward term's naming, in its worker process:
tests/e2e/test_reward_fns.py."""

import numpy as np
import pytest

from ebpo_jax import errors
from ebpo_jax.rollouts import scoring
from ebpo_jax.tasks import get_task, reward_fns
from ebpo_jax.tasks.rewards import RewardPool


def failing_verifier(response, row):
  return 1.0 / (len(response) - len(response))  # ZeroDivisionError, every call


def picky_verifier(response, row):
  if response == "bad":
    raise KeyError("meta")
  return 1.0


@pytest.fixture(scope="module")
def task():
  return get_task("arithmetic", ops=("add",), digits=(1,))


def _score(scorer, texts, group_size=2):
  rows = [{"prompt": "1+1=", "answer": "2", "cluster": 0}] * (len(texts) // group_size)
  lengths = np.ones(len(texts), np.int32)
  return scorer.score(texts, rows, lengths, group_size, training=True)


def _stop_message(task, fns=(), workers=0) -> str:
  """The one line that stops a step of 4 completions scored with `fns` (none: the verifier)."""
  with RewardPool(workers=workers, timeout_s=5.0) as pool:
    scorer = scoring.Scorer(task, pool, fns, max_new_tokens=4, max_error_frac=0.5)
    _score(scorer, ["1", "2", "3", "4"])
    with pytest.raises(errors.BadInput) as error:
      scorer.check_step()
  return str(error.value)


def test_a_step_whose_verifier_calls_all_fail_stops_naming_it(task, monkeypatch):
  monkeypatch.setattr(task, "score", failing_verifier)
  message = _stop_message(task)
  assert "\n" not in message
  assert message.startswith("rewards.max_error_frac=0.5: 4 of 4 reward calls failed in this step")
  assert f"{__name__}.failing_verifier" in message and "ZeroDivisionError" in message


def test_errors_are_counted_over_the_steps_calls_and_reset(task, monkeypatch):
  monkeypatch.setattr(task, "score", picky_verifier)
  with RewardPool(workers=0, timeout_s=5.0) as pool:
    scorer = scoring.Scorer(task, pool, max_new_tokens=4, max_error_frac=0.5)
    _score(scorer, ["bad", "ok", "ok", "ok"])  # 1 of 4: under the limit
    scorer.check_step()
    _score(scorer, ["bad", "bad", "ok", "ok"])  # 2 of 4 is not beyond 0.5
    _score(scorer, ["bad", "bad", "bad", "ok"])  # two calls of one step (refill): 5 of 8
    with pytest.raises(errors.BadInput, match=r"5 of 8 reward calls failed.*KeyError: 'meta'"):
      scorer.check_step()
    scorer.check_step()  # the next step starts from 0


def always_raises(completions, rows, **kwargs):
  raise ValueError("dead term")


def always_one(completions, rows, **kwargs):
  return [1.0] * len(completions)


def test_a_dead_term_stops_the_run_beside_a_working_one(task):
  # Counted over all terms' calls, the dead one was 4 of 8 = 0.5, not above the limit, and the
  # run trained on its zeros to the end (issue 62, item 2): each term has the limit of its own.
  fns = [
    reward_fns.RewardFn("one", always_one, 1.0, f"{__name__}:always_one"),
    reward_fns.RewardFn("dead", always_raises, 1.0, f"{__name__}:always_raises"),
  ]
  message = _stop_message(task, fns, workers=1)
  assert "\n" not in message
  assert message.startswith("rewards.max_error_frac=0.5: 4 of 4 calls of reward 'dead' failed")
  assert "ValueError: dead term" in message
