"""reasoning-gym datasets as tasks: the dataset's own generator and its own `score_answer`.

Clusters are difficulty levels of one dataset (from its curriculum: level L sets every curriculum
attribute to its L-th value) or several datasets, or both (`<dataset>_L<level>`). Each row keeps
what scoring needs, JSON-serialisable, in `row["meta"]`: the dataset name, its config and the
generated entry; the scorer rebuilds the dataset from them (cached per process).
"""

import dataclasses
import functools
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import reasoning_gym  # at module level: a worker imports it when it unpickles the scorer
import reasoning_gym.factory
from reasoning_gym.coaching.attributes import RangeAttributeDefinition, ScalarAttributeDefinition
from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode

from ebpo_jax.tasks.base import (
  Task,
  check_fraction,
  extract_final_answer,
  generated_rows,
)
from ebpo_jax.tasks.tokenizers import ByteTokenizer

INSTRUCTION = "\n\nGive your final answer on the last line, as 'Answer: <answer>'."
_CHUNK = 1000  # items per generated dataset; a row stream is a sequence of such chunks


def score_reasoning_gym(response: str, row: dict[str, Any]) -> float:
  """The dataset's `score_answer` on the response's final answer (see `extract_final_answer`)."""
  meta = row["meta"]
  score = _scorer(meta["dataset"], json.dumps(meta["config"], sort_keys=True))
  value = float(score(extract_final_answer(response), meta["entry"]))
  if not math.isfinite(value):
    raise ValueError(f"{meta['dataset']}.score_answer returned {value}")
  return min(max(value, 0.0), 1.0)


@functools.lru_cache(maxsize=64)
def _scorer(dataset: str, config_json: str):
  return reasoning_gym.create_dataset(dataset, **json.loads(config_json)).score_answer


@dataclasses.dataclass(frozen=True)
class _Cluster:
  name: str
  dataset: str
  level: int
  config: dict[str, Any]  # create_dataset kwargs without seed and size


