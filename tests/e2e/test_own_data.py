"""docs/data.md's two `data.path` recipes, run as written on a small `save_to_disk` data set of
text questions (tests/helpers/own_data.py): the own-data one on the tiny byte-level model, the
GSM8K one at CPU size (`:math,runlocal`) with a tiny Llama of SmolLM2's tokenizer in place of the
135M weights (same prompts, template and buckets). Each run's evaluation names the data set's own
clusters."""

import json
import shlex

from tests.helpers import ROOT
from tests.helpers.own_data import save_own_dataset
from tests.helpers.processes import run_module

PAGE = (ROOT / "docs" / "data.md").read_text().replace("\\\n", " ")


def page_command(word: str) -> list[str]:
  """The arguments after `python -m ebpo_jax.train` of the page's command that holds `word`."""
  (line,) = [ln for ln in PAGE.splitlines() if "python -m ebpo_jax.train" in ln and word in ln]
  return shlex.split(line.split("python -m ebpo_jax.train", 1)[1])


def _train(args: list[str], data_dir: str, workdir, *extra: str):
  args = [
    a.replace("/data/raw/my_dataset", data_dir).replace("/data/raw/gsm8k", data_dir) for a in args
  ]
  args = [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in args]
  result = run_module("ebpo_jax.train", *args, *extra, devices=1, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
  return result, [m for m in lines if "eval/accuracy" in m]


def test_own_text_data_trains_on_the_tiny_model_and_evaluates_its_own_clusters(tmp_path):
  data_dir = save_own_dataset(tmp_path / "my_dataset")
  args = page_command("/data/raw/my_dataset")
  result, evals = _train(args, data_dir, tmp_path / "run", "--config.train.num_steps=1")
  assert [m["step"] for m in evals] == [0, 1]
  assert {"eval/accuracy/small", "eval/accuracy/large"} <= set(evals[-1])
  assert not [k for k in evals[-1] if k.startswith("eval/accuracy/add_")]
  table = result.stdout.split("held-out accuracy", 1)[1]
  assert "small" in table and "large" in table


def test_the_gsm8k_recipe_runs_at_cpu_size(tmp_path, tiny_llama_dir):
  data_dir = save_own_dataset(tmp_path / "gsm8k")
  args = [a.replace(":math", ":math,runlocal") for a in page_command("/data/raw/gsm8k")]
  _, evals = _train(args, data_dir, tmp_path / "run", f"--config.model.path={tiny_llama_dir}")
  assert [m["step"] for m in evals] == [0, 1]
  assert set(evals[-1]) >= {"eval/accuracy", "eval/accuracy/0"}  # no cluster column: one cluster
