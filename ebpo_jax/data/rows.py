"""Rows of prompts from JSONL or Parquet files (local or `gs://...`), validated up front.

A row is a plain dict `{"prompt": str, "answer": str, "cluster": int, "difficulty": float}`; other
keys in the file are kept as they are (e.g. metadata a verifier needs). `cluster` defaults to 0 and
`difficulty` to NaN (higher = harder). Clusters may be written as ints (ids, names "0", "1", ...) or
as strings (names, numbered in order of first appearance) but not both in one file.
"""

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ebpo_jax import files

SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
  """A data file or row that cannot be used; the message starts with `FILE:LINE:`."""


def load_rows(path: files.PathLike) -> list[dict[str, Any]]:
  """Reads and validates every row of a JSONL or Parquet file; DataError on the first bad one."""
  rows, _ = load_rows_and_clusters(path)
  return rows


def load_rows_and_clusters(path: files.PathLike) -> tuple[list[dict[str, Any]], list[str]]:
  """Like `load_rows`, also returning the cluster names (index = cluster id)."""
  rows, names, _ = load_checked_rows(path)
  return rows, names


# Bad rows listed in one DataError, one line each, before the rest are counted.
MAX_LISTED = 20


def load_checked_rows(
  path: files.PathLike, check: Callable[[dict], str | None] | None = None, *, skip_bad: bool = False
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
  """Rows, cluster names and the `FILE:LINE: problem` of each bad row: not UTF-8, not JSON, not a
  valid row, or a row for which `check` returns a problem (e.g. a prompt the tokenizer cannot
  encode). With `skip_bad` the bad rows are dropped; otherwise one DataError lists them all."""
  path = os.fspath(path)
  suffix = os.path.splitext(path)[1]
  if not files.isfile(path):
    raise DataError(f"{path}: no such file")
  if suffix not in SUFFIXES:
    raise DataError(f"{path}: unknown file type {suffix!r}; expected one of {SUFFIXES}")
  records = _jsonl_records(path) if suffix == ".jsonl" else _parquet_records(path)
  clusters = _ClusterIds()
  rows, problems = [], []
  for line, record in records:
    try:
      row = _checked_row(record, f"{path}:{line}", clusters, check)
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


def _checked_row(record: Any, where: str, clusters: "_ClusterIds", check) -> dict[str, Any]:
  if isinstance(record, DataError):
    raise record
  row = _validate(record, where, clusters)
  problem = check(row) if check is not None else None
  if problem:
    raise DataError(f"{where}: {problem}")
  return row


def _jsonl_records(path: str) -> Iterator[tuple[int, Any]]:
  """Yields (1-based line number, parsed JSON value or the line's DataError) for each non-blank
  line. Lines end at \\n only (JSON strings may hold U+2028 and other separators)."""
  with files.open_file(path, "rb") as f:
    for line_number, raw in enumerate(f, start=1):
      if raw.strip():
        yield line_number, _parsed(raw, f"{path}:{line_number}")


def _parsed(raw: bytes, where: str) -> Any:
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    return DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})")


def _parquet_records(path: str) -> Iterator[tuple[int, Any]]:
  """Yields (1-based row number, row dict) for each row of a Parquet file."""
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
  yield from enumerate(table.to_pylist(), start=1)


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


def _validate(record: Any, where: str, clusters: _ClusterIds) -> dict[str, Any]:
  """Checks one record and returns it as a row with cluster and difficulty filled in."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: a row must be a JSON object, got {_describe(record)}")
  prompt = record.get("prompt")
  if prompt is None:
    raise DataError(f"{where}: missing 'prompt'")
  if not isinstance(prompt, str) or not prompt.strip():
    raise DataError(f"{where}: 'prompt' must be a non-empty string, got {_describe(prompt)}")
  if "answer" not in record:
    raise DataError(f"{where}: missing 'answer'")
  answer = record["answer"]
  if not isinstance(answer, str):
    raise DataError(
      f"{where}: 'answer' must be a string, got {_describe(answer)} (write it as \"{answer}\")"
    )
  row = dict(record)
  cluster = record.get("cluster")
  row["cluster"] = clusters.missing(where) if cluster is None else clusters.id_of(cluster, where)
  row["difficulty"] = _difficulty(record.get("difficulty"), where)
  return row


def _difficulty(value: Any, where: str) -> float:
  if value is None:
    return math.nan
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    raise DataError(f"{where}: 'difficulty' must be a finite number, got {_describe(value)}")
  return float(value)


def _describe(value: Any) -> str:
  text = repr(value)
  text = text if len(text) <= 40 else text[:37] + "..."
  return f"{type(value).__name__} {text}"
