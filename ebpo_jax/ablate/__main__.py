"""Ablations: one config under several advantage estimators, group sizes and seeds.

  python -m ebpo_jax.ablate --config=configs/arith_ebpo.py --workdir=/tmp/ablation \
      [--variants=grpo,ebpo_running,...] [--group_sizes=2,4,8,16] [--seeds=3] [--workers=2] \
      [--config.train.num_steps=100 ...] [--report_only]

The command line of `ebpo_jax.ablate`; its docstring says what the runs are and what is written.
"""

import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from ebpo_jax import cli, files
from ebpo_jax.ablate import (
  DEFAULT_VARIANTS,
  VARIANTS,
  AblationError,
  _override_args,
  run_ablation,
)


def main(argv: Sequence[str]) -> None:
  del argv
  f = flags.FLAGS
  config_flag = f["config"]
  try:
    report = run_ablation(
      config_flags.get_config_filename(config_flag),
      f.workdir,
      variants=[v for v in f.variants.split(",") if v],
      group_sizes=[int(g) for g in f.group_sizes.split(",") if g],
      seeds=f.seeds,
      workers=f.workers,
      overrides=_override_args(config_flags.get_override_values(config_flag)),
      target_gain=f.target_gain,
      report_only=f.report_only,
    )
  except (AblationError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(report["markdown"])
  print(f"report: {files.join(f.workdir, 'ablation.md')}")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Experiment config file (path[:arg]).")
  flags.DEFINE_string(
    "workdir", None, "Directory for the runs, ablation.md and plots (local or gs://...)."
  )
  flags.DEFINE_string(
    "variants", ",".join(DEFAULT_VARIANTS), f"Comma list of: {', '.join(VARIANTS)}."
  )
  flags.DEFINE_string("group_sizes", "8", "Comma list of group sizes G.")
  flags.DEFINE_integer("seeds", 3, "Number of seeds (0..n-1).")
  flags.DEFINE_integer("workers", 1, "Runs at once (each one process, one device).")
  flags.DEFINE_float("target_gain", 0.10, "Gain of the hardest cluster counted as 'reached'.")
  flags.DEFINE_bool(
    "report_only", False, "Run nothing: report the finished runs of this plan (results so far)."
  )
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=cli.parse_flags)  # a --config.KEY typo: one line
