"""The configs the tests load."""

from ebpo_jax import cli
from tests.helpers import ROOT


def config_module(name: str):
  """The module of configs/NAME.py (get_config and its constants), as the trainer loads it."""
  return cli.load_module(ROOT / "configs" / f"{name}.py")


# LoRA on the tiny train step (tiny_step.tiny_steps): one compile shared by the LoRA tests.
TINY_LORA = {"model.lora.rank": 4, "rl.loss.kl_coef": 0.1}

RG_TINY = "configs/rg_tiny.py"  # a reasoning-gym task (chain_sum), a tiny byte-level model
