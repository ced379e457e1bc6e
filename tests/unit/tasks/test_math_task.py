"""Tests for ebpo_jax.tasks.math_task: answer extraction, math-verify's verdicts, the timeout path,
and the `math` task on CHAMP's problems."""

import pickle
import subprocess
import sys
import time

import pytest

from ebpo_jax.tasks import get_task
from ebpo_jax.tasks.base import last_boxed, split_of
from ebpo_jax.tasks.math_task import (
  INSTRUCTION,
  extract_math_answer,
  math_answers_equivalent,
  math_score,
  normalize_math_answer,
)
from ebpo_jax.tasks.rewards import RewardPool

# ------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
  "response, expected",
  [
    ("So x = 2.\nAnswer: 3/4", "3/4"),
    ("Answer: 1\nmore work\nAnswer: $\\frac{3}{4}$.", "\\frac{3}{4}"),  # the last line wins
    ("answer: 7\nI hope this helps!", "7"),  # only its line, not the text after it
    ("Final Answer: Answer: 12", "12"),  # the last marker on the line
    ("**Answer:** 42", "42"),
    ("The answer:\n$-5$", "-5"),  # DAPO's pattern lets the answer start on the next line
    ("Answer: \\boxed{\\dfrac{1}{2}}", "\\dfrac{1}{2}"),
    ("Answer: \\(x = 3\\)", "x = 3"),
    ("Answer: 1, 2, ...", "1, 2, ..."),  # an ellipsis keeps its periods
    ("Answer: $a$ and $b$", "$a$ and $b$"),  # two math spans are not one pair of delimiters
    ("so $\\boxed{\\frac{a^{2}}{\\sqrt{b}}}$ in the end", "\\frac{a^{2}}{\\sqrt{b}}"),  # nested
    ("first \\boxed{1}, then \\fbox{2}", "2"),  # the last of \boxed and \fbox
    ("\\boxed{1} and \\boxed {2}.", "2"),
    ("Answer: 5\nand \\boxed{6}", "5"),  # an Answer: line beats a box
    ("cut short: \\boxed{\\frac{1}{2", ""),  # an unclosed box is no answer
    ("I think it is 42.", ""),  # neither marker: no answer (no last-line fallback)
    ("", ""),
  ],
)
def test_extract_math_answer(response, expected):
  assert extract_math_answer(response) == expected


def test_last_boxed_and_normalize():
  assert last_boxed("\\boxed{{a}{b}}") == "{a}{b}"
  assert last_boxed("no box") is None
  assert normalize_math_answer("  **$\\boxed{5}$.**  ") == "5"
  assert normalize_math_answer("\\[\\frac{1}{2}\\]") == "\\frac{1}{2}"
  assert normalize_math_answer("\\boxed{1}+\\boxed{2}") == "\\boxed{1}+\\boxed{2}"  # not one box


# ------------------------------------------------------------------------------ math-verify

