"""The fast tier: `python -m pytest -m "not e2e"` runs these."""
