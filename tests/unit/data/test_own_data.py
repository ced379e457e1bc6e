"""A user's own rows (`data.path`, `eval.path`) with every task kind the docs name: text prompts on
a tiny byte-level model (task `jsonl`, reading `data.*_column` and `data.answer_regex`), the
arithmetic and reasoning-gym tasks' refusals in one line, and an in-training evaluation that
measures the rows it names, labelled by their own clusters."""

import datasets
import pytest

from ebpo_jax import data, tasks
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import task_rows
from tests.helpers.configs import arith_config
from tests.helpers.own_data import COLUMNS, own_rows, save_own_dataset


@pytest.fixture(scope="module")
def own_dir(tmp_path_factory) -> str:
  return save_own_dataset(tmp_path_factory.mktemp("own") / "own")


def _config(overrides: dict):
  config = arith_config({**COLUMNS, **overrides})
  config_lib.check_config(config, num_devices=8)
  return config


def test_jsonl_task_trains_on_text_prompts_of_data_path(own_dir):
  inputs = task_rows.load_task_and_rows(_config({"task.name": "jsonl", "data.path": own_dir}))
  assert isinstance(inputs.task.tokenizer, tokenizers.ByteTokenizer)  # any text: UTF-8 bytes
  file_rows = own_rows(48)
  answers = dict(zip(file_rows["question"], file_rows["answer"], strict=True))
  assert inputs.rows and all(r["prompt"] in answers for r in inputs.rows)
  assert all(answers[r["prompt"]].endswith(f"#### {r['answer']}") for r in inputs.rows)
  assert inputs.cluster_names == ["small", "large"]


def test_jsonl_task_reads_its_own_path_by_the_data_columns(own_dir):
  config = _config({"task.name": "jsonl", "task.options.path": own_dir})
  task = task_rows.load_task(config)
  rows = task.rows("train", 0, seed=0) + task.rows("eval", 0, seed=0)
  assert sorted(r["prompt"] for r in rows) == sorted(own_rows(48)["question"])
  assert task.cluster_names == ["small", "large"]


def test_jsonl_task_without_rows_says_where_to_put_them():
  with pytest.raises(data.DataError, match=r"^task 'jsonl' has no rows: set config.data.path"):
    task_rows.load_task_and_rows(_config({"task.name": "jsonl"}))


def test_arithmetic_refuses_text_prompts_naming_the_task_that_takes_them(own_dir):
  with pytest.raises(data.DataError) as error:
    task_rows.load_task_and_rows(_config({"data.path": own_dir}))
  first = str(error.value).splitlines()[0]
  assert "not in the vocabulary" in first and "--config.task.name=jsonl" in first


def test_reasoning_gym_refuses_rows_it_cannot_score_before_anything_runs(own_dir):
  """Its scorer needs the generated entry (`meta`): rows without it failed every reward call."""
  config = _config({"task.name": "reasoning_gym:chain_sum", "data.path": own_dir})
  config.task.options.levels = 1
  with pytest.raises(data.DataError) as error:
    task_rows.load_task_and_rows(config)
  first = str(error.value).splitlines()[0]
  assert first.startswith(f"{own_dir}/train/") and "no 'meta'" in first and "jsonl" in first


# ----------------------------------------------------------------------------- evaluation rows


def test_evaluation_holds_out_rows_of_data_path_labelled_by_its_clusters(own_dir):
  """Before: the arithmetic task's own eval rows, labelled with the file's cluster names."""
  overrides = {"data.path": own_dir, "data.eval_fraction": 0.25, "task.num_eval": 48}
  inputs = task_rows.load_task_and_rows(_config({"task.name": "jsonl", **overrides}))
  prompts = set(own_rows(48)["question"])
  train, held_out = {r["prompt"] for r in inputs.rows}, {r["prompt"] for r in inputs.eval_rows}
  assert held_out and held_out <= prompts and not held_out & train
  assert train | held_out == prompts
  assert inputs.eval_cluster_names == ["small", "large"]
  names = [inputs.eval_cluster_names[r["cluster"]] for r in inputs.eval_rows]
  assert names == ["small" if int(r["answer"]) < 10 else "large" for r in inputs.eval_rows]


def test_evaluation_reads_eval_path_by_its_own_clusters(own_dir, tmp_path):
  eval_dir = tmp_path / "eval"
  data_ = own_rows(6, offset=3)
  data_["topic"] = ["word" if i % 2 else "number" for i in range(6)]  # not the training clusters
  datasets.Dataset.from_dict(data_).save_to_disk(str(eval_dir))
  config = _config(
    {"task.name": "jsonl", "data.path": own_dir, "eval.path": str(eval_dir), "task.num_eval": 2}
  )
  inputs = task_rows.load_task_and_rows(config)
  assert inputs.eval_cluster_names == ["number", "word"]
  assert len(inputs.rows) == 48  # nothing held out of the training rows
  assert {r["prompt"] for r in inputs.eval_rows} <= set(data_["question"])
  assert sorted(r["cluster"] for r in inputs.eval_rows) == [0, 0, 1, 1]  # task.num_eval each


def test_evaluation_without_files_is_the_tasks_own_split():
  inputs = task_rows.load_task_and_rows(_config({}))
  assert inputs.eval_cluster_names == inputs.task.cluster_names == ["add_1", "add_2"]
  assert len(inputs.eval_rows) == 2 * 8


def test_a_held_out_split_too_small_to_evaluate_is_one_line(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  with pytest.raises(data.DataError, match=r"held-out rows .*data.eval_fraction.*eval.path"):
    task_rows.load_task_and_rows(arith_config({"data.path": str(path)}))


def test_task_rows_and_the_evaluate_tool_read_one_eval_source(own_dir):
  config = _config({"task.name": "jsonl", "data.path": own_dir})
  task = task_rows.load_task(config)
  tokenizer = task_rows.load_tokenizer(config, task)
  rows, names, origin = task_rows.eval_rows(
    config, task, task_rows.row_check(config, task, tokenizer)
  )
  assert names == ["small", "large"] and "held out" in origin
  assert isinstance(tasks.get_task("jsonl").tokenizer, tokenizers.ByteTokenizer)
