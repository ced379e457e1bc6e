"""Tests for tasks.reward_fns: the `config.rewards.fns` string, the weighted sum with None, the
built-ins, and reward functions in the verifier pool (failures score 0 and are counted, a hang is
bounded, a crash leaves the trainer alive). The pool's reward functions are top level in
tests/helpers/reward_workers.py, which the workers import cheaply (this module imports jax)."""

import time

import numpy as np
import pytest

from ebpo_jax import metrics
from ebpo_jax.tasks import reward_fns
from ebpo_jax.tasks.arithmetic import score_arithmetic
from ebpo_jax.tasks.math_task import math_verify_reward
from ebpo_jax.tasks.rewards import RewardPool
from tests.helpers import reward_workers
from tests.helpers.reward_workers import first_char, misbehaving, wants_extras

HERE = reward_workers.__name__  # the module path the workers import these functions by


# ------------------------------------------------------------------------------ the config string


def test_parse_terms_names_and_weights():
  terms = reward_fns.parse(f" math_verify , 0.5*{HERE}:first_char, short=-1e-1*length_penalty,")
  assert terms == [
    ("math_verify", 1.0, "ebpo_jax.tasks.math_task:math_verify_reward"),
    ("first_char", 0.5, f"{HERE}:first_char"),
    ("short", -0.1, "ebpo_jax.tasks.reward_fns:length_penalty"),
  ]
  assert reward_fns.parse("") == []


@pytest.mark.parametrize(
  "spec, message",
  [
    ("math_verfy", "'math_verfy' is neither a built-in .* nor 'package.module:function'"),
    ("half*task", "weight 'half' is not a number"),
    ("inf*task", "weight must be finite"),
    ("task, 2*task", "a second term named 'task' \\(set NAME=\\)"),
    ("my-name=task", "name 'my-name' is not an identifier"),
    ("pkg/mod:f", "neither a built-in"),
  ],
)
def test_parse_errors_name_the_term(spec, message):
  with pytest.raises(ValueError, match=message):
    reward_fns.parse(spec)


def test_load_imports_by_path_and_names_what_is_missing():
  fns = reward_fns.load(f"exact_match, 0.5*{HERE}:first_char")
  assert [(f.name, f.weight, f.fn) for f in fns] == [
    ("exact_match", 1.0, reward_fns.exact_match),
    ("first_char", 0.5, first_char),
  ]
  with pytest.raises(ValueError, match="^reward 'f': cannot import 'no_such_mod' "):
    reward_fns.load("no_such_mod:f")
  with pytest.raises(ValueError, match=f"^reward 'nope': module '{HERE}' has no 'nope'$"):
    reward_fns.load(f"{HERE}:nope")
  with pytest.raises(ValueError, match="^reward 'NAME': .*NAME is a str, not a function$"):
    reward_fns.load(f"{HERE}:NAME")


def test_reward_metric_names():
  assert metrics.reward_fn_key("brevity") == "reward/brevity"
  for taken in ("mean", "errors", "overlong_penalty"):
    with pytest.raises(ValueError, match=f"reward name '{taken}' is taken"):
      metrics.reward_fn_key(taken)


# ------------------------------------------------------------------------------ the weighted sum


def test_combine_golden_values():
  # Two functions, weights 1 and 0.5, over 3 completions; NaN is a None.
  values = np.array([[1.0, 0.0, 1.0], [0.5, np.nan, -1.0]])
  total = reward_fns.combine(values, [1.0, 0.5])
  # 1 + 0.5*0.5 = 1.25;  0 + (None adds 0) = 0;  1 + 0.5*(-1) = 0.5.
  # A None read as 0 gives the same total here; a None read as NaN (np.sum) gives NaN.
  np.testing.assert_array_equal(total, [1.25, 0.0, 0.5])
  assert total.dtype == np.float32
  # Means leave the Nones out: (0.5 - 1) / 2 = -0.25, not (0.5 + 0 - 1) / 3.
  np.testing.assert_array_equal(reward_fns.means(values), [2 / 3, -0.25])
  assert np.isnan(reward_fns.means(np.full((1, 2), np.nan))[0])  # nothing applicable: NaN


