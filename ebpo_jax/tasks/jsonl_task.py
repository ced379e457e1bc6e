"""Rows from a JSONL/Parquet file or a `datasets` directory, scored by exact match after
normalisation: the task for any text prompt with an answer (a UTF-8 byte tokenizer for random-init
models)."""

import pathlib
from typing import Any

from ebpo_jax.data import DataError
from ebpo_jax.data.rows import DEFAULT_COLUMNS, Columns, load_checked_rows
from ebpo_jax.tasks.base import (
  Task,
  answers_match,
  check_fraction,
  check_split,
  extract_final_answer,
  shuffled_rows,
  split_of,
)
from ebpo_jax.tasks.tokenizers import ByteTokenizer


def score_exact(response: str, row: dict[str, Any]) -> float:
  """1.0 when the response's final answer matches row["answer"] (`base.answers_match`)."""
  return float(answers_match(extract_final_answer(response), row["answer"]))


class JsonlTask(Task):
  """Prompts from files, read by `columns` (the trainer passes `data.*_column` and
  `data.answer_regex`). The eval split is `eval_path`'s rows, or, without one, a fixed
  `eval_fraction` of `path`'s prompts (by a hash of the prompt). Without `path` the task has no
  rows of its own: the trainer's rows come from `data.path`."""

  score = staticmethod(score_exact)

  def __init__(
    self,
    path: str | None = None,
    eval_path: str | None = None,
    eval_fraction: float = 0.1,
    instruction: str = "",
    columns: Columns = DEFAULT_COLUMNS,
  ):
    check_fraction(eval_fraction)
    self._rows, self.cluster_names = None, []
    if path:
      rows, self.cluster_names, _ = load_checked_rows(path, columns=columns)
      if eval_path:
        eval_rows = _with_cluster_ids(eval_path, self.cluster_names, path, columns)
        self._rows = {"train": rows, "eval": eval_rows}
      else:
        self._rows = {
          s: [r for r in rows if split_of(r["prompt"], eval_fraction) == s]
          for s in ("train", "eval")
        }
    self.name = f"jsonl:{pathlib.Path(path).name}" if path else "jsonl"
    self.tokenizer = ByteTokenizer()
    self.instruction = instruction

  def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """At most n rows of the split (all when n <= 0), in an order shuffled by seed."""
    check_split(split, max(n, 0))
    if self._rows is None:
      raise DataError(
        "task 'jsonl' has no rows: set config.data.path (or config.task.options.path) to a "
        "JSONL/Parquet file or a datasets directory"
      )
    return shuffled_rows(self._rows[split], n, seed)

  def format_prompt(self, row: dict[str, Any]) -> str:
    return row["prompt"] + self.instruction


def _with_cluster_ids(
  eval_path: str, cluster_names: list[str], path: str, columns: Columns
) -> list[dict[str, Any]]:
  """The rows of eval_path with cluster ids renumbered to match those of the training file."""
  rows, names, _ = load_checked_rows(eval_path, columns=columns)
  id_of = {name: i for i, name in enumerate(cluster_names)}
  unknown = sorted(set(names[r["cluster"]] for r in rows) - set(id_of))
  if unknown:
    raise ValueError(
      f"{eval_path}: clusters {unknown} are not among those of {path}: {cluster_names}"
    )
  return [{**r, "cluster": id_of[names[r["cluster"]]]} for r in rows]
