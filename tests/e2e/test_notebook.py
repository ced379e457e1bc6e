"""notebooks/ablation_small_models.ipynb runs top to bottom with the smoke preset without a failing
cell, shows the ablation table, the accuracy and the diagnostics plots inline, learns something
(a result that is not all zeros), and runs one trainer.run with a reward of its own. Its ablation
(ebpo_jax.ablate: grpo and ebpo_running, G = 4, one seed, 4 RL steps on :runlocal) is also the
ablation runner's end-to-end test: one warm start shared by the variants, and the shell command
the notebook prints skips the finished runs."""

import base64
import json
import os
import time

import nbclient
import nbformat

from ebpo_jax import metrics as metrics_lib
from tests.helpers import ROOT
from tests.helpers.environment import CACHE_VARIABLE
from tests.helpers.notebooks import NOTEBOOK
from tests.helpers.processes import cpu_env, run_module


def execute(notebook, cwd, **kwargs):
  client = nbclient.NotebookClient(
    notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
  )
  return client.execute(**kwargs)


def test_notebook_smoke_preset_shows_table_plots_and_a_nonzero_result(tmp_path, monkeypatch):
  workdir = tmp_path / "ablation"
  monkeypatch.setenv("EBPO_NOTEBOOK_PRESET", "smoke")
  monkeypatch.setenv("EBPO_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("EBPO_NOTEBOOK_INSTALL", "0")  # a test never pip installs
  # The notebook's runs compile into the session's compilation cache (environment.CACHE_VARIABLE)
  # instead of one of their own: the RL steps and rollouts of :runlocal's grpo and ebpo_running at
  # G=4 are the session's trainer runs' programs too. (The notebook only sets its own cache where
  # none is set.)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.environ[CACHE_VARIABLE])
  monkeypatch.setenv("XLA_FLAGS", cpu_env(1)["XLA_FLAGS"])  # the kernel: one device, as in Colab
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  start = time.perf_counter()
  execute(notebook, ROOT / "notebooks")  # raises CellExecutionError naming the failing cell
  print(f"notebook smoke preset: {time.perf_counter() - start:.0f} s")

  outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
  assert not [out for out in outputs if out.output_type == "error"]
  text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
  assert "runtime: cpu" in text and "requirements: present" in text  # nothing installed here
  markdown = [
    out.data["text/markdown"] for out in outputs if "text/markdown" in out.get("data", {})
  ]
  assert any("| grpo | 4 | 1 |" in md and "| ebpo_running | 4 | 1 |" in md for md in markdown)
  # Both plots are shown inline: the accuracy and the diagnostics PNGs the ablation wrote.
  shown = [
    base64.b64decode(out.data["image/png"]) for out in outputs if "image/png" in out.get("data", {})
  ]
  for name in ("ablation_accuracy_G4.png", "ablation_diagnostics_G4.png"):
    assert (workdir / "plots" / name).read_bytes() in shown, name

  # Not all zeros: the warm start solves some held-out problems, some groups carry signal, and
  # EBPO's shrinkage is strictly between the prior (1) and the group mean (0).
  rows = {r["variant"]: r for r in json.loads((workdir / "ablation.json").read_text())["rows"]}
  assert rows["grpo"]["acc_before"] > 0 and rows["ebpo_running"]["acc_mean"] > 0
  assert rows["grpo"]["zero_frac"] < 1
  assert 0 < rows["ebpo_running"]["shrinkage"] < 1
  train = [
    json.loads(line)
    for line in (workdir / "runs" / "ebpo_running_G4_s0" / "metrics.jsonl").open()
    if "reward/mean" in line
  ]
  assert len(train) == 4 and max(r["reward/mean"] for r in train) > 0
  # The one run with a reward of its own, by ebpo_jax.trainer.run from the kernel's child process:
  # the function's mean beside the task's, and the rewards recorded in its config.
  own = workdir / "own_reward" / "run"
  (line,) = [json.loads(x) for x in (own / "metrics.jsonl").open() if "reward/mean" in x]
  assert {"reward/task", "reward/brevity"} <= set(line)
  fns = json.loads((own / "config.json").read_text())["rewards"]["fns"]
  assert fns == "task, brevity=0.5*my_rewards:brevity"
  assert "'reward/brevity'" in text
  _check_the_ablation(workdir, text)


def _check_the_ablation(workdir, text: str) -> None:
  """The notebook's ablation as ebpo_jax.ablate ran it: the report, one warm start for both
  variants (same step-0 evaluation, same rewards at step 1), the estimators' own metrics, and the
  shell command it printed, run again, finds every run finished."""
  assert "## Summary" in (workdir / "ablation.md").read_text()
  runs = {name: workdir / "runs" / f"{name}_G4_s0" for name in ("grpo", "ebpo_running")}
  assert "warm start:" in (workdir / "warm_start" / "s0" / "log.txt").read_text()
  for run_dir in runs.values():
    assert "warm start:" not in (run_dir / "log.txt").read_text()
  lines = {name: [json.loads(x) for x in (d / "metrics.jsonl").open()] for name, d in runs.items()}
  step0 = {name: next(m for m in ls if m["step"] == 0) for name, ls in lines.items()}
  timing = metrics_lib.TIMING_KEYS
  untimed = {name: {k: v for k, v in m.items() if k not in timing} for name, m in step0.items()}
  assert untimed["grpo"] == untimed["ebpo_running"]
  train = {name: [m for m in ls if "reward/mean" in m] for name, ls in lines.items()}
  assert [m["step"] for m in train["grpo"]] == [1, 2, 3, 4]
  assert "ebpo/shrinkage_mean" in train["ebpo_running"][0]
  assert "ebpo/shrinkage_mean" not in train["grpo"][0]
  assert train["grpo"][0]["reward/mean"] == train["ebpo_running"][0]["reward/mean"]

  (command,) = [x.strip() for x in text.splitlines() if x.strip().startswith("python -m ebpo_jax")]
  module, *args = command.split()[2:]
  logs = {p: p.stat().st_mtime_ns for p in (workdir / "runs").glob("**/log.txt")}
  rows = json.loads((workdir / "ablation.json").read_text())["rows"]
  again = run_module(module, *args, devices=1, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert {p: p.stat().st_mtime_ns for p in (workdir / "runs").glob("**/log.txt")} == logs
  assert json.loads((workdir / "ablation.json").read_text())["rows"] == rows
