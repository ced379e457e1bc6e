"""Rows of prompts from JSONL or Parquet files or `datasets` directories (local or `gs://...`),
validated up front.

A row is a plain dict `{"prompt": str, "answer": str, "cluster": int, "difficulty": float}`; other
keys in the file are kept as they are (e.g. metadata a verifier needs). `cluster` defaults to 0 and
`difficulty` to NaN (higher = harder). Clusters may be written as ints (ids, names "0", "1", ...) or
as strings (names, numbered in order of first appearance) but not both in one file.

A directory is one that Hugging Face `datasets`' `save_to_disk` wrote (`saved_dataset`: a Dataset,
or one split of a DatasetDict). `Columns` names the columns that hold prompt, answer and cluster
when they are called otherwise (GSM8K: `question`); they are renamed to those keys in the row.
"""

import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from ebpo_jax import files
from ebpo_jax.data import saved_dataset
from ebpo_jax.errors import DataError

SUFFIXES = (".jsonl", ".parquet")
# A row's chat (`chat_messages`): the prompt column may hold one, or a row keeps it under this key.
MESSAGES = "messages"


class Columns(NamedTuple):
  """The columns that hold each field of a row (config `data.prompt_column`, `data.answer_column`,
  `data.cluster_column`), and `answer_regex` (`data.answer_regex`): when set, the answer is its
  last match in the answer column (its first group if it has one; GSM8K: `####\\s*(.+)`)."""

  prompt: str = "prompt"
  answer: str = "answer"
  cluster: str = "cluster"
  answer_regex: str = ""

  @classmethod
  def from_config(cls, data_config: Any) -> "Columns":
    """The columns of the `config.data` section."""
    return cls(
      prompt=data_config.prompt_column,
      answer=data_config.answer_column,
      cluster=data_config.cluster_column,
      answer_regex=data_config.answer_regex,
    )


DEFAULT_COLUMNS = Columns()


def answer_pattern(regex: str) -> re.Pattern:
  """`regex` compiled (`re` caches it: once per regex, not per row); DataError if it is none."""
  try:
    return re.compile(regex)
  except re.error as e:
    raise DataError(f"answer_regex {regex!r} is not a regular expression ({e})") from None


def extract_answer(text: str, regex: str, where: str) -> str:
  """The last match of `regex` in `text` (its first group if it has one), stripped; DataError
  naming `where` when nothing matches or the match is empty."""
  pattern = answer_pattern(regex)
  matches = list(pattern.finditer(text))
  if not matches:
    raise DataError(f"{where}: no match of answer_regex {regex!r} in the answer {_short(text)}")
  match = matches[-1]
  answer = (match.group(1) if pattern.groups else match.group(0)) or ""
  if not answer.strip():
    raise DataError(f"{where}: answer_regex {regex!r} matches an empty answer in {_short(text)}")
  return answer.strip()


def load_rows(path: files.PathLike) -> list[dict[str, Any]]:
  """Reads and validates every row of a JSONL or Parquet file or a `datasets` directory (its train
  split); DataError on the first bad one."""
  rows, _ = load_rows_and_clusters(path)
  return rows


def load_rows_and_clusters(path: files.PathLike) -> tuple[list[dict[str, Any]], list[str]]:
  """Like `load_rows`, also returning the cluster names (index = cluster id)."""
  rows, names, _ = load_checked_rows(path)
  return rows, names


# Bad rows listed in one DataError, one line each, before the rest are counted.
MAX_LISTED = 20


