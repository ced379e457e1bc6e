"""Directories written by Hugging Face `datasets`' `save_to_disk`, read with pyarrow alone.

A Dataset directory holds `state.json` (whose `_data_files` list its Arrow files in row order),
`dataset_info.json` and the Arrow files `data-0000K-of-0000N.arrow`, each an Arrow IPC stream. A
DatasetDict directory holds `dataset_dict.json` (`{"splits": [...]}`) and one Dataset directory per
split, named after it. `datasets` itself is not needed (nor imported): it is a test dependency only.
Local or `gs://...` (a remote Dataset directory is mirrored by `files.local_copy`, only the split
read).
"""

import json
from collections.abc import Iterator
from typing import Any

from ebpo_jax import files
from ebpo_jax.errors import DataError

STATE = "state.json"  # a Dataset directory
DATASET_DICT = "dataset_dict.json"  # a DatasetDict directory
_BATCH_ROWS = 8192


def is_saved_dataset(path: files.PathLike) -> bool:
  """Whether `path` is a directory that `save_to_disk` wrote (a Dataset or a DatasetDict)."""
  return files.isdir(path) and (
    files.isfile(files.join(path, STATE)) or files.isfile(files.join(path, DATASET_DICT))
  )


def splits(path: str) -> list[str] | None:
  """The split names of a DatasetDict directory, or None for a Dataset directory."""
  index = files.join(path, DATASET_DICT)
  if not files.isfile(index):
    return None
  content = _json(index)
  names = content.get("splits") if isinstance(content, dict) else None
  if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
    raise DataError(f'{index}: expected {{"splits": [names]}}, got {_short(content)}')
  return names


def dataset_dir(path: str, split: str | None, split_option: str = "data.split") -> str:
  """The Dataset directory to read: `path` itself, or for a DatasetDict its split `split`. With
  `split=None` a DatasetDict is refused (the caller reads a single split's folder)."""
  names = splits(path)
  if names is None:
    return path
  if split is None:
    example = files.join(path, names[0])
    raise DataError(
      f"{path}: a DatasetDict (splits: {', '.join(names)}); give one split's folder, e.g. {example}"
    )
  if split not in names:
    raise DataError(
      f"{path}: no split {split!r} in this DatasetDict (splits: {', '.join(names)}); "
      f"choose one with {split_option}"
    )
  chosen = files.join(path, split)
  if not files.isfile(files.join(chosen, STATE)):
    raise DataError(f"{chosen}: split {split!r} has no {STATE} (not written by save_to_disk?)")
  return chosen


def records(
  path: str, split: str | None = "train", split_option: str = "data.split"
) -> Iterator[tuple[str, Any]]:
  """Yields ("ARROW_FILE:ROW", record dict) for every row of a saved Dataset, or of split `split`
  of a saved DatasetDict, in the dataset's order (ROW counts from 1 in each Arrow file)."""
  directory = dataset_dir(path, split, split_option)
  local = files.local_copy(directory)
  for name in _data_files(directory):
    yield from _arrow_records(files.join(directory, name), files.join(local, name))


def _data_files(directory: str) -> list[str]:
  """The Arrow file names that `state.json` lists, in row order."""
  state_path = files.join(directory, STATE)
  state = _json(state_path)
  entries = state.get("_data_files") if isinstance(state, dict) else None
  if not isinstance(entries, list) or not all(
    isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries
  ):
    raise DataError(f"{state_path}: no '_data_files' list of {{\"filename\": ...}} entries")
  names = [entry["filename"] for entry in entries]
  for name in names:
    if not files.isfile(files.join(directory, name)):
      raise DataError(f"{files.join(directory, name)}: no such file (listed in {state_path})")
  return names


def _json(path: str) -> Any:
  try:
    return json.loads(files.read_text(path))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise DataError(f"{path}: malformed JSON ({e})") from e


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _arrow_records(shown: str, local: str) -> Iterator[tuple[str, Any]]:
  """Rows of one Arrow file (IPC stream, as `datasets` writes; or IPC file), named by `shown`."""
  import pyarrow as pa

  try:
    with pa.memory_map(local) as source:
      try:
        table = pa.ipc.open_stream(source).read_all()
      except pa.ArrowInvalid:
        source.seek(0)
        table = pa.ipc.open_file(source).read_all()
      row = 0
      for batch in table.to_batches(max_chunksize=_BATCH_ROWS):
        for record in batch.to_pylist():
          row += 1
          yield f"{shown}:{row}", record
  except (pa.ArrowException, OSError) as e:
    raise DataError(f"{shown}: unreadable Arrow file ({e})") from e
