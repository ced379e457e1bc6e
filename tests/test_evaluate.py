"""Evaluation: pass@k / maj@k math against brute force and hand values, a run's params restored
from its checkpoint, evaluate on a trained run (the CLI; also a LoRA run) and on a Hugging Face
directory, the clear error when there is nothing to evaluate, and the difficulty CLI round trip."""

import itertools
import json
import math
import pathlib
import shutil
from fractions import Fraction

import jax
import numpy as np
import pytest

from ebpo_jax import data, difficulty, evaluate, models, sharding, tasks
from ebpo_jax.evaluate import (
  majority_correct,
  majority_vote,
  pass_at_k,
  problem_metrics,
  sample_counts,
)
from ebpo_jax.models import lora
from ebpo_jax.trainer import policy, rollouts, task_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arith_ebpo.py")


# ----------------------------------------------------------------------------- metric math


def brute_pass_at_k(correct: list[bool], k: int) -> float:
  """Share of the k-subsets of the samples that hold a correct one."""
  subsets = list(itertools.combinations(correct, k))
  return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumerating_every_subset():
  for n in range(1, 7):
    for c in range(n + 1):
      correct = [True] * c + [False] * (n - c)
      for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_hand_values_and_large_n():
  # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7 (the biased 1 - (1 - 2/5)^2 gives 0.64).
  assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
  assert pass_at_k(4, 0, 4) == 0.0
  assert pass_at_k(4, 1, 4) == 1.0
  assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
  # n=2000: C(n, k) overflows a float; the product form agrees with exact fractions.
  exact = 1 - Fraction(math.comb(1990, 1000), math.comb(2000, 1000))
  assert pass_at_k(2000, 10, 1000) == pytest.approx(float(exact), rel=1e-12)
  with pytest.raises(ValueError, match="0 <= c <= n"):
    pass_at_k(3, 4, 1)


def test_sample_counts_are_powers_of_two_then_k():
  assert sample_counts(1) == [1]
  assert sample_counts(4) == [1, 2, 4]
  assert sample_counts(6) == [1, 2, 4, 6]
  assert sample_counts(8) == [1, 2, 4, 8]


def test_majority_vote_ties_go_to_the_first_answer_and_empty_answers_abstain():
  assert majority_vote(["5", "3", "5"]) == "5"
  assert majority_vote(["3", "5", "5", "3"]) == "3"  # tie: "3" came first
  assert majority_vote(["", "", "7"]) == "7"  # two responses without an answer do not win
  assert majority_vote(["", ""]) is None
  assert majority_correct(["5", "3", "5"], [True, False, True])
  assert not majority_correct(["3", "3", "5"], [False, False, True])  # the right answer loses
  assert not majority_correct(["", ""], [False, False])


def test_problem_metrics_by_hand():
  # answers 3, 5, 5, 5 with 5 right: avg@4 = 3/4; pass@1 = 3/4, pass@2 = 1 - C(1,2)/C(4,2) = 1;
  # maj@1 votes "3" (wrong); maj@2 ties "3" vs "5": half of the tied answers are right (0.5);
  # maj@4 picks "5".
  m = problem_metrics([0.0, 1.0, 1.0, 1.0], ["3", "5", "5", "5"])
  assert m == {
    "avg@4": 0.75,
    "reward": 0.75,
    "pass@1": 0.75,
    "pass@2": 1.0,
    "pass@4": 1.0,
    "maj@1": 0.0,
    "maj@2": 0.5,
    "maj@4": 1.0,
  }
  # A partial reward (0.5) counts in `reward` but is not correct.
  assert problem_metrics([0.5, 1.0], ["1", "2"])["avg@2"] == 0.5
  assert problem_metrics([0.5, 1.0], ["1", "2"])["reward"] == 0.75


def test_grouped_metrics_split_by_dataset_and_cluster():
  per_problem = [problem_metrics(r, ["1"] * 2) for r in ([1, 1], [0, 1], [0, 0])]
  grouped = evaluate.grouped_metrics(per_problem, ["a", "a", "b"], ["x", "y", "x"])
  assert grouped["overall"]["avg@2"] == pytest.approx(0.5)
  assert grouped["by_dataset"]["a"] == {**grouped["by_dataset"]["a"], "n": 2, "avg@2": 0.75}
  assert grouped["by_dataset"]["b"]["pass@2"] == 0.0
  assert grouped["by_cluster"]["x"]["avg@2"] == 0.5
  assert grouped["by_cluster"]["y"]["n"] == 1


# ----------------------------------------------------------------------------- on a trained run


