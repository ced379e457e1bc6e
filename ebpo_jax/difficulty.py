"""Difficulty of each prompt: 1 - pass rate of the base model over k sampled rollouts.

  python -m ebpo_jax.difficulty --config=configs/smollm2_135m_ebpo.py \
      --input=rows.jsonl --output=rows_difficulty.jsonl [--k=8] [--run_dir=RUN --step=0]

The base model is `config.model.path` (a Hugging Face directory) or, with `--run_dir`, a trainer
checkpoint (e.g. step 0 of a run: the warm-started model), exactly as `python -m ebpo_jax.evaluate`
picks it; rollouts are sampled with `config.sampling.*` and scored by the task's verifier through
the same function evaluate uses. The output keeps every row and key of the input (clusters as the
input wrote them), adding `pass_rate` (share of the k rollouts with the full reward) and
`difficulty` = 1 - pass_rate (higher = harder, as `ebpo_jax.data.rows` documents), so that
`--config.data.path=OUT --config.data.order=curriculum` trains easy to hard.

An entry point (it runs the policy), so it lives beside evaluate rather than in `ebpo_jax.data`,
which knows nothing of models.
"""

import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from absl import app, flags, logging

from ebpo_jax import cli, data, files, jsonable, sharding, tasks
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.rollouts.worker import make_worker
from ebpo_jax.trainer import config as config_lib
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer import task_rows

# Prompts per sampler call when the config says all at once (0): the unit of progress kept.
DEFAULT_PROMPTS_PER_CALL = 64


def with_difficulty(
  rows: Sequence[dict[str, Any]], cluster_names: Sequence[str], rewards_nk: np.ndarray
) -> list[dict[str, Any]]:
  """The rows with `pass_rate` and `difficulty` from their k rewards, clusters written as the
  file wrote them (names, or ids when the names are just the ids)."""
  ids_only = list(cluster_names) == [str(i) for i in range(len(cluster_names))]
  pass_rates = (rewards_nk >= tasks.base.FULL_REWARD).mean(axis=1)
  out = []
  for row, pass_rate in zip(rows, pass_rates, strict=True):
    cluster = row["cluster"] if ids_only else cluster_names[row["cluster"]]
    out.append({**row, "cluster": cluster, "pass_rate": float(pass_rate)})
    out[-1]["difficulty"] = 1.0 - float(pass_rate)
  return out


def write_rows(path: str, rows: Sequence[dict[str, Any]], header: dict | None = None) -> None:
  """Rows as JSONL, atomically; `header` (a partial file's) first."""
  lines = ([header] if header is not None else []) + list(rows)
  files.write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in lines))


