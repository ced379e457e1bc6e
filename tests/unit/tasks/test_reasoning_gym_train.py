"""The reasoning-gym config (chain_sum, a tiny random-init byte-level model) passes the trainer's
checks (one trainer step on it: e2e/test_reasoning_gym_train.py)."""

import pytest

from ebpo_jax.trainer import config as config_lib
from tests.helpers.configs import RG_TINY, load_config


def test_both_variants_of_the_config_pass_the_trainer_checks():
  for arg in ("", ":runlocal"):
    config_lib.check_config(load_config(RG_TINY + arg), num_devices=8)
  with pytest.raises(ValueError, match="unknown argument 'big'"):
    load_config(RG_TINY + ":big")
