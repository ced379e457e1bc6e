"""The storage emulator's bucket, as the gs:// tests use it."""

import os

from ebpo_jax import files


def upload(local: str | os.PathLike, remote: str) -> str:
  """Copies a local file, or every file of a local directory, to `remote`; returns `remote`."""
  if os.path.isdir(local):
    for relative in files.walk_files(local):
      files.copy_file(os.path.join(local, relative), files.join(remote, relative))
  else:
    files.copy_file(local, remote)
  return remote
