r"""Math data sets in their usual Hugging Face layouts, read into project rows.

`read_source(name, path)` reads a copy (a `.jsonl`, `.json` or `.parquet` file, or a directory of
them, all read in sorted order; local or `gs://...`, as is `prepare`'s output) and returns rows
`{"prompt", "answer", "cluster", "difficulty", "source", "id"}`: the bare problem text (instruction
wrappers such as DAPO's "Solve the following math problem step by step..." removed), the gold answer
as a string (`\boxed{}` and `$...$` removed, numbers without a trailing `.0`), a topic cluster (else
the source name) and a difficulty (the MATH level, else NaN). Exactly repeated prompts are kept once
(DAPO-Math-17k repeats each of its ~17k prompts about 100 times). `champ` takes no path: it reads
the installed `champ-dataset` package (270 problems), the offline evaluation set.

Expected columns of each source, the ids read and the copies known to work: see
`ebpo_jax.data.sources`. Bad input (a missing column, a malformed line, an empty answer) raises
`DataError` starting with `FILE:LINE:` (LINE is the row number in a Parquet file).

Command line (writes JSONL that `ebpo_jax.data.load_rows_and_clusters` reads back):

  python -m ebpo_jax.data.prepare --source=math500 --path=MATH-500/test.jsonl --out=math500.jsonl
  # several sources into one file; /data/raw holds math500/ (or math500.jsonl), aime24/, ...
  python -m ebpo_jax.data.prepare --source=math500,aime24,aime25,amc23,olympiadbench \
      --path=/data/raw --out=math_eval.jsonl
"""

import collections
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from absl import app, flags, logging

from ebpo_jax import files
from ebpo_jax.data.rows import DataError
from ebpo_jax.data.sources import LAYOUTS, SOURCES, champ_rows, parse_row, skip_reason

SUFFIXES = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH = 8192
_METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "state.json")  # not rows


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
  if os.path.splitext(out)[1] != ".jsonl":
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
  _write_jsonl_atomically(out, rows)
  clusters = len({row["cluster"] for row in rows})
  per_source = f" ({', '.join(counts)})" if len(names) > 1 else ""
  detail = f" ({_describe_dropped(dropped)})" if dropped else ""
  return (
    f"{','.join(names)}: {len(rows)} rows{per_source}, {clusters} clusters, "
    f"{sum(dropped.values())} dropped{detail} -> {out}"
  )


def _source_path(name: str, directory: str | None) -> str | None:
  """The copy of `name` in `directory`: `<name>` or `<name>.<suffix>`; None for champ."""
  if name == "champ":
    return None
  if directory is None or not files.isdir(directory):
    raise DataError(f"several sources need --path to be a directory of copies, got {directory}")
  candidates = [files.join(directory, f"{name}{suffix}") for suffix in ("", *SUFFIXES)]
  found = next((c for c in candidates if files.exists(c)), None)
  if found is None:
    raise DataError(
      f"{directory}: no {name} copy (expected {name}/ or {name}{{{','.join(SUFFIXES)}}})"
    )
  return found


# ----------------------------------------------------------------------------- reading


def _read(name: str, path: str | None) -> tuple[list[dict[str, Any]], collections.Counter]:
  """Rows of `name` and the number of records dropped per reason."""
  if name not in SOURCES:
    raise DataError(f"unknown source {name!r}; expected one of {', '.join(SOURCES)}")
  dropped = collections.Counter()
  if name == "champ":
    if path is not None:
      raise DataError("champ is read from the installed champ-dataset package; it takes no path")
    return list(_unique(champ_rows(), dropped)), dropped
  if path is None:
    raise DataError(f"{name} needs a path to a copy (a file or a directory)")
  rows = list(_unique(_source_rows(name, path, dropped), dropped))
  if not rows:
    left = f" left ({_describe_dropped(dropped)} dropped)" if dropped else ""
    raise DataError(f"{path}: no rows{left}")
  return rows, dropped


