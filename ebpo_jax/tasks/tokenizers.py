"""Tokenizers: characters of arithmetic or UTF-8 bytes (random-init models), or a model directory's.

All have `vocab_size`, `pad_id`, `bos_id`, `eos_id`, `stop_ids`; `encode(text)` gives the text's ids
only; `prompt_ids(text, system_prompt, history, tools)` the ids the model sees before its
completion: the user turn `text` after the chat's earlier `history` messages ({role, content}), as a
chat model's template renders them (with the tool schemas `tools`), or BOS + the texts one per
line; `observation_ids(text)` those of an environment's answer between two model turns (a chat
model's tool message); `decode(ids)` stops at the first stop id and drops pad and BOS.
"""

import functools
import json
from collections.abc import Sequence
from typing import Any

from ebpo_jax import files
from ebpo_jax.tasks import tool_calls

_SPECIALS = 3  # ids 0, 1, 2: pad, BOS, EOS
# A model directory's weights: a tokenizer needs none of them (not mirrored from gs://).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.msgpack")


class _Prompts:
  """The prompt and observation ids of every tokenizer here: without a chat template, BOS (if the
  tokenizer has one) + the texts one per line, and an observation's own tokens; a tokenizer whose
  chat template is in use (`use_chat_template`) renders them with it (`_chat_*`)."""

  bos_id: int | None
  use_chat_template = False

  def prompt_ids(
    self,
    text: str,
    system_prompt: str | None = None,
    history: Sequence[dict] = (),
    tools: Sequence[dict] = (),
  ) -> list[int]:
    """The chat template's conversation so far, else BOS + the texts (without a template the tools
    are not rendered: a tiny model learns its tools in the warm start)."""
    if self.use_chat_template:
      return self._chat_prompt_ids(text, system_prompt, history, tools)  # type: ignore[attr-defined]
    bos = [] if self.bos_id is None else [self.bos_id]
    return bos + self.encode(plain_prompt(text, system_prompt, history))  # type: ignore[attr-defined]

  def observation_ids(self, text: str, *, after_end_of_turn: bool = True) -> list[int]:
    """An environment's answer after a model turn: the chat template's rendering, else the text's
    tokens (no chat template: nothing closes a turn)."""
    if self.use_chat_template:
      return self._chat_observation_ids(text, after_end_of_turn)  # type: ignore[attr-defined]
    return self.encode(text)  # type: ignore[attr-defined]


class _Own(_Prompts):
  """Stop ids of the project's own tokenizers (subclasses define `encode`)."""

  pad_id: int
  bos_id: int
  eos_id: int

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)


class CharTokenizer(_Own):
  """The characters of arithmetic prompts and answers (18 ids)."""

  CHARS = "0123456789+-*= "

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self._id_of = {c: i + _SPECIALS for i, c in enumerate(self.CHARS)}
    self.vocab_size = _SPECIALS + len(self.CHARS)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._id_of[c] for c in text]
    except KeyError as e:
      raise ValueError(
        f"character {e.args[0]!r} is not in the vocabulary {self.CHARS!r} (task arithmetic; "
        "text prompts: --config.task.name=jsonl)"
      ) from e

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.CHARS[i - _SPECIALS] for i in _content_ids(ids, self))


