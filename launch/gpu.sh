#!/usr/bin/env bash
# Runs the trainer on one host with N GPUs: one process drives all local GPUs (the JAX norm), and
# the config's mesh spreads over them (mesh.fsdp=-1 takes every device).
#
#   WORKDIR=/tmp/arith NUM_GPUS=4 launch/gpu.sh [--dry-run]
#   CUDA_VISIBLE_DEVICES=2,3 WORKDIR=/tmp/arith launch/gpu.sh
#
# Variables (required ones marked *):
#   NUM_GPUS                 GPUs to use (default: those in CUDA_VISIBLE_DEVICES, else all that
#                            nvidia-smi lists)
#   CUDA_VISIBLE_DEVICES     which GPUs (default 0..NUM_GPUS-1); its count must equal NUM_GPUS
#   MEM_FRACTION             XLA_PYTHON_CLIENT_MEM_FRACTION: the share of each GPU's memory that
#                            JAX preallocates (default 0.90; JAX's own default is 0.75)
#   PREALLOCATE              XLA_PYTHON_CLIENT_PREALLOCATE (default true; false allocates on demand,
#                            slower, fragments, but leaves memory to other processes)
#   XLA_FLAGS                passed through, e.g. "--xla_gpu_enable_latency_hiding_scheduler=true"
#   CONFIG                   experiment config (default configs/arith_ebpo.py; NAME.py:ARG passes ARG)
#   WORKDIR*                 checkpoints, metrics and plots
#                            (relative paths are relative to where you run this: the repository root)
#   EXTRA_ARGS               more trainer flags, split on spaces, e.g. "--config.train.num_steps=500"
#   INSTALL                  1: first pip install -e . and JAX_PIP_SPEC (default 0)
#   JAX_PIP_SPEC             the JAX build to install (default "jax[cuda12]"; or "jax[cuda13]")
#   PYTHON                   the interpreter (default python)
#   DRY_RUN                  1: print every command instead of running it (same as --dry-run)
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_args -- "$@"
PYTHON=${PYTHON:-python}
MEM_FRACTION=${MEM_FRACTION:-0.90}
PREALLOCATE=${PREALLOCATE:-true}
INSTALL=${INSTALL:-0}
JAX_PIP_SPEC=${JAX_PIP_SPEC:-jax[cuda12]}
require WORKDIR "checkpoints, metrics and plots go there"

# NUM_GPUS and CUDA_VISIBLE_DEVICES: either one gives the other; both must agree.
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
  NUM_GPUS=${NUM_GPUS:-${#visible[@]}}
  ((NUM_GPUS == ${#visible[@]})) ||
    fail "NUM_GPUS=$NUM_GPUS but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES lists ${#visible[@]}"
else
  if [[ -z ${NUM_GPUS:-} ]]; then
    command -v nvidia-smi >/dev/null || fail "no nvidia-smi here: set NUM_GPUS"
    NUM_GPUS=$(nvidia-smi -L | grep -c '^GPU ')
  fi
  [[ $NUM_GPUS =~ ^[1-9][0-9]*$ ]] || fail "NUM_GPUS=$NUM_GPUS is not a positive integer"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NUM_GPUS - 1)))
fi

trainer_args
gpu_env=(
  env
  CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"
  JAX_PLATFORMS=cuda
  XLA_PYTHON_CLIENT_MEM_FRACTION="$MEM_FRACTION"
  XLA_PYTHON_CLIENT_PREALLOCATE="$PREALLOCATE"
)
if [[ -n ${XLA_FLAGS:-} ]]; then
  gpu_env+=(XLA_FLAGS="$XLA_FLAGS")
fi
install=("$PYTHON" -m pip install -e "$REPO_ROOT" "$JAX_PIP_SPEC")
check_py='import sys
try:
  import jax
  n = jax.device_count()
except Exception as e:  # no CUDA plugin or driver: backend initialisation raises (or asserts)
  sys.exit(f"error: JAX has no GPU backend ({type(e).__name__} {e}); INSTALL=1 installs {sys.argv[2]}")
if n != int(sys.argv[1]):
  sys.exit(f"error: JAX sees {n} GPUs, expected {sys.argv[1]}")
print(f"JAX sees {n} GPUs: {jax.devices()}")'
check=("${gpu_env[@]}" "$PYTHON" -c "$check_py" "$NUM_GPUS" "$JAX_PIP_SPEC")
train=("${gpu_env[@]}" "$PYTHON" -m ebpo_jax.train "${train_args[@]}")

echo "# $NUM_GPUS GPU(s): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES, one process"
if [[ $INSTALL == 1 ]]; then
  print_command "${install[@]}"
fi
print_command "${check[@]}"
print_command "${train[@]}"
if [[ $DRY_RUN == 1 ]]; then
  exit 0
fi
if [[ $INSTALL == 1 ]]; then
  "${install[@]}"
fi
"${check[@]}"
exec "${train[@]}"
