"""Evaluation: k sampled completions per problem, scored by the task's verifier.

  python -m ebpo_jax.evaluate --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo
  python -m ebpo_jax.evaluate --config=configs/arith_ebpo.py --workdir=/tmp/eval \
      --run_dir=/tmp/arith_ebpo --step=100 --config.eval.num_samples=8
  python -m ebpo_jax.evaluate --config=CFG --workdir=/tmp/eval --config.model.path=HF_DIR \
      --config.eval.path=champ.jsonl --config.eval.num_samples=4

The policy comes from the latest (or `--step`) checkpoint of `--run_dir`, a trainer workdir
(default: `--workdir` itself when it has `checkpoints/`; the model shape is the run's own, read
from the checkpoint's saved config), else from the Hugging Face directory `config.model.path`.
Problems come from `config.eval.path` (a rows file, e.g. from `python -m ebpo_jax.data.prepare`),
else the rows of `config.data.path` held out of training, else the task's eval split
(`task_rows.eval_rows`, the in-training evaluation's source). Each problem gets k =
`config.eval.num_samples` completions (greedy when `config.eval.greedy` and k == 1, else sampled
with `config.sampling.*`), scored by the task's verifier; a response is correct when it earns the
full reward 1.

Metrics, overall, per dataset (a row's `source`, else the task name) and per cluster:
- `avg@k`: Pass@1 averaged over the k samples (the paper's metric), i.e. the mean of c/k;
- `pass@j`: the unbiased pass@j of Chen et al. (2021), for j = 1, 2, 4, ... and k;
- `maj@j`: majority vote over the extracted answers of the first j samples (an unbiased estimate
  of maj@j, since samples are i.i.d.); a tie scores the share of the tied answers that are right
  (a uniform pick among them, in expectation); `reward`: the mean reward.
Writes WORKDIR/eval.json (config, where the params came from, k, counts, metrics) and
WORKDIR/eval_samples.jsonl (every problem's responses, rewards and extracted answers), each
atomically (WORKDIR and the run directory may be `gs://bucket/...`), and prints a table.
"""

import collections
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm
from absl import app, flags, logging

from ebpo_jax import cli, files, jsonable, sharding, tasks
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.errors import ConfigError
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts.options import EvalOptions
from ebpo_jax.rollouts.worker import make_worker
from ebpo_jax.tasks import base as tasks_base
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer import task_rows

EVAL_FILE = "eval.json"
SAMPLES_FILE = "eval_samples.jsonl"


# ----------------------------------------------------------------------------- metric math


def pass_at_k(n: int, c: int, k: int) -> float:
  r"""Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):

    1 - C(n - c, k) / C(n, k) = 1 - \prod_{i = n - c + 1}^{n} (1 - k / i),

  the chance that k samples drawn from the n without replacement hold a correct one; the product
  form stays finite for large n.
  """
  if not (0 <= c <= n and 1 <= k <= n):
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def sample_counts(n: int) -> list[int]:
  """The j of pass@j and maj@j for n samples: 1, 2, 4, ... below n, then n."""
  return [2**i for i in range(max(n - 1, 0).bit_length()) if 2**i < n] + [n]


def majority_vote(answers: Sequence[str]) -> str | None:
  """The most frequent non-empty answer (ties: the one that appears first); None if all empty."""
  counts = collections.Counter(a for a in answers if a)
  if not counts:
    return None
  top = max(counts.values())
  return next(a for a in answers if a and counts[a] == top)


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> float:
  """The majority vote's score: 1 when the most frequent non-empty answer is right (at least half
  of the responses giving it are correct: they agree under a deterministic verifier), 0 when it
  is wrong or no response has an answer. A tie between answers scores the expected value of a
  uniform pick among them (two samples that disagree, one right: 0.5), so maj@2 is not maj@1."""
  if len(answers) != len(correct):
    raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
  counts = collections.Counter(a for a in answers if a)
  if not counts:
    return 0.0
  top = max(counts.values())
  tied = [answer for answer, count in counts.items() if count == top]

  def right(winner: str) -> bool:
    votes = [ok for answer, ok in zip(answers, correct, strict=True) if answer == winner]
    return 2 * sum(votes) >= len(votes)

  return sum(right(answer) for answer in tied) / len(tied)


