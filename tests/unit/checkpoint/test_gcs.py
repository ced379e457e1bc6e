"""gs:// inputs against the storage emulator (conftest's `gcs_emulator`, `gcs_dir`), nothing mocked:
rows, prepared and clustered data, a Hugging Face model directory and its tokenizer read from the
bucket as from local disk (trainer runs on a bucket: e2e/test_gcs.py)."""

import json
import math

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebpo_jax import errors, files, models, tasks
from ebpo_jax.data import DataError, cluster, load_rows_and_clusters, prepare
from ebpo_jax.models import gguf_io, hf_io
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer import task_rows
from tests.helpers.configs import load_config
from tests.helpers.gcs import upload

ROWS = [
  {"prompt": "1+2=", "answer": "3", "cluster": "add_1", "difficulty": 0.5},
  {"prompt": "12+30=", "answer": "42", "cluster": "add_2", "extra": [1, 2]},
  {"prompt": "4+4=", "answer": "8", "cluster": "add_1"},
]


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


def test_missing_model_directory_names_it_on_the_bucket_as_on_disk(gcs_dir, tmp_path):
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
