"""The storage emulator's bucket, as the gs:// tests use it."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from ebpo_jax import files
from tests.helpers import ROOT

GCS_BUCKET = "ebpo-test"


def upload(local: str | os.PathLike, remote: str) -> str:
  """Copies a local file, or every file of a local directory, to `remote`; returns `remote`."""
  if os.path.isdir(local):
    for relative in files.walk_files(local):
      files.copy_file(os.path.join(local, relative), files.join(remote, relative))
  else:
    files.copy_file(local, remote)
  return remote


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running_emulator() -> Iterator[str]:
  """A Google Cloud Storage API on loopback (`gcp-storage-emulator`, started by
  tests/helpers/gcs_emulator.py, in memory) with the bucket GCS_BUCKET; this process and its
  children use it while the context is open (gcsfs and google-cloud-storage follow
  STORAGE_EMULATOR_HOST, tensorstore TENSORSTORE_GCS_HTTP_URL). Yields its URL."""
  port = _free_port()
  url = f"http://localhost:{port}"
  server = subprocess.Popen(
    [
      sys.executable,
      str(ROOT / "tests" / "helpers" / "gcs_emulator.py"),  # with GCS's generation headers
      "start",
      "--host=localhost",
      f"--port={port}",
      "--in-memory",
      f"--default-bucket={GCS_BUCKET}",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.monotonic() + 30
  while True:
    try:
      socket.create_connection(("localhost", port), timeout=1).close()
      break
    except OSError:
      if server.poll() is not None or time.monotonic() > deadline:
        server.kill()
        raise RuntimeError(f"gcp-storage-emulator did not start on port {port}") from None
      time.sleep(0.1)
  emulator_env = {
    "STORAGE_EMULATOR_HOST": url,
    "TENSORSTORE_GCS_HTTP_URL": url,
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
    "GOOGLE_CLOUD_PROJECT": "test",
  }
  saved = {k: os.environ.get(k) for k in emulator_env}
  os.environ.update(emulator_env)
  yield url
  for key, value in saved.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  server.terminate()
  server.wait(timeout=10)
