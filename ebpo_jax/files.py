"""Paths, local or `gs://bucket/...`: the one layer through which the project reads and writes.

Every path a user gives (workdir, data, eval rows, a Hugging Face model directory, a tokenizer)
may be local or on Google Cloud Storage. Remote paths go through `etils.epath` (gs:// by
`gcsfs`); local paths stay on `os`, so local behaviour (atomic renames, fsync) is unchanged. A
base-layer module: it imports nothing of the project, so every layer may use it.

Writes are atomic: a reader sees the old file or the whole new one, never a part.
- Local: the data goes to `.NAME.PID.tmp` in the directory of NAME (a rename is atomic only within
  one file system; the pid keeps two processes writing the same path from sharing a temporary
  file), is fsync'ed, and `os.replace`s NAME. On any error, an interrupt included, the temporary
  file is removed and NAME keeps its old content.
- Remote: the whole content is built in memory and uploaded as one object (an object upload is
  atomic: readers see the old object or the new one); nothing is uploaded when building it fails.

Object stores cannot append, so `Appender` keeps a remote file's content in memory and uploads
all of it on every `flush`; locally it appends to the file.

Libraries that need a local file (safetensors' memory map, a tokenizer directory, the parquet
reader) get one from `local_copy`, which mirrors a remote file or directory into the cache.

The Google Cloud clients follow `STORAGE_EMULATOR_HOST` (gcsfs, google-cloud-storage) and
`TENSORSTORE_GCS_HTTP_URL` (tensorstore, under orbax): the tests point them at a
`gcp-storage-emulator` on loopback.
"""

import contextlib
import fnmatch
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, BinaryIO

import fsspec
from etils import epath

__all__ = [
  "Appender",
  "PathLike",
  "abspath",
  "copy_file",
  "exists",
  "is_remote",
  "isdir",
  "isfile",
  "join",
  "listdir",
  "local_copy",
  "makedirs",
  "move_tree",
  "open_file",
  "read_bytes",
  "read_text",
  "remove",
  "remove_tree",
  "staged_dir",
  "walk_files",
  "write_atomic",
  "write_lines",
  "write_new",
]

PathLike = str | os.PathLike
CACHE_ENV = "EBPO_JAX_CACHE"  # where remote inputs are mirrored (default ~/.cache/ebpo_jax)

# Other processes write the same bucket (the trainer's processes, an evaluation, an ablation's
# runs): a listing or existence check must ask the store. gcsfs would answer from the listings it
# cached, so a file another process wrote since stayed missing for this process.
fsspec.config.conf.setdefault("gcs", {})["use_listings_cache"] = False


def is_remote(path: PathLike) -> bool:
  """Whether `path` names an object store (`gs://...`) rather than a local file."""
  return "://" in os.fspath(path)


def _path(path: PathLike) -> epath.Path:
  return epath.Path(os.fspath(path))


def join(base: PathLike, *names: str) -> str:
  """`base/name/...` as a string; remote paths keep their scheme (`gs://b/run/metrics.jsonl`)."""
  base = os.fspath(base)
  if is_remote(base):
    return "/".join([base.rstrip("/"), *(n.strip("/") for n in names)])
  return os.path.join(base, *names)


def abspath(path: PathLike) -> str:
  """`path` made absolute against the working directory; a remote path is absolute already
  (`os.path.abspath` would make `gs://b/run` into `CWD/gs:/b/run`)."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)


def exists(path: PathLike) -> bool:
  return _path(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: PathLike) -> bool:
  return _path(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: PathLike) -> bool:
  return _path(path).is_file() if is_remote(path) else os.path.isfile(path)


def listdir(path: PathLike) -> list[str]:
  """The names in directory `path`, sorted."""
  if is_remote(path):
    return sorted(p.name for p in _path(path).iterdir())
  return sorted(os.listdir(path))


def walk_files(path: PathLike) -> list[str]:
  """The files under directory `path`, as '/'-separated paths relative to it, in the order of
  their parts (`a/x` before `a-b/x`), local and remote alike."""
  if is_remote(path):
    root = _path(path)
    found = ["/".join(item.relative_to(root).parts) for item in _walk_files(root)]
  else:
    found = [
      os.path.relpath(os.path.join(directory, name), path).replace(os.sep, "/")
      for directory, _, names in os.walk(path)
      for name in names
    ]
  return sorted(found, key=lambda relative: relative.split("/"))


def makedirs(path: PathLike) -> None:
  """Creates directory `path` and its parents (object stores need none: a no-op there)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def open_file(path: PathLike, mode: str = "r") -> IO:
  """`path` opened for reading ("r", "rb"); for writing use `write_atomic` or `Appender`."""
  if mode not in ("r", "rb"):
    raise ValueError(f"open_file reads only (mode 'r' or 'rb'), got {mode!r}")
  if is_remote(path):
    return _path(path).open(mode)
  return open(path, mode, encoding=None if "b" in mode else "utf-8")  # noqa: SIM115 (the caller's)