def _source_rows(name: str, path: str, dropped: collections.Counter) -> Iterator[dict[str, Any]]:
  layout = LAYOUTS[name]
  for index, (where, record) in enumerate(_records(path)):
    skipped = skip_reason(record) if layout.skip_images_and_proofs else None
    if skipped:
      dropped[skipped] += 1
    else:
      yield parse_row(name, layout, record, where, index)


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


def _records(path: str) -> Iterator[tuple[str, Any]]:
  """Yields ("FILE:LINE", record) for each record of a file or of each data file in a directory."""
  if files.isdir(path):
    data_files = [files.join(path, relative) for relative in _data_files(path)]
    if not data_files:
      raise DataError(f"{path}: no {'/'.join(SUFFIXES)} files in this directory")
  elif files.isfile(path):
    suffix = os.path.splitext(path)[1]
    if suffix not in SUFFIXES:
      raise DataError(f"{path}: unknown file type {suffix!r}; expected one of {SUFFIXES}")
    data_files = [path]
  else:
    raise DataError(f"{path}: no such file or directory")
  for file in data_files:
    if file.endswith(".parquet"):
      yield from _parquet_records(file)
    else:
      yield from _json_records(file)


def _data_files(directory: str) -> list[str]:
  """The data files under `directory` (relative paths, sorted), without metadata or hidden ones."""
  return [
    relative
    for relative in files.walk_files(directory)
    if os.path.splitext(relative)[1] in SUFFIXES
    and relative.rsplit("/", 1)[-1] not in _METADATA_FILES
    and not any(part.startswith(".") for part in relative.split("/"))
  ]


def _json_records(path: str) -> Iterator[tuple[str, Any]]:
  """Records of a JSON array file or of a JSONL file (also when it is named `.json`)."""
  text = files.read_text(path)
  if text.lstrip().startswith("["):
    yield from _json_array_records(path, text)
    return
  # Lines end at \n only: splitlines would also break at U+2028 and the like inside strings.
  for line_number, line in enumerate(text.split("\n"), start=1):
    if line.strip():
      try:
        yield f"{path}:{line_number}", json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(
          f"{path}:{line_number}: malformed JSON ({e.msg} at column {e.colno})"
        ) from e


def _json_array_records(path: str, text: str) -> Iterator[tuple[str, Any]]:
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


def _parquet_records(path: str) -> Iterator[tuple[str, Any]]:
  """Records of a Parquet file, read in batches (DAPO-Math-17k's file has ~1.8M rows)."""
  import pyarrow.parquet as pq

  try:
    parquet = pq.ParquetFile(files.local_copy(path))
    row_number = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH):
      for record in batch.to_pylist():
        row_number += 1
        yield f"{path}:{row_number}", record
  except Exception as e:  # pyarrow raises several types for unreadable files
    raise DataError(f"{path}: unreadable Parquet file ({e})") from e


# ----------------------------------------------------------------------------- writing


def _write_jsonl_atomically(path: str, rows: list[dict[str, Any]]) -> None:
  """Writes rows as JSONL, atomically; NaN difficulties are left out."""
  records = (
    {k: v for k, v in row.items() if not (k == "difficulty" and math.isnan(v))} for row in rows
  )
  files.write_lines(path, (json.dumps(record, ensure_ascii=False) for record in records))


def _describe_dropped(dropped: collections.Counter) -> str:
  return ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()) if n)


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
    "A copy (local or gs://): a .jsonl/.json/.parquet file or a directory (several sources: a "
    "directory holding <source> or <source>.jsonl/.json/.parquet for each).",
  )
  flags.DEFINE_string("out", None, "Output .jsonl file of project rows (local or gs://).")
  flags.DEFINE_integer("limit", None, "Keep only the first N rows of each source (after dedup).")
  flags.mark_flags_as_required(["source", "out"])
  app.run(main)
