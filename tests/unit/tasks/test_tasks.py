"""Tests for ebpo_jax.tasks: the registry and config options, arithmetic + tokenizer,
reasoning-gym, jsonl, answer extraction."""

import inspect
import json
import pickle

import numpy as np
import pytest

from ebpo_jax import cli, tasks
from ebpo_jax.tasks import extract_final_answer, get_task
from ebpo_jax.tasks.arithmetic import CharTokenizer, score_arithmetic
from ebpo_jax.tasks.base import answers_match, split_of
from ebpo_jax.tasks.tokenizers import ByteTokenizer
from ebpo_jax.trainer import workdir as workdir_lib
from tests.helpers import ROOT

# ------------------------------------------------------------------------------ arithmetic


def test_char_tokenizer_round_trip_and_special_ids():
  tok = CharTokenizer()
  assert tok.vocab_size == 18  # pad, bos, eos + 10 digits + "+-*= "
  assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
  ids = tok.encode("12+345= 6*7-8")
  assert len(ids) == 13 and max(ids) < tok.vocab_size
  assert tok.decode(ids) == "12+345= 6*7-8"
  # decode drops pad and BOS and stops at the first EOS
  assert tok.decode([tok.bos_id, *tok.encode("35"), tok.pad_id, *tok.encode("7")]) == "357"
  assert tok.decode([*tok.encode("35"), tok.eos_id, *tok.encode("9")]) == "35"
  with pytest.raises(ValueError, match="'x' is not in the vocabulary"):
    tok.encode("3x4")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([99])


def test_byte_tokenizer_round_trip():
  tok = ByteTokenizer()
  assert tok.vocab_size == 259
  text = "Calculate 3 × 4 = ?\nAnswer: 12 ✓"
  ids = tok.encode(text)
  assert min(ids) >= 3 and max(ids) < tok.vocab_size
  assert tok.decode([tok.bos_id, *ids, tok.eos_id, *tok.encode("junk")]) == text
  assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte character is replaced
  assert get_task("reasoning_gym:chain_sum", levels=1).tokenizer.vocab_size == 259


def _evaluate(prompt: str) -> int:
  """Independent check of a prompt like '12*34=' with Python's own arithmetic."""
  for symbol, op in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__)):
    if symbol in prompt:
      a, b = prompt.rstrip("=").split(symbol)
      return op(int(a), int(b))
  raise AssertionError(prompt)


def test_arithmetic_rows_are_correct_balanced_and_deterministic():
  task = get_task("arithmetic", ops=("add", "sub", "mul"), digits=(1, 3))
  assert task.cluster_names == ["add_1", "add_3", "sub_1", "sub_3", "mul_1", "mul_3"]
  rows = task.rows("train", 600, seed=0)
  assert len(rows) == 600
  assert np.bincount([r["cluster"] for r in rows]).tolist() == [100] * 6
  for row in rows:
    op, digits = task.cluster_names[row["cluster"]].split("_")
    a, b = row["prompt"].rstrip("=").split({"add": "+", "sub": "-", "mul": "*"}[op])
    assert row["answer"] == str(_evaluate(row["prompt"]))
    assert len(a) == len(b) == int(digits)
    assert int(row["answer"]) >= 0
    d = int(digits)
    assert row["difficulty"] == {"add": d, "sub": d + 0.5, "mul": 2 * d}[op]
  assert task.rows("train", 600, seed=0) == rows
  assert task.rows("train", 600, seed=1) != rows


def test_train_and_eval_prompts_are_disjoint():
  task = get_task("arithmetic", digits=(1, 2))
  train = {r["prompt"] for r in task.rows("train", 4000, seed=0)}
  evals = {r["prompt"] for r in task.rows("eval", 400, seed=5)}
  assert train and evals and not train & evals
  # add_1 has only 100 problems: about eval_fraction = 20% of them are held out.
  one_digit = {f"{a}+{b}=" for a in range(10) for b in range(10)}
  assert 10 <= len(one_digit & evals) <= 30
  assert all(split_of(p, 0.2) == "eval" for p in evals)


def test_arithmetic_score_and_target():
  row = {"prompt": "12+345=", "answer": "357"}
  assert score_arithmetic("357", row) == 1.0
  assert score_arithmetic(" 357 \n12+3", row) == 1.0  # only the first line counts
  assert score_arithmetic("3570", row) == 0.0
  assert score_arithmetic("35", row) == 0.0
  assert score_arithmetic("", row) == 0.0
  tok = CharTokenizer()
  assert tok.decode(tok.encode("12+345=")) == "12+345="
  task = get_task("arithmetic")
  assert task.format_prompt(row) == "12+345=" and task.format_target(row) == "357"
  assert pickle.loads(pickle.dumps(task.score)) is score_arithmetic


