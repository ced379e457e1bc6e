#!/usr/bin/env bash
# Runs the trainer on every worker of a Cloud TPU VM slice (one process per host, the same command
# on each; with EBPO_JAX_DISTRIBUTED=auto the trainer calls jax.distributed.initialize(), which
# finds the other hosts from the TPU metadata).
#
#   TPU_NAME=ebpo ZONE=us-east5-a WORKDIR=gs://BUCKET/runs/arith launch/tpu_pod.sh [--dry-run]
#   launch/tpu_pod.sh --attach    # stream worker 0's log again (after Ctrl-C or a dropped link)
#   launch/tpu_pod.sh --stop      # SIGTERM the trainers on all workers (they checkpoint and exit
#                                 # with 143, which --attach then reports)
#
# Steps: check on this machine that the config fits the slice (PRECHECK); create the slice, or
# reuse it if `describe` finds it; copy this checkout to every worker
# (or clone a git branch there); `pip install -e .` plus jax[tpu] on every worker; start the trainer
# on all workers at once, detached (setsid nohup, log in ~/$LOG on each worker); stream worker 0's
# log until its trainer exits, and exit with its status. Ctrl-C stops the stream, not the run.
# Every value is passed to the workers' shell quoted, as one literal word.
#
# Variables (required ones marked *):
#   TPU_NAME*         name of the TPU VM slice
#   ZONE*             its zone, e.g. us-east5-a (v5p), us-west4-a (v5e)
#   PROJECT           GCP project (default: gcloud's configured project)
#   ACCELERATOR_TYPE  slice type, used when creating it (default v5p-64: 8 hosts x 4 chips)
#   RUNTIME_VERSION   TPU VM image (default v2-alpha-tpuv5; v5e: v2-alpha-tpuv5-lite,
#                     v6e: v2-alpha-tpuv6e, v4: tpu-ubuntu2204-base)
#   SPOT              1: create the slice as Spot capacity (default 0)
#   CODE              copy: tar this checkout (tracked and untracked, not ignored files) and scp it
#                     to every worker (default); git: clone REPO_URL at BRANCH on every worker
#   REPO_URL, BRANCH  the git remote and branch for CODE=git (BRANCH default main)
#   REPO_DIR          the code's directory on the workers, relative to the home directory
#                     (default ebpo-jax)
#   INSTALL           1: pip install -e . and JAX_PIP_SPEC on every worker (default 1)
#   JAX_PIP_SPEC      the JAX build to install (default "jax[tpu]"; requirements.txt pins the version)
#   CONFIG            experiment config, relative to REPO_DIR (default configs/arith_ebpo.py);
#                     CONFIG=configs/NAME.py:ARG passes ARG to get_config
#   WORKDIR*          checkpoints, metrics and plots; a gs:// path so that every host sees it
#   EXTRA_ARGS        more trainer flags, split on spaces, e.g. "--config.train.num_steps=500"
#   LOG               the trainer's log file on each worker, in the home directory (default
#                     ebpo_train.log; LOG.pid and LOG.rc hold its process id and exit status)
#   PRECHECK          1 (default): before creating or using the slice, compile the train step and
#                     a sampler call for ACCELERATOR_TYPE with the TPU compiler on this machine
#                     (`python -m ebpo_jax.aot --config=$CONFIG --topology=$ACCELERATOR_TYPE` plus
#                     EXTRA_ARGS' --config.* flags; needs `pip install -e '.[aot]'`, 1-10 min)
#                     and stop if it does not fit the chips' HBM; 0: skip the check
#   PYTHON            the Python that runs the check here (default python3)
#   DRY_RUN           1: print every command instead of running it (same as --dry-run; the check
#                     is printed, not run); with DRY_RUN_TPU_EXISTS=1 the dry run takes the reuse
#                     branch, else the create one
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_args --attach --stop -- "$@"
require TPU_NAME "the TPU VM slice's name"
require ZONE "e.g. us-east5-a"
PROJECT=${PROJECT:-}
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5p-64}
RUNTIME_VERSION=${RUNTIME_VERSION:-v2-alpha-tpuv5}
SPOT=${SPOT:-0}
CODE=${CODE:-copy}
REPO_URL=${REPO_URL:-}
BRANCH=${BRANCH:-main}
REPO_DIR=${REPO_DIR:-ebpo-jax}
INSTALL=${INSTALL:-1}
JAX_PIP_SPEC=${JAX_PIP_SPEC:-jax[tpu]}
LOG=${LOG:-ebpo_train.log}
PRECHECK=${PRECHECK:-1}
PYTHON=${PYTHON:-python3}
if [[ $action == launch ]]; then
  require WORKDIR "a gs:// path that every host can write"
  [[ $WORKDIR == gs://* ]] ||
    echo "# warning: WORKDIR=$WORKDIR is not a gs:// path; every host must see the same directory"
fi

# ~/NAME for the workers' shell: their home directory, then NAME as one literal word.
in_home() {
  # shellcheck disable=SC2088 # the tilde is for the workers' shell
  echo "~/$(quote_words "$1")"
}
remote_repo=$(in_home "$REPO_DIR")
remote_log=$(in_home "$LOG")
remote_pid=$(in_home "$LOG.pid")
remote_rc=$(in_home "$LOG.rc")

tpu_vm=(gcloud compute tpus tpu-vm)
where=(--zone="$ZONE")
if [[ -n $PROJECT ]]; then
  where+=(--project="$PROJECT")
fi

# Runs a shell command line on the workers ("all" or an index).
on_workers() {
  run "${tpu_vm[@]}" ssh "$TPU_NAME" "${where[@]}" --worker="$1" --command="$2"
}

# Compiles the config for the slice here (ebpo_jax.aot) and stops unless it fits.
precheck() {
  local extra word check=() last
  [[ $PRECHECK == 1 ]] || return 0
  read -ra extra <<<"${EXTRA_ARGS:-}"
  check=("$PYTHON" -m ebpo_jax.aot --config="${CONFIG:-$DEFAULT_CONFIG}"
    --topology="$ACCELERATOR_TYPE")
  for word in "${extra[@]}"; do
    if [[ $word == --config.* ]]; then
      check+=("$word")
    fi
  done
  echo "# checking that the config fits $ACCELERATOR_TYPE (TPU compiler, here; PRECHECK=0 skips)"
  print_command "${check[@]}"
  if [[ $DRY_RUN == 1 ]]; then
    return 0
  fi
  # The check's report goes to the terminal; its last line is the JSON verdict.
  last=$(cd "$REPO_ROOT" && "${check[@]}" | tee /dev/stderr | tail -n 1) ||
    fail "the fit check failed (above); fix it, or skip it with PRECHECK=0"
  [[ $last == *'"fits": true'* ]] ||
    fail "the config does not fit $ACCELERATOR_TYPE's HBM (report above); nothing was created" \
      "or started. Shrink the config (e.g. sampling.prompts_per_call, train.micro_batch_size)" \
      "or take a larger slice; PRECHECK=0 skips the check"
  echo "# it fits"
}

create_or_reuse() {
  local describe=("${tpu_vm[@]}" describe "$TPU_NAME" "${where[@]}" --format=value\(state\))
  local state
  print_command "${describe[@]}"
  if [[ $DRY_RUN == 1 && ${DRY_RUN_TPU_EXISTS:-0} == 1 ]]; then
    state=READY
  elif [[ $DRY_RUN == 1 ]]; then
    state=""
  else
    state=$("${describe[@]}" 2>/dev/null || true)
  fi
  if [[ -n $state ]]; then
    echo "# reusing TPU VM $TPU_NAME (state $state)"
    [[ $state == READY ]] || fail "TPU VM $TPU_NAME is $state, not READY (start or delete it)"
    return
  fi
  echo "# creating TPU VM $TPU_NAME ($ACCELERATOR_TYPE, $RUNTIME_VERSION)"
  local create=("${tpu_vm[@]}" create "$TPU_NAME" "${where[@]}"
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION")
  if [[ $SPOT == 1 ]]; then
    create+=(--spot)
  fi
  run "${create[@]}"
}

ship_code() {
  case $CODE in
    copy)
      local tarball=/tmp/ebpo_jax_code_$$.tgz
      print_command git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard \
        "|" tar -C "$REPO_ROOT" -czf "$tarball" --null -T -
      if [[ $DRY_RUN != 1 ]]; then
        # shellcheck disable=SC2064 # expanded now: $tarball is local
        trap "rm -f $tarball" EXIT
        git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard |
          tar -C "$REPO_ROOT" -czf "$tarball" --null -T -
      fi
      run "${tpu_vm[@]}" scp "$tarball" "$TPU_NAME:ebpo_jax_code.tgz" "${where[@]}" --worker=all
      on_workers all "mkdir -p $remote_repo && tar -xzf ~/ebpo_jax_code.tgz -C $remote_repo"
      ;;
    git)
      [[ -n $REPO_URL ]] || fail "CODE=git needs REPO_URL (the git remote to clone)"
      local branch url
      branch=$(quote_words "$BRANCH")
      url=$(quote_words "$REPO_URL")
      on_workers all "if [ -d $remote_repo/.git ]; then git -C $remote_repo fetch origin $branch \
&& git -C $remote_repo checkout -B $branch FETCH_HEAD; \
else git clone --branch $branch $url $remote_repo; fi"
      ;;
    *) fail "CODE=$CODE: must be copy or git" ;;
  esac
}

