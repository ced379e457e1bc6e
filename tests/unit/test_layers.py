"""Who may import whom: the import-linter contracts of pyproject.toml hold (`lint-imports`), and
no file imports the trainer's entry point `ebpo_jax.train` (it is run as `python -m`). And the
house's size rules (issue 31): no Python file over 500 lines, no function over 80 but the configs'
`get_config` key listings."""

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SEARCHED = ("tests", "bench", "ebpo_jax", "notebooks")
_NAMES = r"(?:\((?P<paren>[^)]*)\)|(?P<line>[^\n#]*))"
_FROM_PACKAGE = re.compile(r"^\s*from\s+ebpo_jax\s+import\s+" + _NAMES, re.MULTILINE)
_DIRECT = re.compile(
  r"^\s*(?:from\s+ebpo_jax\.train\s+import\b|import\s+ebpo_jax\.train\b(?!er))"
  r"|import_module\(\s*['\"]ebpo_jax\.train['\"]",
  re.MULTILINE,
)


def imports_train(source: str) -> list[str]:
  """The statements of `source` that import ebpo_jax.train."""
  found = [m.group(0).strip() for m in _DIRECT.finditer(source)]
  for m in _FROM_PACKAGE.finditer(source):
    names = (m.group("paren") or m.group("line") or "").replace("\n", " ").split(",")
    if any(name.split(" as ")[0].strip() == "train" for name in names):
      found.append(m.group(0).strip())
  return found


def python_sources(path: pathlib.Path) -> str:
  """A .py file's text, or a notebook's code cells joined."""
  if path.suffix == ".ipynb":
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  return path.read_text()


def test_the_import_contracts_hold():
  lint = shutil.which("lint-imports") or os.path.join(
    os.path.dirname(sys.executable), "lint-imports"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's ebpo_jax, not another install
  result = subprocess.run(
    [lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  assert "0 broken" in result.stdout


def test_the_grep_finds_every_form_of_the_import():
  module = "ebpo_jax." + "train"  # split: this file must not match itself
  package = "from ebpo_jax import "
  for statement in (
    package + "train",
    package + "checkpoint, train as t",
    package + "(\n  data,\n  train,\n)",
    f"from {module} import run",
    f"import {module}",
    f"importlib.import_module('{module}')",
  ):
    assert imports_train(statement), statement
  for statement in (
    package + "trainer",
    f"from {module}er import step",
    f"import {module}er.state",
    f"cmd = [sys.executable, '-m', '{module}']",
    package + "metrics  # train",
  ):
    assert not imports_train(statement), statement


@pytest.mark.parametrize("folder", SEARCHED)
def test_nothing_imports_the_trainer_entry_point(folder):
  paths = sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.ipynb"))
  assert paths or folder == "notebooks"
  found = {str(p.relative_to(ROOT)): imports_train(python_sources(p)) for p in paths}
  assert not {p: s for p, s in found.items() if s}, "run it as `python -m ebpo_jax.train` instead"


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def test_no_file_over_500_lines_and_no_function_over_80():
  too_long = []
  for folder in ("ebpo_jax", "tests", "bench", "configs", "launch"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      source = path.read_text()
      name = path.relative_to(ROOT)
      if len(source.splitlines()) > MAX_FILE_LINES:
        too_long.append(f"{name}: {len(source.splitlines())} lines")
      for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
          continue
        lines = node.end_lineno - node.lineno + 1
        listing = folder == "configs" and node.name == "get_config"
        if lines > MAX_FUNCTION_LINES and not listing:
          too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
  assert not too_long, too_long
