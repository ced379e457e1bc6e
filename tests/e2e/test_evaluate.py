"""Evaluation of trained runs: evaluate's CLI on a trainer workdir (also a LoRA run), a LoRA run's
policy, and the difficulty CLI round trip."""

import json
import shutil

import jax
import numpy as np
import pytest

from ebpo_jax import data, difficulty, sharding, tasks
from ebpo_jax.evaluate import (
  majority_correct,
)
from ebpo_jax.models import lora
from ebpo_jax.rollouts import batch as rollout_batch
from ebpo_jax.trainer import policy, task_rows
from tests.helpers import ROOT
from tests.helpers.checkpoints import restore_run_state, save_checkpoint
from tests.helpers.configs import arith_config
from tests.helpers.evaluation import brute_pass_at_k
from tests.helpers.processes import run_module
from tests.helpers.runs import LORA_RUN

CONFIG = str(ROOT / "configs" / "arith_ebpo.py")


def test_evaluate_cli_on_a_trainer_workdir_writes_eval_json(arith_run, tmp_path):
  workdir, _ = arith_run  # checkpoints every 2 steps, the latest at step 4
  run_dir = tmp_path / "run"
  shutil.copytree(workdir / "checkpoints", run_dir / "checkpoints")
  result = run_module(
    "ebpo_jax.evaluate",
    f"--config={CONFIG}:runlocal",
    f"--workdir={run_dir}",  # evaluates the workdir's own checkpoints
    "--config.eval.num_samples=4",
    "--config.sampling.prompts_per_call=8",  # 16 problems: two sampler calls
    devices=1,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((run_dir / "eval.json").read_text())
  assert saved["params"] == {"kind": "checkpoint", "run_dir": str(run_dir), "step": 4}
  assert saved["num_samples"] == 4 and not saved["greedy"]
  assert saved["num_problems"] == 16 and saved["num_responses"] == 64  # 8 per cluster
  assert saved["config"]["eval"]["num_samples"] == 4
  assert saved["verifier_errors"] == 0 and saved["verifier_error_examples"] == []
  metrics = saved["metrics"]
  assert set(metrics["by_cluster"]) == {"add_1", "add_2"}
  assert set(metrics["by_dataset"]) == {"arithmetic"}
  assert set(metrics["overall"]) == {
    "n", "avg@4", "avg@4_se", "reward", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4"
  }  # fmt: skip
  assert metrics["by_cluster"]["add_1"]["n"] == 8
  assert "cluster add_2" in result.stdout  # the table
  assert "evaluate: 100%" in result.stderr and "2/2" in result.stderr  # the bar, per call
  # The metrics again, by brute force, from the per-problem records.
  lines = (run_dir / "eval_samples.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]
  assert len(records) == 16 and all(len(r["responses"]) == 4 for r in records)
  correct = [[reward == 1.0 for reward in r["rewards"]] for r in records]
  assert metrics["overall"]["avg@4"] == pytest.approx(np.mean(correct))
  for k in (2, 4):
    brute = np.mean([brute_pass_at_k(c, k) for c in correct])
    assert metrics["overall"][f"pass@{k}"] == pytest.approx(brute)
  votes = [majority_correct(r["answers"], c) for r, c in zip(records, correct, strict=True)]
  assert metrics["overall"]["maj@4"] == pytest.approx(np.mean(votes))


def test_evaluate_cli_on_a_lora_run_gives_the_accuracy_the_trainer_logged(lora_run, tmp_path):
  # The experiment's own config (runlocal: an SFT warm start, which a LoRA run refuses; the tool
  # evaluates the run's adapters and warm-starts nothing) and the run's seed (the same eval rows).
  workdir, _ = lora_run
  result = run_module(
    "ebpo_jax.evaluate",
    f"--config={CONFIG}:runlocal",
    f"--workdir={tmp_path}",
    f"--run_dir={workdir}",
    "--config.seed=1",
    devices=1,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "eval.json").read_text())
  assert saved["params"]["step"] == 2 and saved["greedy"] and saved["num_problems"] == 16
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  logged = [m for m in lines if "eval/accuracy" in m][-1]
  assert logged["step"] == 2
  metrics = saved["metrics"]
  assert metrics["overall"]["avg@1"] == pytest.approx(logged["eval/accuracy"])
  for cluster in ("add_1", "add_2"):
    got = metrics["by_cluster"][cluster]["avg@1"]
    assert got == pytest.approx(logged[f"eval/accuracy/{cluster}"]), cluster


# e2e: reads lora_run's checkpoints (in process)
def test_a_lora_runs_policy_is_its_adapters_on_the_base_it_trained(lora_run):
  # evaluate's and export's path (policy.load_policy) under a config whose seed is not the run's:
  # the base of a random-init LoRA run comes from the run's seed, as the resumed trainer builds it.
  workdir, _ = lora_run
  config, step = policy.policy_config(arith_config(), str(workdir), None)
  assert step == 2 and config.seed != LORA_RUN["seed"]
  mesh = sharding.make_mesh(dict(config.mesh))
  tokenizer = task_rows.load_tokenizer(config, tasks.from_config(config.task))
  model, params, _ = policy.load_policy(config, tokenizer, mesh, str(workdir), step)
  run_config = arith_config(LORA_RUN)
  trained = restore_run_state(workdir, run_config, 2).params
  want = lora.combine(trained, policy.lora_base(run_config, model, mesh))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  b = trained["layers"]["self_attn"]["q_proj"][lora.B_NAME]
  assert np.abs(np.asarray(b)).max() > 1e-3  # trained: not the fresh B = 0


# ----------------------------------------------------------------------------- difficulty


def test_difficulty_cli_round_trip(arith_run, tmp_path):
  workdir, _ = arith_run
  rows = [
    {"prompt": "1+1=", "answer": "2", "cluster": "easy", "id": "a"},
    {"prompt": "45+38=", "answer": "83", "cluster": "hard", "id": "b"},
    {"prompt": "3+4=", "answer": "7", "cluster": "easy", "id": "c"},
  ]
  source = tmp_path / "rows.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "rows_difficulty.jsonl"
  result = run_module(
    "ebpo_jax.difficulty",
    f"--config={CONFIG}:runlocal",
    f"--input={source}",
    f"--output={out}",
    "--k=4",
    f"--run_dir={workdir}",
    devices=1,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "difficulty: 100%" in result.stderr  # the bar
  assert not (tmp_path / "rows_difficulty.jsonl.partial").exists()  # removed at the end
  back, names = data.load_rows_and_clusters(out)
  assert names == ["easy", "hard"]
  assert [r["id"] for r in back] == ["a", "b", "c"] and [r["cluster"] for r in back] == [0, 1, 0]
  for row in back:
    assert row["pass_rate"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert row["difficulty"] == pytest.approx(1.0 - row["pass_rate"])
  order = data.make_batches(back, batch_size=3, order="curriculum", seed=0)
  first = [back[i]["difficulty"] for i in next(order)]
  assert first == sorted(first)  # easy to hard


# e2e: in process, but about 20 s: one sampler compile
def test_difficulty_writes_as_it_goes_and_a_rerun_takes_up_after_it(tmp_path, monkeypatch):
  run_dir = tmp_path / "run"
  save_checkpoint(run_dir, arith_config({"model.num_layers": 1}), step=0)  # compiles faster
  source = tmp_path / "rows.jsonl"
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "cluster": i % 2} for i in range(20)]
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"

  def measure(path):  # 20 rows, 8 per sampler call (one per device): calls of 8, 8 and 4
    config = arith_config({"sampling.prompts_per_call": 8, "sampling.max_new_tokens": 2})
    return difficulty.run(config, str(source), str(path), k=2, run_dir=str(run_dir))

  reference = measure(tmp_path / "reference.jsonl")
  real, skipped = rollout_batch.sample_and_score_batches, []

  def stopped_after_two_calls(*args, **kwargs):
    for i, batch in enumerate(real(*args, **kwargs)):
      if i == 2:
        raise KeyboardInterrupt  # ^C during the third call
      yield batch

  monkeypatch.setattr(rollout_batch, "sample_and_score_batches", stopped_after_two_calls)
  with pytest.raises(KeyboardInterrupt):
    measure(out)
  assert not out.exists()
  header, *kept = [json.loads(line) for line in partial.read_text().splitlines()]
  assert header["k"] == 2 and kept == reference[:16]  # the two calls' rows, on disk

  def counting(*args, skip=0, **kwargs):
    skipped.append(skip)
    yield from real(*args, skip=skip, **kwargs)

  monkeypatch.setattr(rollout_batch, "sample_and_score_batches", counting)
  assert measure(out) == reference  # the same rows as a run never stopped
  assert skipped == [2] and not partial.exists()  # only the third call ran again
  assert [json.loads(line) for line in out.read_text().splitlines()] == reference
