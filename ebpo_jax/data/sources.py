r"""The math sources' column tables and the parsing of one source record into a project row.

Expected columns, the first one present wins (`a.b` is field `b` of struct column `a`):

| source        | prompt                     | answer                     | cluster; difficulty |
|---------------|----------------------------|----------------------------|---------------------|
| dapo_math_17k | prompt (chat list or str)  | reward_model.ground_truth  | -                   |
| math500       | problem                    | answer, or solution (1)    | subject; level      |
| aime24        | problem, Problem, question | answer, Answer             | -                   |
| aime25        | problem, question, Problem | answer, Answer             | -                   |
| amc23         | problem, question          | answer (str, int or float) | -                   |
| olympiadbench | context + question         | final_answer (list)        | subfield, subject   |
| champ         | champ-dataset package      | its answer                 | its category        |
| generic       | --prompt_column (prompt)   | --answer_column (answer)   | --cluster_column    |

(1) the last `\boxed{}` of the worked solution, as in the original MATH files.

`generic` reads any data set whose columns are named on the command line (`rows.Columns`); with
`--answer_regex` the answer is the regex's last match in the answer column (its first group if it
has one): GSM8K (`question`, and `answer` ending in `#### 42`) is `--prompt_column=question
--answer_regex='####\s*(.+)'`. Its rows are in cluster `generic` unless `--cluster_column` names
a column that holds one.

Ids: `extra_info.index` (DAPO), `unique_id` (MATH-500), else `id` or `ID`, else `<source>-<n>`.
Copies with these layouts: BytedTsinghua-SIA/DAPO-Math-17k and its verl re-uploads,
HuggingFaceH4/MATH-500, Maxwell-Jia/AIME_2024, HuggingFaceH4/aime_2024, opencompass/AIME2025,
yentinglin/aime_2025, math-ai/aime25, math-ai/amc23, zwhe99/amc23, Hothan/OlympiadBench,
math-ai/olympiadbench; every source also reads the verl RL layout of the DAPO row (copies
preprocessed for verl). OlympiadBench rows with images (a non-empty `image_*` column) and theorem
proofs (`question_type`) are skipped and counted.
"""

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

from ebpo_jax.data.rows import MESSAGES, Columns, DataError, chat_messages, extract_answer

SOURCES = (
  "dapo_math_17k",
  "math500",
  "aime24",
  "aime25",
  "amc23",
  "olympiadbench",
  "champ",
  "generic",
)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Candidate column names of one source, in order of preference."""

  prompt: tuple[str, ...]
  answer: tuple[str, ...]
  ids: tuple[str, ...] = ("id", "ID")
  cluster: tuple[str, ...] = ()
  difficulty: tuple[str, ...] = ()
  context: tuple[str, ...] = ()  # text placed before the prompt when present
  answer_in_solution: bool = False  # no answer column: the last \boxed{} of `solution`
  skip_images_and_proofs: bool = False  # OlympiadBench: multimodal and theorem-proof rows
  answer_regex: str = ""  # the answer is this regex's last match (group 1 if any) in the answer
  chat: bool = False  # a chat-list prompt keeps its messages (`rows.chat_messages`) in the row


def generic_layout(columns: Columns) -> Layout:
  """The layout of source `generic`: exactly the columns named (`--prompt_column`, ...)."""
  return Layout(
    prompt=(columns.prompt,),
    answer=(columns.answer,),
    cluster=(columns.cluster,),
    answer_regex=columns.answer_regex,
    chat=True,
  )


# Every source also reads the verl RL layout (DAPO's): a `prompt` chat list, the answer in
# `reward_model.ground_truth`, the id in `extra_info.index`; these come last among the candidates.
_VERL_PROMPT, _VERL_ANSWER, _VERL_ID = "prompt", "reward_model.ground_truth", "extra_info.index"
LAYOUTS = {
  "dapo_math_17k": Layout(
    prompt=(_VERL_PROMPT, "problem"),
    answer=(_VERL_ANSWER, "answer", "solution"),
    ids=(_VERL_ID, "id"),
  ),
  "math500": Layout(
    prompt=("problem", _VERL_PROMPT),
    answer=("answer", _VERL_ANSWER),
    ids=("unique_id", "id", _VERL_ID),
    cluster=("subject", "type"),
    difficulty=("level",),
    answer_in_solution=True,
  ),
  "aime24": Layout(
    prompt=("problem", "Problem", "question", _VERL_PROMPT),
    answer=("answer", "Answer", _VERL_ANSWER),
    ids=("id", "ID", _VERL_ID),
  ),
  "aime25": Layout(
    prompt=("problem", "question", "Problem", _VERL_PROMPT),
    answer=("answer", "Answer", _VERL_ANSWER),
    ids=("id", "ID", _VERL_ID),
  ),
  "amc23": Layout(
    prompt=("problem", "question", _VERL_PROMPT),
    answer=("answer", _VERL_ANSWER),
    ids=("id", _VERL_ID),
  ),
  "olympiadbench": Layout(
    prompt=("question", "problem", _VERL_PROMPT),
    answer=("final_answer", "answer", _VERL_ANSWER),
    ids=("id", _VERL_ID),
    cluster=("subfield", "subject"),
    context=("context",),
    skip_images_and_proofs=True,
  ),
}

# Instruction wrappers around the problem text in some copies (DAPO, verl and lighteval prompts).
_DAPO_INSTRUCTION = "Solve the following math problem step by step."  # ...then a blank line
_DAPO_REMINDER = 'Remember to put your answer on its own line after "Answer:"'
_BOXED_INSTRUCTION = re.compile(
  r"(Please reason step by step, and put|Please output|Let's think step by step and output)"
  r" (your|the) final answer within \\boxed\{\}\.?\s*$"
)
_ENCLOSINGS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def champ_rows() -> Iterator[dict[str, Any]]:
  """The CHAMP problems as project rows, each in its category's cluster."""
  for identifier, text, answer, category in _champ_problems():
    yield {
      "prompt": text,
      "answer": answer,
      "cluster": category,
      "difficulty": math.nan,
      "source": "champ",
      "id": identifier,
    }


