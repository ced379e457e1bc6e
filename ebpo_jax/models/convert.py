"""Convert a GGUF file into a Hugging Face directory (weights, config.json, tokenizer).

python -m ebpo_jax.models.convert --gguf=FILE --out=DIR [--dtype=float32|bfloat16]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from ebpo_jax import cli
from ebpo_jax.models import gguf_io


def define_flags(flag_values: flags.FlagValues) -> None:
  """The command line's flags (`cli.run` and `cli.parse` call this)."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_string("gguf", None, "Input .gguf file (local or gs://...).", required=True, **fv)
  flags.DEFINE_string("out", None, "Output Hugging Face directory.", required=True, **fv)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight dtype.", **fv)


def main(argv: Sequence[str] | None = None) -> int:
  """Converts; prints the output directory. 1 on a missing or unreadable file. `argv`: flags
  only, or None for the command line's (parsed by absl)."""
  args = cli.parse(define_flags, argv)
  try:
    gguf_io.convert_gguf(args.gguf, args.out, args.dtype)
  except (FileNotFoundError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 1
  print(args.out)
  return 0


if __name__ == "__main__":
  cli.run(define_flags, main)
