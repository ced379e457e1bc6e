"""gs:// inputs and several hosts on a bucket, against the storage emulator (conftest's
`gcs_emulator`, `gcs_dir`), nothing mocked: rows, prepared and clustered data, a Hugging Face
model directory and its tokenizer read from the bucket as from local disk; a trainer run whose
`data.path` and `model.path` are on the bucket; two processes (launch/local_multiprocess.sh)
training into a gs:// workdir and resuming from it, equal to one process on local disk."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebpo_jax import checkpoint, errors, files, models, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.data import DataError, cluster, load_rows_and_clusters, prepare
from ebpo_jax.models import gguf_io, hf_io
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer import task_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = [
  {"prompt": "1+2=", "answer": "3", "cluster": "add_1", "difficulty": 0.5},
  {"prompt": "12+30=", "answer": "42", "cluster": "add_2", "extra": [1, 2]},
  {"prompt": "4+4=", "answer": "8", "cluster": "add_1"},
]


def upload(local: str | os.PathLike, remote: str) -> str:
  """Copies a local file, or every file of a local directory, to `remote`; returns `remote`."""
  if os.path.isdir(local):
    for relative in files.walk_files(local):
      files.copy_file(os.path.join(local, relative), files.join(remote, relative))
  else:
    files.copy_file(local, remote)
  return remote


def same(a, b) -> bool:
  """Rows equal, NaN difficulties included."""
  nan = lambda row: {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row}
  return [nan(r.items()) for r in a] == [nan(r.items()) for r in b]


# ----------------------------------------------------------------------------- rows and data


def test_rows_jsonl_and_parquet_load_from_the_bucket_as_from_disk(gcs_dir, tmp_path):
  jsonl = tmp_path / "rows.jsonl"
  jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  parquet = tmp_path / "rows.parquet"
  pq.write_table(
    pa.Table.from_pylist([{k: r[k] for k in ("prompt", "answer")} for r in ROWS]), parquet
  )
  for local in (jsonl, parquet):
    remote = upload(local, files.join(gcs_dir, local.name))
    (rows, names), (want_rows, want_names) = (
      load_rows_and_clusters(remote),
      load_rows_and_clusters(local),
    )
    assert same(rows, want_rows) and names == want_names
  task = tasks.get_task(
    "jsonl", path=files.join(gcs_dir, "rows.jsonl"), eval_path=files.join(gcs_dir, "rows.jsonl")
  )
  assert task.name == "jsonl:rows.jsonl" and task.cluster_names == ["add_1", "add_2"]


def test_bad_rows_on_the_bucket_fail_with_the_local_one_line_messages(gcs_dir, tmp_path):
  missing = files.join(gcs_dir, "missing.jsonl")
  with pytest.raises(DataError, match=f"^{missing}: no such file$"):
    load_rows_and_clusters(missing)
  bad = files.join(gcs_dir, "bad.jsonl")
  files.write_atomic(bad, '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
  with pytest.raises(DataError, match=f"^{bad}:2: malformed JSON"):
    load_rows_and_clusters(bad)
  broken = files.join(gcs_dir, "broken.parquet")
  files.write_atomic(broken, b"not parquet")
  with pytest.raises(DataError, match=f"^{broken}: unreadable Parquet file"):
    load_rows_and_clusters(broken)


def test_prepare_and_cluster_read_and_write_the_bucket(gcs_dir, capsys):
  """prepare: a gs:// directory of copies in, gs:// rows out; cluster: gs:// in and out."""
  copies = files.join(gcs_dir, "raw")
  math500 = [
    {"problem": f"What is {i}+{i}?", "answer": str(2 * i), "subject": s, "level": 1}
    for i, s in enumerate(["Algebra", "Geometry", "Algebra"])
  ]
  files.write_lines(files.join(copies, "math500", "test.jsonl"), map(json.dumps, math500))
  files.write_lines(
    files.join(copies, "aime25.jsonl"), [json.dumps({"problem": "Hard?", "answer": "7"})]
  )
  out = files.join(gcs_dir, "prepared.jsonl")
  summary = prepare.prepare("math500,aime25", copies, out)
  assert summary.endswith(f"-> {out}") and "4 rows" in summary
  rows, names = load_rows_and_clusters(out)
  assert [r["prompt"] for r in rows][-1] == "Hard?" and names == ["Algebra", "Geometry", "aime25"]
  assert (
    prepare.read_source("math500", files.join(copies, "math500"))[0]["prompt"] == "What is 0+0?"
  )

  clustered = files.join(gcs_dir, "clustered.jsonl")
  assert cluster.main([f"--input={out}", f"--output={clustered}", "--from_column=source"]) == 0
  rows, names = load_rows_and_clusters(clustered)
  assert names == ["math500", "aime25"] and [r["cluster"] for r in rows] == [0, 0, 0, 1]
  missing = files.join(gcs_dir, "nope.jsonl")
  assert cluster.main([f"--input={missing}", f"--output={clustered}"]) == 1
  assert f"{missing}: no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- model directories