def read_bytes(path: PathLike) -> bytes:
  with open_file(path, "rb") as f:
    return f.read()


def read_text(path: PathLike) -> str:
  return read_bytes(path).decode("utf-8")


def write_atomic(path: PathLike, data: str | bytes) -> None:
  """Writes `data` (text as UTF-8, or bytes) to `path` atomically; creates local parents."""
  payload = data.encode("utf-8") if isinstance(data, str) else data
  with _replacing(path) as f:
    f.write(payload)


def default_file_mode() -> int:
  """The mode `open()` gives a new file: 0666 less the process umask. Read without `os.umask`,
  which can only be read by setting it (for that moment, for every thread of the process)."""
  try:
    with open("/proc/self/status") as f:
      umask = next((line.split()[1] for line in f if line.startswith("Umask:")), None)
    if umask is not None:
      return 0o666 & ~int(umask, 8)
  except OSError:
    pass  # no procfs (macOS): create a file and look
  with tempfile.TemporaryDirectory(prefix="ebpo_jax_mode_") as directory:
    probe = os.path.join(directory, "probe")
    os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o666))
    return stat.S_IMODE(os.stat(probe).st_mode)


def write_lines(path: PathLike, lines: Iterable[str]) -> None:
  """Writes each string of `lines` and a newline after it (e.g. JSONL rows) to `path` atomically.

  `lines` may be a generator: it is consumed while writing, and if it raises, `path` is left as
  it was and the error propagates.
  """
  with _replacing(path) as f:
    for line in lines:
      f.write(line.encode("utf-8") + b"\n")


def copy_file(source: PathLike, target: PathLike) -> None:
  """Copies one file, local or remote either side; the target is written atomically."""
  write_atomic(target, read_bytes(source))


@contextlib.contextmanager
def staged_dir(path: PathLike) -> Iterator[str]:
  """A local directory for writing the files of directory `path` with libraries that need local
  files (safetensors, a tokenizer's `save_pretrained`): `path` itself when local (created); for a
  remote `path`, a temporary directory whose files are copied into `path` (`copy_file`, each file
  one atomic upload) when the block ends without an error, then removed."""
  if not is_remote(path):
    makedirs(path)
    yield os.fspath(path)
    return
  with tempfile.TemporaryDirectory(prefix="ebpo_jax_staged_") as staging:
    yield staging
    for relative in walk_files(staging):
      copy_file(os.path.join(staging, relative), join(path, relative))


def write_new(path: PathLike, data: str) -> bool:
  """Creates file `path` holding `data` only if no file `path` exists: True when created, False
  when one existed. Atomic between processes (a lock): locally `O_EXCL`, on GCS an upload with
  `ifGenerationMatch=0`, which the store refuses when the object exists."""
  payload = data.encode("utf-8")
  if is_remote(path):
    store, name = fsspec.core.url_to_fs(os.fspath(path))
    try:
      store.pipe_file(name, payload, mode="create")
    except FileExistsError:
      return False
    return True
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "wb") as f:
    f.write(payload)
  return True


def remove(path: PathLike) -> None:
  """Deletes file `path` if it exists."""
  if is_remote(path):
    with contextlib.suppress(FileNotFoundError):
      _path(path).unlink()
  else:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def remove_tree(path: PathLike) -> None:
  """Deletes directory `path` and everything under it, if it exists."""
  if is_remote(path):
    if _path(path).exists():
      _path(path).rmtree()
  else:
    shutil.rmtree(path, ignore_errors=True)


def move_tree(source: PathLike, target: PathLike) -> None:
  """Moves directory `source` to `target` (which must not exist), creating its parents. Remote:
  each object is copied within the store (no download), then the originals are deleted (not
  gcsfs's `mv`: it first tries the moveTo API, which only hierarchical-namespace buckets serve,
  and retries it for half a minute elsewhere)."""
  if is_remote(source):
    store = fsspec.filesystem("gs")
    store.copy(os.fspath(source), os.fspath(target), recursive=True)
    store.rm(os.fspath(source), recursive=True)
  else:
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    os.rename(source, target)


