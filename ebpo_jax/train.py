"""The trainer's command line: RL with verifiable rewards (GRPO family, EBPO) on a decoder LM.

  python -m ebpo_jax.train --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo \
      [--config.rl.advantage=grpo ...]

The run itself is `ebpo_jax.trainer.run` (ebpo_jax/trainer/loop.py), which Python code (a notebook)
calls directly; this file is only the entry point: flags, and `main` turning a bad input into one
line `error: ...` with exit status 2. Nothing imports it.
"""

from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

from ebpo_jax import cli, trainer
from ebpo_jax.trainer import banner as banner_lib

_CONFIG, _ = cli.define_config_flags()
flags.adopt_module_key_flags(cli)  # --help lists --config and --print_config
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Directory for checkpoints, metrics and plots (local or gs://bucket/...)."
)


def main(argv: Sequence[str]) -> None:
  del argv
  if cli.printed_config_or_required("workdir"):
    return
  config, workdir = _CONFIG.value, _WORKDIR.value
  name = banner_lib.config_name(
    config_flags.get_config_filename(flags.FLAGS["config"]),
    config_flags.get_override_values(flags.FLAGS["config"]),
  )
  with cli.entry_point():
    trainer.run(config, workdir, name=name)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)  # a --config.KEY typo: one line