class ReasoningGymTask(Task):
  """One or several reasoning-gym datasets; clusters by dataset and difficulty level."""

  score = staticmethod(score_reasoning_gym)
  name_arg = "datasets"  # reasoning_gym:chain_sum+basic_arithmetic

  def __init__(
    self,
    datasets: Sequence[str],
    levels: int | None = None,
    dataset_cfg: dict[str, dict[str, Any]] | None = None,
    eval_fraction: float = 0.2,
    instruction: str = INSTRUCTION,
  ):
    """`levels`: difficulty levels per dataset (default 3 for one dataset, 1 for several; 1 = the
    dataset's default config). `dataset_cfg`: create_dataset kwargs per dataset name, applied on
    top of the level's settings."""
    datasets = list(datasets)
    registered = sorted(reasoning_gym.factory.DATASETS)
    unknown = [d for d in datasets if d not in registered]
    if unknown or not datasets:
      raise ValueError(
        f"unknown reasoning_gym dataset(s) {unknown}; known: {', '.join(registered)}"
      )
    levels = (3 if len(datasets) == 1 else 1) if levels is None else levels
    if not isinstance(levels, int) or levels < 1:
      raise ValueError(f"levels must be an int >= 1, got {levels!r}")
    dataset_cfg = dict(dataset_cfg or {})
    if set(dataset_cfg) - set(datasets):
      raise ValueError(
        f"dataset_cfg names {sorted(set(dataset_cfg) - set(datasets))}, not in {datasets}"
      )
    check_fraction(eval_fraction)
    self.name = "reasoning_gym:" + "+".join(datasets)
    self.tokenizer = ByteTokenizer()
    self.eval_fraction = eval_fraction
    self.instruction = instruction
    self.clusters = [
      _cluster(d, level, levels, dataset_cfg.get(d, {}))
      for d in datasets
      for level in range(levels)
    ]
    self.cluster_names = [c.name for c in self.clusters]
    for k in range(len(self.clusters)):
      self._check_scoring_round_trip(k)

  def rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    candidates = lambda k: self._candidates(k, seed)
    return generated_rows(
      candidates,
      self.cluster_names,
      split,
      n,
      eval_fraction=self.eval_fraction,
      where=f"{self.name} cluster",
    )

  def check_row(self, row: dict[str, Any]) -> str | None:
    if isinstance(row.get("meta"), dict):
      return None
    return (
      "no 'meta' (the generated entry that reasoning-gym's scorer needs): task reasoning_gym "
      "scores the rows it generates; for your own rows use --config.task.name=jsonl (exact "
      "match) or math (math-verify)"
    )

  def format_prompt(self, row: dict[str, Any]) -> str:
    return row["prompt"] + self.instruction

  def format_target(self, row: dict[str, Any]) -> str:
    return f"Answer: {row['answer']}"

  def _candidates(self, k: int, seed: int) -> Iterator[dict[str, Any]]:
    """An endless stream of rows of cluster k (chunks of items), the same for both splits."""
    cluster = self.clusters[k]
    for chunk in range(2**31):
      chunk_seed = int(np.random.SeedSequence([seed, k, chunk]).generate_state(1)[0])
      items = reasoning_gym.create_dataset(
        cluster.dataset, **cluster.config, seed=chunk_seed, size=_CHUNK
      )
      for i in range(_CHUNK):
        yield self._row(k, items[i])

  def _row(self, k: int, entry: dict[str, Any]) -> dict[str, Any]:
    cluster = self.clusters[k]
    entry = json.loads(json.dumps(entry, default=str))
    meta = {"dataset": cluster.dataset, "config": cluster.config, "entry": entry}
    answer = entry.get("answer")
    return {
      "prompt": entry["question"],
      "answer": "" if answer is None else str(answer),
      "cluster": k,
      "difficulty": float(cluster.level),
      "meta": meta,
    }

  def _check_scoring_round_trip(self, k: int) -> None:
    """The gold answer, written as `format_target` writes it and scored from a row (JSON copy of the
    entry), must score as the dataset scores it directly."""
    cluster = self.clusters[k]
    dataset = reasoning_gym.create_dataset(cluster.dataset, **cluster.config, seed=0, size=1)
    entry = dataset[0]
    answer = "" if entry.get("answer") is None else str(entry["answer"])
    direct = dataset.score_answer(answer, entry)
    row = self._row(k, entry)
    via_row = score_reasoning_gym(self.format_target(row), row)
    if not math.isclose(direct, via_row):
      raise ValueError(
        f"reasoning_gym dataset {cluster.dataset!r} is not supported: its gold answer scores "
        f"{direct} directly but {via_row} from a row (entries that do not survive a JSON round "
        "trip, or answers that 'Answer: ...' cannot carry)"
      )


def _cluster(dataset: str, level: int, levels: int, overrides: dict[str, Any]) -> _Cluster:
  """The config of one difficulty level of a dataset (levels == 1: its default config)."""
  config: dict[str, Any] = {}
  if levels > 1:
    config = _level_config(dataset, level)
  config = json.loads(json.dumps({**config, **overrides}))
  name = dataset if levels == 1 else f"{dataset}_L{level}"
  try:
    reasoning_gym.factory.create_dataset(dataset, **config, seed=0, size=1)
  except (TypeError, ValueError, AssertionError) as e:
    raise ValueError(f"reasoning_gym dataset {dataset!r}: bad config {config}: {e}") from e
  return _Cluster(name=name, dataset=dataset, level=level, config=config)


def _level_config(dataset: str, level: int) -> dict[str, Any]:
  """The curriculum's settings at `level`, each attribute exactly at its level's value."""
  if not reasoning_gym.factory.has_curriculum(dataset):
    raise ValueError(f"reasoning_gym dataset {dataset!r} has no curriculum; use levels=1")
  curriculum = reasoning_gym.factory.create_curriculum(dataset)
  num_levels = max(len(a.levels) for a in curriculum.attributes.values())
  if level >= num_levels:
    raise ValueError(f"reasoning_gym dataset {dataset!r} has {num_levels} levels, asked for more")
  curriculum.set_global_level(level)
  context = DefaultCurriculumContext(mode=RangeAttributeMode.UPPER_BOUND)
  config = curriculum.generate_configuration(context=context)
  fields = set()
  for attr in curriculum.attributes.values():
    if isinstance(attr, RangeAttributeDefinition):
      fields.update((attr.lower_field_name, attr.upper_field_name))
    elif isinstance(attr, ScalarAttributeDefinition):
      fields.add(attr.field_name)
  return {f: getattr(config, f) for f in sorted(fields)}
