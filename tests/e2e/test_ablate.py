"""ebpo_jax.ablate's command line refuses a bad variant before it runs anything. (A real two-variant
ablation, its report, plots, shared warm start and a rerun that skips finished runs: the notebook's
smoke preset runs one, tests/e2e/test_notebook.py.)"""

import os
import subprocess
import sys

from tests.helpers import ROOT

CONFIG = f"{ROOT / 'configs' / 'arith_ebpo.py'}:runlocal"


def test_cli_rejects_an_unknown_variant(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "ebpo_jax.ablate",
      f"--config={CONFIG}",
      f"--workdir={tmp_path}",
      "--variants=grpo,ppo",
    ],
    cwd=ROOT,
    env=dict(os.environ),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode != 0
  assert "unknown variant(s) ['ppo']" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "runs").exists()
