"""The command lines' frame: one flag library (absl), the config flags, bad input as one line.

A command line that is also called as a function (`simulate.main([...])` from a test or a
notebook) declares its flags once, in a function `define(flag_values)`; `run(define, main)` is its
`python -m` (absl parses the command line, `--help` lists the flags as the module's own) and
`parse(define, argv)` gives `main(argv)` the same flags, checks and messages in-process. A bad flag
is one line `error: flag --NAME=VALUE: why` and exit status 2, as a bad input (`BadInput`: a config
value, a data row, a policy to load) is under `entry_point`.

The entry points that read a config (train, evaluate, difficulty, aot, ablate) declare
`--config=FILE.py[:ARG]` with `define_config_flags` and parse with `parse_flags`; `load_config` is
the one loader of a config file by path (the configs load `configs/common.py` with `load_module`).
"""

import contextlib
import difflib
import importlib.util
import logging as std_logging
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from ebpo_jax import jsonable, process
from ebpo_jax.errors import BadInput, ConfigError

BAD_INPUT_STATUS = 2  # the exit status of a bad flag or a bad input (never a traceback)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

Define = Callable[[flags.FlagValues], None]


def usage_error(message: str) -> NoReturn:
  """Exits with `error: <message>` on stderr and status 2 (a SystemExit in-process)."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(BAD_INPUT_STATUS)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's FLAGS parsed from `argv` (pass as `app.run(main, flags_parser=parse_flags)`); a bad
  flag is one line and status 2 (absl's parser prints `FATAL Flags parsing error`, exits 1), and
  so is a `--config.KEY` override that names no key of the config file, with the closest key
  (ml_collections raises a long traceback from inside the parser). `--help` (and absl's
  `--helpshort`, `--helpfull`, `--helpxml`) prints the usage and exits 0: absl exits 1 there, as
  if asking for help were an error."""
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    asked = any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:])
    sys.exit(0 if asked and e.code == 1 else e.code)
  except flags.Error as e:
    usage_error(_without_traceback(str(e)))
  except (AttributeError, KeyError, TypeError):
    problem = _unknown_override(argv)
    if problem is None:
      raise
    usage_error(problem)


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _without_traceback(message: str) -> str:
  """A flag error as one line: ml_collections puts the traceback of a config file that raised
  (`--config=F.py:ARG` with a mistyped ARG) under `flag --config=...: Error whilst parsing config
  file:`; the flag and the exception's own last line stay."""
  lines = [line for line in message.splitlines() if line.strip()]
  if len(lines) == 1:
    return message
  flag = lines[0].split(": Error whilst parsing config file", 1)[0]
  return f"{flag}: {lines[-1]}"


def _unknown_override(argv: Sequence[str]) -> str | None:
  """The first `--config.KEY=VALUE` of `argv` whose KEY the `--config=` file lacks, described with
  the closest known key; None when every key exists (or the config file does not load)."""
  spec = _flag_value(argv, "--config")
  if spec is None:
    return None
  try:
    known = set(flat_keys(load_config(spec)))
  except Exception:  # the file's own error is absl's to report
    return None
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    key = arg.removeprefix("--config.").split("=", 1)[0]
    if key not in known and not any(k.startswith(key + ".") for k in known):
      close = difflib.get_close_matches(key, sorted(known), n=1)
      hint = f"; did you mean {close[0]}?" if close else ""
      return f"{arg}: no config key {key}{hint}"
  return None


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
  """The value of `flag` in `argv`, given as `FLAG=VALUE` or as `FLAG VALUE`."""
  for i, arg in enumerate(argv):
    if arg.startswith(flag + "="):
      return arg.split("=", 1)[1]
    if arg == flag and i + 1 < len(argv):
      return argv[i + 1]
  return None


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


# ----------------------------------------------------------------------------- configs


@contextlib.contextmanager
def entry_point(verbosity: int = logging.WARNING) -> Iterator[None]:
  """The frame of every command-line entry point: absl logging at `verbosity` for other libraries
  (orbax logs each save at INFO; the project's own INFO lines are shown, `set_verbosity`),
  `jax.distributed` joined when the environment asks for it, and a bad input (BadInput) turned
  into `error: <message>` and exit status 2 (BAD_INPUT_STATUS); on N fake CPU devices, XLA:CPU
  thread pools that fit them (`process.size_cpu_thread_pools`); garbage collected less often
  (`process.collect_garbage_less_often`)."""
  set_verbosity(verbosity)
  process.collect_garbage_less_often()
  try:
    process.size_cpu_thread_pools()  # 8 CPU devices on 2 cores: no rendezvous abort
    process.init_distributed()
    yield
  except BadInput as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT_STATUS)


def define_config_flags() -> tuple[flags.FlagHolder, flags.FlagHolder]:
  """`--config=FILE.py[:ARG]` (required; `--config.KEY=VALUE` overrides) and `--print_config`,
  in absl's FLAGS: the flags of every entry point that reads a config. The entry point adopts
  them (`flags.adopt_module_key_flags(cli)`) so that its `--help` lists them."""
  config = config_flags.DEFINE_config_file("config", None, "Experiment config file: FILE.py[:ARG].")
  flags.mark_flag_as_required("config")
  print_config = flags.DEFINE_bool(
    "print_config",
    False,
    "Print the resolved config (the file and its --config.* overrides) as JSON and exit; "
    "nothing is compiled or written.",
  )
  return config, print_config


def print_config(config: ml_collections.ConfigDict) -> None:
  """`--print_config`: the resolved config as JSON on stdout, as config.json holds it."""
  print(jsonable.dumps(config, indent=1, sort_keys=True), flush=True)


def printed_config_or_required(*names: str) -> bool:
  """The start of an entry point's `main`: True when `--print_config` printed the config (main
  then returns), else a usage error naming the flags of `names` left unset, else False."""
  f = flags.FLAGS
  if f.print_config:
    print_config(f.config)
    return True
  missing = [f"--{name}" for name in names if f[name].value is None]
  if missing:
    raise app.UsageError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
  return False


def load_module(path: str | os.PathLike) -> types.ModuleType:
  """The Python module of a config file (its `get_config` and any tables it defines), loaded by
  path: configs/ is not a package (a config loads its sibling configs/common.py with this too)."""
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(
  spec: str | os.PathLike, overrides: Mapping[str, Any] | None = None
) -> ml_collections.ConfigDict:
  """The ConfigDict of `configs/NAME.py[:ARG]` (what `--config=` takes), with `overrides`
  (dotted keys, e.g. {"rl.group_size": 4}) applied as `--config.KEY=VALUE` would."""
  path, _, arg = os.fspath(spec).partition(":")
  config = load_module(path).get_config(arg or None)
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  return config


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every dotted key of `config` (nested ConfigDicts descended, their own keys included)."""
  keys = []
  for name, value in config.items():
    keys.append(prefix + name)
    if isinstance(value, ml_collections.ConfigDict):
      keys += flat_keys(value, f"{prefix}{name}.")
  return keys
