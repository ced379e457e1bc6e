"""launch/: the dry runs of tpu_pod.sh and gpu.sh, local_multiprocess.sh's usage errors and failure
handling, tpu_pod.sh against a fake gcloud (precheck, --stop, quoting). The multi-host check
(2 processes x 4 CPU devices equal 1 process x 8 devices) runs on a bucket, in test_gcs.py."""

import contextlib
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT
from tests.helpers.launch import LAUNCH, SCRIPT_VARS, TPU_VARS, make_executable, run_script

TRAIN_ARGS = "--config=configs/arith_ebpo.py:runlocal --workdir=gs://bucket/runs/arith"

# The fit check tpu_pod.sh runs first, here: the config and EXTRA_ARGS' --config.* flags.
PRECHECK_CMD = (
  "+ python3 -m ebpo_jax.aot --config=configs/arith_ebpo.py:runlocal --topology=v5p-64 "
  "--config.train.num_steps=7 --config.seed=3"
)


def _commands(stdout: str) -> list[str]:
  """The printed commands ("+ ..." lines; a quoted word may span lines)."""
  return ["+" + c for c in ("\n" + stdout.rstrip("\n")).split("\n+")[1:]]


# ----------------------------------------------------------------------------- tpu_pod.sh


def test_tpu_pod_dry_run_creates_copies_installs_and_runs_on_all_workers():
  result = run_script([LAUNCH / "tpu_pod.sh", "--dry-run"], **TPU_VARS)
  assert result.returncode == 0, result.stderr
  precheck, *cmds = _commands(result.stdout)
  assert precheck == PRECHECK_CMD  # printed, not run, in a dry run
  where = "--zone=us-east5-a --project=my-proj"
  assert cmds[0].startswith(f"+ gcloud compute tpus tpu-vm describe ebpo-test {where}")
  assert cmds[1] == (
    f"+ gcloud compute tpus tpu-vm create ebpo-test {where} "
    "--accelerator-type=v5p-64 --version=v2-alpha-tpuv5"
  )
  assert "git" in cmds[2] and "tar" in cmds[2]
  assert cmds[3].startswith("+ gcloud compute tpus tpu-vm scp /tmp/ebpo_jax_code_")
  assert cmds[3].endswith(f"ebpo-test:ebpo_jax_code.tgz {where} --worker=all")
  assert "--worker=all" in cmds[4] and "tar -xzf ~/ebpo_jax_code.tgz -C ~/ebpo-jax" in cmds[4]
  pip = "--worker=all \"--command=cd ~/ebpo-jax && python3 -m pip install -q -e . 'jax[tpu]'\""
  assert cmds[5].endswith(pip)  # the spec quoted for the workers' shell
  assert "--worker=all" in cmds[6]
  assert (
    f"python3 -m ebpo_jax.train {TRAIN_ARGS} --config.train.num_steps=7 --config.seed=3"
    in (cmds[6])
  )
  assert "nohup" in cmds[6] and "> ~/ebpo_train.log" in cmds[6]
  assert "--worker=0" in cmds[7] and "tail" in cmds[7] and "~/ebpo_train.log" in cmds[7]
  assert len(cmds) == 8


def test_tpu_pod_dry_run_reuses_an_existing_slice_and_clones_with_git():
  result = run_script(
    [LAUNCH / "tpu_pod.sh"],
    **TPU_VARS,
    DRY_RUN="1",
    DRY_RUN_TPU_EXISTS="1",
    CODE="git",
    REPO_URL="https://example.com/ebpo-jax.git",
    BRANCH="dev",
    INSTALL="0",
  )
  assert result.returncode == 0, result.stderr
  precheck, *cmds = _commands(result.stdout)
  assert precheck == PRECHECK_CMD
  assert "reusing TPU VM ebpo-test" in result.stdout
  assert not any(" create " in c or " scp " in c or "pip install" in c for c in cmds)
  assert "--worker=all" in cmds[1]
  assert "git clone --branch dev https://example.com/ebpo-jax.git ~/ebpo-jax" in cmds[1]
  assert "--worker=all" in cmds[2] and f"python3 -m ebpo_jax.train {TRAIN_ARGS}" in cmds[2]


