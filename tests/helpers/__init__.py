"""What the unit and e2e tests share: plain functions and constants, imported by name
(`from tests.helpers import configs`); tests/conftest.py keeps only fixtures and hooks."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
