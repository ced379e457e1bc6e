"""Chat-format rows (TRL's conversational data sets): a `messages` column, a list of {role, content}
up to the last user turn, rendered with the model's chat template; read by the trainer
(`data.prompt_column=messages`) and by `prepare --source=generic`, bad ones refused in one line."""

import json

import datasets
import pytest
import transformers

from ebpo_jax import data
from ebpo_jax.data import prepare
from ebpo_jax.rollouts import prompts
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import task_rows
from tests.helpers.configs import arith_config

datasets.disable_progress_bars()

CHATS = [
  [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "5"},  # after the last user turn: not part of the prompt
  ],
  [
    {"role": "user", "content": "Add 1 and 1."},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2 and 2?"},
  ],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("chat") / "chat"
  columns = {"messages": CHATS * 4, "answer": ["5", "4"] * 4, "topic": ["a", "b"] * 4}
  datasets.Dataset.from_dict(columns).save_to_disk(str(path))
  return str(path)


def test_rows_keep_the_messages_up_to_the_last_user_turn(chat_dir):
  rows, _, _ = data.load_checked_rows(chat_dir, columns=data.Columns(prompt="messages"))
  assert [r["prompt"] for r in rows[:2]] == ["What is 2 plus 3?", "And 2 and 2?"]
  assert rows[0]["messages"] == CHATS[0][:2] and rows[1]["messages"] == CHATS[1]


def test_the_prompt_is_the_models_chat_template_of_the_messages(
  chat_dir, tiny_llama_dir, monkeypatch
):
  overrides = {
    "model.path": str(tiny_llama_dir),
    "task.name": "jsonl",
    "data.path": chat_dir,
    "data.prompt_column": "messages",
    "data.cluster_column": "topic",
    "eval.path": chat_dir,
  }
  config = arith_config(overrides)
  config_lib.check_config(config, num_devices=8)
  loads = []
  load = tokenizers.HFTokenizer.__init__
  monkeypatch.setattr(
    tokenizers.HFTokenizer, "__init__", lambda *a, **k: loads.append(1) or load(*a, **k)
  )
  inputs = task_rows.load_task_and_rows(config)
  # The model directory's tokenizer, loaded once: the rows were checked with the one the run gets.
  assert len(loads) == 1 and isinstance(inputs.tokenizer, tokenizers.HFTokenizer)
  encoder = prompts.PromptEncoder.from_config(config, inputs.task, inputs.tokenizer)
  reference = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)  # independent rendering
  for row, chat in zip(inputs.rows[:2], CHATS, strict=True):
    upto = chat[:2] if chat[-1]["role"] == "assistant" else chat
    want = reference.apply_chat_template(upto, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert encoder.prompt_ids(row) == list(want)


def test_prepare_generic_keeps_the_messages(chat_dir, tmp_path):
  out = tmp_path / "chat.jsonl"
  prepare.prepare("generic", chat_dir, str(out), columns=data.Columns(prompt="messages"))
  prepared = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["messages"] for r in prepared] == [CHATS[0][:2], CHATS[1]]  # unique prompts
  rows, _, _ = data.load_checked_rows(out)  # the prepared file reads back with its messages
  assert [r["messages"] for r in rows] == [CHATS[0][:2], CHATS[1]]


@pytest.mark.parametrize(
  "messages, problem",
  [
    ([{"role": "assistant", "content": "hi"}], "no 'user' turn"),
    ([{"role": "user"}], "message 1 must be {role, content} strings"),
    (5, "must be a non-empty string or a list of {role, content} messages, got int 5"),
  ],
)
def test_a_bad_chat_row_is_one_line_naming_it(tmp_path, messages, problem):
  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps({"messages": messages, "answer": "1"}) + "\n")
  with pytest.raises(data.DataError) as error:
    data.load_checked_rows(path, columns=data.Columns(prompt="messages"))
  assert str(error.value).startswith(f"{path}:1: ") and problem in str(error.value)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("chat_template", [True, False], ids=["template", "no_template"])
def test_a_task_instruction_follows_the_last_user_turn(chat_dir, tiny_llama_dir, chat_template):
  # The task's instruction goes after the last user turn's text (not after the whole chat), with
  # the model's chat template; without one (`model.chat_template=False`, or a base model's
  # tokenizer that has none) the prompt is BOS + the chat's contents, one per line.
  instruction = " Answer with a number."
  overrides = {
    "model.path": str(tiny_llama_dir),
    "model.chat_template": chat_template,
    "task.name": "jsonl",
    "task.options.instruction": instruction,
    "data.path": chat_dir,
    "data.prompt_column": "messages",
    "data.cluster_column": "topic",
    "eval.path": chat_dir,
  }
  config = arith_config(overrides)
  inputs = task_rows.load_task_and_rows(config)
  encoder = prompts.PromptEncoder.from_config(config, inputs.task, inputs.tokenizer)
  reference = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
  for row, chat in zip(inputs.rows[:2], CHATS, strict=True):
    upto = [dict(m) for m in (chat[:2] if chat[-1]["role"] == "assistant" else chat)]
    upto[-1]["content"] += instruction
    if chat_template:
      want = reference.apply_chat_template(upto, add_generation_prompt=True, tokenize=True)
      want = list(want["input_ids"] if hasattr(want, "keys") else want)
    else:
      text = "\n".join(m["content"] for m in upto)
      bos = [] if reference.bos_token_id is None else [reference.bos_token_id]
      want = bos + reference.encode(text, add_special_tokens=False)
    assert encoder.prompt_ids(row) == want
    assert reference.decode(want).count(instruction) == 1