def problem_metrics(rewards: Sequence[float], answers: Sequence[str]) -> dict[str, float]:
  """One problem's metrics from its k rewards and extracted answers (in sample order)."""
  k = len(rewards)
  correct = [r >= tasks_base.FULL_REWARD for r in rewards]
  c = sum(correct)
  out = {f"avg@{k}": c / k, "reward": float(np.mean(rewards))}
  for j in sample_counts(k):
    out[f"pass@{j}"] = pass_at_k(k, c, j)
  for j in sample_counts(k):
    out[f"maj@{j}"] = majority_correct(answers[:j], correct[:j])
  return out


def mean_metrics(per_problem: Sequence[dict[str, float]]) -> dict[str, float]:
  """Problem metrics averaged over problems, with the count `n` and the binomial standard error
  over the n problems of each avg@k (`avg@k_se`)."""
  out: dict[str, float] = {"n": len(per_problem)}
  for key in per_problem[0]:
    out[key] = float(np.mean([m[key] for m in per_problem]))
    if key.startswith("avg@"):
      out[f"{key}_se"] = metrics_lib.binomial_se(out[key], len(per_problem))
  return out


def grouped_metrics(
  per_problem: Sequence[dict[str, float]], datasets: Sequence[str], clusters: Sequence[str]
) -> dict[str, Any]:
  """{"overall": ..., "by_dataset": {name: ...}, "by_cluster": {name: ...}} of mean metrics."""

  def by(labels: Sequence[str]) -> dict[str, dict[str, float]]:
    groups = collections.defaultdict(list)
    for label, metrics in zip(labels, per_problem, strict=True):
      groups[label].append(metrics)
    return {label: mean_metrics(groups[label]) for label in sorted(groups)}

  return {
    "overall": mean_metrics(per_problem),
    "by_dataset": by(datasets),
    "by_cluster": by(clusters),
  }


def answer_extractor(task: tasks.Task) -> Callable[[str], str]:
  """response -> normalised final answer: the task's own `extract_answer` when it has one."""
  return lambda response: tasks_base.normalize_answer(task.extract_answer(response))


# ----------------------------------------------------------------------------- files


def metrics_table(metrics: dict[str, Any]) -> str:
  """The overall, per-dataset and per-cluster metrics as one plain-text table."""
  rows = {"all": metrics["overall"]}
  if len(metrics["by_dataset"]) > 1:
    rows.update({f"dataset {name}": m for name, m in metrics["by_dataset"].items()})
  else:
    rows[f"dataset {next(iter(metrics['by_dataset']))}"] = metrics["overall"]
  rows.update({f"cluster {name}": m for name, m in metrics["by_cluster"].items()})
  rows = {name: {**m, "n": int(m["n"])} for name, m in rows.items()}
  return metrics_lib.summary_table(rows, row_header="subset")


# ----------------------------------------------------------------------------- main


def _samples(rows, datasets, clusters, texts, rewards, answers) -> list[dict]:
  """samples.jsonl's records: each problem with its responses, rewards, answers and majority."""
  return [
    {
      "index": i,
      "prompt": row["prompt"],
      "answer": row["answer"],
      "dataset": dataset,
      "cluster": cluster,
      "responses": group,
      "rewards": r.tolist(),
      "answers": a,
      "majority": majority_vote(a),
    }
    for i, (row, dataset, cluster, group, r, a) in enumerate(
      zip(rows, datasets, clusters, texts, rewards, answers, strict=True)
    )
  ]