def test_builtins():
  rows = [{"answer": "1,000"}, {"answer": "\\frac{1}{2}"}, {"answer": "7"}]
  completions = ["so\nAnswer: 1000", "Answer: $0.5$", "7\n"]
  assert reward_fns.exact_match(completions, rows) == [1.0, 0.0, 1.0]
  assert reward_fns.answer_format(completions, rows) == [1.0, 1.0, 0.0]
  assert reward_fns.answer_format(["Answer:", "answer: x\n\n", ""], rows) == [0.0, 1.0, 0.0]
  assert math_verify_reward(completions, rows) == [1.0, 1.0, 0.0]  # 7 has no Answer: line
  penalty = reward_fns.length_penalty(completions, rows, lengths=[0, 2, 8], max_new_tokens=4)
  assert penalty == [0.0, -0.5, -1.0]  # capped at -1
  arith = [{"answer": "3"}, {"answer": "4"}]
  got = reward_fns.task_verifier(["3", "5"], arith, task_score=score_arithmetic, lengths=[1, 1])
  assert got == [1.0, 0.0]


# ------------------------------------------------------------------------------ in the pool

COMPLETIONS = ["ok", "raise", "two", "str", "nan", "neg", "ok"]


def _extras(n):
  return [{"lengths": [2], "max_new_tokens": 4, "task_score": score_arithmetic}] * n


@pytest.mark.parametrize("workers", [0, 1])
def test_pool_scores_reward_functions_and_counts_failures(workers):
  rows = [{"answer": "ok"}] * len(COMPLETIONS)
  named = [("misbehaving", misbehaving), ("first_char", first_char)]
  with RewardPool(workers=workers, timeout_s=2.0) as pool:
    values, errors = pool.score_rewards(named, COMPLETIONS, rows, _extras(len(rows)))
    # raise, two values, a string and NaN fail (score 0, counted); -3 is a fine value.
    np.testing.assert_array_equal(values[0], [1, 0, 0, 0, 0, -3, 1])
    np.testing.assert_array_equal(values[1], [0.25] * 7)
    assert errors.tolist() == [4, 0]  # per function
    assert pool.last_errors[0] == "misbehaving: RuntimeError: reward bug"
    values, errors = pool.score_rewards([("e", wants_extras)], ["ok"], rows[:1], _extras(1))
    assert values.tolist() == [[1.5]] and errors.tolist() == [
      0
    ]  # 2/4 + score_arithmetic("ok", ok) = 1
    values, _ = pool.score_rewards([("f", first_char)], ["-x", "ab"], rows[:2], _extras(2))
    assert np.isnan(values[0, 0]) and values[0, 1] == 0.5  # None is NaN


def test_pool_bounds_a_hanging_reward_function():
  with RewardPool(workers=1, timeout_s=0.5) as pool:
    start = time.monotonic()
    values, errors = pool.score_rewards([("m", misbehaving)], ["hang", "ok"], [{}, {}], _extras(2))
    assert time.monotonic() - start < 10.0
    assert values.tolist() == [[0.0, 1.0]] and errors.tolist() == [1]
    assert pool.last_errors == ["m: timed out after 0.5 s (running)"]


def test_reward_functions_never_run_in_the_trainer_process():
  # workers=0 (the default) scores the task's verifier inline, but a reward function (user code)
  # in a worker: one that kills the interpreter killed the trainer.
  with RewardPool(workers=0, timeout_s=2.0) as pool:
    named = [("m", misbehaving)]
    values, errors = pool.score_rewards(named, ["exit", "ok"], [{}, {}], _extras(2))
    assert values.tolist() == [[0.0, 1.0]] and errors.tolist() == [1]
    assert pool.last_errors == ["m: worker died (exit code 3)"]
    rewards, errors = pool.score(score_arithmetic, ["3"], [{"answer": "3"}])
    assert rewards.tolist() == [1.0] and errors == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_function_whose_calls_time_out_in_a_row_is_dropped_for_the_batch(workers):
  # 8 hangs at 0.5 s ran one after another, a timeout and a worker restart each (32 at the default
  # 5 s: 160 s a step). After workers + 1 timeouts in a row (2 with one worker) the function's
  # other calls in the batch score 0, counted, without being made; fewer drop nothing
  # (test_pool_bounds_a_hanging_reward_function, test_rewards.py's two hangs on two workers); the
  # other functions are scored.
  limit = max(workers, 1) + 1
  with RewardPool(workers=workers, timeout_s=0.5) as pool:
    named = [("m", misbehaving), ("f", first_char)]
    values, errors = pool.score_rewards(named, ["hang"] * 8, [{}] * 8, _extras(8))
    assert values[0].tolist() == [0.0] * 8 and values[1].tolist() == [0.25] * 8
    assert errors.tolist() == [8, 0]
  timed_out = pool.last_errors.count("m: timed out after 0.5 s (running)")
  assert limit <= timed_out <= 2 * limit - 2  # and the calls in flight when it was dropped
  not_called = f"m: not called: timed out or killed its worker {limit} times in a row in this batch"
  assert pool.last_errors[timed_out:] == [not_called] * (8 - timed_out)


