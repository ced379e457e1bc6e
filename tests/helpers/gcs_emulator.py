"""`gcp-storage-emulator` with the generation headers that Google Cloud Storage sends on a download.

  python tests/helpers/gcs_emulator.py start --host=HOST --port=PORT --in-memory --default-bucket=B

The same command line as `gcp-storage-emulator`. Real GCS answers an object download with
`x-goog-generation` and `x-goog-metageneration`; the emulator leaves them out. tensorstore (under
orbax) reads an object's generation from that header and makes its next conditional write on it,
so without it every OCDBT checkpoint write fails with "Malformed StorageGeneration". This adds the
two headers, from the object's own metadata. It also refuses an upload with `ifGenerationMatch=0`
when the object exists (412 Precondition Failed) as GCS does: a workdir lock on a bucket is such a
create-only upload (gcsfs `mode="create"`); the emulator would overwrite.
"""

import sys
import threading
from http import HTTPStatus

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


_uploads_lock = threading.Lock()  # check-then-create is one step, also between request threads


def create_only(upload):
  """`upload` (the emulator's media or multipart upload) that answers 412 when the request asks
  for `ifGenerationMatch=0` and the object exists."""

  def guarded(request, response, storage):
    if request.query.get("ifGenerationMatch") != ["0"]:
      return upload(request, response, storage)
    name = request.query["name"][0] if "name" in request.query else request.data["meta"]["name"]
    with _uploads_lock:
      try:
        storage.get_file_obj(request.params["bucket_name"], name)
      except NotFound:
        return upload(request, response, storage)
      response.status = HTTPStatus.PRECONDITION_FAILED
      response.json({"error": {"code": 412, "message": "Precondition Failed"}})

  return guarded


if __name__ == "__main__":
  objects._media_upload = create_only(objects._media_upload)
  objects._multipart_upload = create_only(objects._multipart_upload)
  objects.download = download  # before the server module binds its routes to the handler
  from gcp_storage_emulator.__main__ import main

  sys.exit(main())
