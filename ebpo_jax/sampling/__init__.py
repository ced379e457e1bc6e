"""The decode engine: from left-padded prompts and weights to completions with their log-probs.

- `engine`: `generate` (prefill once per prompt, a `while_loop` decode over a KV cache), prompt
  buckets, and the rollout weight layout (`decode_params`: dtype, per-layer, replicated).
- `loop`: the decode loop's row state, recording a drawn token, halving the running rows.
- `draw`: one token per row (temperature, top-k, top-p, inverse CDF).
- `turns`: multi-turn decoding over a cache kept between turns.
- `sequences`: the prompt + completion layout the sampler and the trainer share.
- `options`: `DecodeOptions`, what the sampler reads of `config.sampling`, validated once.
"""

from ebpo_jax.sampling.engine import (
  SampleOutput,
  bucket_length,
  compile_count,
  decode_converter,
  decode_params,
  generate,
  is_decode_params,
  pad_prompts,
  trace_generate,
  trace_parts,
)
from ebpo_jax.sampling.options import DecodeOptions

__all__ = [
  "DecodeOptions",
  "SampleOutput",
  "bucket_length",
  "compile_count",
  "decode_converter",
  "decode_params",
  "generate",
  "is_decode_params",
  "pad_prompts",
  "trace_generate",
  "trace_parts",
]
