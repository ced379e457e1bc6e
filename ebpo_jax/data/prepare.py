r"""Math data sets in their usual Hugging Face layouts, read into project rows.

`read_source(name, path)` reads a local copy (a `.jsonl`, `.json` or `.parquet` file, or a
directory of them, all read in sorted order) and returns rows `{"prompt", "answer", "cluster",
"difficulty", "source", "id"}`: the bare problem text (instruction wrappers such as DAPO's "Solve
the following math problem step by step..." removed), the gold answer as a string (`\boxed{}` and
`$...$` removed, numbers without a trailing `.0`), a topic cluster (else the source name) and a
difficulty (the MATH level, else NaN). Exactly repeated prompts are kept once (DAPO-Math-17k
repeats each of its ~17k prompts about 100 times). `champ` takes no path: it reads the installed
`champ-dataset` package (270 problems), the offline evaluation set.

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

(1) the last `\boxed{}` of the worked solution, as in the original MATH files.

Ids: `extra_info.index` (DAPO), `unique_id` (MATH-500), else `id` or `ID`, else `<source>-<n>`.
Copies with these layouts: BytedTsinghua-SIA/DAPO-Math-17k and its verl re-uploads,
HuggingFaceH4/MATH-500, Maxwell-Jia/AIME_2024, HuggingFaceH4/aime_2024, opencompass/AIME2025,
yentinglin/aime_2025, math-ai/aime25, math-ai/amc23, zwhe99/amc23, Hothan/OlympiadBench,
math-ai/olympiadbench; every source also reads the verl RL layout of the DAPO row (copies
preprocessed for verl). OlympiadBench rows with images (a non-empty `image_*` column) and theorem
proofs (`question_type`) are skipped and counted.
Bad input (a missing column, a malformed line, an empty answer) raises `DataError` starting with
`FILE:LINE:` (LINE is the row number in a Parquet file).

Command line (writes JSONL that `ebpo_jax.data.load_rows_and_clusters` reads back):

  python -m ebpo_jax.data.prepare --source=math500 --path=MATH-500/test.jsonl --out=math500.jsonl
  # several sources into one file; /data/raw holds math500/ (or math500.jsonl), aime24/, ...
  python -m ebpo_jax.data.prepare --source=math500,aime24,aime25,amc23,olympiadbench \
      --path=/data/raw --out=math_eval.jsonl
"""

import collections
import dataclasses
import functools
import json
import math
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from absl import app, flags, logging

from ebpo_jax import files
from ebpo_jax.data.rows import DataError

