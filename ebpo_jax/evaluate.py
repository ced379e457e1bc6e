"""Evaluation: k sampled completions per problem, scored by the task's verifier.

  python -m ebpo_jax.evaluate --config=configs/arith_ebpo.py --workdir=/tmp/arith_ebpo
  python -m ebpo_jax.evaluate --config=configs/arith_ebpo.py --workdir=/tmp/eval \
      --run_dir=/tmp/arith_ebpo --step=100 --config.eval.num_samples=8
  python -m ebpo_jax.evaluate --config=CFG --workdir=/tmp/eval --config.model.path=HF_DIR \
      --config.eval.path=champ.jsonl --config.eval.num_samples=4

The policy comes from the latest (or `--step`) checkpoint of `--run_dir`, a trainer workdir
(default: `--workdir` itself when it has `checkpoints/`; the model shape is the run's own, read
from the checkpoint's saved config), else from the Hugging Face directory `config.model.path`.
Problems come from `config.eval.path` (a rows file, e.g. from `python -m ebpo_jax.data.prepare`)
or the task's eval split. Each problem gets k = `config.eval.num_samples` completions (greedy when
`config.eval.greedy` and k == 1, else sampled with `config.sampling.*`), scored by the task's
verifier; a response is correct when it earns the full reward 1.

Metrics, overall, per dataset (a row's `source`, else the task name) and per cluster:
- `avg@k`: Pass@1 averaged over the k samples (the paper's metric), i.e. the mean of c/k;
- `pass@j`: the unbiased pass@j of Chen et al. (2021), for j = 1, 2, 4, ... and k;
- `maj@j`: majority vote over the extracted answers of the first j samples (an unbiased estimate
  of maj@j, since samples are i.i.d.); `reward`: the mean reward.
Writes WORKDIR/eval.json (config, where the params came from, k, counts, metrics) and
WORKDIR/eval_samples.jsonl (every problem's responses, rewards and extracted answers), each
atomically, and prints a table.
"""

import collections
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging

from ebpo_jax import data, models, sharding, tasks, train
from ebpo_jax import metrics as metrics_lib
from ebpo_jax.tasks import base as tasks_base
from ebpo_jax.tasks import rewards as rewards_lib

EVAL_FILE = "eval.json"
SAMPLES_FILE = "eval_samples.jsonl"
CORRECT_REWARD = 1.0  # a response is correct when its reward reaches this


class EvalError(ValueError):
  """Nothing to evaluate, or a checkpoint that does not fit; the message says what to pass."""


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


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> bool:
  """Whether the majority answer is right: at least half of the responses giving it are correct
  (they agree under a deterministic verifier). No answer at all counts as wrong."""
  if len(answers) != len(correct):
    raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
  winner = majority_vote(answers)
  if winner is None:
    return False
  votes = [ok for answer, ok in zip(answers, correct, strict=True) if answer == winner]
  return 2 * sum(votes) >= len(votes)


def problem_metrics(rewards: Sequence[float], answers: Sequence[str]) -> dict[str, float]:
  """One problem's metrics from its k rewards and extracted answers (in sample order)."""
  k = len(rewards)
  correct = [r >= CORRECT_REWARD for r in rewards]
  c = sum(correct)
  out = {f"avg@{k}": c / k, "reward": float(np.mean(rewards))}
  for j in sample_counts(k):
    out[f"pass@{j}"] = pass_at_k(k, c, j)
  for j in sample_counts(k):
    out[f"maj@{j}"] = float(majority_correct(answers[:j], correct[:j]))
  return out


def mean_metrics(per_problem: Sequence[dict[str, float]]) -> dict[str, float]:
  """Problem metrics averaged over problems, with the count `n`."""
  out: dict[str, float] = {"n": len(per_problem)}
  for key in per_problem[0]:
    out[key] = float(np.mean([m[key] for m in per_problem]))
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


# ----------------------------------------------------------------------------- the policy