def test_tpu_pod_runs_gcloud_and_ships_this_checkout(tmp_path):
  """The real (not dry) path, against a fake gcloud that logs its calls and the tarball's files,
  after the fit check (a fake python that logs its words and reports a fit)."""
  log = tmp_path / "gcloud.log"
  make_executable(
    tmp_path / "python3",
    '#!/usr/bin/env bash\necho "python3 $*" >> "$FAKE_GCLOUD_LOG"\necho \'{"fits": true}\'\n',
  )
  make_executable(
    tmp_path / "gcloud",
    "#!/usr/bin/env bash\n"
    'echo "gcloud $*" >> "$FAKE_GCLOUD_LOG"\n'
    'case "$4" in\n'
    '  describe) echo "NOT_FOUND: no such node" >&2; exit 1 ;;\n'
    '  scp) tar -tzf "$5" > "$FAKE_GCLOUD_LOG.files" ;;\n'
    "esac\n",
  )
  path = f"{tmp_path}:{os.environ['PATH']}"
  result = run_script([LAUNCH / "tpu_pod.sh"], **TPU_VARS, PATH=path, FAKE_GCLOUD_LOG=str(log))
  assert result.returncode == 0, result.stderr
  precheck, *calls = log.read_text().splitlines()
  assert precheck == PRECHECK_CMD.removeprefix("+ ")  # on this machine, before any gcloud call
  assert [c.split()[4] for c in calls] == ["describe", "create", "scp", "ssh", "ssh", "ssh", "ssh"]
  shipped = set(pathlib.Path(f"{log}.files").read_text().split())
  assert {"setup.py", "ebpo_jax/train.py", "configs/arith_ebpo.py", "launch/tpu_pod.sh"} <= shipped
  assert not any(p.startswith(".git/") or p.endswith(".pyc") for p in shipped)
  tarball = calls[2].split()[5]
  assert not pathlib.Path(tarball).exists()  # removed on exit


@pytest.fixture
def fake_pod(tmp_path) -> tuple[pathlib.Path, pathlib.Path, dict[str, str]]:
  """A slice of one worker on this machine: a fake gcloud runs each ssh --command in a local
  shell in the worker's home (HOME), as sshd would; fake git and python3 (the stand-in trainer)
  go in the returned bin directory. Returns the home, that directory and the environment."""
  home, bin_dir = tmp_path / "home", tmp_path / "bin"
  home.mkdir()
  bin_dir.mkdir()
  make_executable(
    bin_dir / "gcloud",
    "#!/usr/bin/env bash\n"
    'case "$4" in\n'
    "  describe) exit 1 ;;\n"
    '  scp) cp "$5" "$HOME/ebpo_jax_code.tgz" ;;\n'
    '  ssh) cd "$HOME" || exit\n'
    '    for a; do [[ $a == --command=* ]] && exec bash -c "${a#--command=}"; done ;;\n'
    "esac\n",
  )
  return home, bin_dir, {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}


def test_tpu_pod_runs_the_trainer_detached_with_its_words_intact(fake_pod):
  """Words with quotes, spaces and `$` reach the trainer as given, and the script streams its log
  and exits with its status."""
  home, bin_dir, env = fake_pod
  make_executable(
    bin_dir / "python3",
    "#!/usr/bin/env bash\n"
    'printf "%s\\n" "$EBPO_JAX_DISTRIBUTED" "$PWD" "$@" > "$HOME/trainer_args"\n'
    "echo trainer says hi\n"
    "exit 7\n",
  )
  variables = {
    **TPU_VARS,
    "WORKDIR": "gs://bucket/it's here",
    "EXTRA_ARGS": "--config.name=a'b --config.path=$HOME --config.glob=*",
    "INSTALL": "0",
    "PRECHECK": "0",  # the python3 here is the workers' stand-in trainer
  }
  result = run_script([LAUNCH / "tpu_pod.sh"], **variables, **env)
  assert result.returncode == 7, result.stderr
  assert "ebpo_jax.aot" not in result.stdout  # PRECHECK=0: no fit check
  assert "trainer says hi" in result.stdout
  assert (home / "ebpo-jax" / "launch" / "common.sh").exists()  # shipped with the scripts
  assert (home / "trainer_args").read_text().splitlines() == [
    "auto",
    str(home / "ebpo-jax"),
    "-m",
    "ebpo_jax.train",
    "--config=configs/arith_ebpo.py:runlocal",
    "--workdir=gs://bucket/it's here",
    "--config.name=a'b",
    "--config.path=$HOME",
    "--config.glob=*",
  ]
  assert (home / "ebpo_train.log.rc").read_text() == "7\n"


