"""What several benchmarks share (not a benchmark itself): the model shapes they time, a shape's
keys under ModelConfig's and transformers' names, and the printing of their tables.

The scripts import it as `_common` (bench/ is first on the path of a script run from it, and
tests/helpers/bench_runs.py puts it there).
"""

import os
from collections.abc import Iterable

from ebpo_jax.models import ModelConfig

# The tiny shape of the issue (4 layers, d=256) with the byte-level vocabulary of the project's tiny
# tasks (ebpo_jax.tasks.tokenizers.ByteTokenizer: 3 specials + 256 bytes).
TINY = ModelConfig(
  vocab_size=259, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
  num_kv_heads=2, head_dim=64,
)  # fmt: skip
# Real models' shapes (random weights: the timings do not depend on the values).
SMOLLM2_135M = ModelConfig(
  vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
  num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip
QWEN3_0_6B = ModelConfig(
  vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
  num_kv_heads=8, head_dim=128, rope_theta=1e6, tie_word_embeddings=True, architecture="qwen3",
)  # fmt: skip

# A shape's keys: as configs name them (`model.*`, and the vocabulary), and as transformers does.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size")  # fmt: skip
HF_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")  # fmt: skip


def shape(config: ModelConfig) -> dict[str, int]:
  """`config`'s shape keys, as bench/train_step.py's SHAPES hold them."""
  return {key: getattr(config, key) for key in SHAPE_KEYS}


def hf_shape(config: ModelConfig) -> dict[str, int]:
  """`config`'s shape under the names of a transformers config (LlamaConfig and the like)."""
  hf = config.to_hf()
  return {key: hf[key] for key in HF_SHAPE_KEYS}


def host() -> str:
  """This machine's CPU count and load average, for a table's heading."""
  return f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"


def print_table(header: str, lines: Iterable[str]) -> None:
  """A table: `header`, a rule as wide, then its `lines`."""
  print(header)
  print("-" * len(header))
  for line in lines:
    print(line)
