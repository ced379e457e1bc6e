"""Atomic writes of local files: a reader sees the old file or the whole new one, never a part.

The one copy of the temporary-file-and-rename pattern. A base-layer module: it imports nothing of
the project, so every layer may use it.

The data goes to `.NAME.PID.tmp` in the directory of NAME (a rename is atomic only within one file
system; the pid keeps two processes writing the same path from sharing a temporary file), is
fsync'ed, and `os.replace`s NAME. On any error, an interrupt included, the temporary file is
removed and NAME keeps its old content.
"""

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import BinaryIO

__all__ = ["write_atomic", "write_lines"]


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes `data` (text as UTF-8, or bytes) to the local file `path` atomically; creates the
  parent directories."""
  payload = data.encode("utf-8") if isinstance(data, str) else data
  with _replacing(path) as f:
    f.write(payload)


def write_lines(path: str | os.PathLike, lines: Iterable[str]) -> None:
  """Writes each string of `lines` and a newline after it (e.g. JSONL rows) to `path` atomically.

  `lines` may be a generator: it is consumed while writing, and if it raises, `path` is left as
  it was and the error propagates.
  """
  with _replacing(path) as f:
    for line in lines:
      f.write(line.encode("utf-8") + b"\n")


@contextlib.contextmanager
def _replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
  """A binary file that replaces `path` when the block ends without an error."""
  path = os.fspath(path)
  if "://" in path:
    raise ValueError(f"{path}: atomic writes are for local paths only")
  directory, name = os.path.split(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
  try:
    with open(temporary, "wb") as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(temporary)
    raise
  _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
  """Makes the rename itself durable; skipped where directories cannot be opened (Windows)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:  # some file systems refuse fsync on a directory; the data is already synced
    pass
  finally:
    os.close(fd)
