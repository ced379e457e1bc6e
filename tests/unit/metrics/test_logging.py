"""Logging beyond metrics.jsonl (ebpo_jax.metrics): sample completion tables (samples.jsonl,
TensorBoard text, wandb Table), the config as TensorBoard hparams and wandb config, the learning
rate, wandb's run per workdir (the tiny training run with wandb offline: e2e/test_logging.py)."""

import glob
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboardX.proto import plugin_hparams_pb2

from ebpo_jax import errors, jsonable, metrics
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts import worker as worker_lib
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import optimizer as optimizer_lib
from tests.helpers.configs import arith_config
from tests.helpers.tensorboard import read_event_files


def _tb_texts(events_per_file) -> dict[tuple[str, int], str]:
  """{(tag, step): text} of the text summaries of `read_event_files(logdir)`."""
  return {
    (v.tag, e.step): v.tensor.string_val[0].decode()
    for events in events_per_file
    for e in events
    for v in e.summary.value
    if v.metadata.plugin_data.plugin_name == "text"
  }


ROWS = [
  {"prompt": "1+2=", "completion": "3", "answer": "3", "reward": 1.0, "advantage": 0.5},
  {"prompt": "1+2=", "completion": "4|5\nx", "answer": "3", "reward": np.float32(0.0),
   "advantage": float("nan")},
]  # fmt: skip


def test_samples_go_to_jsonl_and_tensorboard_text_and_a_resume_cuts_them(tmp_path):
  with metrics.MetricsWriter(tmp_path) as writer:
    for step in (1, 2, 3):
      writer.write_samples(step, ROWS)
  lines = [json.loads(line) for line in (tmp_path / metrics.SAMPLES_FILE).read_text().splitlines()]
  assert [r["step"] for r in lines] == [1, 1, 2, 2, 3, 3]
  # Strict JSON: numbers as numbers, NaN as null; the texts unchanged.
  assert lines[1] == {
    "step": 1, "prompt": "1+2=", "completion": "4|5\nx", "answer": "3", "reward": 0.0,
    "advantage": None,
  }  # fmt: skip
  table = _tb_texts(read_event_files(tmp_path / "tensorboard"))[("samples/text_summary", 2)]
  assert table.splitlines() == [
    "| step | prompt | completion | answer | reward | advantage |",
    "|---|---|---|---|---|---|",
    "| 2 | 1+2= | 3 | 3 | 1.0 | 0.5 |",
    "| 2 | 1+2= | 4\\|5\\nx | 3 | 0.0 | None |",  # a cell's | and newline escaped
  ]
  # Resuming from the checkpoint of step 2 drops the samples of step 3 (as metrics.jsonl's lines).
  with metrics.MetricsWriter(tmp_path, resume_step=2) as writer:
    pass
  steps = [
    json.loads(x)["step"] for x in (tmp_path / metrics.SAMPLES_FILE).read_text().splitlines()
  ]
  assert steps == [1, 1, 2, 2]


def test_no_samples_no_file(tmp_path):
  with metrics.MetricsWriter(tmp_path) as writer:
    writer.write(1, {"loss": 1.0})
    writer.write_samples(1, [])
  assert not (tmp_path / metrics.SAMPLES_FILE).exists()


def test_the_config_goes_to_tensorboard_as_hparams_and_as_text(tmp_path):
  hparams = jsonable.to_data(arith_config())
  with metrics.MetricsWriter(tmp_path, hparams=hparams) as writer:
    writer.write(1, {"reward/mean": 0.5})
  events = [e for f in read_event_files(tmp_path / "tensorboard") for e in f]
  by_tag = {v.tag: v for e in events for v in e.summary.value}
  # One event file (not add_hparams' extra run directory): the HPARAMS tab's session ...
  assert glob.glob(str(tmp_path / "tensorboard" / "*" / "events*")) == []
  start = plugin_hparams_pb2.HParamsPluginData.FromString(
    by_tag["_hparams_/session_start_info"].metadata.plugin_data.content
  ).session_start_info.hparams
  assert start["rl.advantage"].string_value == "ebpo"
  assert start["rl.group_size"].number_value == 4
  assert start["rl.dynamic_sampling"].bool_value is False
  assert json.loads(start["task.options.digits"].string_value) == [1, 2]  # a list: as JSON
  experiment = plugin_hparams_pb2.HParamsPluginData.FromString(
    by_tag["_hparams_/experiment"].metadata.plugin_data.content
  ).experiment
  assert {m.name.tag for m in experiment.metric_infos} == {"reward/mean", "eval/accuracy"}
  # ... and the whole config in the TEXT tab, a code block of JSON.
  text = _tb_texts(read_event_files(tmp_path / "tensorboard"))[("config/text_summary", 0)]
  assert json.loads(text) == hparams


