"""Convert a GGUF file into a Hugging Face directory (weights, config.json, tokenizer).

python -m ebpo_jax.models.convert --gguf FILE --out DIR [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import sys

from ebpo_jax.models import gguf_io


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--gguf", required=True, help="input .gguf file")
  parser.add_argument("--out", required=True, help="output Hugging Face directory")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = parser.parse_args(argv)
  try:
    gguf_io.convert_gguf(args.gguf, args.out, args.dtype)
  except (FileNotFoundError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 1
  print(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