# (gold, predicted, math-verify's verdict, why). Verdicts are what math-verify 0.9 says, recorded
# as they are; the surprising ones say so.
VERDICTS = [
  # fractions and decimals
  ("\\frac{1}{2}", "0.5", True, ""),
  ("1/2", "\\frac{1}{2}", True, ""),
  ("\\frac12", "1/2", True, ""),
  ("0.5", "\\dfrac{1}{2}", True, "\\dfrac"),
  ("\\tfrac{3}{4}", "0.75", True, "\\tfrac"),
  ("\\frac{2}{4}", "\\frac{1}{2}", True, ""),
  ("1/3", "0.333333", True, "numbers are compared rounded to 6 decimals"),
  ("1/3", "0.333", False, "too few decimals"),
  ("10", "10.0", True, ""),
  ("5.00", "5", True, ""),
  ("2", "2.000001", False, ""),
  ("3", "3.0000001", False, "surprising: 6-decimal rounding does not absorb 1e-7"),
  ("1e3", "1000", False, "surprising: 1e3 parses as 1*e*3 (Euler's e)"),
  ("\\pi", "3.14159265", True, ""),
  ("3.14", "\\pi", False, ""),
  # thousands separators
  ("1000", "1,000", True, ""),
  ("1000000", "1,000,000", True, ""),
  ("1000", "1{,}000", True, ""),
  ("1000", "1\\,000", False, "surprising: a thin space splits the number"),
  ("1.2", "1,2", False, "a decimal comma reads as the set {1, 2}"),
  # units, degrees, percentages, currency
  ("5", "5 cm", True, "units are dropped"),
  ("5\\text{ cm}", "5", True, ""),
  ("0.5", "\\frac{1}{2}\\text{ cm}^2", True, ""),
  ("30", "30^\\circ", True, ""),
  ("30^{\\circ}", "30", True, ""),
  ("\\frac{\\pi}{2}", "90^\\circ", False, "degrees are not converted to radians"),
  ("\\frac{\\sqrt{3}}{2}", "\\sin 60^\\circ", False, "surprising: sin(60) is in radians"),
  ("50\\%", "0.5", True, "a percentage is its fraction"),
  ("50\\%", "50", True, "surprising: ... and also the bare number"),
  ("5", "\\$5", True, "an escaped dollar sign"),
  ("5", "\\$5.00", True, ""),
  # intervals, sets, tuples
  ("(0,1]", "(0,1]", True, ""),
  ("(0,1]", "(0,1)", False, "the closed end matters"),
  ("[0,1)", "[0, 1)", True, ""),
  ("(-\\infty, 2]", "(-\\infty,2]", True, ""),
  ("\\left( 1, 2 \\right)", "(1,2)", True, "\\left( \\right)"),
  ("x \\in (0,1]", "(0,1]", True, ""),
  ("(0,1]", "0 < x \\le 1", False, "surprising: an inequality is not matched to an interval"),
  ("\\{1,2,3\\}", "\\{3,2,1\\}", True, "sets are unordered"),
  ("1,2,3", "3,2,1", True, "a bare list reads as a set"),
  ("\\{1,2\\}", "\\{1,2,3\\}", False, ""),
  ("(1,2)", "(2,1)", False, "an open interval against a tuple"),
  # roots and symbolic forms
  ("2\\sqrt{2}", "\\sqrt{8}", True, ""),
  ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True, ""),
  ("\\sqrt{2}", "1.41421356", True, ""),
  ("\\sqrt{2}", "1.414", False, ""),
  ("x^2+2x+1", "(x+1)^2", True, "symbolic simplification"),
  ("3+2i", "2i+3", True, ""),
  ("120", "5!", True, ""),
  # negative numbers
  ("-3", "-3", True, ""),
  ("-3", "3", False, ""),
  ("-\\frac{1}{2}", "-0.5", True, ""),
  ("-5", "\u22125", True, "a Unicode minus sign"),
  # equations and assignments
  ("3", "x = 3", True, "the right-hand side of an assignment"),
  ("x=3", "3", True, ""),
  ("x = 3", "y=3", False, "a different variable"),
  ("3", "x=4", False, ""),
  ("y=2x+1", "2x+1", True, ""),
  # text answers and multiple-choice letters
  ("\\text{Monday}", "Monday", True, ""),
  ("\\text{Monday}", "\\text{Tuesday}", False, ""),
  ("listen", "silent", True, "surprising: bare words are products of letter symbols"),
  ("Monday", "monday", True, ""),
  ("\\text{east}", "\\text{East}", True, "case is ignored"),
  ("\\text{yes}", "\\text{no}", False, ""),
  ("\\text{(A)}", "A", True, ""),
  ("A", "(A)", True, ""),
  ("E", "\\textbf{(E)}", True, ""),
  ("A", "B", False, ""),
  ("E", "(E) 12", False, "a letter with its value reads as the product e*12"),
  # verbal answers as CHAMP writes them
  ("Yes", "\\text{yes}", True, ""),
  ("a=3, b=-7, c=4", "3,-7,4", True, "assignments against their values"),
  ("(x=1, y=2) and (x=2, y=1)", "(1,2),(2,1)", True, ""),
  ("x=\u00b11, \u00b12, \u00b11/2", "\\pm 1, \\pm 2, \\pm \\frac12", True, "a Unicode plus-minus"),
  ("3 is the only possible value", "3", False, "surprising: a sentence is 3 times its letters"),
  ("0 is the only possible value", "0", True, "surprising: ... and 0 times them is 0"),
  ("0", "0 is not possible", True, "surprising: so any sentence starting with 0 is 0"),
  ("No such values", "No integer solutions", False, ""),
]


@pytest.mark.parametrize("gold, predicted, verdict, why", VERDICTS)
def test_math_verify_verdicts(gold, predicted, verdict, why):
  assert math_answers_equivalent(gold, predicted) is verdict


def test_verdict_table_covers_both_ways():
  assert len(VERDICTS) >= 30
  assert sum(v for *_, v, _ in VERDICTS) >= 15 and sum(not v for *_, v, _ in VERDICTS) >= 15


def test_math_score_reads_the_response():
  row = {"prompt": "p", "answer": "\\frac{3}{4}"}
  assert math_score("Work: 3/4 of it.\nAnswer: 0.75", row) == 1.0
  assert math_score("Answer: $\\boxed{\\dfrac{3}{4}}$.", row) == 1.0
  assert math_score("So \\boxed{3/4}.", row) == 1.0
  assert math_score("Answer: 0.75\nAnswer: 0.7", row) == 0.0  # the last answer counts
  assert math_score("0.75", row) == 0.0  # no marker, no answer
  assert math_score("Answer: 0.75", {"prompt": "p", "answer": ""}) == 0.0
  assert pickle.loads(pickle.dumps(math_score)) is math_score


def test_a_worker_that_unpickles_the_scorer_imports_no_jax():
  """A verifier worker imports the scorer's module when it unpickles it: math-verify, not the JAX
  and grain of ebpo_jax.data's batches (they cost a worker 1.4 CPU-s and 150 MB more)."""
  script = f"""
import pickle, sys
score = pickle.loads({pickle.dumps(math_score)!r})
print(score.__name__, sorted(m for m in ("jax", "grain") if m in sys.modules))
"""
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["math_score", "[]"]


