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
