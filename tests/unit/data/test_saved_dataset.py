"""Directories that Hugging Face `datasets` wrote with `save_to_disk`, read without `datasets`:
rows by column names (`data.*_column`, `data.answer_regex`), a DatasetDict's split (`data.split`),
`prepare --source=generic` on a GSM8K-shaped data set, bad input in one line, and a gs:// copy.
Every fixture is written by `datasets` itself; `ebpo_jax` reads it with pyarrow."""

import json
import subprocess
import sys

import datasets
import pytest

from ebpo_jax import errors, files
from ebpo_jax.data import (
  Columns,
  DataError,
  load_checked_rows,
  load_rows_and_clusters,
  prepare,
  saved_dataset,
)
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import task_rows
from tests.helpers.configs import arith_config

datasets.disable_progress_bars()

GSM8K_REGEX = r"####\s*(.+)"
GSM8K = Columns(prompt="question", answer_regex=GSM8K_REGEX)
# GSM8K's layout: the answer column holds the worked solution, its last line "#### <answer>".
TRAIN = {
  "question": [
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "A book costs $12. How much do 3 books cost?",
    "Sara reads 5 pages a day. How many pages does she read in a week?",
  ],
  "answer": [
    "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    "3 books cost 3 * 12 = <<3*12=36>>36 dollars.\n#### 36",
    "A week has 7 days, so 5 * 7 = <<5*7=35>>35 pages.\n#### 35",
  ],
}
TEST = {"question": ["What is 2 more than 40?"], "answer": ["40 + 2 = 42\n#### 42"]}


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> str:
  """A GSM8K-shaped DatasetDict (train in two Arrow files, test in one), as save_to_disk writes."""
  path = tmp_path_factory.mktemp("gsm8k") / "gsm8k"
  splits = datasets.DatasetDict(
    {"train": datasets.Dataset.from_dict(TRAIN), "test": datasets.Dataset.from_dict(TEST)}
  )
  splits.save_to_disk(str(path), num_shards={"train": 2, "test": 1})
  return str(path)


def _save(path, columns: dict, **kwargs) -> str:
  datasets.Dataset.from_dict(columns).save_to_disk(str(path), **kwargs)
  return str(path)


# ----------------------------------------------------------------------------- reading rows


def test_reads_a_dataset_dict_as_datasets_does(gsm8k_dir):
  rows, names, problems = load_checked_rows(gsm8k_dir, columns=GSM8K)
  reference = datasets.load_from_disk(gsm8k_dir)["train"]  # datasets' own reading of the folder
  assert [row["prompt"] for row in rows] == reference["question"]
  # The answer is the regex's group after "####"; the question column is renamed to prompt.
  assert [row["answer"] for row in rows] == ["7", "36", "35"]
  assert set(rows[0]) == {"prompt", "answer", "cluster", "difficulty"}
  assert names == ["0"] and problems == [] and {row["cluster"] for row in rows} == {0}
  # data.split picks another split; a split's own folder is a Dataset directory.
  test_rows, _, _ = load_checked_rows(gsm8k_dir, columns=GSM8K, split="test")
  folder_rows, _, _ = load_checked_rows(files.join(gsm8k_dir, "test"), columns=GSM8K, split=None)
  assert [r["answer"] for r in test_rows] == [r["answer"] for r in folder_rows] == ["42"]
  # Without answer_regex the column is taken as it is.
  raw, _, _ = load_checked_rows(gsm8k_dir, columns=Columns(prompt="question"))
  assert [row["answer"] for row in raw] == TRAIN["answer"]


def test_a_dataset_with_a_cluster_column_and_extra_columns(tmp_path):
  path = _save(
    tmp_path / "topics",
    {
      "problem": ["1+1=", "2*3=", "4+4=", "5*5="],
      "solution": ["2", "6", "8", "25"],
      "topic": ["add", "mul", "add", "mul"],
      "level": [1, 2, 1, 3],
    },
    num_shards=3,
  )
  columns = Columns(prompt="problem", answer="solution", cluster="topic")
  rows, names, _ = load_checked_rows(path, columns=columns)
  assert names == ["add", "mul"]
  assert [(r["prompt"], r["answer"], r["cluster"], r["level"]) for r in rows] == [
    ("1+1=", "2", 0, 1),
    ("2*3=", "6", 1, 2),
    ("4+4=", "8", 0, 1),
    ("5*5=", "25", 1, 3),
  ]
  assert all("topic" not in r and "problem" not in r for r in rows)