def test_get_task_errors():
  with pytest.raises(ValueError, match="unknown task 'sudoku'; known: arithmetic, reasoning_gym"):
    get_task("sudoku")
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['digit'\]; options: ops, digits"):
    get_task("arithmetic", digit=(1,))
  with pytest.raises(ValueError, match="'div_2' must be <op>_<digits>"):
    get_task("arithmetic", clusters=("add_1", "div_2"))
  with pytest.raises(ValueError, match="split must be one of"):
    get_task("arithmetic").rows("test", 4, 0)


# ------------------------------------------------------------------------------ answers


@pytest.mark.parametrize(
  "response, expected",
  [
    ("Let me think.\n<answer>42</answer>\nAnswer: 7", "42"),
    ("<answer>1</answer> then <answer> 2 </answer>", "2"),
    ("Work...\nAnswer: 17\nso the Answer: -3.", "-3"),
    ("Answer:\n1 2\n3 4\n", "1 2\n3 4"),  # answers may span lines
    ("The answer is: 12", "12"),
    ("so $x = \\boxed{\\frac{1}{2}}$ done", "\\frac{1}{2}"),
    ("step one\nstep two\n  **19**  \n\n", "19"),
    ("Answer: The cat sat.", "The cat sat."),  # only a number loses its final period
    ("Answer: 3.25.", "3.25"),
    ("", ""),
  ],
)
def test_extract_final_answer(response, expected):
  assert extract_final_answer(response) == expected


def test_answers_match():
  assert answers_match("1,000", "1000")
  assert answers_match("3.0", "3")
  assert answers_match("  Paris. ", "paris")
  assert not answers_match("3.01", "3")
  assert answers_match("nan", "NaN")  # equal strings after normalisation
  assert not answers_match("12", "21")


# ------------------------------------------------------------------------------ reasoning-gym


@pytest.fixture(scope="module")
def chain_sum():
  return get_task("reasoning_gym:chain_sum")


def test_reasoning_gym_levels_as_clusters(chain_sum):
  assert chain_sum.cluster_names == ["chain_sum_L0", "chain_sum_L1", "chain_sum_L2"]
  rows = chain_sum.rows("train", 30, seed=0)
  assert np.bincount([r["cluster"] for r in rows]).tolist() == [10, 10, 10]
  for row in rows:
    json.dumps(row)  # JSON-serialisable, meta included
    level = row["cluster"]
    assert row["difficulty"] == level
    # Level L of the curriculum: L+2 terms of L+1 digits each.
    terms = row["meta"]["entry"]["metadata"]["expression"].split()[::2]
    assert len(terms) == level + 2 and {len(t) for t in terms} == {level + 1}
    assert row["prompt"] in chain_sum.format_prompt(row)
  assert chain_sum.rows("train", 30, seed=0) == rows


def test_reasoning_gym_scores_with_the_datasets_scorer(chain_sum):
  row = chain_sum.rows("eval", 1, seed=3)[0]
  gold = row["answer"]
  wrong = str(int(gold) + 1)
  row = pickle.loads(pickle.dumps(row))  # as a worker process receives it
  assert chain_sum.score(f"I add them up.\nAnswer: {gold}", row) == 1.0
  assert chain_sum.score(f"<answer>{gold}</answer>", row) == 1.0
  assert chain_sum.score(f"Answer: {wrong}", row) == 0.0
  assert chain_sum.score(chain_sum.format_target(row), row) == 1.0


def test_reasoning_gym_train_eval_disjoint(chain_sum):
  train = {r["prompt"] for r in chain_sum.rows("train", 300, seed=0)}
  evals = {r["prompt"] for r in chain_sum.rows("eval", 60, seed=0)}
  assert not train & evals


def test_reasoning_gym_several_datasets_as_clusters():
  task = get_task(
    "reasoning_gym:chain_sum+basic_arithmetic", dataset_cfg={"chain_sum": {"max_terms": 2}}
  )
  assert task.cluster_names == ["chain_sum", "basic_arithmetic"]
  rows = task.rows("train", 8, seed=0)
  assert [r["meta"]["dataset"] for r in rows] == ["chain_sum", "basic_arithmetic"] * 4
  for row in rows:
    assert task.score(f"Answer: {row['answer']}", row) == 1.0
    if row["cluster"] == 0:
      assert len(row["meta"]["entry"]["metadata"]["expression"].split()) == 3  # "a + b"


def test_reasoning_gym_bad_names():
  with pytest.raises(ValueError, match="unknown reasoning_gym dataset.*'chain_summ'.*chain_sum"):
    get_task("reasoning_gym:chain_summ")
  with pytest.raises(ValueError, match="arc_agi' is not supported: its gold answer scores 1.0"):
    get_task("reasoning_gym:arc_agi", levels=1)


# ------------------------------------------------------------------------------ jsonl


