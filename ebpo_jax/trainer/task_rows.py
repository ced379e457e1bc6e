"""The task, its tokenizer and its rows for a run: training rows (from `data.path` or the task),
evaluation rows (`eval_rows`: from `eval.path`, a held-out split of `data.path`, or the task's
split), every one tokenized and length-checked before anything compiles (`load_task_and_rows`)."""

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from ebpo_jax import data, models, tasks
from ebpo_jax.rollouts import prompts
from ebpo_jax.tasks import tokenizers


class Inputs(NamedTuple):
  """A run's task, tokenizer and rows (`load_task_and_rows`)."""

  task: tasks.Task
  tokenizer: Any  # `load_tokenizer`'s, loaded once for the row checks and the run
  rows: list[dict]  # training rows, "cluster" an index into cluster_names
  cluster_names: list[str]  # the training clusters (the prior's)
  eval_rows: list[dict]  # the in-training evaluation's rows, "cluster" into eval_cluster_names
  eval_cluster_names: list[str]  # the clusters of the evaluation's source: eval/accuracy/<name>


def load_tokenizer(config: ml_collections.ConfigDict, task: tasks.Task | None):
  """The model directory's tokenizer, or the task's own for a random-init model."""
  if config.model.path:
    return tokenizers.HFTokenizer(
      models.build.model_dir(config), chat_template=config.model.chat_template
    )
  return task.tokenizer


def load_task(config: ml_collections.ConfigDict) -> tasks.Task:
  """The task of `config.task` (a task that reads a rows file reads it by `data.*_column`)."""
  return tasks.from_config(config.task, columns=data.Columns.from_config(config.data))


def row_check(
  config: ml_collections.ConfigDict, task: tasks.Task, tokenizer: Any
) -> Callable[[dict], str | None]:
  """The check of one row: the task can score it, its prompt and answer encode (by `tokenizer`,
  `load_tokenizer`'s), the prompt fits."""
  return prompts.PromptEncoder.from_config(config, task, tokenizer).check


def load_task_and_rows(config: ml_collections.ConfigDict) -> Inputs:
  """The task, its tokenizer, training rows and their cluster names, and the evaluation's rows and
  clusters.

  Training rows come from `data.path` when set (clusters named in the file; a `datasets`
  directory's split `data.split`, columns `data.*_column`), else from the task. The in-training
  evaluation measures `eval.path` when set, else the rows of `data.path` held out of training
  (`data.eval_fraction`, by a hash of the prompt), else the task's eval split; at most
  `task.num_eval` rows per cluster, labelled by that source's clusters. Every row is tokenized
  here, before anything compiles: a row the task cannot score, a prompt or answer the tokenizer
  cannot encode, or a prompt longer than the largest of `sampling.prompt_buckets`, is a DataError
  line per row (`FILE:LINE:`), or with `data.skip_bad_rows` a dropped row, counted on stderr.
  """
  task = load_task(config)
  tokenizer = load_tokenizer(config, task)
  check = row_check(config, task, tokenizer)
  if config.data.path:
    rows, cluster_names = _file_rows(config, config.data.path, check, split=config.data.split)
  else:
    rows, cluster_names = task.rows("train", config.task.num_train, config.seed), task.cluster_names
    rows = _checked_task_rows(rows, check, f"{config.task.name} train", config.data.skip_bad_rows)
  if config.data.path and not config.eval.path:
    rows, held_out = _held_out(rows, config)
    evals, eval_names = held_out, cluster_names
  else:
    evals, eval_names, _ = eval_rows(config, task, check)
  evals = _per_cluster(evals, config.task.num_eval, config.seed)
  return Inputs(task, tokenizer, rows, list(cluster_names), evals, list(eval_names))


def eval_rows(
  config: ml_collections.ConfigDict, task: tasks.Task, check: Callable[[dict], str | None]
) -> tuple[list[dict], list[str], str]:
  """(rows, cluster names, where they come from) of the evaluation, all of them: `eval.path`'s
  rows (a DatasetDict: name its split's folder), else those of `data.path` held out of training,
  else the task's eval split (`task.num_eval` per cluster). `check`: `row_check`'s."""
  if config.eval.path:
    rows, names = _file_rows(config, config.eval.path, check, split=None)
    return rows, names, config.eval.path
  if config.data.path:
    rows, names = _file_rows(config, config.data.path, check, split=config.data.split)
    fraction = config.data.eval_fraction
    return _held_out(rows, config)[1], names, f"{config.data.path} (held out: {fraction})"
  rows = task.rows("eval", config.task.num_eval * len(task.cluster_names), config.seed)
  rows = _checked_task_rows(rows, check, f"{config.task.name} eval", config.data.skip_bad_rows)
  return rows, list(task.cluster_names), f"{task.name} eval split"


def _file_rows(config, path: str, check, *, split: str | None) -> tuple[list[dict], list[str]]:
  rows, names, dropped = data.load_checked_rows(
    path,
    check,
    skip_bad=config.data.skip_bad_rows,
    columns=data.Columns.from_config(config.data),
    split=split,
  )
  _report_dropped(path, dropped, len(rows))
  return rows, names


def _held_out(rows: list[dict], config) -> tuple[list[dict], list[dict]]:
  """(training rows, held-out rows) of `data.path`: a prompt is held out by a hash of its text
  (`data.eval_fraction` of them), so a duplicated prompt never falls on both sides."""
  fraction = config.data.eval_fraction
  split = [tasks.base.split_of(row["prompt"], fraction) for row in rows]
  train = [row for row, s in zip(rows, split, strict=True) if s == "train"]
  held_out = [row for row, s in zip(rows, split, strict=True) if s == "eval"]
  if not train or not held_out:
    raise data.DataError(
      f"{config.data.path}: {len(held_out)} held-out rows and {len(train)} training rows of "
      f"{len(rows)} (data.eval_fraction={fraction}); set data.eval_fraction or eval.path"
    )
  return train, held_out


def _per_cluster(rows: list[dict], n: int, seed: int) -> list[dict]:
  """At most n rows of each cluster, chosen by seed, in their order."""
  order = np.random.default_rng(np.random.SeedSequence([seed])).permutation(len(rows))
  taken, counts = set(), {}
  for i in order:
    cluster = rows[i]["cluster"]
    if counts.get(cluster, 0) < n:
      counts[cluster] = counts.get(cluster, 0) + 1
      taken.add(int(i))
  return [row for i, row in enumerate(rows) if i in taken]


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