def test_default_columns_read_a_dataset_of_project_rows(tmp_path):
  """A data set already in the project's layout needs no column keys (the defaults)."""
  path = _save(tmp_path / "rows", {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
  rows, names = load_rows_and_clusters(path)
  assert [(r["prompt"], r["answer"], r["cluster"]) for r in rows] == [
    ("1+1=", "2", 0),
    ("2+2=", "4", 0),
  ]


# ----------------------------------------------------------------------------- bad input


def test_a_missing_split_names_the_splits_and_the_key(gsm8k_dir):
  with pytest.raises(DataError) as error:
    load_checked_rows(gsm8k_dir, columns=GSM8K, split="validation")
  assert str(error.value) == (
    f"{gsm8k_dir}: no split 'validation' in this DatasetDict (splits: train, test); "
    "choose one with data.split"
  )
  with pytest.raises(DataError, match=f"^{gsm8k_dir}: a DatasetDict .* e.g. {gsm8k_dir}/train$"):
    load_checked_rows(gsm8k_dir, columns=GSM8K, split=None)


def test_bad_rows_name_the_arrow_file_and_row(tmp_path):
  path = _save(
    tmp_path / "bad",
    {"question": ["ok?", "", "fine?", "no answer?"], "answer": ["#### 1", "#### 2", "3", "#### "]},
  )
  arrow = f"{path}/data-00000-of-00001.arrow"
  with pytest.raises(DataError) as error:
    load_checked_rows(path, columns=GSM8K)
  assert str(error.value).splitlines() == [
    f"{arrow}:2: 'question' must be a non-empty string, got str ''",
    f"{arrow}:3: no match of answer_regex '####\\\\s*(.+)' in the answer '3'",
    f"{arrow}:4: answer_regex '####\\\\s*(.+)' matches an empty answer in '#### '",
  ]
  # A misnamed column lists the columns there are; an int answer is named with its row.
  with pytest.raises(
    DataError, match=rf"^{arrow}:1: missing 'prompt' \(columns: answer, question\)"
  ):
    load_checked_rows(path)
  bad_regex = Columns(prompt="question", answer_regex="(#")
  with pytest.raises(DataError, match=r"^answer_regex '\(#' is not a regular expression [^\n]*$"):
    load_checked_rows(path, columns=bad_regex)
  numbers = _save(tmp_path / "ints", {"prompt": ["1+1="], "answer": [2]})
  with pytest.raises(DataError, match=r"data-00000-of-00001.arrow:1: 'answer' must be a string"):
    load_checked_rows(numbers)


def test_empty_unreadable_and_foreign_directories_are_one_line(tmp_path):
  empty = _save(tmp_path / "empty", {"prompt": [], "answer": []})
  with pytest.raises(DataError, match=f"^{empty}: no rows$"):
    load_checked_rows(empty)
  broken = _save(tmp_path / "broken", {"prompt": ["1+1="], "answer": ["2"]})
  arrow = f"{broken}/data-00000-of-00001.arrow"
  with open(arrow, "r+b") as f:
    f.truncate(100)
  with pytest.raises(DataError, match=f"^{arrow}: unreadable Arrow file"):
    load_checked_rows(broken)
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
  with pytest.raises(DataError, match=f"^{foreign}: a directory, but not one that datasets'"):
    load_checked_rows(foreign)
  state = tmp_path / "no_files"
  state.mkdir()
  (state / "state.json").write_text(json.dumps({"_data_files": [{"filename": "gone.arrow"}]}))
  with pytest.raises(DataError, match=f"^{state}/gone.arrow: no such file .listed in"):
    load_checked_rows(state)
  assert saved_dataset.is_saved_dataset(state) and not saved_dataset.is_saved_dataset(foreign)


# ----------------------------------------------------------------------------- prepare


def test_prepare_generic_gsm8k_round_trip(gsm8k_dir, tmp_path):
  out = tmp_path / "gsm8k.jsonl"
  summary = prepare.prepare("generic", gsm8k_dir, str(out), columns=GSM8K)
  assert summary == f"generic: 3 rows, 1 clusters, 0 dropped -> {out}"
  rows, names = load_rows_and_clusters(out)
  assert [(r["prompt"], r["answer"]) for r in rows] == list(
    zip(TRAIN["question"], ["7", "36", "35"], strict=True)
  )
  assert names == ["generic"] and [r["id"] for r in rows] == ["generic-0", "generic-1", "generic-2"]
  # The command line, on the test split; column flags are for --source=generic only.
  test_out = tmp_path / "gsm8k_test.jsonl"
  result = _run_cli(
    "--source=generic",
    f"--path={gsm8k_dir}",
    f"--out={test_out}",
    "--split=test",
    "--prompt_column=question",
    "--answer_column=answer",
    f"--answer_regex={GSM8K_REGEX}",
  )
  assert result.returncode == 0, result.stderr
  assert [json.loads(line)["answer"] for line in test_out.read_text().splitlines()] == ["42"]
  result = _run_cli("--source=math500", f"--path={gsm8k_dir}", f"--out={out}", "--split=bad")
  assert result.stderr.strip() == (
    f"error: {gsm8k_dir}: no split 'bad' in this DatasetDict (splits: train, test); "
    "choose one with --split"
  )
  result = _run_cli("--source=aime24", f"--path={gsm8k_dir}", f"--out={out}", "--prompt_column=q")
  assert "are for --source=generic" in result.stderr and result.returncode != 0


def test_prepare_reads_a_saved_copy_of_a_math_source(tmp_path):
  path = _save(tmp_path / "aime24", {"Problem": ["Find x."], "Answer": [5]})
  assert [(r["prompt"], r["answer"]) for r in prepare.read_source("aime24", path)] == [
    ("Find x.", "5")
  ]


def _run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "ebpo_jax.data.prepare", *args], capture_output=True, text=True
  )