def _nasty(tag: str) -> str:
  """A value that a remote shell would split, glob or run unless it is quoted."""
  return f'{tag} it\'s "{tag}"; touch PWNED; $(touch PWNED) `touch PWNED` *'


@pytest.mark.parametrize("code", ["copy", "git"])
def test_tpu_pod_passes_its_values_to_the_workers_literally(fake_pod, tmp_path, code):
  """REPO_DIR, LOG, BRANCH, REPO_URL and JAX_PIP_SPEC with spaces, quotes, `;`, `$(...)` and `*`
  reach git, pip and the log as given, and nothing in them runs on the worker. CODE=git runs
  twice: a clone, then a fetch and checkout of the existing clone."""
  home, bin_dir, env = fake_pod
  calls = home / "calls"
  log_calls = f'{{ printf "%s\\n" "$PWD" "$@"; echo ---; }} >> "{calls}"\n'
  if code == "git":  # CODE=copy runs the real git here, to list the files it ships
    make_executable(
      bin_dir / "git",
      f"#!/usr/bin/env bash\n{log_calls}"
      'if [[ $1 == clone ]]; then mkdir -p "${@: -1}/.git"; fi\n',
    )
  make_executable(bin_dir / "python3", f"#!/usr/bin/env bash\n{log_calls}echo trainer says hi\n")
  repo_dir, log, branch, url, spec = map(_nasty, ["dir", "log", "branch", "url", "spec"])
  variables = {
    **TPU_VARS,
    "CODE": code,
    "REPO_DIR": repo_dir,
    "LOG": log,
    "BRANCH": branch,
    "REPO_URL": url,
    "JAX_PIP_SPEC": spec,
    "PRECHECK": "0",
  }
  for _ in range(2 if code == "git" else 1):
    result = run_script([LAUNCH / "tpu_pod.sh"], **variables, **env)
    assert result.returncode == 0, result.stdout + result.stderr
  repo = home / repo_dir
  pip = [str(repo), "-m", "pip", "install", "-q", "-e", ".", spec]
  train = [str(repo), "-m", "ebpo_jax.train", "--config=configs/arith_ebpo.py:runlocal"]
  train += ["--workdir=gs://bucket/runs/arith", "--config.train.num_steps=7", "--config.seed=3"]
  clone = [str(home), "clone", "--branch", branch, url, str(repo)]
  fetch = [str(home), "-C", str(repo), "fetch", "origin", branch]
  checkout = [str(home), "-C", str(repo), "checkout", "-B", branch, "FETCH_HEAD"]
  expected = {
    "copy": [pip, train],
    "git": [clone, pip, train, fetch, checkout, pip, train],
  }[code]
  assert [c.splitlines() for c in calls.read_text().split("---\n")[:-1]] == expected
  if code == "copy":
    assert (repo / "launch" / "tpu_pod.sh").exists()
  assert "trainer says hi" in (home / log).read_text()
  assert (home / f"{log}.rc").read_text() == "0\n"
  assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()