def test_a_reward_function_that_kills_its_worker_every_call_is_dropped_for_the_batch():
  # Only timeouts tripped the breaker: a function killing its worker on every call restarted one
  # per completion (174-281 s steps, issue 62, item 3). Deaths in a row now count as timeouts do.
  with RewardPool(workers=1, timeout_s=5.0) as pool:
    values, errors = pool.score_rewards([("m", misbehaving)], ["exit"] * 8, [{}] * 8, _extras(8))
  assert values.tolist() == [[0.0] * 8] and errors.tolist() == [8]
  died = pool.last_errors.count("m: worker died (exit code 3)")
  assert died == 2  # workers + 1
  not_called = "m: not called: timed out or killed its worker 2 times in a row in this batch"
  assert pool.last_errors[died:] == [not_called] * (8 - died)


def hanging_verifier(response, row):
  time.sleep(60)
  return 1.0


def test_an_inline_verifier_called_off_the_main_thread_still_times_out():
  # workers=0 scores the verifier inline with a SIGALRM timeout, which only the main thread has:
  # from the asynchronous producer's thread a hanging verifier hung the run. There it runs in a
  # worker instead, with its timeout.
  import concurrent.futures

  with RewardPool(workers=0, timeout_s=0.5) as pool:
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
      rewards, errors = thread.submit(pool.score, hanging_verifier, ["x"], [{}]).result(timeout=30)
  assert time.monotonic() - start < 20
  assert rewards.tolist() == [0.0] and errors == 1
  assert pool.last_errors == ["timed out after 0.5 s (running)"]


# ----------------------------------------------------------------------------- Python callables


def brevity(completions, rows, **extras):
  """A module-level reward function, as the scorer processes import it."""
  return [float(len(c) <= 2) for c in completions]


def test_python_reward_functions_become_the_terms_the_workers_import():
  spec = reward_fns.spec_of([(brevity, 0.5), "math_verify"])  # a str: a term as written
  assert spec == f"brevity=0.5*{__name__}:brevity, math_verify"
  (fn,) = reward_fns.load(reward_fns.spec_of([(brevity, -0.25)]))
  assert (fn.name, fn.weight, fn.fn) == ("brevity", -0.25, brevity)


def _nested():
  def inner(completions, rows, **extras):
    return [0.0] * len(completions)

  return inner


@pytest.mark.parametrize(
  "item, message",
  [
    (lambda completions, rows, **extras: [0.0], "a lambda .* define it with def in a module"),
    (_nested(), "inner is defined inside .* top level of a module"),
    (print, "print is not a Python function"),
    ((brevity, "heavy"), "weight 'heavy' is not a number"),
  ],
)
def test_a_reward_the_workers_cannot_import_is_one_line(item, message):
  with pytest.raises(ValueError, match=message) as error:
    reward_fns.spec_of([item])
  assert "\n" not in str(error.value)


def test_a_notebooks_own_function_is_refused_with_how_to_fix_it():
  namespace = {"__name__": "__main__"}
  exec("def mine(completions, rows, **extras):\n  return [1.0] * len(completions)", namespace)
  with pytest.raises(ValueError, match=r"mine is defined in __main__ .*%%writefile") as error:
    reward_fns.spec_of([namespace["mine"]])
  assert "\n" not in str(error.value)


def test_trainer_run_refuses_a_lambda_before_the_workdir_is_touched(tmp_path):
  from ebpo_jax import errors, trainer
  from tests.helpers.configs import arith_config

  with pytest.raises(
    errors.ConfigError, match=r"^rewards=\[\.\.\.\]: a lambda cannot run"
  ) as error:
    trainer.run(arith_config(), str(tmp_path / "run"), rewards=[lambda c, r, **e: [0.0] * len(c)])
  assert "\n" not in str(error.value)
  assert not (tmp_path / "run").exists()
  with pytest.raises(errors.ConfigError, match="config.rewards.fns='task' and rewards=.* use one"):
    trainer.run(arith_config({"rewards.fns": "task"}), str(tmp_path / "run"), rewards=[brevity])