install_code() {
  if [[ $INSTALL == 1 ]]; then
    on_workers all "cd $remote_repo && python3 -m pip install -q -e . $(quote_words "$JAX_PIP_SPEC")"
  fi
}

start_trainer() {
  local train_cmd keeper
  trainer_args
  # EBPO_JAX_DISTRIBUTED=auto: the trainer calls jax.distributed.initialize(), which reads the
  # slice's hosts from the TPU metadata. Quoted twice: for the remote shell, then for bash -c.
  train_cmd="EBPO_JAX_DISTRIBUTED=auto $(quote_words python3 -m ebpo_jax.train "${train_args[@]}")"
  # A detached shell (setsid nohup: it outlives the ssh session) starts the trainer, writes the
  # trainer's own pid to LOG.pid, so that --stop's SIGTERM reaches the trainer (which checkpoints
  # and exits with 143), then waits for it and writes its status to LOG.rc. That shell ignores
  # SIGTERM, so the status is written even when the signal goes to every process. The ssh command
  # returns once LOG.pid is written (at most 10 s). Every value stays outside the remote double
  # quotes: quote_words quotes it for the remote shell, whose double quotes would undo that.
  keeper="$train_cmd & echo \$! > $remote_pid; trap \"\" TERM; wait \$!; echo \$? > $remote_rc"
  on_workers all "cd $remote_repo || exit; rm -f $remote_pid $remote_rc; \
setsid nohup bash -c $(quote_words "$keeper") > $remote_log 2>&1 < /dev/null & \
for _ in \$(seq 100); do [ -s $remote_pid ] && exit; sleep 0.1; done; \
echo \"error: the trainer did not start on \$(hostname); see\" $remote_log >&2; exit 1"
}

stream_worker0() {
  echo "# streaming worker 0's ~/$LOG (Ctrl-C stops the stream; the run goes on: --attach)"
  # LOG.rc is written just after the trainer exits, so tail may return before it is there.
  on_workers 0 "tail -n +1 --pid=\$(cat $remote_pid) -F $remote_log; \
for _ in \$(seq 50); do [ -s $remote_rc ] && break; sleep 0.2; done; \
exit \$(cat $remote_rc 2>/dev/null || echo 1)"
}

case $action in
  launch)
    precheck
    create_or_reuse
    ship_code
    install_code
    start_trainer
    stream_worker0
    ;;
  attach) stream_worker0 ;;
  stop)
    on_workers all "if [ -s $remote_rc ]; then \
echo \"\$(hostname): the trainer has exited (status \$(cat $remote_rc))\"; \
else kill -TERM \$(cat $remote_pid) && echo \"stopping on \$(hostname)\"; fi"
    ;;
esac