def _read_only_manager(run_dir: str) -> ocp.CheckpointManager:
  """Reads `run_dir/checkpoints` without touching it (a trainer may be writing there now)."""
  directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
  if not os.path.isdir(directory):
    raise EvalError(f"--run_dir={run_dir}: no checkpoints/ directory (not a trainer workdir?)")
  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  return ocp.CheckpointManager(directory, options=options)


def checkpoint_step(run_dir: str, step: int | None) -> int:
  """`step`, checked to exist in `run_dir`'s checkpoints, or the latest one."""
  steps = sorted(_read_only_manager(run_dir).all_steps())
  if not steps:
    raise EvalError(f"--run_dir={run_dir}: no complete checkpoint in {run_dir}/checkpoints")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise EvalError(f"--step={step}: no such checkpoint in {run_dir}/checkpoints; steps: {steps}")
  return step


def saved_config(run_dir: str, step: int) -> ml_collections.ConfigDict:
  """The config that the run saved with checkpoint `step`."""
  manager = _read_only_manager(run_dir)
  restored = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  if restored.get("config") is None:
    raise EvalError(f"checkpoint {step} of {run_dir} has no saved config")
  return ml_collections.ConfigDict(restored["config"])


def restore_params(run_dir: str, step: int, like: Any) -> Any:
  """The policy params of checkpoint `step`, in the shapes, dtypes and shardings of `like` (the
  params of the model that the run's config builds); the optimizer state etc. are not read."""
  item = {
    "params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
  }
  args = ocp.args.PyTreeRestore(
    item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
  )
  try:
    restored = _read_only_manager(run_dir).restore(step, args=ocp.args.Composite(state=args))
  except ValueError as e:
    raise EvalError(
      f"checkpoint {step} of {run_dir} does not fit the model its config builds (a random-init "
      f"model's vocabulary is its task's tokenizer: is config.task the run's?): {e}"
    ) from e
  return restored["state"]["params"]


def with_run_model(config: ml_collections.ConfigDict, run_config) -> ml_collections.ConfigDict:
  """`config` with the model section (shape, dtype, path) of the run that is evaluated."""
  config = ml_collections.ConfigDict(config.to_dict())
  with config.unlocked():
    config.model.update(dict(run_config.model))
  return config


def load_policy(config, tokenizer, mesh, run_dir: str | None, step: int | None):
  """(model, params, origin) from a run's checkpoint, else from `config.model.path`.

  With `run_dir`, `config.model` must already be the run's (`with_run_model`).
  """
  check_policy_source(config, run_dir)
  model, params = train.build_model(config, tokenizer, mesh)
  if run_dir is None:
    path = models.resolve_model_path(config.model.path)
    return model, params, {"kind": "hf", "path": os.path.abspath(path)}
  params = restore_params(run_dir, step, params)
  return model, params, {"kind": "checkpoint", "run_dir": os.path.abspath(run_dir), "step": step}


def check_policy_source(config, run_dir: str | None) -> None:
  """Raises EvalError unless there is a run or a model directory to take the policy from."""
  if run_dir is None and not config.model.path:
    raise EvalError(
      "nothing to evaluate: no trainer workdir with checkpoints/ (--run_dir, or --workdir "
      "itself) and config.model.path is empty; pass --run_dir=RUN or "
      "--config.model.path=HF_DIR"
    )


def resolve_run_dir(run_dir: str | None, workdir: str | None, step: int | None) -> str | None:
  """The trainer workdir to read: `--run_dir`, else `--workdir` when it has checkpoints/."""
  if run_dir is None and workdir and os.path.isdir(os.path.join(workdir, "checkpoints")):
    run_dir = workdir
  if run_dir is None and step is not None:
    raise EvalError(f"--step={step} needs a trainer workdir (--run_dir)")
  return run_dir


# ----------------------------------------------------------------------------- sample and score