def test_a_runs_params_are_restored_from_its_checkpoint(arith_config, checkpoint_writer, tmp_path):
  run_dir = tmp_path / "run"
  # Perturbed params: a restore that fell back to a fresh init (seed 0) would not match them.
  model, saved = checkpoint_writer(run_dir, arith_config(), step=2, perturb=0.05)
  config, step = policy.policy_config(arith_config({"model.num_layers": 1}), str(run_dir), None)
  assert step == 2 and config.model.num_layers == 3  # the run's model, from the saved config
  mesh = sharding.make_mesh(dict(config.mesh))
  task = tasks.from_config(config.task)
  tokenizer = task_rows.load_tokenizer(config, task)
  restored_model, params, origin = policy.load_policy(config, tokenizer, mesh, str(run_dir), step)
  assert origin == {"kind": "checkpoint", "run_dir": str(run_dir), "step": 2}
  assert restored_model.config == model.config
  abstract = models.build.abstract_params(restored_model, mesh)
  leaves, saved_leaves = jax.tree.leaves(params), jax.tree.leaves(saved)
  assert len(leaves) == len(saved_leaves) == len(jax.tree.leaves(abstract))
  for ours, ref, want in zip(leaves, saved_leaves, jax.tree.leaves(abstract), strict=True):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    assert ours.sharding == want.sharding  # placed as the model's rules say


