"""The tiers' selection (tests/conftest.py): the tests marked `peers` (tunix, installed apart) run
only when `-m` names them, whatever else `-m` selects."""

import types

import pytest

from tests import conftest


def fake_item(name, *markers):
  return types.SimpleNamespace(
    nodeid=f"tests/e2e/test_x.py::{name}",
    get_closest_marker=lambda marker: marker if marker in markers else None,
  )


@pytest.mark.parametrize(
  "markexpr, kept",
  [
    ("", ["plain", "slow"]),
    ("e2e", ["plain", "slow"]),  # the e2e tier: the peers test, an e2e one too, still left out
    ("peers", ["plain", "slow", "tunix"]),  # pytest's own -m then keeps the peers test only
  ],
)
def test_peers_tests_are_left_out_unless_asked_for(markexpr, kept):
  items = [fake_item("plain"), fake_item("slow", "e2e"), fake_item("tunix", "e2e", "peers")]
  deselected = []
  config = types.SimpleNamespace(
    option=types.SimpleNamespace(markexpr=markexpr),
    hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
  )
  conftest.pytest_collection_modifyitems(config, items)
  assert sorted(item.nodeid.split("::")[1] for item in items) == kept
  assert len(deselected) == 3 - len(kept)
