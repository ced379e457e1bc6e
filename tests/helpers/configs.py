"""The configs the tests load."""

from ebpo_jax import cli
from tests.helpers import ROOT


def config_module(name: str):
  """The module of configs/NAME.py (get_config and its constants), as the trainer loads it."""
  return cli.load_module(ROOT / "configs" / f"{name}.py")
