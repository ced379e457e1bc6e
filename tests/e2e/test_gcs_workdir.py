"""Outputs on a gs:// workdir from processes, against the storage emulator: a listing sees what
another process wrote; a run on the bucket that lost its latest checkpoint (as a run that died
before it completed) resumes exactly from the bucket, then evaluates and exports reading the run
from there; a failed ablation run uploads its log."""

import json
import shutil
import subprocess
import sys

import pytest
from tensorboardX.proto import event_pb2

from ebpo_jax import ablate, export, files
from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.gcs import upload
from tests.helpers.processes import run_module, run_trainer
from tests.helpers.runs import PNG
from tests.helpers.tensorboard import read_event_files


def comparable(lines: list[dict]) -> list[dict]:
  """Metrics without wall-clock timings, which differ between runs by nature."""
  return [{k: v for k, v in m.items() if k not in metrics_lib.TIMING_KEYS} for m in lines]


def tensorboard_scalars(events_per_file: list[list]) -> dict[tuple[str, int], list[float]]:
  """{(tag, step): values} of the scalars as TensorBoard reads the event files (oldest first, as
  `read_event_files` gives them): a SessionLog START at step s (tensorboardX's purge_step) drops
  the earlier events with step >= s. A (tag, step) with two values: the resume did not purge."""
  scalars: dict[tuple[str, int], list[float]] = {}
  for event in (event for events in events_per_file for event in events):
    if event.session_log.status == event_pb2.SessionLog.START:
      scalars = {key: v for key, v in scalars.items() if key[1] < event.step}
    for value in event.summary.value:
      if value.WhichOneof("value") != "simple_value":  # the config's text and hparams
        continue
      scalars.setdefault((value.tag, event.step), []).append(value.simple_value)
  return scalars


# ----------------------------------------------------------------------------- processes


def test_a_listing_sees_what_another_process_wrote_since(gcs_dir):
  files.write_atomic(files.join(gcs_dir, "a"), "a")
  path = files.join(gcs_dir, "sub", "b")
  assert files.listdir(gcs_dir) == ["a"] and not files.exists(path)
  write = f"from ebpo_jax import files; files.write_atomic({path!r}, 'b')"
  subprocess.run([sys.executable, "-c", write], check=True, cwd=ROOT, timeout=120)
  assert files.listdir(gcs_dir) == ["a", "sub"] and files.exists(path)


def test_a_run_on_a_bucket_resumes_exactly_then_evaluates_and_exports_from_it(
  arith_run, gcs_dir, tmp_path
):
  reference, _ = arith_run  # 4 steps on 8 devices in a local workdir, checkpoints at 2 and 4
  # Its workdir on the bucket as a run that died before checkpoint 4 completed: the lines of steps
  # 3 and 4 are there, the checkpoint is not (nor its plots). The run resumes from checkpoint 2 and
  # writes steps 3 and 4 again. (A run trains into a bucket from scratch in e2e/test_gcs.py.)
  died = tmp_path / "died"
  shutil.copytree(reference, died, ignore=shutil.ignore_patterns("lock", "plots"))
  shutil.rmtree(died / "checkpoints" / "4")
  upload(died, gcs_dir)
  resumed = run_trainer(gcs_dir, "--config.train.num_steps=4", plots=True, devices=8)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "] resuming from step 2\n" in resumed.stderr
  written = files.walk_files(gcs_dir)
  assert {"checkpoints/4/commit_success.txt", "plots/reward.png"} <= set(written)
  assert len([name for name in written if name.startswith("tensorboard/events.")]) == 2
  assert f"plots in {gcs_dir}/plots/" in resumed.stdout
  assert files.read_bytes(files.join(gcs_dir, "plots", "reward.png")).startswith(PNG)
  lines = metrics_lib.read_metrics(gcs_dir)
  assert comparable(lines) == comparable(metrics_lib.read_metrics(reference))
  # TensorBoard: the second event file purges steps >= 3 of the first; one value per (tag, step),
  # the metrics.jsonl one.
  scalars = tensorboard_scalars(read_event_files(files.join(gcs_dir, metrics_lib.TENSORBOARD_DIR)))
  logged = {(k, m["step"]): v for m in lines for k, v in m.items() if k != "step" and v is not None}
  assert scalars.keys() == logged.keys()
  wrong = {key: (v, logged[key]) for key, v in scalars.items() if v != pytest.approx([logged[key]])}
  assert not wrong

  # evaluate and export read the run from the bucket and write there.
  config = "--config=configs/arith_ebpo.py:runlocal"
  evaluated = run_module("ebpo_jax.evaluate", config, f"--workdir={gcs_dir}")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  saved = json.loads(files.read_text(files.join(gcs_dir, "eval.json")))
  assert saved["params"] == {"kind": "checkpoint", "run_dir": gcs_dir, "step": 4}
  samples = files.read_text(files.join(gcs_dir, "eval_samples.jsonl")).splitlines()
  assert len(samples) == saved["num_problems"] > 0
  out = files.join(gcs_dir, "hf")
  exported = run_module("ebpo_jax.export", f"--run_dir={gcs_dir}", f"--out={out}")
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert f"step 4 of {gcs_dir} -> {out};" in exported.stdout
  local = export.export(gcs_dir, str(tmp_path / "hf"))  # the same export, to local disk
  assert local["step"] == 4
  names = files.walk_files(out)
  assert names == files.walk_files(tmp_path / "hf") == ["config.json", "model.safetensors"]
  for name in names:
    assert files.read_bytes(files.join(out, name)) == (tmp_path / "hf" / name).read_bytes()

  # The ablation report reads runs and writes its files on the bucket as on disk.
  run = ablate.Run("ebpo_running", 4, 0)
  result = ablate.summarize_run(gcs_dir, run)
  assert result["curve"]["step"] == [0, 2, 4]
  ablation = files.join(gcs_dir, "ablation")
  files.write_atomic(files.join(ablation, "runs", run.name, ablate.RESULT_FILE), json.dumps(result))
  assert ablate.load_results(ablation) == [result]
  (plot,) = ablate.plot_ablation(ablation, [result])
  assert plot == files.join(ablation, "plots", "ablation_accuracy_G4.png")
  assert files.read_bytes(plot).startswith(PNG)
  assert not (ROOT / "gs:").exists()  # nothing went to a local folder named after the scheme


def test_a_failed_ablation_run_on_a_bucket_uploads_its_log(gcs_dir):
  warm = files.join(gcs_dir, "warm_start", "s0")
  with pytest.raises(ablate.AblationError, match=f"log: {warm}/log.txt") as error:
    ablate.run_ablation(
      f"{ROOT}/configs/arith_ebpo.py:runlocal",
      gcs_dir,
      variants=["grpo"],
      group_sizes=[4],
      seeds=1,
      overrides=["--config.rl.ebpo.decay=1.5"],  # the warm start stops on it
      progress=False,
    )
  log = files.read_text(files.join(warm, "log.txt"))
  assert log.startswith("$ ") and "config.rl.ebpo.decay=1.5: must lie in (0, 1]" in log
  assert "must lie in (0, 1]" in str(error.value)  # the log's tail
  assert not files.exists(files.join(gcs_dir, "ablation.md"))