class ByteTokenizer(_Own):
  """UTF-8 bytes (259 ids): any text, for tiny models on reasoning-gym or file tasks."""

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.vocab_size = _SPECIALS + 256

  def encode(self, text: str) -> list[int]:
    return [b + _SPECIALS for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(i - _SPECIALS for i in _content_ids(ids, self))
    return data.decode("utf-8", errors="replace")


class PieceTokenizer(ByteTokenizer):
  """UTF-8 bytes plus whole pieces of text, one id each (ids 259 on, in `pieces`' order): a tiny
  model's tool calls in a few tokens. Encoding takes the longest piece at each place, else a byte;
  `stop_pieces` end a model turn like EOS (they stay in its decoded text)."""

  def __init__(self, pieces: Sequence[str], stop_pieces: Sequence[str] = ()):
    super().__init__()
    self.pieces = tuple(pieces)
    if len(set(self.pieces)) != len(self.pieces) or not all(self.pieces):
      raise ValueError(f"pieces must be distinct and non-empty, got {self.pieces}")
    self._first_id = self.vocab_size
    self._id_of_piece = {p: self._first_id + i for i, p in enumerate(self.pieces)}
    self.vocab_size += len(self.pieces)
    self._stop_ids = (self.eos_id, *(self._id_of_piece[p] for p in stop_pieces))
    self._lengths = sorted({len(p) for p in self.pieces}, reverse=True)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stop_ids

  def encode(self, text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
      found = (text[i : i + n] for n in self._lengths)
      piece = next((p for p in found if p in self._id_of_piece), None)
      if piece is None:
        ids.extend(super().encode(text[i]))
        i += 1
      else:
        ids.append(self._id_of_piece[piece])
        i += len(piece)
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text before the first EOS (pieces and bytes; pad and BOS dropped)."""
    out, run = [], []
    for i in map(int, ids):
      if i == self.eos_id:
        break
      if i >= self._first_id and i < self.vocab_size:
        out.append(super().decode(run))
        out.append(self.pieces[i - self._first_id])
        run = []
      else:
        run.append(i)
    return "".join(out) + super().decode(run)


def _content_ids(ids: Sequence[int], tokenizer: CharTokenizer | ByteTokenizer) -> list[int]:
  """The ids before the first EOS, without pad and BOS; out-of-vocabulary ids raise."""
  out = []
  for i in map(int, ids):
    if i == tokenizer.eos_id:
      break
    if i in (tokenizer.pad_id, tokenizer.bos_id):
      continue
    if not _SPECIALS <= i < tokenizer.vocab_size:
      raise ValueError(f"token id {i} is outside the vocabulary (size {tokenizer.vocab_size})")
    out.append(i)
  return out


# transformers' generic tokenizer of a tokenizer.json (TokenizersBackend in transformers 5, which
# keeps the older name as an alias): the class AutoTokenizer picks for a directory that names it.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_transformers_tokenizer(local: str) -> Any:
  """The tokenizer AutoTokenizer loads from the local directory `local`. A directory whose
  tokenizer_config.json names the generic class (the packaged SmolLM2's, Llama 3's) loads by that
  class directly: AutoTokenizer would also read the model's config and import torch with it, about
  3 s of a trainer's start."""
  import transformers

  config_file = files.join(local, "tokenizer_config.json")
  named = json.loads(files.read_text(config_file)) if files.exists(config_file) else {}
  generic = named.get("tokenizer_class") in _GENERIC_CLASSES
  if generic and files.exists(files.join(local, "tokenizer.json")):
    return transformers.PreTrainedTokenizerFast.from_pretrained(local, local_files_only=True)
  return transformers.AutoTokenizer.from_pretrained(local, local_files_only=True)


class HFTokenizer(_Prompts):
  """A model directory's tokenizer (transformers), with its chat template for instruct models.

  `chat_template=True` wraps prompts in the directory's chat template (when it has one), with the
  generation prompt appended; otherwise prompts are BOS (if the model has one) + text. Completions
  stop at EOS or at any `eos_token_id` listed in the directory's generation_config.json. A `gs://`
  directory is mirrored (without its weights) by `files.local_copy`.
  """

  def __init__(self, path: str, *, chat_template: bool = True):
    if not files.isdir(path):
      raise FileNotFoundError(f"{path}: no such tokenizer (model) directory")
    local = files.local_copy(path, exclude=WEIGHT_FILES)
    self._tok = _load_transformers_tokenizer(local)
    if self._tok.eos_token_id is None:
      raise ValueError(f"{path}: the tokenizer has no EOS token; completions could never stop")
    self.eos_id = int(self._tok.eos_token_id)
    pad = self._tok.pad_token_id
    self.pad_id = self.eos_id if pad is None else int(pad)
    self.bos_id = None if self._tok.bos_token_id is None else int(self._tok.bos_token_id)
    self.vocab_size = len(self._tok)
    self.stop_ids = _stop_ids(local, self.eos_id)
    self.use_chat_template = bool(chat_template and self._tok.chat_template)

  @property
  def hf_tokenizer(self) -> Any:
    return self._tok

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False))

  def _chat_prompt_ids(self, text, system_prompt, history, tools) -> list[int]:
    """`prompt_ids` by the chat template. The tool schemas `tools` are rendered as the template
    renders them; a template that ignores `tools=` (SmolLM2's) gets them in the system prompt
    instead (`tool_calls.tools_system_prompt`, after the task's)."""
    has_system = any(m["role"] == "system" for m in history)
    messages = (
      [{"role": "system", "content": system_prompt}] if system_prompt and not has_system else []
    )
    messages += [*history, {"role": "user", "content": text}]
    if tools and not self._renders_tools():
      messages, tools = _tools_in_system_prompt(messages, tools), ()
    out = self._tok.apply_chat_template(
      messages, tools=list(tools) or None, add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)

  @functools.cache  # noqa: B019 (one tokenizer per run; the answer never changes)
  def _renders_tools(self) -> bool:
    """Whether the chat template renders `tools=`: a conversation with a tool differs."""
    schema = {
      "type": "function",
      "function": {"name": "probe", "description": "", "parameters": {}},
    }
    messages = [{"role": "user", "content": "?"}]
    render = functools.partial(self._tok.apply_chat_template, messages, tokenize=False)
    return render(tools=[schema]) != render()

  def _chat_observation_ids(self, text: str, after_end_of_turn: bool) -> list[int]:
    """`observation_ids` by the chat template: its tool message and the next turn's generation
    prompt (less the end-of-turn mark when the model drew it, `after_end_of_turn`; a turn cut at a
    stop string such as a tool call's close tag has not)."""
    marker = "\ue000"  # a private-use character: where the model's turn ends in the rendering
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    messages.append({"role": "tool", "content": text})
    rendered = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tail = rendered.split(marker, 1)[1]
    for stop in self.stop_ids if after_end_of_turn else ():
      tail = tail.removeprefix(self._tok.decode([stop]))
    return self.encode(tail)

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    for n, i in enumerate(ids):
      if i in self.stop_ids:
        ids = ids[:n]
        break
    return self._tok.decode(ids, skip_special_tokens=True)


