"""The GPU benchmark's full run names a train-step shape (the benchmarks run: e2e/test_bench.py)."""

import sys

from tests.helpers import ROOT


def test_the_gpu_benchmarks_full_run_names_a_train_step_shape():
  """bench/gpu.py's full run (on a GPU: not run here) times bench/train_step.py's step at its
  TRAIN_SHAPE: the name must be one of train_step's SHAPES (it once was not: a KeyError after the
  decode benchmarks)."""
  sys.path.insert(0, str(ROOT / "bench"))
  try:
    import gpu
    import train_step
  finally:
    sys.path.remove(str(ROOT / "bench"))
  assert gpu.TRAIN_SHAPE in train_step.SHAPES
  assert train_step.SHAPES[gpu.TRAIN_SHAPE]["num_layers"] == gpu.MODELS["qwen3-0.6b"].num_layers


def test_bench_holds_scripts_only():
  """bench/ holds the benchmark scripts and nothing else: what they measured lives in results/."""
  others = [
    p.name for p in (ROOT / "bench").iterdir() if p.suffix != ".py" and p.name != "__pycache__"
  ]
  assert not others, others
