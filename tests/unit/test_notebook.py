"""notebooks/ablation_small_models.ipynb's install cell clones REPO_URL when there is no checkout,
and without either stops with a message that says what to set (the whole notebook:
e2e/test_notebook.py)."""

import os
import subprocess
import sys

import nbformat

from tests.helpers import ROOT
from tests.helpers.notebooks import NOTEBOOK


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
