"""One tiny training run with wandb offline, read back from the offline run's `.wandb` file: its
scalars, config and sample tables."""

import glob
import json
import os
import struct

import pytest

from ebpo_jax import metrics
from tests.helpers import runs
from tests.helpers.tensorboard import read_event_files


def _wandb_records(path: str):
  """The Records of a `.wandb` file: a 7-byte header (`:W&B`, magic, version), then LevelDB log
  records (32 KiB blocks; each chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST) of protobuf
  `wandb.proto.wandb_internal_pb2.Record`s. wandb 0.31 has no Python reader of its own."""
  from wandb.proto import wandb_internal_pb2

  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", data[:7]
  pos, block, payload = 7, 32 * 1024, b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    payload += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST: a whole record
      yield wandb_internal_pb2.Record.FromString(payload)
      payload = b""


def test_a_run_with_wandb_offline_logs_the_scalars_config_and_samples(arith_run):
  # arith_run: 4 RL steps with wandb offline and a samples table every 2 steps (ARITH_LOGGING).
  workdir, _ = arith_run
  (run_dir,) = glob.glob(str(workdir / "wandb" / "offline-run-*"))
  run_id = (workdir / metrics.WANDB_RUN_ID_FILE).read_text().strip()
  records = list(_wandb_records(os.path.join(run_dir, f"run-{run_id}.wandb")))
  kinds = [r.WhichOneof("record_type") for r in records]
  (run,) = [r.run for r, kind in zip(records, kinds, strict=True) if kind == "run"]
  assert (run.display_name, list(run.tags)) == (workdir.name, ["ebpo", "test"])
  config = {u.key: json.loads(u.value_json) for u in run.config.update}
  assert config["rl"]["advantage"] == "ebpo" and config["rl"]["group_size"] == 4
  assert config["logging"]["wandb"] is True
  history = {}
  for r, kind in zip(records, kinds, strict=True):
    if kind == "history":
      items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
      history[items["_step"]] = items
  # Every scalar of metrics.jsonl, with its key and step (NaN: null in metrics.jsonl).
  lines = [line for line in metrics.read_metrics(workdir) if line["step"] >= 0]  # not the SFT's
  assert sorted(history) == [line["step"] for line in lines] == [0, 1, 2, 3, 4]
  for line in lines:
    for key, value in line.items():
      if key != "step" and value is not None:
        assert history[line["step"]][key] == pytest.approx(value), (line["step"], key)
  assert history[1][metrics.LEARNING_RATE] == pytest.approx(1e-4)
  # A samples table at steps 2 and 4 with the rows of samples.jsonl.
  samples = [json.loads(x) for x in (workdir / metrics.SAMPLES_FILE).read_text().splitlines()]
  assert [s["step"] for s in samples] == [2] * 6 + [4] * 6
  assert {s["cluster"] for s in samples} <= {"add_1", "add_2"}
  assert "samples/_type" not in history[1] | history[3]
  for step in (2, 4):
    assert history[step]["samples/_type"] == "table-file"
    with open(os.path.join(run_dir, "files", history[step]["samples/path"])) as f:
      table = json.load(f)
    columns = ["step", "prompt", "completion", "answer", "reward", "advantage", "cluster"]
    assert table["columns"] == columns
    assert table["data"] == [[s[c] for c in columns] for s in samples if s["step"] == step]


def test_the_warm_starts_loss_is_logged_every_step_before_rl_and_plotted(arith_run):
  """arith_run's 5 supervised steps: `sft/loss` at steps -5..-1 (RL starts at 0), in
  metrics.jsonl and TensorBoard, and its panel. Before: only the final loss, on stderr."""
  workdir, _ = arith_run
  sft = [m for m in metrics.read_metrics(workdir) if metrics.SFT_LOSS in m]
  assert [m["step"] for m in sft] == [-5, -4, -3, -2, -1]
  assert all(set(m) == {"step", metrics.SFT_LOSS} and m[metrics.SFT_LOSS] > 0 for m in sft)
  events = [e for f in read_event_files(workdir / metrics.TENSORBOARD_DIR) for e in f]
  scalars = [(e.step, v.simple_value) for e in events for v in e.summary.value]
  tb = [(step, value) for step, value in scalars if step < 0]
  assert tb == [(m["step"], pytest.approx(m[metrics.SFT_LOSS])) for m in sft]
  assert (workdir / metrics.PLOTS_DIR / "sft_loss.png").read_bytes()[:8] == runs.PNG