# ------------------------------------------------------------------------------ the timeout path


def test_pathological_answer_costs_at_most_the_pool_timeout():
  row = {"prompt": "p", "answer": "3"}
  bomb = "Answer: 9^{9^{9^{9}}}"  # math-verify tries to evaluate the tower
  with RewardPool(workers=1, timeout_s=1.0) as pool:
    pool.score(math_score, ["Answer: 3"], [row])  # warm: the worker has imported math-verify
    start = time.monotonic()
    rewards, errors = pool.score(math_score, [bomb], [row])
    elapsed = time.monotonic() - start
    assert rewards.tolist() == [0.0] and errors == 1 and "timed out" in pool.last_errors[0]
    assert elapsed < 1.0 + 1.0
    rewards, errors = pool.score(math_score, ["Answer: 3", "Answer: 4"], [row, row])
    assert rewards.tolist() == [1.0, 0.0] and errors == 0  # a fresh worker took over


def test_math_verify_times_itself_out_below_a_longer_pool_timeout():
  """With a pool timeout above math-verify's own (2 s), the slow comparison scores 0 without
  costing a worker, is counted as a verifier error (it was silently a wrong answer), and the
  batch goes on."""
  row = {"prompt": "p", "answer": "3"}
  responses = ["Answer: 3", "Answer: (10^{10})!", "Answer: 3.0"]
  with RewardPool(workers=1, timeout_s=6.0) as pool:
    pool.score(math_score, ["Answer: 3"], [row])
    start = time.monotonic()
    rewards, errors = pool.score(math_score, responses, [row] * 3)
    elapsed = time.monotonic() - start
  assert rewards.tolist() == [1.0, 0.0, 1.0] and errors == 1
  assert "math-verify timed out" in pool.last_errors[0]
  assert 2.0 <= elapsed < 6.0


# ------------------------------------------------------------------------------ the task


@pytest.fixture(scope="module")
def champ():
  return get_task("math", source="champ")


def test_champ_task_splits_and_clusters(champ):
  assert champ.name == "math:champ" and champ.system_prompt is None
  train, evals = champ.rows("train", 0, seed=0), champ.rows("eval", 0, seed=0)
  assert len(train) + len(evals) == 270
  assert 0.1 * 270 < len(evals) < 0.3 * 270
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
  assert all(split_of(r["prompt"], 0.2) == "eval" for r in evals)
  assert champ.rows("train", 10, seed=3) == champ.rows("train", 10, seed=3)
  assert champ.rows("train", 10, seed=3) != champ.rows("train", 10, seed=4)
  assert get_task("math", eval_fraction=0.2).rows("eval", 0, seed=0) == evals  # deterministic
  ids = sorted({r["cluster"] for r in train + evals})
  assert ids == list(range(len(champ.cluster_names))) and len(ids) > 1
  assert all(isinstance(name, str) and name for name in champ.cluster_names)
  assert all(r["source"] == "champ" and r["answer"] for r in train + evals)


def test_champ_prompt_target_and_gold_answers_score_one(champ):
  rows = champ.rows("eval", 0, seed=0)
  row = rows[0]
  prompt = champ.format_prompt(row)
  assert prompt.startswith("Solve the following math problem step by step.")
  assert row["prompt"] in prompt and prompt.endswith('after "Answer:".')
  assert champ.format_target(row) == f"Answer: {row['answer']}"
  assert champ.extract_answer("x\nAnswer: $\\frac{1}{2}$.") == "\\frac{1}{2}"
  assert champ.tokenizer.vocab_size == 259
  scores = [math_score(champ.format_target(r), r) for r in rows]
  assert sum(scores) == len(rows), [r["answer"] for r, s in zip(rows, scores, strict=True) if s < 1]


def test_task_from_a_prepared_file(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_text(
    '{"prompt": "1+1?", "answer": "2", "cluster": "algebra"}\n'
    '{"prompt": "2+2?", "answer": "4", "cluster": "geometry"}\n'
  )
  task = get_task("math", path=str(path), instruction="Q: {prompt}\nA:")
  assert task.name == "math:math.jsonl" and task.cluster_names == ["algebra", "geometry"]
  rows = task.rows("train", 0, 0) + task.rows("eval", 0, 0)
  assert sorted(r["prompt"] for r in rows) == ["1+1?", "2+2?"]
  assert task.format_prompt(rows[0]) == f"Q: {rows[0]['prompt']}\nA:"


def test_bad_options():
  with pytest.raises(ValueError, match=r"task 'math': unknown option\(s\) \['paht'\]"):
    get_task("math", paht="x.jsonl")
  with pytest.raises(ValueError, match="must contain '\\{prompt\\}' once"):
    get_task("math", instruction="\n\nAnswer:")
  with pytest.raises(ValueError, match="eval_fraction"):
    get_task("math", eval_fraction=1.0)
  with pytest.raises(ValueError, match="no such file"):
    get_task("math", path="/nonexistent.jsonl")
  assert INSTRUCTION.count("{prompt}") == 1
