"""Reward functions for the verifier pool's tests (tests/unit/tasks/test_reward_fns.py), top level
in a module of light imports: each pool worker imports it when it unpickles a call, and a worker
killed for a hang is replaced and imports it again (the test module itself imports jax and
math-verify on the way: about 3 CPU-s a worker)."""

import os
import time

NAME = "reward_workers"  # not a function: a reward term that names it is refused


def first_char(completions, rows, **extras):
  """0.5 for "a...", None (not applicable) for "-...", else 0.25."""
  return [{"a": 0.5, "-": None}.get(c[:1], 0.25) for c in completions]


def misbehaving(completions, rows, **extras):
  """By the first completion: raises, hangs, exits, or returns a bad or fine value list."""
  c = completions[0]
  if c == "raise":
    raise RuntimeError("reward bug")
  if c == "hang":
    time.sleep(60)
  if c == "exit":
    os._exit(3)
  return {"two": [1.0, 2.0], "str": ["1"], "nan": [float("nan")], "neg": [-3.0]}.get(c, [1.0])


def wants_extras(completions, rows, *, lengths, max_new_tokens, task_score, **extras):
  """Reads the extras by name: the length share of the cap plus the task's score."""
  triples = zip(completions, rows, lengths, strict=True)
  return [n / max_new_tokens + task_score(c, r) for c, r, n in triples]