def run(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  run_dir: str | None = None,
  step: int | None = None,
) -> dict[str, Any]:
  """Evaluates the policy (see the module docstring); writes and returns the eval.json dict."""
  t0 = time.perf_counter()
  run_dir = policy_lib.resolve_run_dir(run_dir, workdir, step)
  policy_lib.check_policy_source(config, run_dir)
  config, step = policy_lib.policy_config(config, run_dir, step)
  eval_options = EvalOptions.from_config(config)
  k, greedy = eval_options.num_samples, eval_options.greedy
  if k < 1:
    raise ConfigError(f"config.eval.num_samples={k!r}: must be >= 1")
  config_lib.check_config(config, jax.device_count())
  mesh = sharding.make_mesh(dict(config.mesh))
  task = task_rows.load_task(config)
  tokenizer = task_rows.load_tokenizer(config, task)
  check = task_rows.row_check(config, task, tokenizer)
  rows, cluster_names, rows_origin = task_rows.eval_rows(config, task, check)
  model, params, origin = policy_lib.load_policy(config, tokenizer, mesh, run_dir, step)
  worker = make_worker(model, task, tokenizer, config, mesh)
  with worker.scorer.pool:
    batches = rollout_batch.sample_and_score_batches(
      worker, params, rows, num_samples=k, greedy=greedy
    )
    calls = math.ceil(len(rows) / (config.sampling.prompts_per_call or len(rows)))
    bar = dict(total=calls, desc="evaluate", unit="call", disable=jax.process_index() != 0)
    texts, rewards, errors = rollout_batch.join_batches(list(tqdm.tqdm(batches, **bar)))
    error_examples = list(worker.scorer.pool.last_errors)
  extract = answer_extractor(task)
  answers = [[extract(t) for t in group] for group in texts]
  per_problem = [problem_metrics(r.tolist(), a) for r, a in zip(rewards, answers, strict=True)]
  datasets = [str(row.get("source") or task.name) for row in rows]
  clusters = [cluster_names[row["cluster"]] for row in rows]
  result = {
    "params": origin,
    "rows": rows_origin,
    "num_samples": k,
    "greedy": greedy,
    "num_problems": len(rows),
    "num_responses": int(rewards.size),
    "verifier_errors": errors,
    "verifier_error_examples": error_examples,
    "metrics": grouped_metrics(per_problem, datasets, clusters),
    "time_s": time.perf_counter() - t0,
    "config": config.to_dict(),
  }
  if jax.process_index() == 0:
    samples = _samples(rows, datasets, clusters, texts, rewards, answers)
    files.write_lines(
      files.join(workdir, SAMPLES_FILE), (jsonable.dumps(s, nan_as_null=True) for s in samples)
    )
    files.write_atomic(
      files.join(workdir, EVAL_FILE), jsonable.dumps(result, nan_as_null=True, indent=2) + "\n"
    )
    print(
      f"{len(rows)} problems x {k} samples ({'greedy' if greedy else 'sampled'}), params: "
      f"{origin}, {errors} verifier errors, {result['time_s']:.1f} s"
    )
    if error_examples:
      print(f"first verifier errors: {error_examples[:3]}")
    print(metrics_table(result["metrics"]))
  return result


def define_policy_flags() -> None:
  """Flags shared by the evaluation CLIs: which run and step."""
  flags.DEFINE_string("run_dir", None, "Trainer workdir whose checkpoint to evaluate.")
  flags.DEFINE_integer("step", None, "Checkpoint step of --run_dir (default: the latest).")


def main(argv: Sequence[str]) -> None:
  del argv
  if cli.printed_config_or_required("workdir"):
    return
  f = flags.FLAGS
  with cli.entry_point(logging.ERROR):  # orbax warns about the items it skips
    run(f.config, f.workdir, run_dir=f.run_dir, step=f.step)


if __name__ == "__main__":
  cli.define_config_flags()
  flags.adopt_module_key_flags(cli)  # --help lists --config and --print_config
  flags.DEFINE_string(
    "workdir", None, "Directory for eval.json and eval_samples.jsonl (local or gs://...)."
  )
  define_policy_flags()
  app.run(main, flags_parser=cli.parse_flags)  # a --config.KEY typo: one line
