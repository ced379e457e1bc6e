"""`gcp-storage-emulator` with the generation headers that Google Cloud Storage sends on a download.

  python tests/gcs_emulator.py start --host=localhost --port=PORT --in-memory --default-bucket=B

The same command line as `gcp-storage-emulator`. Real GCS answers an object download with
`x-goog-generation` and `x-goog-metageneration`; the emulator leaves them out. tensorstore (under
orbax) reads an object's generation from that header and makes its next conditional write on it,
so without it every OCDBT checkpoint write fails with "Malformed StorageGeneration". This adds the
two headers, from the object's own metadata, and changes nothing else.
"""

import sys

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
  """The emulator's download, with the object's generation headers as GCS sends them."""
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
  except NotFound:  # the emulator's own handler answers 404
    obj = None
  if obj is not None:
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
  return _download(request, response, storage, *args, **kwargs)


if __name__ == "__main__":
  objects.download = download  # before the server module binds its routes to the handler
  from gcp_storage_emulator.__main__ import main

  sys.exit(main())