def read_partial(path: str, header: dict, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The rows a stopped run measured (`OUTPUT.partial`), when it measured these rows with this
  header (input, k, policy, config); else none."""
  if not files.exists(path):
    return []
  lines = files.read_text(path).splitlines()
  try:
    saved_header, done = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    same_rows = all(
      d["prompt"] == r["prompt"] and d["answer"] == r["answer"]
      for d, r in zip(done, rows, strict=False)
    )
  except (IndexError, KeyError, TypeError, json.JSONDecodeError):  # not a file this run wrote
    return []
  same_header = json.dumps(saved_header, sort_keys=True) == json.dumps(header, sort_keys=True)
  if not same_header or len(done) > len(rows) or not same_rows:
    return []
  return done


def run(
  config,
  input_path: str,
  output_path: str,
  *,
  k: int = 8,
  run_dir: str | None = None,
  step: int | None = None,
) -> list[dict[str, Any]]:
  """Measures the pass rate of every row of `input_path` and writes `output_path`.

  Rows go `sampling.prompts_per_call` at a time (0: DEFAULT_PROMPTS_PER_CALL, rounded up to a
  multiple of the data x fsdp shards, when there are more rows; else all at once); after each call
  the rows measured so far are in `OUTPUT.partial` (a header line, then rows), so a stopped run
  keeps them, and a run started again with the same input, k, policy and config takes up after
  them (one process; the same results as a run that was never stopped). The output is written
  when every row is measured, and the partial file removed.
  """
  if k < 1:
    raise policy_lib.PolicyError(f"--k={k}: must be >= 1")
  if not output_path.endswith(".jsonl"):
    raise policy_lib.PolicyError(f"--output={output_path}: must end in .jsonl")
  if run_dir is None and step is not None:
    raise policy_lib.PolicyError(f"--step={step} needs --run_dir")
  config, step = policy_lib.policy_config(config, run_dir, step)
  policy_lib.check_policy_source(config, run_dir)
  config_lib.check_config(config, jax.device_count())
  rows, cluster_names = data.load_rows_and_clusters(input_path)
  mesh = sharding.make_mesh(dict(config.mesh))
  if not config.sampling.prompts_per_call and len(rows) > DEFAULT_PROMPTS_PER_CALL:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]  # a call's prompts are split over them
    config.sampling.prompts_per_call = -(-DEFAULT_PROMPTS_PER_CALL // shards) * shards
  chunk = config.sampling.prompts_per_call or len(rows)
  task = tasks.from_config(config.task)
  tokenizer = task_rows.load_tokenizer(config, task)
  model, params, origin = policy_lib.load_policy(config, tokenizer, mesh, run_dir, step)
  is_main, partial_path = jax.process_index() == 0, output_path + ".partial"
  header = {
    "difficulty_of": files.abspath(input_path),
    "k": k,
    "params": origin,
    "config": jsonable.to_data(config),
  }
  # Several processes would each have to read the same partial file: they start afresh.
  out = read_partial(partial_path, header, rows) if jax.process_count() == 1 else []
  done_calls = len(out) // chunk
  out, errors = out[: done_calls * chunk], 0
  if out:
    print(f"{partial_path}: {len(out)} of {len(rows)} rows measured before; taking up after them")
  elif is_main and files.exists(partial_path):
    print(f"{partial_path}: another input, k, policy or config measured it; starting over")
  worker = make_worker(model, task, tokenizer, config, mesh)
  calls = math.ceil(len(rows) / chunk)
  with worker.scorer.pool:
    batches = rollout_batch.sample_and_score_batches(
      worker, params, rows, num_samples=k, greedy=False, skip=done_calls
    )
    bar = dict(total=calls, initial=done_calls, desc="difficulty", unit="call", disable=not is_main)
    for batch in tqdm.tqdm(batches, **bar):
      part = rows[batch.start : batch.start + len(batch.texts)]
      out += with_difficulty(part, cluster_names, batch.rewards)
      errors += batch.errors
      if is_main:
        write_rows(partial_path, out, header)
  if is_main:
    write_rows(output_path, out)
    files.remove(partial_path)
    mean = float(np.mean([r["pass_rate"] for r in out]))
    print(
      f"{len(out)} prompts x {k} rollouts, params: {origin}, mean pass rate {mean:.3f}, "
      f"{errors} verifier errors (this run) -> {files.abspath(output_path)}"
    )
  return out


def main(argv: Sequence[str]) -> None:
  del argv
  if cli.printed_config_or_required("input", "output"):
    return
  f = flags.FLAGS
  with cli.entry_point(logging.ERROR):  # orbax warns about the items it skips
    run(f.config, f.input, f.output, k=f.k, run_dir=f.run_dir, step=f.step)


if __name__ == "__main__":
  cli.define_config_flags()
  flags.adopt_module_key_flags(cli)  # --help lists --config and --print_config
  flags.DEFINE_string("input", None, "Rows file (JSONL or Parquet) to measure.")
  flags.DEFINE_string("output", None, "Output JSONL: the rows with pass_rate and difficulty.")
  flags.DEFINE_integer("k", 8, "Rollouts per prompt.")
  flags.DEFINE_string("run_dir", None, "Trainer workdir whose checkpoint to measure.")
  flags.DEFINE_integer("step", None, "Checkpoint step of --run_dir (default: the latest).")
  app.run(main, flags_parser=cli.parse_flags)  # a --config.KEY typo: one line