@pytest.mark.e2e
def test_evaluate_cli_on_a_trainer_workdir_writes_eval_json(arith_run, module_cli, tmp_path):
  workdir, _ = arith_run  # checkpoints every 2 steps, the latest at step 4
  run_dir = tmp_path / "run"
  shutil.copytree(workdir / "checkpoints", run_dir / "checkpoints")
  result = module_cli(
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
    "n", "avg@4", "reward", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4"
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


@pytest.mark.e2e
def test_evaluate_cli_on_a_lora_run_gives_the_accuracy_the_trainer_logged(
  lora_run, module_cli, tmp_path
):
  # The experiment's own config (runlocal: an SFT warm start, which a LoRA run refuses; the tool
  # evaluates the run's adapters and warm-starts nothing) and the run's seed (the same eval rows).
  workdir, _ = lora_run
  result = module_cli(
    "ebpo_jax.evaluate",
    f"--config={CONFIG}:runlocal",
    f"--workdir={tmp_path}",
    f"--run_dir={workdir}",
    "--config.seed=1",
    devices=1,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((tmp_path / "eval.json").read_text())
  assert saved["params"]["step"] == 4 and saved["greedy"] and saved["num_problems"] == 16
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  logged = [m for m in lines if "eval/accuracy" in m][-1]
  assert logged["step"] == 4
  metrics = saved["metrics"]
  assert metrics["overall"]["avg@1"] == pytest.approx(logged["eval/accuracy"])
  for cluster in ("add_1", "add_2"):
    got = metrics["by_cluster"][cluster]["avg@1"]
    assert got == pytest.approx(logged[f"eval/accuracy/{cluster}"]), cluster


@pytest.mark.e2e  # reads lora_run's checkpoints (in process)
def test_a_lora_runs_policy_is_its_adapters_on_the_base_it_trained(
  lora_run, lora_overrides, arith_config, run_state
):
  # evaluate's and export's path (policy.load_policy) under a config whose seed is not the run's:
  # the base of a random-init LoRA run comes from the run's seed, as the resumed trainer builds it.
  workdir, _ = lora_run
  config, step = policy.policy_config(arith_config(), str(workdir), None)
  assert step == 4 and config.seed != lora_overrides["seed"]
  mesh = sharding.make_mesh(dict(config.mesh))
  tokenizer = task_rows.load_tokenizer(config, tasks.from_config(config.task))
  model, params, _ = policy.load_policy(config, tokenizer, mesh, str(workdir), step)
  run_config = arith_config(lora_overrides)
  trained = run_state(workdir, run_config, 4).params
  want = lora.combine(trained, policy.lora_base(run_config, model, mesh))
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  b = trained["layers"]["self_attn"]["q_proj"][lora.B_NAME]
  assert np.abs(np.asarray(b)).max() > 1e-3  # trained: not the fresh B = 0


def test_nothing_to_evaluate_is_one_clear_error(arith_config, tmp_path):
  with pytest.raises(
    policy.PolicyError, match="nothing to evaluate: .* config.model.path is empty"
  ):
    evaluate.run(arith_config(), str(tmp_path))
  with pytest.raises(policy.PolicyError, match="no checkpoints/ directory"):
    evaluate.run(arith_config(), str(tmp_path), run_dir=str(tmp_path / "missing"))
  assert not (tmp_path / "eval.json").exists()


# ----------------------------------------------------------------------------- a model directory


def test_evaluate_a_hugging_face_directory(arith_config, tiny_llama_dir, tmp_path):
  tiny_hf_dir = tiny_llama_dir
  config = arith_config(
    {
      "model.path": str(tiny_hf_dir),
      "task.num_eval": 2,
      "eval.num_samples": 2,
      "sampling.max_new_tokens": 4,
    }
  )
  result = evaluate.run(config, str(tmp_path))
  assert result["params"] == {"kind": "hf", "path": str(tiny_hf_dir)}
  assert result["num_problems"] == 4 and result["num_responses"] == 8
  records = [
    json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()
  ]
  assert all(isinstance(t, str) for r in records for t in r["responses"])
  assert any(t for r in records for t in r["responses"])  # BPE text, not empty
  assert json.loads((tmp_path / "eval.json").read_text())["config"]["model"]["path"] == str(
    tiny_hf_dir
  )


# ----------------------------------------------------------------------------- difficulty


@pytest.mark.e2e
def test_difficulty_cli_round_trip(arith_run, module_cli, tmp_path):
  workdir, _ = arith_run
  rows = [
    {"prompt": "1+1=", "answer": "2", "cluster": "easy", "id": "a"},
    {"prompt": "45+38=", "answer": "83", "cluster": "hard", "id": "b"},
    {"prompt": "3+4=", "answer": "7", "cluster": "easy", "id": "c"},
  ]
  source = tmp_path / "rows.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "rows_difficulty.jsonl"
  result = module_cli(
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


def test_maj_at_j_splits_ties_evenly_so_maj2_is_not_maj1():
  # Two samples that disagree, one right: the vote is a tie; a tie scores the expected value of a
  # uniform pick among the tied answers (0.5 here), not the first answer's (which made maj@2
  # always equal maj@1).
  metrics = problem_metrics([1.0, 0.0], ["5", "3"])
  assert metrics["maj@1"] == 1.0 and metrics["maj@2"] == 0.5
  assert problem_metrics([0.0, 1.0], ["3", "5"])["maj@2"] == 0.5
  assert problem_metrics([1.0, 1.0, 0.0], ["5", "5", "3"])["maj@2"] == 1.0  # no tie at j = 2
  three = problem_metrics([1.0, 0.0, 0.0, 0.0], ["5", "3", "4", "4"])
  assert three["maj@2"] == 0.5 and three["maj@4"] == 0.0  # "4" wins 2 to 1 to 1
  assert problem_metrics([0.0, 0.0], ["", ""])["maj@2"] == 0.0  # no answer: wrong


@pytest.mark.e2e  # in process, but about 20 s: one sampler compile
def test_difficulty_writes_as_it_goes_and_a_rerun_takes_up_after_it(
  arith_config, checkpoint_writer, tmp_path, monkeypatch
):
  run_dir = tmp_path / "run"
  checkpoint_writer(run_dir, arith_config({"model.num_layers": 1}), step=0)  # compiles faster
  source = tmp_path / "rows.jsonl"
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "cluster": i % 2} for i in range(20)]
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"

  def measure(path):  # 20 rows, 8 per sampler call (one per device): calls of 8, 8 and 4
    config = arith_config({"sampling.prompts_per_call": 8, "sampling.max_new_tokens": 2})
    return difficulty.run(config, str(source), str(path), k=2, run_dir=str(run_dir))

  reference = measure(tmp_path / "reference.jsonl")
  real, skipped = rollouts.sample_and_score_batches, []

  def stopped_after_two_calls(*args, **kwargs):
    for i, batch in enumerate(real(*args, **kwargs)):
      if i == 2:
        raise KeyboardInterrupt  # ^C during the third call
      yield batch

  monkeypatch.setattr(rollouts, "sample_and_score_batches", stopped_after_two_calls)
  with pytest.raises(KeyboardInterrupt):
    measure(out)
  assert not out.exists()
  header, *kept = [json.loads(line) for line in partial.read_text().splitlines()]
  assert header["k"] == 2 and kept == reference[:16]  # the two calls' rows, on disk

  def counting(*args, skip=0, **kwargs):
    skipped.append(skip)
    yield from real(*args, skip=skip, **kwargs)

  monkeypatch.setattr(rollouts, "sample_and_score_batches", counting)
  assert measure(out) == reference  # the same rows as a run never stopped
  assert skipped == [2] and not partial.exists()  # only the third call ran again
  assert [json.loads(line) for line in out.read_text().splitlines()] == reference


def test_difficulty_takes_up_only_its_own_partial_file(tmp_path):
  rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
  measured = [{**rows[0], "pass_rate": 1.0, "difficulty": 0.0}]
  header, path = {"k": 2, "config": {"seed": 0}}, str(tmp_path / "out.jsonl.partial")
  difficulty.write_rows(path, measured, header)
  assert difficulty.read_partial(path, header, rows) == measured
  assert difficulty.read_partial(path, {"k": 4, "config": {"seed": 0}}, rows) == []  # another k
  assert difficulty.read_partial(path, header, rows[::-1]) == []  # other rows
  assert difficulty.read_partial(str(tmp_path / "missing.partial"), header, rows) == []
  (tmp_path / "out.jsonl.partial").write_text("not json\n")
  assert difficulty.read_partial(path, header, rows) == []
