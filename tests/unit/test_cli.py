"""A flag given in-process is checked as on the command line (each `--help`: e2e/test_cli.py)."""

import pytest

from ebpo_jax import cli, simulate
from ebpo_jax.data import cluster
from ebpo_jax.models import convert


def test_in_process_flags_are_checked_as_on_the_command_line(capsys):
  args = simulate.parse_args(["--num_prompts=64", "--group_sizes=2,8", "--rewards", "gaussian"])
  assert (args.num_prompts, args.group_sizes, args.rewards, args.steps) == (
    64,
    [2, 8],
    "gaussian",
    5,
  )

  def error(parse, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
      parse(argv)
    assert exit_info.value.code == cli.BAD_INPUT_STATUS
    return capsys.readouterr().err

  assert error(simulate.parse_args, ["--num_prompts=1"]) == (
    "error: flag --num_prompts=1: 1 is not integer >= 2\n"
  )
  assert error(simulate.parse_args, ["--group_sizes=2,x"]) == (
    "error: flag --group_sizes=2,x: must be comma-separated integers >= 2, got '2,x'\n"
  )
  assert error(simulate.parse_args, ["--nope=1"]) == "error: Unknown command line flag 'nope'\n"
  assert error(simulate.parse_args, ["stray"]) == "error: unexpected arguments ['stray']\n"
  assert "--output must have a value" in error(cluster.parse_args, ["--input=rows.jsonl"])
  assert error(convert.main, ["--gguf=x.gguf", "--out=o", "--dtype=float16"]) == (
    "error: flag --dtype=float16: value should be one of <float32|bfloat16>\n"
  )
