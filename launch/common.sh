# shellcheck shell=bash disable=SC2034 # it sets variables for the script that sources it
# Sourced by launch/gpu.sh and launch/tpu_pod.sh (not run on its own): the argument handling,
# required variables, trainer flags and command quoting that they share.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#   parse_args --attach --stop -- "$@"   # --dry-run, -h/--help and the action flags before --
#   require WORKDIR "checkpoints, metrics and plots go there"
#   trainer_args                # fills train_args from CONFIG, WORKDIR and EXTRA_ARGS
#   print_command "${cmd[@]}"   # or: run "${cmd[@]}" (prints, then runs unless DRY_RUN=1)
#
# Errors print "error: ..." to stderr and exit 2 before anything has run.

# The repository root (this file is in launch/).
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The config the scripts run when CONFIG is not set.
DEFAULT_CONFIG=configs/arith_ebpo.py

# Prints the calling script's header comment (its usage and variables) and exits 2.
usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

fail() {
  echo "error: $*" >&2
  exit 2
}

# parse_args [ACTION_FLAG...] -- ARG...: sets DRY_RUN (from the environment, default 0; --dry-run
# sets 1) and action (launch, or the ACTION_FLAG given, without its dashes); -h/--help prints the
# usage; any other ARG fails.
parse_args() {
  local arg known=--dry-run actions=()
  while [[ $1 != -- ]]; do
    actions+=("$1")
    known+=", $1"
    shift
  done
  shift
  DRY_RUN=${DRY_RUN:-0}
  action=launch
  for arg in "$@"; do
    case $arg in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage ;;
      *)
        [[ " ${actions[*]} " == *" $arg "* ]] || fail "unknown argument $arg (known: $known, --help)"
        action=${arg#--}
        ;;
    esac
  done
}

# Fails unless the variable NAME is set and not empty; WHY says what it is for.
require() {
  [[ -n ${!1:-} ]] || fail "$1 is not set ($2); see $0 --help"
}

# Fills the array train_args with the trainer's flags: --config=$CONFIG (default DEFAULT_CONFIG)
# --workdir=$WORKDIR and EXTRA_ARGS split on spaces.
trainer_args() {
  local extra
  read -ra extra <<<"${EXTRA_ARGS:-}"
  train_args=(--config="${CONFIG:-$DEFAULT_CONFIG}" --workdir="$WORKDIR" "${extra[@]}")
}

# Prints the words as one shell command line, quoting only the words that need it, so that the
# line pastes back into a shell, or runs remotely, as the same words: in double quotes a word that
# holds single quotes and nothing that double quotes expand (it reads better), else in single quotes.
quote_words() {
  local word out=""
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=@,+%^-]+$ ]]; then
      out+="$word "
    elif [[ $word == *\'* && $word != *[\"\$\`\\!]* ]]; then
      out+="\"$word\" "
    else
      out+="'${word//\'/\'\\\'\'}' "
    fi
  done
  echo "${out% }"
}

# Prints a command as "+ WORDS", pasteable.
print_command() {
  echo "+ $(quote_words "$@")"
}

# Runs a command, or only prints it under DRY_RUN=1.
run() {
  print_command "$@"
  if [[ $DRY_RUN != 1 ]]; then
    "$@"
  fi
}
