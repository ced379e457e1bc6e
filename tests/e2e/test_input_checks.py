"""Bad input on the command line, as a process: a typo in a `--config.KEY` override is one line
with the closest key, in each entry point that takes a config; `--print_config` prints and exits;
bad config values and rows files are one line and status 2 before anything compiles, leaving the
workdir as it was."""

import json

import pytest

from tests.helpers.processes import run_trainer

ENTRY_POINTS = ["ebpo_jax.evaluate", "ebpo_jax.difficulty", "ebpo_jax.ablate"]


@pytest.fixture(scope="module")
def entry_point_typos() -> list[dict]:
  """The exit status and stderr of each of ENTRY_POINTS on a key typo (one process, a fork each:
  trainer_starts)."""
  from tests.helpers.trainer_starts import starts

  args = ["--config=configs/arith_ebpo.py:runlocal", "--config.sed=1"]
  return starts([["-m", module, *args] for module in ENTRY_POINTS])


@pytest.mark.parametrize("index", range(len(ENTRY_POINTS)), ids=ENTRY_POINTS)
def test_every_config_entry_point_reports_a_key_typo_in_one_line(entry_point_typos, index):
  result = entry_point_typos[index]
  assert result["status"] == 2, result["stderr"][-3000:]
  assert result["stderr"].strip() == "error: --config.sed=1: no config key sed; did you mean seed?"


def test_print_config_prints_the_resolved_config_and_exits(tmp_path):
  result = run_trainer(
    tmp_path / "run", "--config.rl.group_size=8", "--config.seed=3", "--print_config", timeout=120
  )
  assert result.returncode == 0, result.stderr[-2000:]
  printed = json.loads(result.stdout)
  assert printed["rl"]["group_size"] == 8 and printed["seed"] == 3
  assert printed["task"]["name"] == "arithmetic" and "checkpoint" in printed
  assert not (tmp_path / "run").exists()  # nothing written, nothing compiled


# ----------------------------------------------------------------------------- bad starts

TYPO = "--config.train.num_step=3"  # the trainer's key typo: its whole stderr is checked below

# (arguments, the start of the one line after "error: "): each gave a traceback, failed late
# (after the warm start), or was accepted. All run in one process (trainer_starts: a fork each).
BAD_STARTS = [
  ([TYPO], f"{TYPO}: no config key train.num_step; did you mean train.num_steps?"),
  (["--config.train.mini_batch_size=0"], "config.train.mini_batch_size=0: must be >= 1"),
  (["--config.train.micro_batch_size=-1"], "config.train.micro_batch_size=-1: must be >= 0"),
  (["--config.model.num_layers=0"], "config.model.num_layers=0: must be >= 1"),
  (["--config.model.hidden_size=0"], "config.model.hidden_size=0: must be >= 1"),
  (["--config.model.num_heads=0"], "config.model.num_heads=0: must be >= 1"),
  (["--config.model.head_dim=-1"], "config.model.head_dim=-1: must be >= 1"),
  (["--config.model.intermediate_size=0"], "config.model.intermediate_size=0: must be >= 1"),
  (["--config.model.num_kv_heads=3"], "config.model.num_kv_heads=3: must divide model.num_heads"),
  (["--config.train.learning_rate=inf"], "config.train.learning_rate=inf: must be finite"),
  (["--config.rl.loss.clip_low=2"], "config.rl.loss.clip_low=2.0: must lie in [0, 1)"),
  (["--config.model.rope_theta=0"], "config.model.rope_theta=0.0: must be > 0"),
  (["--config.model.vocab_size=-5"], "config.model.vocab_size=-5: must be >= 0"),
  (["--config.seed=-1"], "config.seed=-1: must be an int in [0, 2**32)"),
  (["--config.rl.group_size=1"], "config.rl.group_size=1: must be >= 2"),
  (["--config.task.name=nope"], "config.task.name='nope': unknown task 'nope'; known: "),
  (["--config.task.options.ops=('pow',)"], "config.task.options: task 'arithmetic': "),
  (["--config=configs/arith_ebpo.py:runlcal"], "flag --config=configs/arith_ebpo.py:runlcal: "),
  # Rows ({rows}: a folder of the files ROWS_FILES writes): a traceback each, and config.json was
  # written before the rows were read, so that the corrected command was refused.
  (["--config.data.path={rows}/deep.jsonl"], "{rows}/deep.jsonl:2: JSON nested too deeply"),
  (["--config.data.path={rows}/digits.jsonl"], "{rows}/digits.jsonl:1: an integer of 5001 digits"),
  (["--config.data.path={rows}/cut.jsonl"], "{rows}/cut.jsonl:2:"),  # a line cut short
  (["--config.data.path=/nonexistent.jsonl"], "/nonexistent.jsonl: no such file"),
]
ROWS_FILES = {
  "cut.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n',
  "deep.jsonl": '{"prompt": "1+1=", "answer": "2"}\n' + "[" * 100_000 + "]" * 100_000 + "\n",
  "digits.jsonl": '{"prompt": "1+1=", "answer": "2", "n": ' + "9" * 5001 + "}\n",
}


@pytest.fixture(scope="module")
def bad_starts(tmp_path_factory) -> tuple[list[tuple[dict, object]], object]:
  """([(the trainer's exit status and stderr, its workdir) of each of BAD_STARTS], the folder of
  the rows files)."""
  from tests.helpers.configs import ARITH
  from tests.helpers.trainer_starts import starts

  root = tmp_path_factory.mktemp("bad_starts")
  for name, text in ROWS_FILES.items():
    (root / name).write_text(text)
  argvs = [
    [f"--config={ARITH}", f"--workdir={root / str(i)}", *(a.format(rows=root) for a in args)]
    for i, (args, _) in enumerate(BAD_STARTS)
  ]
  workdirs = [root / str(i) for i in range(len(argvs))]
  return list(zip(starts(argvs), workdirs, strict=True)), root


@pytest.mark.parametrize("index", range(len(BAD_STARTS)), ids=lambda i: BAD_STARTS[i][0][-1][-34:])
def test_a_bad_start_is_one_line_and_status_2_before_anything_compiles(bad_starts, index):
  (result, workdir), (_, message) = bad_starts[0][index], BAD_STARTS[index]
  lines = result["stderr"].strip().splitlines()
  assert result["status"] == 2 and len(lines) == 1, result["stderr"][-3000:]
  assert lines[0].startswith(f"error: {message.format(rows=bad_starts[1])}"), lines[0]
  assert not (workdir / "config.json").exists()  # the workdir is left as it was
  assert not (workdir / "checkpoints").exists()


def test_cli_typo_in_a_config_key_is_one_line_with_the_suggestion(bad_starts):
  (result, _), (args, _) = bad_starts[0][0], BAD_STARTS[0]  # the trainer's start as any other's
  assert args == [TYPO]
  assert result["status"] == 2, result["stderr"][-3000:]
  assert result["stderr"].strip() == (
    "error: --config.train.num_step=3: no config key train.num_step; did you mean train.num_steps?"
  )


def test_the_corrected_command_runs_on_the_workdir_of_a_bad_start(bad_starts):
  # The start on /nonexistent.jsonl wrote no config.json: its data.path is no change to refuse.
  (_, workdir), (args, _) = bad_starts[0][-1], BAD_STARTS[-1]
  assert args == ["--config.data.path=/nonexistent.jsonl"]
  args = ("--config.train.num_steps=0", "--config.sft.num_steps=0")  # that it starts is the point
  result = run_trainer(workdir, *args, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (workdir / "config.json").exists()
