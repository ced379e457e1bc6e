"""The task, its tokenizer and its rows for a run: training rows (from `data.path` or the task),
evaluation rows, every one tokenized and length-checked before anything compiles
(`load_task_and_rows`)."""

import sys
from collections.abc import Sequence

import jax
import ml_collections

from ebpo_jax import data, models, tasks
from ebpo_jax.tasks import tokenizers
from ebpo_jax.trainer import prompts


def load_tokenizer(config: ml_collections.ConfigDict, task: tasks.Task | None):
  """The model directory's tokenizer, or the task's own for a random-init model."""
  if config.model.path:
    return tokenizers.HFTokenizer(
      models.build.model_dir(config), chat_template=config.model.chat_template
    )
  return task.tokenizer


def load_task_and_rows(
  config: ml_collections.ConfigDict,
) -> tuple[tasks.Task, list[dict], list[str], list[dict]]:
  """The task, training rows and their cluster names, and held-out evaluation rows.

  Training rows come from `data.path` when set (clusters named in the file; a `datasets` directory's
  split `data.split`, columns `data.*_column`), else from the task;
  evaluation rows always come from the task's eval split (`task.num_eval` per cluster). Every row
  is tokenized here, before anything compiles: a prompt or answer the tokenizer cannot encode, or
  a prompt longer than the largest of `sampling.prompt_buckets`, is a DataError line per row
  (`FILE:LINE:`), or with `data.skip_bad_rows` a dropped row, counted on stderr.
  """
  task = tasks.from_config(config.task)
  check = prompts.PromptEncoder.from_config(config, task, load_tokenizer(config, task)).check
  skip = config.data.skip_bad_rows
  if config.data.path:
    rows, cluster_names, dropped = data.load_checked_rows(
      config.data.path,
      check,
      skip_bad=skip,
      columns=data.Columns.from_config(config.data),
      split=config.data.split,
    )
    _report_dropped(config.data.path, dropped, len(rows))
  else:
    rows, cluster_names = task.rows("train", config.task.num_train, config.seed), task.cluster_names
    rows = _checked_task_rows(rows, check, f"{config.task.name} train", skip)
  eval_rows = task.rows("eval", config.task.num_eval * len(task.cluster_names), config.seed)
  eval_rows = _checked_task_rows(eval_rows, check, f"{config.task.name} eval", skip)
  return task, rows, list(cluster_names), eval_rows


def _checked_task_rows(rows: list[dict], check, name: str, skip: bool) -> list[dict]:
  """The task's own rows that pass `check` (named `NAME row I` in the problems)."""
  problems = [(i, p) for i, row in enumerate(rows) if (p := check(row))]
  lines = [f"{name} row {i}: {p}" for i, p in problems]
  if lines and not skip:
    raise data.DataError(data.rows.listing(lines))
  _report_dropped(name, lines, len(rows) - len(lines))
  bad = {i for i, _ in problems}
  return [row for i, row in enumerate(rows) if i not in bad]


def _report_dropped(source: str, dropped: Sequence[str], kept: int) -> None:
  if dropped and jax.process_index() == 0:
    print(
      f"{source}: dropped {len(dropped)} bad rows of {len(dropped) + kept} "
      f"(data.skip_bad_rows=True); first: {dropped[0]}",
      file=sys.stderr,
    )