def test_jsonl_task(tmp_path):
  path = tmp_path / "qa.jsonl"
  lines = [{"prompt": f"What is {i} times 1000?", "answer": f"{i * 1000}"} for i in range(200)]
  path.write_text("\n".join(json.dumps(x) for x in lines))
  task = get_task("jsonl", path=str(path), eval_fraction=0.25)
  train, evals = task.rows("train", 0, seed=0), task.rows("eval", 0, seed=0)
  assert len(train) + len(evals) == 200 and 25 <= len(evals) <= 75
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
  assert len(task.rows("train", 10, seed=1)) == 10
  assert task.cluster_names == ["0"]
  row = train[0]
  number = int(row["answer"])
  assert task.score(f"Thinking...\nAnswer: {number:,}", row) == 1.0
  assert task.score(f"Answer: {number + 1}", row) == 0.0
  with pytest.raises(ValueError, match="task 'jsonl' has no rows: set config.data.path"):
    get_task("jsonl", path="").rows("train", 0, seed=0)


def test_jsonl_task_eval_file_clusters_follow_the_training_file(tmp_path):
  train, evals, bad = tmp_path / "train.jsonl", tmp_path / "eval.jsonl", tmp_path / "bad.jsonl"
  row = {"prompt": "q", "answer": "a"}
  train.write_text("\n".join(json.dumps({**row, "cluster": c}) for c in ("alg", "geo")))
  evals.write_text(json.dumps({**row, "cluster": "geo"}))  # "geo" is cluster 0 in this file
  bad.write_text(json.dumps({**row, "cluster": "topology"}))
  task = get_task("jsonl", path=str(train), eval_path=str(evals))
  assert task.cluster_names == ["alg", "geo"]
  assert [r["cluster"] for r in task.rows("eval", 0, seed=0)] == [1]
  assert len(task.rows("train", 0, seed=0)) == 2
  with pytest.raises(ValueError, match=r"clusters \['topology'\] are not among"):
    get_task("jsonl", path=str(train), eval_path=str(bad))


# ------------------------------------------------------------------------------ registry, options


def test_the_registry_names_every_task_class():
  for key, path in tasks.TASKS.items():
    cls = tasks.load_object(path)
    assert issubclass(cls, tasks.Task), key
  with pytest.raises(ValueError, match="task 'reasoning_gym' is named reasoning_gym:<datasets>"):
    get_task("reasoning_gym")
  with pytest.raises(ValueError, match="task 'arithmetic' takes no ':' part"):
    get_task("arithmetic:add")


def test_common_declares_every_option_of_every_task():
  # Each constructor keyword of each registered task is a key of config.task.options (so it is
  # settable from the command line), and each key there is some task's keyword.
  common = cli.load_module(ROOT / "configs" / "common.py").get_config()
  declared = set(common.task.options)
  taken = set()
  for path in tasks.TASKS.values():
    cls = tasks.load_object(path)
    parameters = list(inspect.signature(cls.__init__).parameters)[1:]
    taken |= {p for p in parameters if p != cls.name_arg and p not in tasks.FROM_DATA}
  assert declared == taken


def test_task_name_and_options_from_the_command_line(tmp_path):
  path = tmp_path / "qa.jsonl"
  path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(40)))
  args = ["--config.task.name=jsonl", f"--config.task.options.path={path}"]
  config = workdir_lib.resolved_config(f"{ROOT}/configs/arith_ebpo.py:runlocal", args)
  task = tasks.from_config(config.task)  # the arithmetic options (ops, digits) are not jsonl's
  assert task.name == "jsonl:qa.jsonl"
  assert len(task.rows("train", 0, seed=0)) + len(task.rows("eval", 0, seed=0)) == 40
  assert len(task.rows("eval", 0, seed=0)) < 12  # eval_fraction 0.1, jsonl's default
  args += ["--config.task.options.eval_fraction=0.5", "--config.task.options.instruction=!"]
  config = workdir_lib.resolved_config(f"{ROOT}/configs/arith_ebpo.py:runlocal", args)
  task = tasks.from_config(config.task)
  assert task.format_prompt({"prompt": "q"}) == "q!" and len(task.rows("eval", 0, seed=0)) > 12
  # Options of any type: a dict of dicts (Python literal), an int.
  args = ["--config.task.name=reasoning_gym:chain_sum", "--config.task.options.levels=1"]
  args += ["--config.task.options.dataset_cfg={'chain_sum': {'min_terms': 3, 'max_terms': 3}}"]
  config = workdir_lib.resolved_config(f"{ROOT}/configs/arith_ebpo.py:runlocal", args)
  task = tasks.from_config(config.task)
  assert task.cluster_names == ["chain_sum"]
  row = task.rows("train", 1, seed=0)[0]
  assert len(row["meta"]["entry"]["metadata"]["expression"].split()) == 5  # "a + b + c"
  # An option set to None is the task's own default; the arithmetic config's own options hold.
  arith = workdir_lib.resolved_config(f"{ROOT}/configs/arith_ebpo.py:runlocal", [])
  assert tasks.from_config(arith.task).cluster_names == ["add_1", "add_2"]