def _tools_in_system_prompt(messages: list[dict], tools: Sequence[dict]) -> list[dict]:
  """`messages` with the tools' text at the end of the system message (a new one if none)."""
  text = tool_calls.tools_system_prompt(tools)
  if messages and messages[0]["role"] == "system":
    first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    return [first, *messages[1:]]
  return [{"role": "system", "content": text}, *messages]


def turn_stops(
  tokenizer, stop_strings: Sequence[str]
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
  """(stop ids, stop sequences) that end a model turn: the tokenizer's stop ids, and each of
  `stop_strings` (an environment's, e.g. a tool call's close tag) as `tokenizer.encode` gives it:
  one token joins the stop ids, several make a stop sequence (the decode loop matches the turn's
  last tokens). A model that spells the string in other tokens than its encoding does not stop
  there; its turn goes on to its end-of-turn token or its budget."""
  ids, seqs = list(tokenizer.stop_ids), []
  for text in stop_strings:
    encoded = tuple(int(i) for i in tokenizer.encode(text))
    if len(encoded) == 1 and encoded[0] not in ids:
      ids.append(encoded[0])
    elif len(encoded) > 1 and encoded not in seqs:
      seqs.append(encoded)
  return tuple(ids), tuple(seqs)


def plain_prompt(text: str, system_prompt: str | None, history: Sequence[dict]) -> str:
  """A prompt without a chat template: the system prompt (unless the chat has its own), the
  chat's earlier messages and the user turn, one per line."""
  has_system = any(m["role"] == "system" for m in history)
  lines = [system_prompt] if system_prompt and not has_system else []
  return "\n".join([*lines, *(m["content"] for m in history), text])


def _stop_ids(path: str, eos_id: int) -> tuple[int, ...]:
  """EOS plus the `eos_token_id`s of generation_config.json (a chat model's end-of-turn ids)."""
  ids = [eos_id]
  config_path = files.join(path, "generation_config.json")
  if files.isfile(config_path):
    extra = json.loads(files.read_text(config_path)).get("eos_token_id")
    extra = [] if extra is None else [extra] if isinstance(extra, int) else extra
    ids += [int(i) for i in extra if int(i) not in ids]
  return tuple(ids)