def load_checked_rows(
  path: files.PathLike,
  check: Callable[[dict], str | None] | None = None,
  *,
  skip_bad: bool = False,
  columns: Columns = DEFAULT_COLUMNS,
  split: str | None = "train",
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
  """Rows, cluster names and the `FILE:LINE: problem` of each bad row: not UTF-8, not JSON, not a
  valid row, or a row for which `check` returns a problem (e.g. a prompt the tokenizer cannot
  encode). With `skip_bad` the bad rows are dropped; otherwise one DataError lists them all.

  `path` is a `.jsonl` or `.parquet` file or a `save_to_disk` directory: a Dataset, or a
  DatasetDict whose split `split` is read (`data.split`; None: a DatasetDict is refused, name one
  split's folder). In a directory FILE is the Arrow file and LINE the row in it. `columns` says
  where prompt, answer and cluster are (renamed to those keys)."""
  path = os.fspath(path)
  if columns.answer_regex:
    answer_pattern(columns.answer_regex)  # a bad regex is one error, not one per row
  clusters = _ClusterIds()
  rows, problems = [], []
  for where, record in _records(path, split):
    try:
      row = _checked_row(record, where, clusters, check, columns)
    except DataError as e:
      problems.append(str(e))
      continue
    rows.append(row)
  if problems and not skip_bad:
    raise DataError(listing(problems))
  if not rows:
    raise DataError(f"{path}: no rows")
  return rows, clusters.names(), problems


def listing(problems: Sequence[str]) -> str:
  """Problems one per line, the first MAX_LISTED of them, and how many more."""
  lines = list(problems[:MAX_LISTED])
  if len(problems) > MAX_LISTED:
    lines.append(f"... and {len(problems) - MAX_LISTED} more bad rows")
  return "\n".join(lines)


def _records(path: str, split: str | None) -> Iterator[tuple[str, Any]]:
  """("FILE:LINE", record or its DataError) of every record of a rows file or directory."""

  if files.isdir(path):
    if not saved_dataset.is_saved_dataset(path):
      raise DataError(
        f"{path}: a directory, but not one that datasets' save_to_disk wrote (no "
        f"{saved_dataset.STATE} or {saved_dataset.DATASET_DICT}); expected a {'/'.join(SUFFIXES)} "
        "file or such a directory"
      )
    return saved_dataset.records(path, split)
  if not files.isfile(path):
    raise DataError(f"{path}: no such file")
  suffix = os.path.splitext(path)[1]
  if suffix not in SUFFIXES:
    raise DataError(
      f"{path}: unknown file type {suffix!r}; expected one of {SUFFIXES} or a datasets directory"
    )
  return _jsonl_records(path) if suffix == ".jsonl" else _parquet_records(path)


def _checked_row(
  record: Any, where: str, clusters: "_ClusterIds", check, columns: Columns
) -> dict[str, Any]:
  if isinstance(record, DataError):
    raise record
  row = _validate(record, where, clusters, columns)
  problem = check(row) if check is not None else None
  if problem:
    raise DataError(f"{where}: {problem}")
  return row


def _jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields ("FILE:LINE", parsed JSON value or the line's DataError) for each non-blank line
  (LINE from 1). Lines end at \\n only (JSON strings may hold U+2028 and other separators)."""
  with files.open_file(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      if raw.strip():
        yield f"{path}:{line_number}", _parsed(raw, f"{path}:{line_number}")


def _parsed(raw: bytes, where: str) -> Any:
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    return DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})")
  except RecursionError:
    return DataError(f"{where}: JSON nested too deeply for Python's parser")
  except ValueError:  # Python's limit on the digits of an int (sys.get_int_max_str_digits)
    longest = max((len(digits) for digits in re.findall(r"\d+", line)), default=0)
    return DataError(
      f"{where}: an integer of {longest} digits (more than Python reads, "
      f"{sys.get_int_max_str_digits()})"
    )


def _parquet_records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields ("FILE:ROW", row dict) for each row of a Parquet file (ROW from 1)."""
  try:
    import pyarrow.parquet as pq
  except ImportError as e:
    raise DataError(
      f"{path}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
    ) from e
  try:
    table = pq.read_table(files.local_copy(path))
  except Exception as e:  # pyarrow raises several types for unreadable files
    raise DataError(f"{path}: unreadable Parquet file ({e})") from e
  for row_number, record in enumerate(table.to_pylist(), start=1):
    yield f"{path}:{row_number}", record


class _ClusterIds:
  """Maps cluster values to ids: ints are ids, strings are numbered in order of first appearance."""

  def __init__(self):
    self.kind: type | None = None
    self.by_name: dict[str, int] = {}
    self.max_id = -1
    self.first_missing: str | None = None

  def missing(self, where: str) -> int:
    """A row without a cluster: cluster 0, allowed only when no row has one."""
    if self.kind is not None:
      raise DataError(f"{where}: missing 'cluster' while earlier rows have one")
    self.first_missing = self.first_missing or where
    return 0

  def id_of(self, value: Any, where: str) -> int:
    if self.first_missing is not None:
      raise DataError(f"{where}: has a 'cluster' but {self.first_missing} has none")
    if isinstance(value, bool) or not isinstance(value, int | str):
      raise DataError(f"{where}: cluster must be an int or a string, got {_describe(value)}")
    if self.kind is not None and not isinstance(value, self.kind):
      raise DataError(
        f"{where}: cluster {value!r} is a {type(value).__name__}, but earlier rows use "
        f"{self.kind.__name__}s; use one kind per file"
      )
    self.kind = type(value)
    if isinstance(value, str):
      if not value:
        raise DataError(f"{where}: cluster name is empty")
      return self.by_name.setdefault(value, len(self.by_name))
    if value < 0:
      raise DataError(f"{where}: cluster id must be >= 0, got {value}")
    self.max_id = max(self.max_id, value)
    return value

  def names(self) -> list[str]:
    if self.kind is str:
      return list(self.by_name)
    return [str(i) for i in range(max(self.max_id + 1, 1))]


def _validate(
  record: Any, where: str, clusters: _ClusterIds, columns: Columns = DEFAULT_COLUMNS
) -> dict[str, Any]:
  """Checks one record and returns it as a row with cluster and difficulty filled in (and the
  columns of `columns` renamed to prompt, answer and cluster)."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: a row must be a JSON object, got {_describe(record)}")
  prompt = record.get(columns.prompt)
  if prompt is None:
    raise DataError(f"{where}: missing {columns.prompt!r}{_found(record, columns.prompt)}")
  messages = record.get(MESSAGES)
  if isinstance(prompt, list):  # a chat: its last user turn is the prompt
    messages = prompt
  elif isinstance(prompt, str) and not prompt.strip():
    raise DataError(
      f"{where}: {columns.prompt!r} must be a non-empty string, got {_describe(prompt)}"
    )
  elif not isinstance(prompt, str):
    raise DataError(
      f"{where}: {columns.prompt!r} must be a non-empty string or a list of {{role, content}} "
      f"messages, got {_describe(prompt)}"
    )
  if messages is not None:
    messages = chat_messages(messages, f"{where}: {columns.prompt!r}")
    prompt = messages[-1]["content"]
  if columns.answer not in record:
    raise DataError(f"{where}: missing {columns.answer!r}{_found(record, columns.answer)}")
  answer = record[columns.answer]
  if not isinstance(answer, str):
    raise DataError(
      f"{where}: {columns.answer!r} must be a string, got {_describe(answer)} "
      f'(write it as "{answer}")'
    )
  if columns.answer_regex:
    answer = extract_answer(answer, columns.answer_regex, where)
  row = dict(record)
  for column, key in zip(columns[:3], ("prompt", "answer", "cluster"), strict=True):
    if column != key:
      row.pop(column, None)
  row["prompt"], row["answer"] = prompt, answer
  if messages is not None:
    row[MESSAGES] = messages
  cluster = record.get(columns.cluster)
  row["cluster"] = clusters.missing(where) if cluster is None else clusters.id_of(cluster, where)
  row["difficulty"] = _difficulty(record.get("difficulty"), where)
  return row


def chat_messages(value: Any, where: str) -> list[dict[str, str]]:
  """A chat's messages up to its last user turn (TRL's conversational rows: a list of {role,
  content} strings; later turns, e.g. the reference answer, are left out); DataError naming
  `where` otherwise."""
  if not isinstance(value, list) or not value:
    raise DataError(f"{where} must be a non-empty list of {{role, content}} messages")
  for i, message in enumerate(value, start=1):
    fields = ("role", "content")
    if not isinstance(message, dict) or not all(isinstance(message.get(f), str) for f in fields):
      raise DataError(f"{where}: message {i} must be {{role, content}} strings, got {message!r}")
  users = [i for i, m in enumerate(value) if m["role"] == "user"]
  if not users or not value[users[-1]]["content"].strip():
    raise DataError(f"{where}: no 'user' turn with content among the messages")
  return [{"role": m["role"], "content": m["content"]} for m in value[: users[-1] + 1]]


def _difficulty(value: Any, where: str) -> float:
  if value is None:
    return math.nan
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    raise DataError(f"{where}: 'difficulty' must be a finite number, got {_describe(value)}")
  return float(value)


def _found(record: dict, column: str) -> str:
  """ " (columns: ...)" when `column` is not a key of `record`: the names it could have meant."""
  if column in record:
    return ""
  return f" (columns: {', '.join(sorted(record)) or 'none'})"


def _short(text: str) -> str:
  return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def _describe(value: Any) -> str:
  text = repr(value)
  text = text if len(text) <= 40 else text[:37] + "..."
  return f"{type(value).__name__} {text}"