@contextlib.contextmanager
def _replacing(path: PathLike) -> Iterator[BinaryIO]:
  """A binary file that replaces `path` when the block ends without an error."""
  path = os.fspath(path)
  if is_remote(path):
    buffer = _MemoryFile()
    yield buffer
    _path(path).write_bytes(buffer.getvalue())
    return
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


class _MemoryFile:
  """The write side of a binary file, kept in memory until it is uploaded whole."""

  def __init__(self):
    self._parts: list[bytes] = []

  def write(self, data: bytes) -> int:
    self._parts.append(bytes(data))
    return len(data)

  def getvalue(self) -> bytes:
    return b"".join(self._parts)


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


class Appender:
  """Appends text to `path`. Locally an open file, flushed on `flush` and fsync'ed on `sync`;
  remotely the whole content (what the file held when opened, then every append) is uploaded as
  one object on either."""

  def __init__(self, path: PathLike):
    self.path = os.fspath(path)
    self._remote = is_remote(self.path)
    if self._remote:
      self._content = read_text(self.path) if exists(self.path) else ""
      self._dirty = False
    else:
      makedirs(os.path.dirname(os.path.abspath(self.path)))
      self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
    self._unsynced = False  # written to since the last sync

  def write(self, text: str) -> None:
    self._unsynced = True
    if self._remote:
      self._content += text
      self._dirty = True
    else:
      self._file.write(text)

  def sync(self) -> None:
    """What was appended is durable: fsync'ed locally (when anything new was), uploaded remotely."""
    self.flush()
    if self._unsynced and not self._remote:
      os.fsync(self._file.fileno())
    self._unsynced = False

  def flush(self) -> None:
    if self._remote:
      if self._dirty:
        write_atomic(self.path, self._content)
        self._dirty = False
    else:
      self._file.flush()

  def close(self) -> None:
    self.flush()
    if not self._remote:
      self._file.close()


def cache_dir() -> str:
  """Where remote inputs are mirrored: $EBPO_JAX_CACHE, else ~/.cache/ebpo_jax."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "ebpo_jax")


def local_copy(path: PathLike, *, exclude: Iterable[str] = ()) -> str:
  """A local path with the content of `path`: `path` itself when local; for `gs://...` a file or
  directory tree mirrored under `cache_dir()/remote/`. A mirrored file is reused while its
  object is unchanged (the store's checksum of the object's metadata, generation included, is
  kept beside the mirror); others are downloaded (to a temporary name, then renamed into place).
  Files of a directory whose name matches a glob pattern of `exclude` (e.g. "*.safetensors" for
  a model directory's tokenizer) are not mirrored."""
  path = os.fspath(path)
  if not is_remote(path):
    return path
  source = _path(path)
  digest = hashlib.sha256(path.rstrip("/").encode()).hexdigest()[:16]
  root = os.path.join(cache_dir(), "remote", digest)
  target = os.path.join(root, source.name)
  if source.is_dir():
    patterns = tuple(exclude)
    for relative in walk_files(path):
      if not any(fnmatch.fnmatch(relative.rsplit("/", 1)[-1], p) for p in patterns):
        _mirror_file(join(path, relative), root, os.path.join(source.name, *relative.split("/")))
  elif source.exists():
    _mirror_file(path, root, source.name)
  else:
    raise FileNotFoundError(f"{path}: no such file or directory")
  return target


def _walk_files(directory: epath.Path) -> Iterator[epath.Path]:
  for item in sorted(directory.iterdir()):
    if item.is_dir():
      yield from _walk_files(item)
    else:
      yield item


def _mirror_file(source: str, root: str, relative: str) -> None:
  """Downloads `source` to `root/relative` unless `root.sums/relative` names its checksum."""
  store, name = fsspec.core.url_to_fs(source)
  checksum = str(store.checksum(name))
  target, sums = os.path.join(root, relative), os.path.join(root + ".sums", relative)
  if os.path.isfile(target) and os.path.isfile(sums) and read_text(sums) == checksum:
    return
  os.makedirs(os.path.dirname(target), exist_ok=True)
  fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".download.")
  try:
    os.fchmod(fd, default_file_mode())  # mkstemp's 0600, as every other file we write: 0666 - umask
    with os.fdopen(fd, "wb") as out, store.open(name, "rb") as f:
      shutil.copyfileobj(f, out, length=1 << 24)
    os.replace(temporary, target)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(temporary)
    raise
  write_atomic(sums, checksum)
