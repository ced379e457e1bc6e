"""SmolLM2-135M-Instruct (the packaged model) in the trainer: its chat template and tokenizer, and
`configs/smollm2_135m_cpu.py:runlocal` (the laptop run's config: LoRA, reasoning-gym's datasets
at set difficulties, the held-out avg@k) for 1 RL step on a CPU and its evaluation, as
docs/models.md documents them."""

import json
import os
import shutil

import pytest
import transformers

from ebpo_jax import models
from ebpo_jax.envs import tool_schema
from ebpo_jax.envs.tools import calc
from ebpo_jax.tasks import tokenizers, tool_calls
from tests.helpers.processes import run_python


@pytest.fixture(scope="module")
def model_dir() -> str:
  return models.resolve_model_path("packaged:smollm2-135m-instruct")


def test_packaged_path_resolves_and_unknown_names_fail(model_dir):
  assert os.path.isfile(os.path.join(model_dir, "config.json"))
  assert models.resolve_model_path("/some/dir") == "/some/dir"
  with pytest.raises(ValueError, match="unknown packaged model 'nope'"):
    models.resolve_model_path("packaged:nope")


def test_the_tokenizer_is_autotokenizers_one_loaded_without_torch(model_dir, tmp_path):
  # A tokenizer_config.json naming transformers' generic fast class (the packaged model's, Llama
  # 3's) loads by that class: AutoTokenizer would read the model's config and import torch with it
  # (about 3 s of every trainer process's start). Another class goes through AutoTokenizer.
  code = (
    "import sys; from ebpo_jax.tasks import tokenizers; "
    f"tok = tokenizers.HFTokenizer({model_dir!r}); "
    "print(type(tok.hf_tokenizer).__name__, 'torch' in sys.modules)"
  )
  result = run_python(["-c", code])
  assert result.stdout.split() == ["TokenizersBackend", "False"], result.stderr[-2000:]
  auto = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
  tok = tokenizers.HFTokenizer(model_dir)
  assert type(tok.hf_tokenizer) is type(auto)
  text = "What is 12*34? <tool_call>{}</tool_call> é"
  assert tok.encode(text) == auto.encode(text, add_special_tokens=False)
  messages = [{"role": "user", "content": text}]
  rendered = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  assert tok.prompt_ids(text) == list(rendered["input_ids"])
  other = tmp_path / "gpt2_class"
  shutil.copytree(model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
  config = json.loads((other / "tokenizer_config.json").read_text())
  (other / "tokenizer_config.json").write_text(
    json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"})
  )
  assert type(tokenizers.HFTokenizer(str(other)).hf_tokenizer) is transformers.GPT2Tokenizer


def test_prompts_follow_the_chat_template(model_dir):
  tok = tokenizers.HFTokenizer(model_dir)
  hf = tok.hf_tokenizer
  messages = [{"role": "user", "content": "What is 2+3?"}]
  want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert hf.decode(tok.prompt_ids("What is 2+3?")) == want
  assert want.endswith("<|im_start|>assistant\n")
  with_system = hf.decode(tok.prompt_ids("Q", system_prompt="Be brief."))
  assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")
  plain = tokenizers.HFTokenizer(model_dir, chat_template=False)
  assert plain.prompt_ids("hi") == [plain.bos_id, *plain.encode("hi")]


def test_decode_stops_at_the_end_of_turn(model_dir):
  tok = tokenizers.HFTokenizer(model_dir)
  assert tok.eos_id in tok.stop_ids and tok.pad_id == tok.eos_id
  ids = tok.encode("Answer: 5") + [tok.eos_id] + tok.encode(" trailing")
  assert tok.decode(ids) == "Answer: 5"


def test_a_tool_message_continues_the_transcript_as_the_chat_template_renders_it(model_dir):
  # Token-in, token-out between turns: prompt + the model's turn (ended by its end-of-turn token)
  # + observation_ids(tool output) reads exactly as the template's whole conversation.
  tok = tokenizers.HFTokenizer(model_dir)
  hf = tok.hf_tokenizer
  schema = {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {}}}
  call = '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>'
  prompt = tok.prompt_ids("What is 12*34?", tools=[schema])
  transcript = prompt + tok.encode(call) + [tok.eos_id] + tok.observation_ids("408")
  messages = [
    {"role": "system", "content": tool_calls.tools_system_prompt([schema])},  # see below
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": call},
    {"role": "tool", "content": "408"},
  ]
  want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert hf.decode(transcript) == want
  assert want.endswith("<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")


def test_the_tool_call_close_tag_is_a_stop_sequence_and_the_observation_closes_the_turn(model_dir):
  # SmolLM2 splits "</tool_call>" into 5 tokens: it ends a turn as a stop sequence, and since the
  # model then has not drawn its end-of-turn token, the observation starts with it.
  tok = tokenizers.HFTokenizer(model_dir)
  hf = tok.hf_tokenizer
  stop_ids, stop_seqs = tokenizers.turn_stops(tok, ("</tool_call>",))
  assert stop_ids == tok.stop_ids and stop_seqs == (tuple(tok.encode("</tool_call>")),)
  assert len(stop_seqs[0]) == 5
  call = '<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>'
  prompt = tok.prompt_ids("What is 12*34?")
  turn = tok.encode(call)
  assert turn[-5:] == list(stop_seqs[0])  # the close tag ends the call's tokens as encoded alone
  transcript = prompt + turn + tok.observation_ids("408", after_end_of_turn=False)
  messages = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": call},
    {"role": "tool", "content": "408"},
  ]
  want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  assert hf.decode(transcript) == want
  assert tok.observation_ids("408") == tok.observation_ids("408", after_end_of_turn=False)[1:]


def test_a_template_that_drops_tools_gets_their_schema_in_the_system_prompt(model_dir):
  # SmolLM2's template ignores `tools=`: the schema goes into the system prompt (Hermes/Qwen's
  # wording), after the task's own system prompt, so the model can read how to call `calc`.
  tok = tokenizers.HFTokenizer(model_dir)
  hf, schema = tok.hf_tokenizer, tool_schema(calc)
  plain = hf.decode(tok.prompt_ids("What is 12*34?"))
  with_tools = hf.decode(tok.prompt_ids("What is 12*34?", "Be brief.", tools=[schema]))
  assert "<tools>" not in plain and "calc" not in plain
  system = with_tools.split("<|im_end|>")[0]
  assert system.startswith("<|im_start|>system\nBe brief.\n\n")
  assert json.dumps(schema) in system and "<tool_call>" in system
  assert with_tools.endswith("<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_renders_tools_renders_them_itself(model_dir, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model_dir, name), tmp_path / name)
  (tmp_path / "chat_template.jinja").write_text(
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  tok = tokenizers.HFTokenizer(str(tmp_path))
  text = tok.hf_tokenizer.decode(tok.prompt_ids("Q", tools=[tool_schema(calc)]))
  assert text.startswith("TOOLS:calc;") and "<tools>" not in text and "system" not in text
