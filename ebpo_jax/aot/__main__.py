"""`python -m ebpo_jax.aot --config=CONFIG --topology=SLICE [--prompt_len=N]`: compiles the train
step and a sampler call for a TPU slice on any machine (`aot.programs`'s docstring) and prints the
report (`aot.report.describe`), then one JSON line. Exit status 0 whether or not it fits
(launch/tpu_pod.sh reads `fits`); 2 with one line for a bad config or an unknown slice."""

import json
import os
import sys
from collections.abc import Sequence

import jax
from absl import app, flags

from ebpo_jax import cli, errors
from ebpo_jax.aot import report as report_lib
from ebpo_jax.aot.programs import check
from ebpo_jax.aot.split import check_split
from ebpo_jax.aot.topology import NoTpuCompiler, parse_slice


def main(argv: Sequence[str]) -> None:
  del argv
  if cli.printed_config_or_required("topology"):
    return
  f = flags.FLAGS
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")  # the TPU devices are compile-only
  with cli.entry_point():
    try:
      tpu = parse_slice(f.topology or "")
      split = f.config.mesh.rollout_devices > 0  # the sampler on chips of its own
      report = (check_split if split else check)(f.config, tpu, f.prompt_len)
    except (ValueError, NoTpuCompiler) as e:  # a bad slice name (ConfigError: entry_point's)
      if isinstance(e, errors.BadInput):
        raise
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(cli.BAD_INPUT_STATUS)
    print(report_lib.describe(report), flush=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
  cli.define_config_flags()
  flags.adopt_module_key_flags(cli)  # --help lists --config and --print_config
  flags.DEFINE_string("topology", None, "Slice (v5p-64, v5e-16) or topology (v5p:4x4x2).")
  flags.DEFINE_integer(
    "prompt_len",
    0,
    "Prompt bucket to compile; 0: the longest training prompt's bucket when the rows are "
    "the task's own, else the largest of sampling.prompt_buckets.",
  )
  app.run(main, flags_parser=cli.parse_flags)  # a --config.KEY typo: one line