@pytest.fixture
def gcs_llama(tiny_llama_dir, gcs_dir) -> str:
  """conftest's tiny Llama directory (weights, config, SmolLM2's tokenizer) on the bucket."""
  return upload(tiny_llama_dir, files.join(gcs_dir, "tiny_llama"))


def test_model_directory_loads_from_the_bucket_as_from_disk(
  gcs_llama, tiny_llama_dir, tmp_path, monkeypatch
):
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / "cache"))
  local_model, local_params = models.from_pretrained(str(tiny_llama_dir))
  model, params = models.from_pretrained(gcs_llama)
  assert model.config == local_model.config
  jax.tree.map(np.testing.assert_array_equal, params, local_params)

  tokenizer = tokenizers.HFTokenizer(gcs_llama)
  local = tokenizers.HFTokenizer(str(tiny_llama_dir))
  text = "What is 12+30? Think, then answer."
  assert tokenizer.vocab_size == local.vocab_size == 49152
  assert tokenizer.prompt_ids(text, "Be brief.") == local.prompt_ids(text, "Be brief.")
  assert tokenizer.encode(text) == local.encode(text) and tokenizer.stop_ids == local.stop_ids
  assert tokenizer.decode(local.encode(text)) == text
  # The tokenizer's mirror holds no weights (load_params mirrors each weight file on its own).
  mirror = files.walk_files(files.local_copy(gcs_llama, exclude=tokenizers.WEIGHT_FILES))
  assert "tokenizer.json" in mirror and not any(name.endswith(".safetensors") for name in mirror)


def test_save_pretrained_to_the_bucket_round_trips(tiny_llama_dir, gcs_dir, tmp_path, monkeypatch):
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / "cache"))
  model, params = models.from_pretrained(str(tiny_llama_dir))
  out = files.join(gcs_dir, "export")
  tokenizer = tokenizers.HFTokenizer(str(tiny_llama_dir)).hf_tokenizer
  models.save_pretrained(out, model, params, tokenizer=tokenizer, max_shard_bytes=40_000)
  written = files.walk_files(out)
  assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(written)
  assert sum(name.endswith(".safetensors") for name in written) > 1  # sharded
  again, reloaded = models.from_pretrained(out)
  assert again.config == model.config
  jax.tree.map(np.testing.assert_array_equal, reloaded, params)
  assert tokenizers.HFTokenizer(out).encode("12+30=") == tokenizers.HFTokenizer(
    str(tiny_llama_dir)
  ).encode("12+30=")