def test_sample_rows_are_whole_groups_with_their_advantages():
  g = 3
  rollout = worker_lib.Rollout(
    rows=[
      {"prompt": "p0", "answer": "a0", "cluster": 1},
      {"prompt": "p1", "answer": "a1", "cluster": 0},
    ],
    texts=[f"c{i}" for i in range(2 * g)],
    rewards=np.arange(2 * g, dtype=np.float32).reshape(2, g),
    lengths=np.ones(2 * g, np.int32),
    errors=0,
    **dict.fromkeys(("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask", "old_logps")),
    truncated=None,
    nonfinite=None,
  )
  advantages_bg = -np.arange(2 * g, dtype=np.float32).reshape(2, g) / 10
  rows = rollout_batch.sample_rows(rollout, advantages_bg, ["easy", "hard"], 4)
  assert [(r["prompt"], r["completion"], r["answer"], r["cluster"]) for r in rows] == [
    ("p0", "c0", "a0", "hard"),
    ("p0", "c1", "a0", "hard"),
    ("p0", "c2", "a0", "hard"),
    ("p1", "c3", "a1", "easy"),
  ]
  assert [r["reward"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
  assert [r["advantage"] for r in rows] == pytest.approx([0.0, -0.1, -0.2, -0.3])
  assert len(rollout_batch.sample_rows(rollout, advantages_bg, ["easy", "hard"], 99)) == 2 * g


def test_sample_tables_carry_each_reward_functions_value(tmp_path):
  """rewards.fns: beside the weighted sum, a column per function (None where it returned None),
  in samples.jsonl and TensorBoard's table (wandb's is the same header and cells)."""
  parts = {"math": np.array([[1.0, 0.0]], np.float32), "brevity": np.array([[np.nan, 0.5]])}
  rollout = worker_lib.Rollout(
    rows=[{"prompt": "p0", "answer": "a0", "cluster": 0}],
    texts=["c0", "c1"],
    rewards=np.array([[1.0, 0.25]], np.float32),
    lengths=np.ones(2, np.int32),
    errors=0,
    **dict.fromkeys(("prompt_ids", "prompt_mask", "tokens", "mask", "loss_mask", "old_logps")),
    truncated=None,
    nonfinite=None,
    reward_parts=parts,
  )
  rows = rollout_batch.sample_rows(rollout, np.zeros((1, 2), np.float32), ["all"], 2)
  with metrics.MetricsWriter(tmp_path) as writer:
    writer.write_samples(3, rows)
  lines = [json.loads(x) for x in (tmp_path / metrics.SAMPLES_FILE).read_text().splitlines()]
  assert [(x["reward"], x["reward/math"], x["reward/brevity"]) for x in lines] == [
    (1.0, 1.0, None),
    (0.25, 0.0, 0.5),
  ]
  table = _tb_texts(read_event_files(tmp_path / "tensorboard"))[("samples/text_summary", 3)]
  assert "reward/math" in table and "reward/brevity" in table


def test_learning_rate_is_the_schedule_at_the_applied_updates():
  config = arith_config({"train.warmup_steps": 4, "train.learning_rate": 1e-3})
  optimizer = optimizer_lib.make_optimizer(config)
  schedule = optimizer_lib.learning_rate_schedule(config)
  params = {"w": jnp.zeros(3)}
  opt_state = optimizer.init(params)
  seen = []
  for _ in range(5):
    seen.append(float(optimizer_lib.learning_rate(schedule, opt_state)))
    updates, opt_state = optimizer.update({"w": jnp.ones(3)}, opt_state, params)
    params = optax.apply_updates(params, updates)
  # Linear warmup from 0 over 4 updates, then constant: 0, 1/4, 2/4, 3/4, 1 x 1e-3 (reading
  # Adam's count instead would agree; a count of RL steps would not with several updates a step).
  assert seen == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])