@functools.cache
def _champ_problems() -> tuple[tuple[str, str, str, str], ...]:
  """(id, problem, answer, category) of the 270 CHAMP problems; loading takes ~1-3 s, so once."""
  import champ_dataset

  return tuple(
    (p.identifier, p.text.strip(), p.answer.strip(), p.category)
    for p in champ_dataset.load("v0").problems.values()
  )


def parse_row(name: str, layout: Layout, record: Any, where: str, index: int) -> dict[str, Any]:
  """One project row from one source record."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: a row must be an object, got {_describe(record)}")
  column, raw_prompt = _required_with_column(record, layout.prompt, where)
  messages = None
  if layout.chat and isinstance(raw_prompt, list):
    messages = chat_messages(raw_prompt, f"{where}: {column!r}")
  prompt = _prompt_text(raw_prompt, where)
  context = _first(record, layout.context)
  if isinstance(context, str) and context.strip():
    prompt = f"{context.strip()}\n\n{prompt}"
  answer_columns = layout.answer + (("solution",) if layout.answer_in_solution else ())
  column, value = _required_with_column(record, answer_columns, where)
  if column == "solution" and layout.answer_in_solution:
    value = _last_boxed(value) if isinstance(value, str) else None
    if value is None:
      raise DataError(f"{where}: no answer column and no \\boxed{{}} answer in 'solution'")
  if layout.answer_regex:
    if not isinstance(value, str):
      raise DataError(f"{where}: answer_regex needs a string answer, got {_describe(value)}")
    value = extract_answer(value, layout.answer_regex, where)
  cluster = _first(record, layout.cluster)
  identifier = _first(record, layout.ids)
  return {
    "prompt": prompt if messages is None else messages[-1]["content"],
    **({} if messages is None else {MESSAGES: messages}),
    "answer": _answer_text(value, where),
    "cluster": str(cluster).strip() or name if cluster is not None else name,
    "difficulty": _difficulty(_first(record, layout.difficulty)),
    "source": name,
    "id": str(identifier) if identifier not in (None, "") else f"{name}-{index}",
  }


def _lookup(record: dict[str, Any], column: str) -> Any:
  """The value at a dotted column path, or None."""
  value: Any = record
  for key in column.split("."):
    if not isinstance(value, dict):
      return None
    value = value.get(key)
  return value


def _first(record: dict[str, Any], columns: Sequence[str]) -> Any:
  return next((v for c in columns if (v := _lookup(record, c)) is not None), None)


def _required_with_column(
  record: dict[str, Any], columns: Sequence[str], where: str
) -> tuple[str, Any]:
  for column in columns:
    value = _lookup(record, column)
    if value is not None:
      return column, value
  expected = " or ".join(repr(c) for c in columns)
  found = ", ".join(sorted(record)) or "none"
  raise DataError(f"{where}: missing column {expected} (columns found: {found})")


def _required(record: dict[str, Any], columns: Sequence[str], where: str) -> Any:
  return _required_with_column(record, columns, where)[1]


def _prompt_text(value: Any, where: str) -> str:
  """The problem text of a string or chat-list prompt, without instruction wrappers."""
  if isinstance(value, list):
    messages = [m for m in value if isinstance(m, dict) and isinstance(m.get("content"), str)]
    users = [m for m in messages if m.get("role") == "user"] or messages
    if not users:
      raise DataError(f"{where}: prompt is a list without a message 'content'")
    value = users[-1]["content"]
  if not isinstance(value, str):
    raise DataError(f"{where}: prompt must be a string or a chat list, got {_describe(value)}")
  text = _without_wrappers(value)
  if not text:
    raise DataError(f"{where}: empty prompt")
  return text


def _without_wrappers(text: str) -> str:
  """The problem text inside a DAPO or `\\boxed{}` instruction wrapper (string ops: ~1.8M rows)."""
  text = text.strip()
  if text.startswith(_DAPO_INSTRUCTION):
    _, blank_line, problem = text.partition("\n\n")
    text = problem if blank_line else text
  reminder = text.find(_DAPO_REMINDER)
  text = text[:reminder] if reminder >= 0 else text
  if "final answer within \\boxed{}" in text:
    text = _BOXED_INSTRUCTION.sub("", text)
  return text.strip()


def _answer_text(value: Any, where: str) -> str:
  """The gold answer as a string: lists joined, numbers without `.0`, `\\boxed{}` removed."""
  if isinstance(value, list | tuple):
    text = ", ".join(_answer_text(item, where) for item in value)
  elif isinstance(value, bool):
    raise DataError(f"{where}: answer must be a string or a number, got {_describe(value)}")
  elif isinstance(value, int):
    text = str(value)
  elif isinstance(value, float):
    if not math.isfinite(value):
      raise DataError(f"{where}: answer is {value}")
    text = str(int(value)) if value.is_integer() else repr(value)
  elif isinstance(value, str):
    text = _unwrap_answer(value)
  else:
    raise DataError(f"{where}: answer must be a string or a number, got {_describe(value)}")
  if not text:
    raise DataError(f"{where}: empty answer")
  return text


def _unwrap_answer(text: str) -> str:
  """Removes an enclosing `\\boxed{...}`, `$...$`, `\\(...\\)` or `\\[...\\]`, repeatedly."""
  while True:
    text = text.strip()
    boxed = _boxed_content(text, 0)
    if boxed is not None and boxed[1] == len(text):
      text = boxed[0]
      continue
    inner = _enclosed(text)
    if inner is None:
      return text
    text = inner


def _enclosed(text: str) -> str | None:
  """The text inside one enclosing pair of math delimiters, or None ("$a$, $b$" is not one)."""
  for opening, closing in _ENCLOSINGS:
    if text.startswith(opening) and text.endswith(closing):
      inner = text[len(opening) : len(text) - len(closing)]
      if len(text) > len(opening) + len(closing) and opening not in inner:
        return inner
  return None


def _boxed_content(text: str, start: int) -> tuple[str, int] | None:
  """If `\\boxed{` or `\\fbox{` begins at `start`: (its balanced content, end index), else None."""
  for command in ("\\boxed{", "\\fbox{"):
    if text.startswith(command, start):
      depth, i = 1, start + len(command)
      while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
          return text[start + len(command) : i], i + 1
        i += 1
  return None


def _last_boxed(solution: str) -> str | None:
  """The content of the last complete `\\boxed{}` in a worked solution (MATH layout)."""
  for match in reversed(list(re.finditer(r"\\(boxed|fbox)\{", solution))):
    inner = _boxed_content(solution, match.start())
    if inner is not None:
      return inner[0]
  return None


def _difficulty(value: Any) -> float:
  """A MATH level (3 or "Level 3") as a float; anything else (e.g. "Competition") is NaN."""
  if isinstance(value, int | float) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, str) and (match := re.fullmatch(r"\s*(Level\s*)?(\d+(\.\d+)?)\s*", value)):
    return float(match.group(2))
  return math.nan


def skip_reason(record: Any) -> str | None:
  """Why an OlympiadBench record has no use here (it shows images, or asks for a proof), or None."""
  if not isinstance(record, dict):
    return None
  if any(k.startswith("image") and v not in (None, "", [], {}) for k, v in record.items()):
    return "with images"
  if str(record.get("question_type", "")).lower().startswith("theorem"):
    return "proofs"
  return None


def _describe(value: Any) -> str:
  text = repr(value)
  text = text if len(text) <= 40 else text[:37] + "..."
  return f"{type(value).__name__} {text}"
