"""Evaluation: pass@k / maj@k math against brute force and hand values, a run's params restored
from its checkpoint, evaluate on a Hugging Face directory, the clear error when there is nothing
to evaluate (the CLIs on trained runs: e2e/test_evaluate.py)."""

import json
import math
from fractions import Fraction

import jax
import numpy as np
import pytest

from ebpo_jax import difficulty, evaluate, models, sharding, tasks
from ebpo_jax.evaluate import (
  majority_correct,
  majority_vote,
  pass_at_k,
  problem_metrics,
  sample_counts,
)
from ebpo_jax.trainer import policy, task_rows
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.configs import arith_config
from tests.helpers.evaluation import brute_pass_at_k


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


def test_eval_json_has_the_binomial_standard_error_of_each_accuracy():
  # avg@2 over the problems of cluster x: (1 + 0.5 + 0 + 0) / 4 = 0.375 from n = 4 problems, so
  # se = sqrt(0.375 * 0.625 / 4) = 0.2421 (over the 8 responses it would be 0.1712).
  rewards = ([1, 1], [0, 1], [0, 0], [0, 0], [1, 1])
  per_problem = [problem_metrics(r, ["1"] * 2) for r in rewards]
  grouped = evaluate.grouped_metrics(per_problem, ["a"] * 5, ["x"] * 4 + ["y"])
  assert grouped["by_cluster"]["x"]["avg@2_se"] == pytest.approx(0.2421, abs=1e-4)
  assert grouped["by_cluster"]["y"]["avg@2_se"] == 0.0  # one problem, all right
  assert grouped["overall"]["avg@2_se"] == pytest.approx((0.5 * 0.5 / 5) ** 0.5)
  assert "avg@2_se" in evaluate.metrics_table(grouped).splitlines()[0]


# ----------------------------------------------------------------------------- on a trained run


def test_a_runs_params_are_restored_from_its_checkpoint(tmp_path):
  run_dir = tmp_path / "run"
  # Perturbed params: a restore that fell back to a fresh init (seed 0) would not match them.
  model, saved = save_checkpoint(run_dir, arith_config(), step=2, perturb=0.05)
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


def test_nothing_to_evaluate_is_one_clear_error(tmp_path):
  with pytest.raises(
    policy.PolicyError, match="nothing to evaluate: .* config.model.path is empty"
  ):
    evaluate.run(arith_config(), str(tmp_path))
  with pytest.raises(policy.PolicyError, match="no checkpoints/ directory"):
    evaluate.run(arith_config(), str(tmp_path), run_dir=str(tmp_path / "missing"))
  assert not (tmp_path / "eval.json").exists()


# ----------------------------------------------------------------------------- a model directory


def test_evaluate_a_hugging_face_directory(tiny_llama_dir, tmp_path):
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
