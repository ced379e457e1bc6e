r"""Math data sets in their usual Hugging Face layouts, and any other by its column names, read into
project rows.

`read_source(name, path)` reads a copy (a `.jsonl`, `.json` or `.parquet` file, a directory of
them, all read in sorted order, or a directory that `datasets`' `save_to_disk` wrote, of which a
DatasetDict's split `split` is read; local or `gs://...`, as is `prepare`'s output) and returns rows
`{"prompt", "answer", "cluster", "difficulty", "source", "id"}`: the bare problem text (instruction
wrappers such as DAPO's "Solve the following math problem step by step..." removed), the gold answer
as a string (`\boxed{}` and `$...$` removed, numbers without a trailing `.0`), a topic cluster (else
the source name) and a difficulty (the MATH level, else NaN). Exactly repeated prompts are kept once
(DAPO-Math-17k repeats each of its ~17k prompts about 100 times). `champ` takes no path: it reads
the installed `champ-dataset` package (270 problems), the offline evaluation set.

Expected columns of each source, the ids read and the copies known to work: see
`ebpo_jax.data.sources`. Source `generic` reads the columns that `columns` (`--prompt_column`,
`--answer_column`, `--cluster_column`) names, the answer optionally cut out of the answer column by
`--answer_regex`. Bad input (a missing column, a malformed line, an empty answer) raises
`DataError` starting with `FILE:LINE:` (LINE is the row number in a Parquet or Arrow file).

Command line (writes JSONL that `ebpo_jax.data.load_rows_and_clusters` reads back):

  python -m ebpo_jax.data.prepare --source=math500 --path=MATH-500/test.jsonl --out=math500.jsonl
  # several sources into one file; /data/raw holds math500/ (or math500.jsonl), aime24/, ...
  python -m ebpo_jax.data.prepare --source=math500,aime24,aime25,amc23,olympiadbench \
      --path=/data/raw --out=math_eval.jsonl
  # any data set; here GSM8K saved by datasets' save_to_disk (a DatasetDict: --split=test for its
  # test split); its answers end in "#### 42"
  python -m ebpo_jax.data.prepare --source=generic --path=/data/raw/gsm8k --out=gsm8k.jsonl \
      --prompt_column=question --answer_column=answer --answer_regex='####\s*(.+)'
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
from ebpo_jax.data import saved_dataset
from ebpo_jax.data.rows import Columns
from ebpo_jax.data.sources import (
  LAYOUTS,
  SOURCES,
  Layout,
  champ_rows,
  generic_layout,
  parse_row,
  skip_reason,
)
from ebpo_jax.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH = 8192
_METADATA_FILES = ("dataset_info.json", "dataset_infos.json", "state.json")  # not rows


# ----------------------------------------------------------------------------- public API


def read_source(
  name: str, path: str | None = None, *, split: str = "train", columns: Columns | None = None
) -> list[dict[str, Any]]:
  """Rows of source `name` (one of SOURCES) read from `path` (a DatasetDict: its split `split`);
  `columns` for source `generic` only (default: prompt, answer, cluster); DataError on bad input."""
  rows, dropped = _read(name, path, split, columns)
  if dropped:
    logging.info("%s: dropped %s", name, _describe_dropped(dropped))
  return rows


def prepare(
  source: str,
  path: str | None,
  out: str,
  limit: int | None = None,
  *,
  split: str = "train",
  columns: Columns | None = None,
) -> str:
  """Writes the rows of `source` to the JSONL file `out` atomically; returns a one-line summary.

  `source` may be a comma list (e.g. an evaluation file of several benchmarks): then `path` is a
  directory holding each source's copy as `<source>` or `<source>.jsonl/.json/.parquet` (champ
  needs none), and `limit` applies to each source. `split` is the split read of a copy that is a
  DatasetDict directory; `columns` are those of source `generic` (which is read alone).
  """
  if os.path.splitext(out)[1] != ".jsonl":
    raise DataError(f"{out}: the output must be a .jsonl file")
  if limit is not None and limit < 1:
    raise DataError(f"--limit must be >= 1, got {limit}")
  names = [name.strip() for name in source.split(",") if name.strip()]
  if "generic" in names and len(names) > 1:
    raise DataError(f"--source={source}: generic reads one data set; prepare it on its own")
  rows, dropped, counts = [], collections.Counter(), []
  for name in names:
    source_path = _source_path(name, path) if len(names) > 1 else path
    source_rows, source_dropped = _read(name, source_path, split, columns)
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


def _read(
  name: str, path: str | None, split: str, columns: Columns | None
) -> tuple[list[dict[str, Any]], collections.Counter]:
  """Rows of `name` and the number of records dropped per reason."""
  if name not in SOURCES:
    raise DataError(f"unknown source {name!r}; expected one of {', '.join(SOURCES)}")
  if columns is not None and name != "generic":
    raise DataError(
      f"column names (--prompt_column, ...) are for --source=generic; {name} knows its own"
    )
  dropped = collections.Counter()
  if name == "champ":
    if path is not None:
      raise DataError("champ is read from the installed champ-dataset package; it takes no path")
    return list(_unique(champ_rows(), dropped)), dropped
  if path is None:
    raise DataError(f"{name} needs a path to a copy (a file or a directory)")
  layout = generic_layout(columns or Columns()) if name == "generic" else LAYOUTS[name]
  rows = list(_unique(_source_rows(name, layout, _records(path, split), dropped), dropped))
  if not rows:
    left = f" left ({_describe_dropped(dropped)} dropped)" if dropped else ""
    raise DataError(f"{path}: no rows{left}")
  return rows, dropped


def _source_rows(
  name: str, layout: Layout, records: Iterator[tuple[str, Any]], dropped: collections.Counter
) -> Iterator[dict[str, Any]]:
  for index, (where, record) in enumerate(records):
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


def _records(path: str, split: str) -> Iterator[tuple[str, Any]]:
  """Yields ("FILE:LINE", record) for each record of a file, of each data file in a directory, or
  of a `save_to_disk` directory (a DatasetDict: its split `split`)."""
  if saved_dataset.is_saved_dataset(path):
    yield from saved_dataset.records(path, split, split_option="--split")
    return
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
  named = dict(
    prompt=f.prompt_column,
    answer=f.answer_column,
    cluster=f.cluster_column,
    answer_regex=f.answer_regex,
  )
  named = {field: value for field, value in named.items() if value is not None}
  columns = Columns(**named) if named or f.source == "generic" else None
  try:
    print(prepare(f.source, f.path, f.out, f.limit, split=f.split, columns=columns))
  except DataError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  flags.DEFINE_string(
    "source", None, f"Data set, or a comma list of math data sets, of: {', '.join(SOURCES)}."
  )
  flags.DEFINE_string(
    "path",
    None,
    "A copy (local or gs://): a .jsonl/.json/.parquet file or a directory (several sources: a "
    "directory holding <source> or <source>.jsonl/.json/.parquet for each).",
  )
  flags.DEFINE_string("out", None, "Output .jsonl file of project rows (local or gs://).")
  flags.DEFINE_integer("limit", None, "Keep only the first N rows of each source (after dedup).")
  flags.DEFINE_string("split", "train", "The split read of a copy that is a DatasetDict directory.")
  flags.DEFINE_string("prompt_column", None, "--source=generic: the prompt's column (prompt).")
  flags.DEFINE_string("answer_column", None, "--source=generic: the answer's column (answer).")
  flags.DEFINE_string("cluster_column", None, "--source=generic: the cluster's column (cluster).")
  flags.DEFINE_string(
    "answer_regex",
    None,
    "--source=generic: the answer is this regex's last match in the answer column (its first group "
    "if it has one); GSM8K: '####\\s*(.+)'. Unset: the column as it is.",
  )
  flags.mark_flags_as_required(["source", "out"])
  from ebpo_jax import cli  # here: cli imports JAX, and verifier workers import ebpo_jax.data

  app.run(main, flags_parser=cli.parse_flags)  # --help exits 0
