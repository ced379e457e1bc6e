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


def test_the_peers_rl_steps_own_side_runs_a_step(tmp_path):
  """bench/peers.py --parts=rl's own side (peers_rl.OurRL: the trainer's collect_batch, then its
  train step) runs on a tiny Llama directory without tunix. Its tokenizer once lacked the
  `history, tools` parameters the prompt encoder passes (a TypeError CI never saw: the peers test
  needs tunix and is deselected by default)."""
  sys.path.insert(0, str(ROOT / "bench"))
  try:
    import peers
    import peers_rl
    import sampler as sampler_bench
  finally:
    sys.path.remove(str(ROOT / "bench"))
  path = sampler_bench.tiny_checkpoint(str(tmp_path), dict(peers.TINY_HF, num_hidden_layers=1))
  shape = peers_rl.RLShape(prompts=2, group_size=2, prompt_len=8, new_tokens=4)
  ours = peers_rl.OurRL(path, shape, peers.TINY_HF["vocab_size"], kl=False)
  try:
    seconds = ours.step()
  finally:
    ours.close()
  assert seconds["step"] >= seconds["rollout"] > 0 and seconds["train"] > 0, seconds
