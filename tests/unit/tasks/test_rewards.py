"""Tests for tasks.rewards.RewardPool: failures score 0, are counted, and the pool survives.

One pool serves the whole module (starting worker processes costs time). The verifiers below are
top-level functions so that the workers can import them by name.
"""

import os
import threading
import time

import numpy as np
import pytest

from ebpo_jax.tasks import get_task, rewards
from ebpo_jax.tasks.arithmetic import score_arithmetic
from ebpo_jax.tasks.rewards import RewardPool

TIMEOUT_S = 0.5


def raising_verifier(response: str, row: dict) -> float:
  if response == "bad":
    raise RuntimeError("verifier bug")
  return 1.0


def hanging_verifier(response: str, row: dict) -> float:
  if response == "bad":
    time.sleep(60)
  return 1.0


def crashing_verifier(response: str, row: dict) -> float:
  if response == "bad":
    os._exit(3)
  return 1.0


def slow_verifier(response: str, row: dict) -> float:
  time.sleep(0.2)
  return 0.25


def out_of_range_verifier(response: str, row: dict) -> float:
  return {"bad": 1.5, "nan": float("nan"), "str": "1"}.get(response, 0.25)


@pytest.fixture(scope="module")
def pool():
  with RewardPool(workers=2, timeout_s=TIMEOUT_S) as pool:
    yield pool


def _arithmetic_check(pool):
  """The pool still scores correctly: 3 right answers, 1 wrong."""
  rows = [{"answer": str(i)} for i in range(4)]
  rewards, errors = pool.score(score_arithmetic, ["0", "1", "2", "7"], rows)
  np.testing.assert_array_equal(rewards, [1, 1, 1, 0])
  assert rewards.dtype == np.float32 and errors == 0


RESPONSES = ["ok", "bad", "ok", "ok", "bad", "ok"]
ROWS = [{"answer": ""}] * len(RESPONSES)
EXPECTED = [1, 0, 1, 1, 0, 1]


def test_raising_verifier_scores_zero_and_is_counted(pool):
  rewards, errors = pool.score(raising_verifier, RESPONSES, ROWS)
  np.testing.assert_array_equal(rewards, EXPECTED)
  assert errors == 2
  assert pool.last_errors == ["RuntimeError: verifier bug"] * 2
  _arithmetic_check(pool)


def test_hanging_verifier_is_killed_in_bounded_time(pool):
  start = time.monotonic()
  rewards, errors = pool.score(hanging_verifier, RESPONSES, ROWS)
  elapsed = time.monotonic() - start
  np.testing.assert_array_equal(rewards, EXPECTED)
  assert errors == 2
  assert "timed out after 0.5 s" in pool.last_errors[0]
  # Two hangs on two workers run side by side: about one timeout, plus restarts; never 60 s.
  assert TIMEOUT_S <= elapsed < 5.0
  _arithmetic_check(pool)


def test_crashing_verifier_is_replaced(pool):
  pids = {w.process.pid for w in pool._workers}
  rewards, errors = pool.score(crashing_verifier, RESPONSES, ROWS)
  np.testing.assert_array_equal(rewards, EXPECTED)
  assert errors == 2
  assert pool.last_errors[0] == "worker died (exit code 3)"
  assert pool.num_workers == 2 and {w.process.pid for w in pool._workers} != pids
  _arithmetic_check(pool)


def test_rewards_outside_zero_one_are_errors(pool):
  rewards, errors = pool.score(out_of_range_verifier, ["ok", "bad", "nan", "str"], [{}] * 4)
  np.testing.assert_array_equal(rewards, [0.25, 0, 0, 0])
  assert errors == 3


def test_reasoning_gym_rows_through_the_pool(pool):
  # The workers import reasoning_gym (~2 s) on their first call: that must not count against the
  # 0.5 s timeout, which starts when the call is unpickled.
  task = get_task("reasoning_gym:chain_sum", levels=2)
  rows = task.rows("train", 6, seed=0)
  responses = [f"Answer: {r['answer']}" if i % 2 else "Answer: x" for i, r in enumerate(rows)]
  rewards, errors = pool.score(task.score, responses, rows)
  np.testing.assert_array_equal(rewards, [0, 1, 0, 1, 0, 1])
  assert errors == 0


def test_interrupted_call_leaves_no_stale_results(pool, monkeypatch):
  real_wait = rewards.multiprocessing.connection.wait
  calls = []

  def interrupt_once(*args, **kwargs):  # Process.join waits with it too: only the first raises
    calls.append(1)
    if len(calls) == 1:
      raise KeyboardInterrupt
    return real_wait(*args, **kwargs)

  with monkeypatch.context() as patch:
    patch.setattr(rewards.multiprocessing.connection, "wait", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
      pool.score(slow_verifier, ["a", "b"], [{}, {}])  # both workers get a call, then Ctrl-C
  # Without replacing the busy workers, this call would read their 0.25 results.
  _arithmetic_check(pool)


def test_misuse(pool):
  with pytest.raises(ValueError, match="2 responses but 1 rows"):
    pool.score(score_arithmetic, ["1", "2"], [{"answer": "1"}])
  with pytest.raises(ValueError, match="cannot be sent to a worker process: use a top-level"):
    pool.score(lambda response, row: 1.0, ["1"], [{}])
  closed = RewardPool(workers=0, timeout_s=1.0)
  closed.close()
  with pytest.raises(RuntimeError, match="closed"):
    closed.score(score_arithmetic, ["1"], [{"answer": "1"}])


def test_inline_catches_and_times_out_on_the_main_thread():
  inline = RewardPool(workers=0, timeout_s=0.3)
  rewards, errors = inline.score(raising_verifier, RESPONSES, ROWS)
  np.testing.assert_array_equal(rewards, EXPECTED)
  assert errors == 2
  start = time.monotonic()
  rewards, errors = inline.score(hanging_verifier, ["ok", "bad"], ROWS[:2])
  assert time.monotonic() - start < 2.0
  np.testing.assert_array_equal(rewards, [1, 0])
  assert errors == 1 and "timed out after 0.3 s" in inline.last_errors[0]


def test_inline_off_the_main_thread_has_no_timeout_but_catches():
  inline = RewardPool(workers=0, timeout_s=0.3)
  result = {}
  thread = threading.Thread(
    target=lambda: result.update(out=inline.score(raising_verifier, RESPONSES, ROWS))
  )
  thread.start()
  thread.join()
  rewards, errors = result["out"]
  np.testing.assert_array_equal(rewards, EXPECTED)
  assert errors == 2


def test_bad_arguments():
  with pytest.raises(ValueError, match="workers must be an int >= 0"):
    RewardPool(workers=-1, timeout_s=1.0)
  with pytest.raises(ValueError, match="timeout_s must be > 0"):
    RewardPool(workers=0, timeout_s=0)
  with pytest.raises(ValueError, match="context must be one of"):
    RewardPool(workers=1, timeout_s=1.0, context="fork")