SOURCES = ("dapo_math_17k", "math500", "aime24", "aime25", "amc23", "olympiadbench", "champ")
SUFFIXES = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH = 8192
_METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "state.json")  # not rows


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Candidate column names of one source, in order of preference."""

  prompt: tuple[str, ...]
  answer: tuple[str, ...]
  ids: tuple[str, ...] = ("id", "ID")
  cluster: tuple[str, ...] = ()
  difficulty: tuple[str, ...] = ()
  context: tuple[str, ...] = ()  # text placed before the prompt when present
  answer_in_solution: bool = False  # no answer column: the last \boxed{} of `solution`
  skip_images_and_proofs: bool = False  # OlympiadBench: multimodal and theorem-proof rows


# Every source also reads the verl RL layout (DAPO's): a `prompt` chat list, the answer in
# `reward_model.ground_truth`, the id in `extra_info.index`; these come last among the candidates.
_VERL_PROMPT, _VERL_ANSWER, _VERL_ID = "prompt", "reward_model.ground_truth", "extra_info.index"
_LAYOUTS = {
  "dapo_math_17k": _Layout(
    prompt=(_VERL_PROMPT, "problem"),
    answer=(_VERL_ANSWER, "answer", "solution"),
    ids=(_VERL_ID, "id"),
  ),
  "math500": _Layout(
    prompt=("problem", _VERL_PROMPT),
    answer=("answer", _VERL_ANSWER),
    ids=("unique_id", "id", _VERL_ID),
    cluster=("subject", "type"),
    difficulty=("level",),
    answer_in_solution=True,
  ),
  "aime24": _Layout(
    prompt=("problem", "Problem", "question", _VERL_PROMPT),
    answer=("answer", "Answer", _VERL_ANSWER),
    ids=("id", "ID", _VERL_ID),
  ),
  "aime25": _Layout(
    prompt=("problem", "question", "Problem", _VERL_PROMPT),
    answer=("answer", "Answer", _VERL_ANSWER),
    ids=("id", "ID", _VERL_ID),
  ),
  "amc23": _Layout(
    prompt=("problem", "question", _VERL_PROMPT),
    answer=("answer", _VERL_ANSWER),
    ids=("id", _VERL_ID),
  ),
  "olympiadbench": _Layout(
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


# ----------------------------------------------------------------------------- public API


def read_source(name: str, path: str | None = None) -> list[dict[str, Any]]:
  """Rows of math source `name` (one of SOURCES) read from `path`; DataError on bad input."""
  rows, dropped = _read(name, path)
  if dropped:
    logging.info("%s: dropped %s", name, _describe_dropped(dropped))
  return rows


def prepare(source: str, path: str | None, out: str, limit: int | None = None) -> str:
  """Writes the rows of `source` to the JSONL file `out` atomically; returns a one-line summary.

  `source` may be a comma list (e.g. an evaluation file of several benchmarks): then `path` is a
  directory holding each source's copy as `<source>` or `<source>.jsonl/.json/.parquet` (champ
  needs none), and `limit` applies to each source.
  """
  out_path = pathlib.Path(out)
  if out_path.suffix != ".jsonl":
    raise DataError(f"{out}: the output must be a .jsonl file")
  if limit is not None and limit < 1:
    raise DataError(f"--limit must be >= 1, got {limit}")
  names = [name.strip() for name in source.split(",") if name.strip()]
  rows, dropped, counts = [], collections.Counter(), []
  for name in names:
    source_path = _source_path(name, path) if len(names) > 1 else path
    source_rows, source_dropped = _read(name, source_path)
    kept = source_rows[:limit] if limit else source_rows
    rows += kept
    dropped += source_dropped
    counts.append(f"{name} {len(kept)}")
  _write_jsonl_atomically(out_path, rows)
  clusters = len({row["cluster"] for row in rows})
  per_source = f" ({', '.join(counts)})" if len(names) > 1 else ""
  detail = f" ({_describe_dropped(dropped)})" if dropped else ""
  return (
    f"{','.join(names)}: {len(rows)} rows{per_source}, {clusters} clusters, "
    f"{sum(dropped.values())} dropped{detail} -> {out_path}"
  )


def _source_path(name: str, directory: str | None) -> str | None:
  """The copy of `name` in `directory`: `<name>` or `<name>.<suffix>`; None for champ."""
  if name == "champ":
    return None
  if directory is None or not pathlib.Path(directory).is_dir():
    raise DataError(f"several sources need --path to be a directory of copies, got {directory}")
  candidates = [pathlib.Path(directory) / f"{name}{suffix}" for suffix in ("", *SUFFIXES)]
  found = next((c for c in candidates if c.exists()), None)
  if found is None:
    raise DataError(
      f"{directory}: no {name} copy (expected {name}/ or {name}{{{','.join(SUFFIXES)}}})"
    )
  return str(found)


# ----------------------------------------------------------------------------- reading


def _read(name: str, path: str | None) -> tuple[list[dict[str, Any]], collections.Counter]:
  """Rows of `name` and the number of records dropped per reason."""
  if name not in SOURCES:
    raise DataError(f"unknown source {name!r}; expected one of {', '.join(SOURCES)}")
  dropped = collections.Counter()
  if name == "champ":
    if path is not None:
      raise DataError("champ is read from the installed champ-dataset package; it takes no path")
    return list(_unique(_champ_rows(), dropped)), dropped
  if path is None:
    raise DataError(f"{name} needs a path to a local copy (a file or a directory)")
  rows = list(_unique(_source_rows(name, pathlib.Path(path), dropped), dropped))
  if not rows:
    left = f" left ({_describe_dropped(dropped)} dropped)" if dropped else ""
    raise DataError(f"{path}: no rows{left}")
  return rows, dropped


def _source_rows(
  name: str, path: pathlib.Path, dropped: collections.Counter
) -> Iterator[dict[str, Any]]:
  layout = _LAYOUTS[name]
  for index, (where, record) in enumerate(_records(path)):
    skipped = _skipped(record) if layout.skip_images_and_proofs else None
    if skipped:
      dropped[skipped] += 1
    else:
      yield _row(name, layout, record, where, index)


def _unique(
  rows: Iterator[dict[str, Any]], dropped: collections.Counter
) -> Iterator[dict[str, Any]]:
  """The first row of each exactly repeated prompt (streamed: DAPO's file has ~1.8M rows)."""
  answers = {}
  for row in rows:
    first_answer = answers.get(row["prompt"])
    if first_answer is None:
      answers[row["prompt"]] = row["answer"]
      yield row
    elif first_answer == row["answer"]:
      dropped["duplicate prompts"] += 1
    else:
      dropped["duplicate prompts (other answer)"] += 1


def _champ_rows() -> Iterator[dict[str, Any]]:
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


def _row(name: str, layout: _Layout, record: Any, where: str, index: int) -> dict[str, Any]:
  """One project row from one source record."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: a row must be an object, got {_describe(record)}")
  prompt = _prompt_text(_required(record, layout.prompt, where), where)
  context = _first(record, layout.context)
  if isinstance(context, str) and context.strip():
    prompt = f"{context.strip()}\n\n{prompt}"
  answer_columns = layout.answer + (("solution",) if layout.answer_in_solution else ())
  column, value = _required_with_column(record, answer_columns, where)
  if column == "solution" and layout.answer_in_solution:
    value = _last_boxed(value) if isinstance(value, str) else None
    if value is None:
      raise DataError(f"{where}: no answer column and no \\boxed{{}} answer in 'solution'")
  cluster = _first(record, layout.cluster)
  identifier = _first(record, layout.ids)
  return {
    "prompt": prompt,
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


def _skipped(record: Any) -> str | None:
  """Why an OlympiadBench record has no use here (it shows images, or asks for a proof), or None."""
  if not isinstance(record, dict):
    return None
  if any(k.startswith("image") and v not in (None, "", [], {}) for k, v in record.items()):
    return "with images"
  if str(record.get("question_type", "")).lower().startswith("theorem"):
    return "proofs"
  return None


def _records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
  """Yields ("FILE:LINE", record) for each record of a file or of each data file in a directory."""
  if path.is_dir():
    files = sorted(
      p
      for p in path.rglob("*")
      if p.is_file()
      and p.suffix in SUFFIXES
      and p.name not in _METADATA_FILES
      and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
      raise DataError(f"{path}: no {'/'.join(SUFFIXES)} files in this directory")
  elif path.is_file():
    if path.suffix not in SUFFIXES:
      raise DataError(f"{path}: unknown file type {path.suffix!r}; expected one of {SUFFIXES}")
    files = [path]
  else:
    raise DataError(f"{path}: no such file or directory")
  for file in files:
    if file.suffix == ".parquet":
      yield from _parquet_records(file)
    else:
      yield from _json_records(file)


def _json_records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
  """Records of a JSON array file or of a JSONL file (also when it is named `.json`)."""
  text = path.read_text(encoding="utf-8")
  if text.lstrip().startswith("["):
    yield from _json_array_records(path, text)
    return
  for line_number, line in enumerate(text.splitlines(), start=1):
    if line.strip():
      try:
        yield f"{path}:{line_number}", json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(
          f"{path}:{line_number}: malformed JSON ({e.msg} at column {e.colno})"
        ) from e


def _json_array_records(path: pathlib.Path, text: str) -> Iterator[tuple[str, Any]]:
  """Elements of a top-level JSON array, each with the line it starts on."""
  decoder = json.JSONDecoder()
  position = _skip_space(text, text.index("[") + 1)
  if text.startswith("]", position):
    return
  while True:
    line = text.count("\n", 0, position) + 1
    try:
      record, position = decoder.raw_decode(text, position)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
    yield f"{path}:{line}", record
    position = _skip_space(text, position)
    if text.startswith(",", position):
      position = _skip_space(text, position + 1)
    elif text.startswith("]", position):
      return
    else:
      line = text.count("\n", 0, position) + 1
      raise DataError(f"{path}:{line}: malformed JSON array (expected ',' or ']')")


def _skip_space(text: str, position: int) -> int:
  while position < len(text) and text[position].isspace():
    position += 1
  return position


def _parquet_records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
  """Records of a Parquet file, read in batches (DAPO-Math-17k's file has ~1.8M rows)."""
  import pyarrow.parquet as pq

  try:
    parquet = pq.ParquetFile(path)
    row_number = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH):
      for record in batch.to_pylist():
        row_number += 1
        yield f"{path}:{row_number}", record
  except Exception as e:  # pyarrow raises several types for unreadable files
    raise DataError(f"{path}: unreadable Parquet file ({e})") from e


# ----------------------------------------------------------------------------- writing


def _write_jsonl_atomically(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
  """Writes rows as JSONL, atomically; NaN difficulties are left out."""
  records = (
    {k: v for k, v in row.items() if not (k == "difficulty" and math.isnan(v))} for row in rows
  )
  files.write_lines(path, (json.dumps(record, ensure_ascii=False) for record in records))


def _describe_dropped(dropped: collections.Counter) -> str:
  return ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()) if n)


def _describe(value: Any) -> str:
  text = repr(value)
  text = text if len(text) <= 40 else text[:37] + "..."
  return f"{type(value).__name__} {text}"


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  try:
    print(prepare(f.source, f.path, f.out, f.limit))
  except DataError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.DEFINE_string("source", None, f"Math data set, or a comma list, of: {', '.join(SOURCES)}.")
  flags.DEFINE_string(
    "path",
    None,
    "Local copy: a .jsonl/.json/.parquet file or a directory (several sources: a "
    "directory holding <source> or <source>.jsonl/.json/.parquet for each).",
  )
  flags.DEFINE_string("out", None, "Output .jsonl file of project rows.")
  flags.DEFINE_integer("limit", None, "Keep only the first N rows of each source (after dedup).")
  flags.mark_flags_as_required(["source", "out"])
  app.run(main)
