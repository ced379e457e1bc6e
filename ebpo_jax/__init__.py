"""ebpo_jax: RL with verifiable rewards on language models, built around EBPO."""

__version__ = "0.1.0"
