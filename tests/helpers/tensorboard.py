"""TensorBoard event files read back without TensorFlow."""

import struct

from ebpo_jax import files


def read_event_files(logdir) -> list[list]:
  """The events of each tensorboardX event file in `logdir` (local or gs://), oldest file first:
  TFRecord framing (length, its CRC, the event, its CRC) read by hand, no TensorFlow."""
  from tensorboardX.proto import event_pb2

  names = sorted(n for n in files.listdir(logdir) if n.startswith("events.out.tfevents."))
  per_file = []
  for name in names:  # events.out.tfevents.<time>.<host>: oldest first
    data, events, pos = files.read_bytes(files.join(logdir, name)), [], 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos : pos + 8])
      events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
      pos += 12 + length + 4
    per_file.append(events)
  return per_file
