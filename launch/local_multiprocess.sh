#!/usr/bin/env bash
# Runs the trainer as N processes of JAX's multi-controller runtime on this machine (loopback CPU).
#
#   launch/local_multiprocess.sh N --config=configs/arith_ebpo.py:runlocal --workdir=/tmp/mp [...]
#
# Each process gets 8/N fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), so the
# N processes together hold the same 8 devices as one process run under tests/conftest.py, and the
# environment that ebpo_jax.train reads to call jax.distributed.initialize:
#   JAX_COORDINATOR_ADDRESS  127.0.0.1:PORT, a free port picked here (process 0 serves it)
#   JAX_NUM_PROCESSES        N
#   JAX_PROCESS_ID           the rank, 0..N-1
# Every output line is prefixed with "[rank R] ". The script waits for all processes; when one
# fails it stops the others (SIGTERM, then SIGKILL after GRACE_S seconds, default 10) and exits with
# that process's status. Ctrl-C stops them all. Variables: PYTHON (default python), GRACE_S.
set -euo pipefail

readonly TOTAL_DEVICES=8

usage() {
  echo "usage: $0 N ARGS...   (N processes of 'python -m ebpo_jax.train ARGS...'; N divides 8)" >&2
  echo "$1" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage "error: missing N, the number of processes"
num_processes=$1
shift
[[ $num_processes =~ ^[1-9][0-9]*$ ]] || usage "error: N=$num_processes is not a positive integer"
((TOTAL_DEVICES % num_processes == 0)) ||
  usage "error: N=$num_processes does not divide $TOTAL_DEVICES (use 1, 2, 4 or 8)"
[[ $# -ge 1 ]] || usage "error: no trainer arguments (at least --config=... --workdir=...)"

python_bin=${PYTHON:-python}
grace_s=${GRACE_S:-10}
devices_per_process=$((TOTAL_DEVICES / num_processes))
port=$("$python_bin" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Any device count already in XLA_FLAGS (tests/conftest.py sets 8) gives way to ours.
xla_flags=$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')
xla_flags="$xla_flags --xla_force_host_platform_device_count=$devices_per_process"

pids=()
declare -A rank_of # pid -> rank

stop_all() {
  local pid
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  local waited=0
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((waited < grace_s * 10)); do
      sleep 0.1
      waited=$((waited + 1))
    done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# shellcheck disable=SC2317 # reached through the trap below
on_signal() {
  echo "[launch] interrupted: stopping all $num_processes processes" >&2
  stop_all
  exit 130
}
trap on_signal INT TERM

for ((rank = 0; rank < num_processes; rank++)); do
  JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" \
    JAX_NUM_PROCESSES="$num_processes" \
    JAX_PROCESS_ID="$rank" \
    JAX_PLATFORMS=cpu \
    XLA_FLAGS="$xla_flags" \
    PYTHONUNBUFFERED=1 \
    "$python_bin" -m ebpo_jax.train "$@" \
    > >(sed -u "s/^/[rank $rank] /") 2>&1 &
  pids+=($!)
  rank_of[$!]=$rank
done
echo "[launch] $num_processes processes x $devices_per_process CPU devices," \
  "coordinator 127.0.0.1:$port, pids ${pids[*]}" >&2

status=0
running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  finished_pid=""
  if wait -n -p finished_pid "${running[@]}"; then
    rc=0
  else
    rc=$?
  fi
  [[ -n $finished_pid ]] || break # no child left to wait for (cannot happen; never spin)
  still=()
  for pid in "${running[@]}"; do
    [[ $pid == "$finished_pid" ]] || still+=("$pid")
  done
  running=("${still[@]}")
  if ((rc != 0)); then
    echo "[launch] rank ${rank_of[$finished_pid]} (pid $finished_pid) exited with status $rc:" \
      "stopping the others" >&2
    status=$rc
    stop_all
    break
  fi
done
wait 2>/dev/null # the sed prefixers flush their last lines (and no "Killed" job notices)
exit "$status"
