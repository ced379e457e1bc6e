"""The errors an entry point reports as one line: bad input that the user can fix.

They live in the base layer so that every layer that reads a config, a data file or a checkpoint
(the model building in `models.build`, the data rows, the trainer's checks) raises the same types;
`cli.entry_point` turns a BadInput into `error: <message>` and exit status 2.
"""


class BadInput(ValueError):
  """Input a user can fix (a config value, a data row, a policy or a checkpoint to load); the
  message says what is wrong and where."""


class ConfigError(BadInput):
  """An invalid config value; the message names the key and the value."""


class DataError(BadInput):
  """A data file or row that cannot be used; the message starts with `FILE:LINE:`."""


def format_mismatch(found: object, expected: int, *, where: str, kind: str, remedy: str) -> str:
  """The one line that refuses a file of another format number (a checkpoint's, a workdir's),
  or "" when `found` is `expected`: who wrote it and what to do. Nothing is ever migrated."""
  if found == expected:
    return ""
  age = "a newer" if isinstance(found, int) and found > expected else "an older"
  shown = "absent" if found is None else found
  return (
    f"{where}: written by {age} ebpo-jax ({kind} format {shown}, this one reads {expected}): "
    f"start a fresh workdir (another --workdir), or {remedy}"
  )
