"""`process.size_cpu_thread_pools`: the XLA:CPU pool sizes it sets (the reason for them:
e2e/test_cpu_collectives.py)."""

import os

import pytest

from ebpo_jax import process


@pytest.mark.parametrize(
  "env, expected",
  [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, "16"),
    ({"XLA_FLAGS": "--foo=1 --xla_force_host_platform_device_count=4", "NPROC": "2"}, "8"),
    ({"JAX_NUM_CPU_DEVICES": "8"}, "16"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "12"}, "12"),
    ({}, None),  # one CPU device (or an accelerator): XLA's own sizing
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, None),
  ],
)
def test_size_cpu_thread_pools(env, expected, monkeypatch):
  monkeypatch.setattr(os, "cpu_count", lambda: 2)
  env = dict(env)
  process.size_cpu_thread_pools(env)
  assert env.get("PJRT_NPROC") == expected


def test_size_cpu_thread_pools_keeps_more_cores(monkeypatch):
  monkeypatch.setattr(os, "cpu_count", lambda: 64)
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  process.size_cpu_thread_pools(env)
  assert env["PJRT_NPROC"] == "64"


@pytest.mark.parametrize(
  "module", ["train.py", "evaluate.py", "export.py", "difficulty.py", "aot/__main__.py"]
)
def test_every_entry_point_that_runs_programs_runs_main_inside_cli_entry_point(module):
  # cli.entry_point sizes the pools before any device is touched; e2e/test_cpu_collectives.py runs
  # 3,000 back-to-back collective steps inside it on 8 devices without the abort. An entry point
  # whose main ran outside it would be the trainer run that aborted (in its warm start's steps).
  import ast

  from tests.helpers import ROOT

  source = (ROOT / "ebpo_jax" / module).read_text()  # read, not imported (train.py)
  (main,) = [n for n in ast.parse(source).body if getattr(n, "name", None) == "main"]
  withs = [
    item.context_expr
    for node in ast.walk(main)
    if isinstance(node, ast.With)
    for item in node.items
  ]
  assert any(ast.unparse(expr).startswith("cli.entry_point(") for expr in withs), module