# ----------------------------------------------------------------------------- wandb


def test_wandb_options_and_checks(monkeypatch):
  assert metrics.wandb_options(arith_config().logging) is None  # off by default
  config = arith_config({"logging.wandb": True, "logging.wandb_tags": " ebpo, g4 ,"})
  options = metrics.wandb_options(config.logging)
  assert options == metrics.WandbOptions(project="ebpo-jax", tags=("ebpo", "g4"))
  bad = arith_config({"logging.wandb_mode": "offlien"})
  with pytest.raises(errors.ConfigError, match=r"^config\.logging\.wandb_mode='offlien'"):
    config_lib.check_config(bad, 8)
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
  with pytest.raises(errors.ConfigError) as error:
    config_lib.check_config(config, 8)
  assert str(error.value) == (
    "config.logging.wandb=True: the wandb package is not installed "
    "(pip install -e '.[wandb]' in the checkout)"
  )


class _FakeWandb:
  """The part of the wandb module WandbRun uses, recording its calls."""

  class Table:
    def __init__(self, columns, data):
      self.columns, self.data = columns, data

  def __init__(self, resumed_at: int | None = None):
    self.inits, self.logged, self._resumed_at = [], [], resumed_at

  def init(self, **kwargs):
    self.inits.append(kwargs)
    fake = self

    class Run:
      resumed = fake._resumed_at is not None
      step = fake._resumed_at or 0

      def log(self, values, step):
        fake.logged.append((step, values))

      def finish(self):
        fake.logged.append("finish")

    return Run()


def test_a_workdir_keeps_one_wandb_run_and_a_resume_continues_it(tmp_path, monkeypatch):
  workdir = tmp_path / "run_a"
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.delenv("WANDB_DIR", raising=False)
  options = metrics.WandbOptions(project="p", tags=("x",))
  with metrics.MetricsWriter(workdir, hparams={"rl": {"advantage": "ebpo"}}, wandb=options) as w:
    w.write(1, {"reward/mean": 0.5, "grad_norm": float("nan")})
    w.write_samples(1, ROWS[:1])
  first = fake.inits[0]
  run_id = (workdir / metrics.WANDB_RUN_ID_FILE).read_text().strip()
  assert first["id"] == run_id and first["resume"] == "allow"
  assert first["name"] == "run_a" and first["project"] == "p" and first["tags"] == ["x"]
  assert first["config"] == {"rl": {"advantage": "ebpo"}} and first["dir"] == str(workdir)
  (step, scalars), (table_step, table), done = fake.logged
  assert (step, scalars["reward/mean"], np.isnan(scalars["grad_norm"])) == (1, 0.5, True)
  assert table_step == 1 and done == "finish"
  assert table["samples"].columns == ["step", *ROWS[0]]
  assert table["samples"].data == [[1, "1+2=", "3", "3", 1.0, 0.5]]
  # The next start on the workdir continues the run; wandb already has steps up to 3 (the dead
  # run logged past its checkpoint), so the steps redone below that are not sent again.
  fake = _FakeWandb(resumed_at=3)
  monkeypatch.setitem(sys.modules, "wandb", fake)
  with metrics.MetricsWriter(workdir, resume_step=1, wandb=options) as w:
    for step in (2, 3, 4):
      w.write(step, {"reward/mean": 0.5})
  assert fake.inits[0]["id"] == run_id
  assert [entry[0] for entry in fake.logged[:-1]] == [3, 4]


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch when it is installed (2-4 s of every trainer's start, for a
  writer that never sees a torch tensor). The writer keeps it out; torch still imports after."""
  script = f"""
import sys
from ebpo_jax import metrics
with metrics.MetricsWriter({str(tmp_path)!r}) as writer:
  writer.write(1, {{"loss": 1.0}})
assert "torch" not in sys.modules, "the writer imported torch"
import torch
print(float(torch.ones(2).sum()))
"""
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == "2.0"
  assert os.listdir(tmp_path / "tensorboard")  # the event file was written
