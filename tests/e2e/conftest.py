"""Every test under this folder is `e2e` (the marker of pyproject.toml): `-m "not e2e"` skips it."""

import pathlib

import pytest

_HERE = pathlib.Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's ordering and pytest's -m selection
def pytest_collection_modifyitems(items):
  for item in items:
    if _HERE in item.path.parents:
      item.add_marker(pytest.mark.e2e)