def test_missing_model_directory_names_it_on_the_bucket_as_on_disk(gcs_dir, tmp_path, load_config):
  missing = files.join(gcs_dir, "no_model")
  with pytest.raises(FileNotFoundError, match=f"{missing}/config.json not found"):
    hf_io.read_hf_config(missing)
  with pytest.raises(FileNotFoundError, match=f"^{missing}: no such tokenizer"):
    tokenizers.HFTokenizer(missing)
  with pytest.raises(FileNotFoundError, match="no_model.gguf"):
    gguf_io.convert_gguf(f"{missing}.gguf", files.join(gcs_dir, "converted"))
  for path in (missing, str(tmp_path / "no_model")):  # the trainer's one line, remote and local
    config = load_config("configs/arith_ebpo.py:runlocal", {"model.path": path})
    with pytest.raises(errors.ConfigError) as error:
      task_rows.load_tokenizer(config, None)
    assert str(error.value) == (
      f"config.model.path='{path}': not a Hugging Face model directory "
      f"({files.join(path, 'config.json')} not found)"
    )


# ----------------------------------------------------------------------------- the trainer


def _metrics(workdir) -> list[dict]:
  """metrics.jsonl of a run (local or gs://) without the timings."""
  lines = files.read_text(files.join(workdir, "metrics.jsonl")).splitlines()
  records = [json.loads(line) for line in lines]
  return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.mark.e2e
def test_a_run_on_bucket_data_and_model_matches_the_run_on_local_copies(
  trainer_cli, tiny_llama_dir, gcs_dir, tmp_path, monkeypatch
):
  monkeypatch.setenv(files.CACHE_ENV, str(tmp_path / "cache"))  # the trainer's mirrors
  task = tasks.get_task("arithmetic", ops=("add",), digits=(1, 2))
  rows = [
    {"prompt": r["prompt"], "answer": r["answer"], "cluster": task.cluster_names[r["cluster"]]}
    for r in task.rows("train", 32, 0)
  ]
  data = tmp_path / "rows.jsonl"
  files.write_lines(data, map(json.dumps, rows))
  sources = {
    "local": (data, tiny_llama_dir),
    "bucket": (upload(data, f"{gcs_dir}/rows.jsonl"), upload(tiny_llama_dir, f"{gcs_dir}/llama")),
  }
  for name, (data_path, model_path) in sources.items():
    result = trainer_cli(
      tmp_path / name,
      f"--config.data.path={data_path}",
      f"--config.model.path={model_path}",
      "--config.sft.num_steps=0",
      "--config.train.num_steps=2",
      "--config.task.num_eval=2",
      "--config.eval.every_steps=100",
      "--config.checkpoint.every_steps=100",
      devices=1,
    )
    assert result.returncode == 0, result.stderr[-3000:]
  local, bucket = _metrics(tmp_path / "local"), _metrics(tmp_path / "bucket")
  assert [m["step"] for m in bucket] == [m["step"] for m in local] == [0, 1, 2]
  for want, have in zip(local, bucket, strict=True):
    assert have.keys() == want.keys()
    for key, value in want.items():
      assert have[key] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), key
  assert len(files.walk_files(tmp_path / "cache")) > 0  # the bucket's model was mirrored


# ----------------------------------------------------------------------------- several hosts

TWO_PROCESS_RUN = (
  f"--config={ROOT}/configs/arith_ebpo.py:runlocal",
  "--config.sft.num_steps=0",
  "--config.checkpoint.every_steps=2",
  "--config.eval.every_steps=2",
  "--config.rewards.workers=0",
  "--config.rl.loss.entropy_coef=0.01",  # the random model's rewards are all 0: this moves it
  "--config.mesh.data=1",
  "--config.mesh.fsdp=8",
  "--config.mesh.tensor=1",
)


