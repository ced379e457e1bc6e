"""Packaging for ebpo_jax: `pip install -e .` (runtime, CPU JAX), `pip install -e '.[test]'`
(tests), `pip install -e '.[cuda]'` / `'.[tpu]'` (JAX for NVIDIA GPUs / TPUs),
`pip install -e '.[aot]'` (the TPU compiler for `python -m ebpo_jax.aot` on any machine) and
`pip install -e '.[wandb]'` (logging to Weights & Biases, `--config.logging.wandb=True`) and
`pip install -e '.[peers]'` (bench/peers.py's peers: torch, and tunix's imports; tunix itself goes
in with `pip install --no-deps google-tunix==0.1.7`, see PEERS_REQUIRES)."""

import pathlib

import setuptools

HERE = pathlib.Path(__file__).parent


def _requirements() -> list[str]:
  lines = (HERE / "requirements.txt").read_text().splitlines()
  return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


# The TPU compiler for `python -m ebpo_jax.aot` on a machine without a TPU: the libtpu that jax's
# own `tpu` extra names for the jax of requirements.txt (0.10.2). TPU VMs get it from jax[tpu].
AOT_REQUIRES = ["libtpu==0.0.42.*"]

# JAX for an accelerator: the jax of requirements.txt with its own backend from pip (jax's extras:
# the CUDA 12 plugin with CUDA and cuDNN wheels; libtpu). The notebook installs the one its runtime
# needs; launch/gpu.sh and launch/tpu_pod.sh name the same builds.
CUDA_REQUIRES = ["jax[cuda12]>=0.10,<0.11"]
TPU_REQUIRES = ["jax[tpu]>=0.10,<0.11"]

# Weights & Biases, optional (config.logging.wandb); tested with 0.31 (an offline run read back).
WANDB_REQUIRES = ["wandb>=0.19,<1"]

# bench/peers.py only (never a runtime dependency): transformers' `generate` runs on torch (2.13.0
# is the CPU wheel; any other pulls CUDA), and tunix 0.1.7's imports of the modules the bench uses.
# google-tunix itself is installed apart, without its dependencies: it pins safetensors<0.8, which
# this package (and transformers >= 5.13) exclude, so pip cannot resolve it beside ebpo_jax; it runs
# with safetensors 0.8 (bench/peers.py, checked). Install:
#   pip install -e '.[peers]' && pip install --no-deps google-tunix==0.1.7
# Tested: google-tunix 0.1.7, google-metrax 0.2.4, jaxtyping 0.3.11, perfetto 0.59.1, sentencepiece
# 0.2.3 (with jax 0.10.2, flax 0.12.8, transformers 5.24.0, safetensors 0.8.0).
PEERS_REQUIRES = [
  "torch==2.13.0",
  "google-metrax>=0.2.3",  # tunix.rl imports metrax (which brings clu)
  "jaxtyping>=0.3",
  "perfetto>=0.59",
  "sentencepiece>=0.2",
]

TEST_REQUIRES = [
  "pytest>=8",
  "pytest-xdist>=3.5",  # `-n 2`: test files in parallel processes
  "import-linter>=2.2",  # the layer contracts of pyproject.toml (tests/unit/test_layers.py)
  "hypothesis>=6.100",
  "ruff>=0.6",
  # PyTorch reference models for logit parity; 2.13.0 is the CPU wheel (any other pulls CUDA).
  "torch==2.13.0",
  # Loads the adapters of `export --format=peft` (tests/unit/models/test_lora_export.py); tested: 0.21.2.
  "peft>=0.21.2,<1",
  "nbclient>=0.10",
  "nbformat>=5.10",
  "ipykernel>=6.29",
  # A Google Cloud Storage API on loopback for the gs:// tests (tests/conftest.py gcs_emulator).
  "gcp-storage-emulator>=2024.8",
  # Writes the save_to_disk fixtures that ebpo_jax.data reads with pyarrow alone (tested: 5.2).
  "datasets>=3.0,<6",
  *AOT_REQUIRES,  # tests/{unit,e2e}/test_aot.py, tests/e2e/test_launch.py (tpu_pod.sh's fit check)
  *WANDB_REQUIRES,  # tests/e2e/test_logging.py: a run with wandb offline
]

setuptools.setup(
  name="ebpo_jax",
  version="0.1.0",
  description="EBPO: empirical-Bayes shrinkage baselines for GRPO-style RLVR, in JAX/Flax.",
  long_description=(HERE / "README.md").read_text(),
  long_description_content_type="text/markdown",
  license="Apache-2.0",
  license_files=["LICENSE"],
  python_requires=">=3.11",
  packages=setuptools.find_packages(include=["ebpo_jax", "ebpo_jax.*"]),
  install_requires=_requirements(),
  extras_require={
    "test": TEST_REQUIRES,
    "aot": AOT_REQUIRES,
    "wandb": WANDB_REQUIRES,
    "peers": PEERS_REQUIRES,
    "cuda": CUDA_REQUIRES,
    "tpu": TPU_REQUIRES,
  },
)
