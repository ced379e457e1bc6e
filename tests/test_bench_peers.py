"""bench/peers.py at smoke sizes: ours vs tunix and transformers in one process, summary keys.

Needs the `peers` extra and tunix (`pip install -e '.[peers]' && pip install --no-deps
google-tunix==0.1.7`); tunix is imported by the benchmark's process only, so collecting this file
needs neither.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

RL_KEYS = [
  f"{part}_over_tunix{kl}" for kl in ("", "_kl") for part in ("rl_step", "train", "rollout")
]


@pytest.mark.peers
@pytest.mark.e2e  # a script run as its own process (about 100 s on 2 shared cores)
def test_peers_quick_run_ends_with_every_ratio():
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=1",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=str(ROOT),
  )
  result = subprocess.run(
    [sys.executable, str(ROOT / "bench" / "peers.py"), "--quick"],
    env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert set(summary) == {"sampler", *RL_KEYS}, summary
  assert set(summary["sampler"]) == {"tiny"}, summary
  ratios = [*summary["sampler"]["tiny"].values(), *(summary[k] for k in RL_KEYS)]
  assert set(summary["sampler"]["tiny"]) == {"sampler_over_tunix", "sampler_over_transformers"}
  assert all(math.isfinite(r) and r > 0 for r in ratios), summary
