"""Tools that misbehave, for the environment tests (top level: they run in pool workers)."""

import os
import time


def raises(x: str) -> str:
  """Raises."""
  raise RuntimeError(f"broken on {x}")


def hangs(x: str) -> str:
  """Never returns (within any test's timeout)."""
  time.sleep(60)
  return x


def no_text(x: str) -> str:
  """Returns a number, not text."""
  return 42  # type: ignore[return-value]


def kills_worker(x: str) -> str:
  """Ends its process at once."""
  os._exit(3)


def echo(x: str) -> str:
  """Returns its argument."""
  return x