def _train(processes: int, workdir, num_steps: int, cwd, env: dict) -> subprocess.CompletedProcess:
  """TWO_PROCESS_RUN for `num_steps` from `cwd` in `env` (8 CPU devices: conftest's
  `cpu_process_env`): 2 processes x 4 devices by launch/local_multiprocess.sh (the emulator's
  variables pass through it), or one process on the 8. Their compiled programs go to the session's
  compilation cache (conftest's), which the session's other trainer runs share: the one-process
  run's sampler programs are those of every default-job run on 8 devices (arith_run's, say)."""
  env = env | {
    "PYTHONPATH": str(ROOT),  # cwd may be elsewhere
    "JAX_COMPILATION_CACHE_DIR": os.environ["EBPO_JAX_TEST_XLA_CACHE"],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }
  if processes == 1:
    launcher = [sys.executable, "-m", "ebpo_jax.train"]
  else:
    launcher = [ROOT / "launch" / "local_multiprocess.sh", str(processes)]
    env.update(PYTHON=sys.executable)
  args = [*TWO_PROCESS_RUN, f"--workdir={workdir}", f"--config.train.num_steps={num_steps}"]
  return subprocess.run(
    launcher + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
  )


def _same_metrics(got: list[dict], expected: list[dict]) -> None:
  """Line for line the same keys and values (to float32 reduction-order noise), timings aside."""
  assert [m["step"] for m in got] == [m["step"] for m in expected]
  for want, have in zip(expected, got, strict=True):
    assert have.keys() == want.keys()
    keys = sorted(k for k in want if not k.startswith("time/"))
    np.testing.assert_allclose(
      [have[k] for k in keys], [want[k] for k in keys], rtol=1e-5, atol=1e-7, err_msg=str(keys)
    )


@pytest.mark.e2e
def test_two_processes_train_into_a_bucket_resume_from_it_and_equal_one_process(
  gcs_dir, tmp_path, arith_config, cpu_process_env
):
  """launch/local_multiprocess.sh 2 into a gs:// workdir, stopped after step 2 and resumed from
  the bucket to step 3: process 0 writes metrics.jsonl (each line once), both processes write
  their shards of every checkpoint, and the metrics equal one process's on local disk."""
  workdir, cwd = files.join(gcs_dir, "run"), tmp_path / "cwd"
  cwd.mkdir()
  env = cpu_process_env(8)
  single = _train(1, tmp_path / "one", 3, ROOT, env)
  assert single.returncode == 0, single.stderr[-3000:]
  for num_steps in (2, 3):
    result = _train(2, workdir, num_steps, cwd, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    assert "[rank 0] " in result.stdout and "[rank 1] " in result.stdout
    lines = files.read_text(files.join(workdir, "metrics.jsonl")).splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(num_steps + 1))
    assert len(set(lines)) == len(lines)
  expected = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").open()]
  assert set(metrics_lib.TIMING_KEYS) <= set(expected[1])
  _same_metrics([json.loads(line) for line in lines], expected)
  assert expected[1]["grad_norm"] > 0  # the update did something that both runs had to agree on
  assert os.listdir(cwd) == []  # nothing written locally (no folder named "gs:")
  written = files.walk_files(workdir)
  assert [name for name in written if name.endswith(".jsonl")] == ["metrics.jsonl"]
  assert sum("tfevents" in name for name in written) == 2  # process 0's, one per run
  for rank in (0, 1):  # every process wrote its shards of the last checkpoint
    assert any(name.startswith(f"checkpoints/3/state/ocdbt.process_{rank}/") for name in written)
  checkpoints = files.join(workdir, "checkpoints")
  assert [n for n in files.listdir(checkpoints) if n.isdigit()] == ["2", "3"]  # max_to_keep=2

  # The 2-process checkpoint restores in this process (8 devices, another layout of processes).
  config = arith_config({"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1})
  model = models.build.make_model(config, tasks.get_task("arithmetic").tokenizer.vocab_size)
  mesh = sharding.make_mesh(dict(config.mesh))
  with checkpoint.Checkpointer(checkpoints) as ckpt:
    at_2 = jax.tree.leaves(ckpt.restore_params(2, models.build.abstract_params(model, mesh)))
    at_3 = jax.tree.leaves(ckpt.restore_params(3, models.build.abstract_params(model, mesh)))
  assert all(np.isfinite(np.asarray(x)).all() for x in at_3)
  assert any(not np.array_equal(a, b) for a, b in zip(at_2, at_3, strict=True))  # step 3 trained
