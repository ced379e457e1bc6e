"""docs/logging.md's list of metrics is written by hand beside ebpo_jax/metrics/names.py: every name
there is on the page, and the page's tables of scalars list the trainer's keys and nothing else."""

import re

from ebpo_jax.metrics import names
from tests.helpers import ROOT

PAGE = (ROOT / "docs" / "logging.md").read_text()
CLUSTER, FN = "<cluster>", "<name>"  # the placeholders the page writes in per-cluster and fn keys


def scalars_section() -> str:
  """The page's "## The scalars" section, up to the next heading of its level."""
  (section,) = re.findall(r"^## The scalars\n(.*?)(?=^## )", PAGE, re.MULTILINE | re.DOTALL)
  return section


def listed_keys() -> list[str]:
  """The keys of the section's table rows: a row's first cell, one key in backticks."""
  rows = re.findall(r"^\| `([^`]+)` \|", scalars_section(), re.MULTILINE)
  assert rows, "no table of scalars on docs/logging.md"
  return rows


def key_patterns() -> set[str]:
  """What the trainer writes, as the page writes it: each name, each per-cluster key with the
  cluster's placeholder, and a reward function's key with its name's."""
  per_cluster = {names.per_cluster(key, CLUSTER) for key in names.PER_CLUSTER_KEYS}
  return set(names.KEYS) | per_cluster | {names.reward_fn_key(FN)}


def test_every_name_in_names_py_is_on_the_page():
  """Every string constant of names.py (metrics, files, folders) in backticks on the page: a
  name added to names.py fails here until the page says what it is."""
  quoted = set(re.findall(r"`([^`\n]+)`", PAGE))
  quoted |= {q.removeprefix("DIR/").removesuffix("/") for q in quoted}
  constants = {k: v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
  assert constants, "names.py defines no names"
  missing = {k: v for k, v in constants.items() if v not in quoted}
  assert not missing, f"in ebpo_jax/metrics/names.py, not in docs/logging.md: {missing}"


def test_the_tables_of_scalars_list_every_key_once_and_only_keys():
  listed, expected = listed_keys(), key_patterns()
  assert len(listed) == len(set(listed)), [k for k in listed if listed.count(k) > 1]
  assert not expected - set(listed), f"not in docs/logging.md's tables: {expected - set(listed)}"
  assert not set(listed) - expected, f"not a key of names.py: {set(listed) - expected}"
