"""notebooks/ablation_small_models.ipynb runs top to bottom with the smoke preset without a failing
cell, shows the ablation table, the accuracy and the diagnostics plots inline, and learns something
(a result that is not all zeros). Its install cell clones REPO_URL when there is no checkout, and
without either stops with a message that says what to set."""

import base64
import json
import os
import pathlib
import subprocess
import sys
import time

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "ablation_small_models.ipynb"


def execute(notebook, cwd, **kwargs):
  client = nbclient.NotebookClient(
    notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
  )
  return client.execute(**kwargs)


@pytest.mark.e2e
def test_notebook_smoke_preset_shows_table_plots_and_a_nonzero_result(tmp_path, monkeypatch):
  workdir = tmp_path / "ablation"
  monkeypatch.setenv("EBPO_NOTEBOOK_PRESET", "smoke")
  monkeypatch.setenv("EBPO_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv("EBPO_NOTEBOOK_INSTALL", "0")  # a test never pip installs
  # The notebook's runs compile into the session's compilation cache (conftest's) instead of one
  # of their own: the RL steps and rollouts of :runlocal's grpo and ebpo_running at G=4 are
  # test_ablate's programs too. (The notebook only sets its own cache where none is set.)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.environ["EBPO_JAX_TEST_XLA_CACHE"])
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


def install_cells(repo_url: str = "") -> str:
  """The settings and install cells as one script, with REPO_URL set to `repo_url`."""
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  settings, install = [c.source for c in notebook.cells if c.cell_type == "code"][:2]
  assert 'REPO_URL = ""' in settings
  return settings.replace('REPO_URL = ""', f"REPO_URL = {repo_url!r}", 1) + "\n" + install


def run_install_cells(cwd, repo_url="", **env_vars):
  """Runs the install cells as a script in `cwd`, never installing (EBPO_NOTEBOOK_INSTALL=0)."""
  env = {**os.environ, "EBPO_NOTEBOOK_WORKDIR": str(cwd / "ablation"), "EBPO_NOTEBOOK_INSTALL": "0"}
  env.update(env_vars)
  script = install_cells(repo_url)
  cmd = [sys.executable, "-c", script]
  return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_install_cell_without_a_checkout_or_repo_url_says_what_to_set(tmp_path):
  done = run_install_cells(tmp_path)
  # Our message, not a failed `git clone` of a placeholder URL.
  assert done.returncode != 0
  assert (
    done.stderr.strip()
    .splitlines()[-1]
    .startswith("RuntimeError: No ebpo-jax checkout here and REPO_URL is empty. Set REPO_URL")
  )


def test_install_cell_clones_repo_url_and_uses_the_clone(tmp_path):
  done = run_install_cells(tmp_path, f"file://{ROOT}")  # the committed checkout, offline
  assert done.returncode == 0, done.stderr
  clone = tmp_path / "ebpo-jax"
  assert (clone / "ebpo_jax" / "ablate" / "__init__.py").is_file()
  assert f"ebpo-jax checkout: {clone}; requirements: present" in done.stdout  # nothing installed

  bad = run_install_cells(tmp_path, "file:///nonexistent/ebpo-jax")
  assert bad.returncode == 0  # the clone of the first call is found: REPO_URL is not used
  assert "REPO_URL is not needed" in bad.stdout
  (tmp_path / "elsewhere").mkdir()
  bad = run_install_cells(tmp_path / "elsewhere", "file:///nonexistent/ebpo-jax")
  last = bad.stderr.strip().splitlines()[-1]
  assert last.startswith("RuntimeError: could not clone REPO_URL='file:///nonexistent/ebpo-jax'")


def test_install_cell_picks_the_jax_of_the_runtime(tmp_path):
  """A GPU (nvidia-smi lists one) asks for '.[cuda]' with the CUDA plugin of jax's own version; a
  Colab TPU (COLAB_TPU_ADDR) is a TPU, whose libtpu the aot extra installed here."""
  fake = tmp_path / "bin" / "nvidia-smi"
  fake.parent.mkdir()
  fake.write_text("#!/bin/sh\necho 'GPU 0: Tesla T4 (UUID: GPU-0)'\n")
  fake.chmod(0o755)
  gpu = run_install_cells(ROOT / "notebooks", PATH=f"{fake.parent}:{os.environ['PATH']}")
  assert gpu.returncode == 0, gpu.stderr
  assert "runtime: gpu" in gpu.stdout
  assert (
    "jax-cuda12-plugin for jax 0.10" in gpu.stdout and f"would install {ROOT}[cuda]" in gpu.stdout
  )
  tpu = run_install_cells(ROOT / "notebooks", COLAB_TPU_ADDR="10.0.0.2:8470")
  assert tpu.returncode == 0, tpu.stderr
  assert "runtime: tpu" in tpu.stdout