def sample_and_score(
  rollouts: train.Rollouts, params: Any, rows: Sequence[dict], *, num_samples: int, greedy: bool
) -> tuple[list[list[str]], np.ndarray, int]:
  """k completions per row, decoded and scored: (texts [N][k], rewards float32 [N, k], errors).

  The sampler takes `sampling.prompts_per_call` rows per call (see `train.Rollouts.sample`).
  """
  key = jax.random.PRNGKey(rollouts.config.seed)
  _, _, out = rollouts.sample(params, list(rows), key, group_size=num_samples, greedy=greedy)
  rewards, errors = rollouts.score(out, list(rows), num_samples)
  texts = rollouts.texts(out)
  return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(rows))], rewards, errors


# ----------------------------------------------------------------------------- files


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file and a rename: never a half-written file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def _json_default(value: Any) -> Any:
  if isinstance(value, np.generic | np.ndarray):
    return value.tolist()
  raise TypeError(f"{type(value).__name__} {value!r} is not JSON-able")


def to_json(value: Any, **kwargs: Any) -> str:
  """JSON of plain values, numpy scalars and arrays; non-finite floats become null."""
  return json.dumps(_finite(value), default=_json_default, **kwargs)


def _finite(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_finite(v) for v in value]
  return value


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


def eval_rows(config, task) -> tuple[list[dict], list[str], str]:
  """(rows, cluster names, description) from `config.eval.path`, else the task's eval split."""
  if config.eval.path:
    rows, names = data.load_rows_and_clusters(config.eval.path)
    return rows, names, config.eval.path
  n = config.task.num_eval * len(task.cluster_names)
  return task.rows("eval", n, config.seed), list(task.cluster_names), f"{task.name} eval split"


def run(
  config: ml_collections.ConfigDict,
  workdir: str,
  *,
  run_dir: str | None = None,
  step: int | None = None,
) -> dict[str, Any]:
  """Evaluates the policy (see the module docstring); writes and returns the eval.json dict."""
  t0 = time.perf_counter()
  run_dir = resolve_run_dir(run_dir, workdir, step)
  check_policy_source(config, run_dir)
  if run_dir is not None:
    step = checkpoint_step(run_dir, step)
    config = with_run_model(config, saved_config(run_dir, step))
  k = config.eval.num_samples
  if k < 1:
    raise train.ConfigError(f"config.eval.num_samples={k!r}: must be >= 1")
  train.check_config(config, jax.device_count())
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.get_task(config.task.name, **config.task.options)
  rows, cluster_names, rows_origin = eval_rows(config, task)
  tokenizer = train.load_tokenizer(config, task)
  model, params, origin = load_policy(config, tokenizer, mesh, run_dir, step)
  greedy = bool(config.eval.greedy and k == 1)
  with rewards_lib.RewardPool(config.rewards.workers, config.rewards.timeout_s) as pool:
    rollouts = train.Rollouts(model, task, tokenizer, config, pool, mesh)
    texts, rewards, errors = sample_and_score(rollouts, params, rows, num_samples=k, greedy=greedy)
    error_examples = list(pool.last_errors)
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
    samples = [
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
    write_atomic(os.path.join(workdir, SAMPLES_FILE), "".join(to_json(s) + "\n" for s in samples))
    write_atomic(os.path.join(workdir, EVAL_FILE), to_json(result, indent=2) + "\n")
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
  logging.set_verbosity(logging.ERROR)  # orbax warns about the checkpoint items it skips
  f = flags.FLAGS
  if f.workdir is None:
    raise app.UsageError("--workdir is required")
  try:
    sharding.init_distributed()
    run(f.config, f.workdir, run_dir=f.run_dir, step=f.step)
  except (EvalError, train.ConfigError, data.DataError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  if "config" not in flags.FLAGS:  # ebpo_jax.train defines --config and --workdir on import
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Experiment config file.")
    flags.DEFINE_string("workdir", None, "Directory for eval.json and eval_samples.jsonl.")
  define_policy_flags()
  flags.mark_flags_as_required(["config"])
  app.run(main)
