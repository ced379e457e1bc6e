"""The command lines' one flag library, absl: a CLI's flags in-process as under `python -m`.

A command line that is also called as a function (`simulate.main([...])` from a test or a
notebook) declares its flags once, in a function `define(flag_values)`; `run(define, main)` is its
`python -m` (absl parses the command line, `--help` lists the flags as the module's own) and
`parse(define, argv)` gives `main(argv)` the same flags, checks and messages in-process. A bad flag
is one line `error: flag --NAME=VALUE: why` and exit status 2, as a bad config value is
(`ebpo_jax.trainer.config.entry_point`).
"""

import logging as std_logging
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags, logging

BAD_FLAG_STATUS = 2

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

Define = Callable[[flags.FlagValues], None]


def usage_error(message: str) -> NoReturn:
  """Exits with `error: <message>` on stderr and status 2 (a SystemExit in-process)."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(BAD_FLAG_STATUS)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's FLAGS parsed from `argv` (pass as `app.run(main, flags_parser=parse_flags)`); a bad
  flag is one line and status 2 (absl's parser prints `FATAL Flags parsing error`, exits 1)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    usage_error(str(e))


def parse(define: Define, argv: Sequence[str] | None) -> types.SimpleNamespace:
  """The values of the flags that `define` declares, by name: absl's FLAGS (parsed by `run`) when
  `argv` is None, else `argv` (flags only, no program name) parsed into a fresh FlagValues."""
  names = flags.FlagValues()
  define(names)
  if argv is None:
    source = flags.FLAGS
  else:
    source = flags.FlagValues()
    define(source)
    try:
      extra = source(["in-process", *argv])[1:]
    except flags.Error as e:
      usage_error(str(e))
    if extra:
      usage_error(f"unexpected arguments {extra}")
  return types.SimpleNamespace(**{name: source[name].value for name in names})


def run(define: Define, main: Callable[[Sequence[str] | None], Any]) -> NoReturn:
  """`python -m` of a command line: `define` declares its flags in absl's FLAGS from the main
  module (so `--help` lists them as its own), absl parses them and `main(None)` runs; an int it
  returns is the exit status (anything else, e.g. the results it also returns in-process: 0)."""
  define(flags.FLAGS)

  def absl_main(argv: Sequence[str]) -> int | None:
    if len(argv) > 1:
      usage_error(f"unexpected arguments {list(argv[1:])}")
    set_verbosity(logging.WARNING)
    status = main(None)
    return status if isinstance(status, int) else None

  app.run(absl_main, flags_parser=parse_flags)


class _ProjectInfo(std_logging.Filter):
  """Lets through records at or above `level`, and the project's own at any level."""

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= self.level or record.pathname.startswith(_PACKAGE_DIR)


def set_verbosity(verbosity: int) -> None:
  """absl logging at `verbosity` (absl's levels: WARNING, ERROR) for other libraries (jax and orbax
  log routine INFO lines), while the project's own INFO lines (the trainer's banner, a GGUF
  conversion) still reach stderr; an explicit `--verbosity` flag wins."""
  if flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(logging.INFO)
  handler = logging.get_absl_handler()
  for old in [f for f in handler.filters if isinstance(f, _ProjectInfo)]:
    handler.removeFilter(old)
  handler.addFilter(_ProjectInfo(logging.converter.absl_to_standard(verbosity)))
