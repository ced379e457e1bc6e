"""notebooks/ablation_small_models.ipynb runs top to bottom (smoke parameters) without a failing
cell, and shows the ablation table and an inline plot."""

import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "ablation_small_models.ipynb"


@pytest.mark.e2e
def test_notebook_executes_with_smoke_parameters(tmp_path, monkeypatch):
  monkeypatch.setenv("EBPO_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("EBPO_NOTEBOOK_WORKDIR", str(tmp_path / "ablation"))
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
    notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  client.execute()  # raises CellExecutionError naming the cell when one fails

  outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
  assert not [out for out in outputs if out.output_type == "error"]
  markdown = [
    out["data"]["text/markdown"] for out in outputs if "text/markdown" in out.get("data", {})
  ]
  assert any("| grpo | 4 | 1 |" in text and "| ebpo_running | 4 | 1 |" in text for text in markdown)
  assert any("image/png" in out.get("data", {}) for out in outputs)
  assert (tmp_path / "ablation" / "ablation.md").exists()