# ----------------------------------------------------------------------------- the trainer's keys


def test_the_trainer_reads_data_path_by_its_column_keys(tmp_path):
  path = tmp_path / "arith"
  datasets.DatasetDict(
    {
      "train": datasets.Dataset.from_dict(
        {"question": ["1+1=", "2+3="], "answer": ["1+1 is 2\n#### 2", "#### 5"], "kind": ["a", "b"]}
      ),
      "test": datasets.Dataset.from_dict({"question": ["4+4="], "answer": ["#### 8"]}),
    }
  ).save_to_disk(str(path))
  keys = {
    "data.path": str(path),
    "data.prompt_column": "question",
    "data.cluster_column": "kind",
    "data.answer_regex": GSM8K_REGEX,
    "eval.path": str(path / "test"),  # too few rows to hold some out of training
  }
  config = arith_config(keys)
  config_lib.check_config(config, num_devices=8)
  inputs = task_rows.load_task_and_rows(config)
  rows, names = inputs.rows, inputs.cluster_names
  assert [(r["prompt"], r["answer"], r["cluster"]) for r in rows] == [
    ("1+1=", "2", 0),
    ("2+3=", "5", 1),
  ]
  assert names == ["a", "b"]
  rows = task_rows.load_task_and_rows(arith_config({**keys, "data.split": "test"})).rows
  assert [r["answer"] for r in rows] == ["8"]


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"data.prompt_column": ""}, "config.data.prompt_column='': must be a name"),
    ({"data.split": ""}, "config.data.split='': must be a name"),
    ({"data.answer_regex": "(#"}, "config.data.answer_regex='(#': not a regular expression"),
  ],
)
def test_bad_data_keys_are_one_line(overrides, message):
  with pytest.raises(errors.ConfigError) as error:
    config_lib.check_config(arith_config(overrides), num_devices=8)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_evaluate_reads_one_split_folder(gsm8k_dir):
  from ebpo_jax import tasks

  config = arith_config({"eval.path": gsm8k_dir})
  task = tasks.from_config(config.task)
  tokenizer = task_rows.load_tokenizer(config, task)
  with pytest.raises(DataError, match=f"a DatasetDict .* e.g. {gsm8k_dir}/train$"):
    task_rows.eval_rows(config, task, task_rows.row_check(config, task, tokenizer))


# ----------------------------------------------------------------------------- gs://


def test_a_dataset_dict_on_the_bucket_reads_as_on_disk(gsm8k_dir, gcs_dir):
  for relative in files.walk_files(gsm8k_dir):
    files.copy_file(files.join(gsm8k_dir, relative), files.join(gcs_dir, "gsm8k", relative))
  remote = files.join(gcs_dir, "gsm8k")
  for split in ("train", "test"):
    got, names, _ = load_checked_rows(remote, columns=GSM8K, split=split)
    want, want_names, _ = load_checked_rows(gsm8k_dir, columns=GSM8K, split=split)
    assert got == want and names == want_names
  with pytest.raises(DataError, match=f"^{remote}/train/data-00000-of-00002.arrow:1: missing"):
    load_checked_rows(remote)
