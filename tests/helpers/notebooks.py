"""The notebooks the tests run."""

from tests.helpers import ROOT

NOTEBOOK = ROOT / "notebooks" / "ablation_small_models.ipynb"