def test_tpu_pod_names_the_log_of_a_trainer_that_did_not_start_without_running_it(fake_pod):
  """The "trainer did not start" line names LOG as given: `$(...)` in it ran on every worker when
  LOG was expanded inside the remote echo's double quotes."""
  home, bin_dir, env = fake_pod
  make_executable(bin_dir / "setsid", "#!/usr/bin/env bash\n")  # the trainer never starts
  make_executable(bin_dir / "seq", "#!/usr/bin/env bash\n")  # no 10 s wait for its pid
  variables = {**TPU_VARS, "LOG": "log$(touch pwned)", "INSTALL": "0", "PRECHECK": "0"}
  result = run_script([LAUNCH / "tpu_pod.sh"], **variables, **env)
  assert result.returncode != 0
  assert f"error: the trainer did not start on {os.uname().nodename}; see {home}/log$(touch " in (
    result.stderr
  ), result.stderr
  assert not list(home.parent.rglob("pwned")) and not (ROOT / "pwned").exists()


def test_tpu_pod_stop_terminates_the_trainer_and_attach_reports_143(fake_pod):
  """--stop sends SIGTERM to the trainer itself (LOG.pid is its pid), which saves and exits with
  143; the launch's stream and a later --attach both end with that status."""
  home, bin_dir, env = fake_pod
  make_executable(
    bin_dir / "python3",
    "#!/usr/bin/env bash\n"
    "trap 'echo SIGTERM: saved; echo TERM > \"$HOME/trainer_got\"; exit 143' TERM\n"
    'echo $$ > "$HOME/trainer_pid"\n'
    "echo trainer started\n"
    "for _ in $(seq 600); do sleep 0.1; done\n",
  )
  variables = {**TPU_VARS, "INSTALL": "0", "PRECHECK": "0"}
  launch = subprocess.Popen(
    [LAUNCH / "tpu_pod.sh"],
    cwd=ROOT,
    env={**{k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}, **variables, **env},
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  pid_file = home / "trainer_pid"  # written by the trainer once its SIGTERM handler is set
  try:
    deadline = time.monotonic() + 60
    started = (pid_file, home / "ebpo_train.log.pid")
    while not all(f.exists() for f in started) and launch.poll() is None:
      assert time.monotonic() < deadline, "the trainer did not start"
      time.sleep(0.1)
    assert all(f.exists() for f in started), launch.communicate(timeout=10)
    stop = run_script([LAUNCH / "tpu_pod.sh", "--stop"], **variables, **env)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "stopping on" in stop.stdout
    out, err = launch.communicate(timeout=30)
    assert (home / "trainer_got").read_text() == "TERM\n"  # the trainer's own handler ran
    assert (home / "ebpo_train.log.pid").read_text() == pid_file.read_text()
    assert (home / "ebpo_train.log.rc").read_text() == "143\n"
    assert launch.returncode == 143, out + err
    assert "trainer started" in out and "SIGTERM: saved" in out
    attach = run_script([LAUNCH / "tpu_pod.sh", "--attach"], **variables, **env)
    assert attach.returncode == 143, attach.stdout + attach.stderr
    assert "SIGTERM: saved" in attach.stdout
    again = run_script(
      [LAUNCH / "tpu_pod.sh", "--stop"], **variables, **env
    )  # no stale pid is signalled
    assert again.returncode == 0 and "the trainer has exited (status 143)" in again.stdout
  finally:
    if launch.poll() is None:
      launch.kill()
      launch.wait()
    if pid_file.exists():  # a stand-in that --stop missed: end it, by its pid
      trainer = int(pid_file.read_text())
      with contextlib.suppress(OSError):
        if str(bin_dir / "python3") in pathlib.Path(f"/proc/{trainer}/cmdline").read_text():
          os.kill(trainer, signal.SIGKILL)


@pytest.mark.parametrize(
  ("report", "message"),
  [
    ("echo '{\"fits\": false}'", "the config does not fit v5p-64's HBM"),
    ("echo error: config.x; exit 1", "the fit check failed"),
  ],
)
def test_tpu_pod_stops_before_gcloud_when_the_check_says_no(tmp_path, report, message):
  log = tmp_path / "gcloud.log"
  make_executable(tmp_path / "gcloud", f'#!/usr/bin/env bash\necho "gcloud $*" >> "{log}"\n')
  make_executable(tmp_path / "python3", f"#!/usr/bin/env bash\n{report}\n")
  result = run_script([LAUNCH / "tpu_pod.sh"], **TPU_VARS, PATH=f"{tmp_path}:{os.environ['PATH']}")
  assert result.returncode == 2
  assert message in result.stderr and "PRECHECK=0" in result.stderr
  assert not log.exists()


def test_the_docs_dry_run_line_works_as_printed():
  (line,) = [
    ln.strip()
    for ln in (ROOT / "docs" / "hosts.md").read_text().splitlines()
    if "DRY_RUN=1" in ln and "launch/tpu_pod.sh" in ln
  ]
  words = shlex.split(line, comments=True)
  env = dict(w.split("=", 1) for w in words[:-1])
  assert words[-1] == "launch/tpu_pod.sh" and all(k.isupper() for k in env)
  result = run_script([ROOT / words[-1]], **env)
  assert result.returncode == 0, result.stderr
  precheck, describe, *_ = _commands(result.stdout)
  assert f"--topology={env['ACCELERATOR_TYPE']}" in precheck
  assert describe.startswith(f"+ gcloud compute tpus tpu-vm describe {env['TPU_NAME']}")


@pytest.mark.parametrize(
  ("drop", "args", "message"),
  [
    ("TPU_NAME", ["--dry-run"], "TPU_NAME is not set"),
    ("WORKDIR", ["--dry-run"], "WORKDIR is not set"),
    ("ZONE", ["--attach"], "ZONE is not set"),
    (None, ["--bogus"], "unknown argument --bogus (known: --dry-run, --attach, --stop, --help)"),
  ],
)
def test_tpu_pod_usage_errors(drop, args, message):
  variables = {k: v for k, v in TPU_VARS.items() if k != drop}
  result = run_script([LAUNCH / "tpu_pod.sh", *args], **variables)
  assert result.returncode == 2
  assert message in result.stderr
  assert "gcloud" not in result.stdout


# ----------------------------------------------------------------------------- gpu.sh


def test_gpu_dry_run_one_process_for_all_gpus():
  result = run_script(
    [LAUNCH / "gpu.sh", "--dry-run"],
    NUM_GPUS="4",
    WORKDIR="/tmp/gpu_run",
    CONFIG="configs/arith_ebpo.py",
    EXTRA_ARGS="--config.mesh.fsdp=4 --config.seed=2",
    MEM_FRACTION="0.8",
  )
  assert result.returncode == 0, result.stderr
  *checks, train_cmd = _commands(result.stdout)
  assert len(checks) == 1 and "jax.device_count()" in checks[0]
  assert train_cmd == (
    "+ env CUDA_VISIBLE_DEVICES=0,1,2,3 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 "
    "XLA_PYTHON_CLIENT_PREALLOCATE=true python -m ebpo_jax.train "
    "--config=configs/arith_ebpo.py --workdir=/tmp/gpu_run --config.mesh.fsdp=4 --config.seed=2"
  )


def test_gpu_dry_run_takes_the_count_from_cuda_visible_devices_and_installs():
  result = run_script(
    [LAUNCH / "gpu.sh", "--dry-run"],
    CUDA_VISIBLE_DEVICES="2,5",
    WORKDIR="w",
    INSTALL="1",
    XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true",
  )
  assert result.returncode == 0, result.stderr
  install, check, train_cmd = _commands(result.stdout)
  assert install == f"+ python -m pip install -e {ROOT} 'jax[cuda12]'"
  assert check.endswith(" 2 'jax[cuda12]'")
  assert "CUDA_VISIBLE_DEVICES=2,5 " in train_cmd
  assert "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true " in train_cmd


def test_gpu_errors():
  mismatch = run_script(
    [LAUNCH / "gpu.sh", "--dry-run"], CUDA_VISIBLE_DEVICES="0,1", NUM_GPUS="3", WORKDIR="w"
  )
  assert mismatch.returncode == 2
  assert "NUM_GPUS=3 but CUDA_VISIBLE_DEVICES=0,1 lists 2" in mismatch.stderr
  assert "WORKDIR is not set" in run_script([LAUNCH / "gpu.sh", "--dry-run"], NUM_GPUS="1").stderr
  bogus = run_script([LAUNCH / "gpu.sh", "--attach"], NUM_GPUS="1", WORKDIR="w")
  assert bogus.returncode == 2
  assert "unknown argument --attach (known: --dry-run, --help)" in bogus.stderr
  # Not a dry run, on this CPU-only machine: the GPU check stops it before the trainer starts.
  no_gpu = run_script([LAUNCH / "gpu.sh"], NUM_GPUS="1", WORKDIR="w", PYTHON=sys.executable)
  assert no_gpu.returncode == 1
  assert "error: JAX has no GPU backend" in no_gpu.stderr
  assert not (ROOT / "w").exists()


@pytest.mark.parametrize("script", ["gpu.sh", "tpu_pod.sh"])
def test_help_prints_the_documented_variables(script):
  result = run_script([LAUNCH / script, "--help"])
  assert result.returncode == 2
  assert "WORKDIR*" in result.stderr and "DRY_RUN" in result.stderr
  assert "set -euo" not in result.stderr and result.stdout == ""


# ------------------------------------------------------------------------- local_multiprocess.sh


@pytest.mark.parametrize(
  ("args", "message"),
  [
    ([], "missing N"),
    (["3", "--workdir=x"], "N=3 does not divide 8"),
    (["0", "--workdir=x"], "N=0 is not a positive integer"),
    (["two", "--workdir=x"], "N=two is not a positive integer"),
    (["2"], "no trainer arguments"),
  ],
)
def test_local_multiprocess_usage_errors(args, message):
  result = run_script([LAUNCH / "local_multiprocess.sh", *args])
  assert result.returncode == 2
  assert message in result.stderr and "usage:" in result.stderr


def test_local_multiprocess_environment_and_stopping_the_others_on_a_failure(tmp_path):
  """A stand-in for python: rank 1 fails at once, the others would run for a minute."""
  stub = make_executable(
    tmp_path / "python",
    "#!/usr/bin/env bash\n"
    f'if [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi\n'
    'echo "env $JAX_COORDINATOR_ADDRESS $JAX_NUM_PROCESSES $JAX_PROCESS_ID $JAX_PLATFORMS"\n'
    'echo "xla $XLA_FLAGS"\n'
    'echo "args $*" >&2\n'
    "if [[ $JAX_PROCESS_ID == 1 ]]; then sleep 0.5; exit 3; fi\n"
    "exec sleep 60\n",
  )
  start = time.monotonic()
  result = run_script(
    [LAUNCH / "local_multiprocess.sh", "4", "--config=c.py", "--workdir=w"],
    PYTHON=str(stub),
    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x",
  )
  assert time.monotonic() - start < 30  # not the 60 s of the other ranks
  assert result.returncode == 3
  assert "rank 1 " in result.stderr and "exited with status 3" in result.stderr
  lines = result.stdout.splitlines()
  for rank in range(4):
    (env_line,) = [ln for ln in lines if ln.startswith(f"[rank {rank}] env ")]
    address, num, rank_id, platform = env_line.split()[3:]
    assert address.startswith("127.0.0.1:") and (num, rank_id, platform) == ("4", str(rank), "cpu")
    (xla_line,) = [ln for ln in lines if ln.startswith(f"[rank {rank}] xla ")]
    assert xla_line.split()[3:] == [
      "--xla_dump_to=/tmp/x",
      "--xla_force_host_platform_device_count=2",
    ]
    assert f"[rank {rank}] args -m ebpo_jax.train --config=c.py --workdir=w" in lines
  assert len({ln.split()[3] for ln in lines if " env " in ln}) == 1  # one coordinator
