"""The tiny policy of the sampler tests (tests/helpers/sampler.py), made once per test module
(test_sampling_turns.py has its own, at the init's scale)."""

import pytest

from tests.helpers.sampler import tiny_policy


@pytest.fixture(scope="module")
def policy():
  return tiny_policy()
