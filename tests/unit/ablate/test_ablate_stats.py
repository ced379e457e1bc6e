"""ebpo_jax.ablate's statistics over seeds: t intervals, differences to GRPO paired by seed, and
the report rows and Markdown that show them. Hand-made run summaries, no training."""

import json
import math

import numpy as np
import pytest

from ebpo_jax import ablate
from ebpo_jax.ablate import advantage_mass, stats
from tests.helpers.ablation import run_summary

# Two-sided 95% Student t critical values t_{0.975, df} from a printed table (not from scipy).
T_975 = {3: 3.182, 4: 2.776}


def t_interval(values, df):
  """The interval by hand: mean +- t * sd(ddof=1) / sqrt(n), t from the table."""
  x = np.asarray(values, dtype=np.float64)
  half = T_975[df] * x.std(ddof=1) / math.sqrt(len(x))
  return x.mean(), x.mean() - half, x.mean() + half


def assert_t_interval(row, prefix, values, df):
  """`row`'s PREFIX_mean, PREFIX_low and PREFIX_high are the interval of `values` by hand."""
  mean, low, high = t_interval(values, df)
  assert row[f"{prefix}_mean"] == pytest.approx(mean)
  assert row[f"{prefix}_low"] == pytest.approx(low, abs=1e-3)
  assert row[f"{prefix}_high"] == pytest.approx(high, abs=1e-3)


def summary(variant, seed, *, gain, acc, g=8):
  """A run summary whose hard cluster gains `gain` and whose final overall accuracy is `acc`. The
  hard cluster starts at the same value for every variant of a seed (the shared warm start)."""
  hard0 = 0.1 + 0.01 * seed
  curve = {"step": [0, 10], "all": [0.5, acc], "easy": [0.8, 0.8], "hard": [hard0, hard0 + gain]}
  return run_summary(
    variant, seed, curve, g=g, all_equal_frac=0.25, zero_frac=0.3, entropy_final=0.4,
    grad_norm=2.0 + seed,
  )  # fmt: skip


# grpo ran seeds 0-4, ebpo_running seeds 0-3 and 5: seeds 4 and 5 have no partner, and each is an
# outlier, so a difference over all seeds (unpaired) moves the mean far from the paired one.
GRPO = {0: (0.10, 0.60), 1: (0.05, 0.55), 2: (0.15, 0.62), 3: (0.00, 0.50), 4: (0.40, 0.90)}
EBPO = {0: (0.30, 0.64), 1: (0.11, 0.60), 2: (0.25, 0.61), 3: (0.10, 0.58), 5: (0.60, 0.20)}


@pytest.fixture
def report():
  results = [summary("grpo", s, gain=gn, acc=a) for s, (gn, a) in GRPO.items()]
  results += [summary("ebpo_running", s, gain=gn, acc=a) for s, (gn, a) in EBPO.items()]
  results.append(summary("rloo", 0, gain=0.2, acc=0.7))  # one seed only
  return ablate.build_report(results)


def test_mean_ci_is_a_student_t_interval_with_ddof_1():
  # [1..5]: mean 3, sd (ddof=1) sqrt(2.5) = 1.581, half-width 2.776 * 1.581 / sqrt(5) = 1.963;
  # ddof=0 would give 1.756, a normal quantile (1.96) 1.386.
  mean, low, high = stats.mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
  assert mean == 3.0
  assert (low, high) == (pytest.approx(3 - 1.963, abs=1e-3), pytest.approx(3 + 1.963, abs=1e-3))
  assert stats.t_quantile(5) == pytest.approx(2.776, abs=1e-3)  # 5 values: 4 degrees of freedom
  assert stats.mean_ci([0.4]) == (0.4, None, None)  # one seed: no interval, not a 0-wide one
  with pytest.raises(ValueError, match="non-empty"):
    stats.mean_ci([])


def test_paired_differences_keep_only_shared_seeds():
  diffs = stats.paired_differences({0: 0.5, 1: 0.2, 5: 0.9}, {1: 0.1, 0: 0.25, 4: 0.0})
  assert list(diffs) == [0, 1] and diffs == pytest.approx({0: 0.25, 1: 0.1})


def test_hard_gain_interval_over_seeds(report):
  rows = {r["variant"]: r for r in report["rows"]}
  ebpo = rows["ebpo_running"]
  # Gains 0.30, 0.11, 0.25, 0.10, 0.60: mean 0.272, t_{0.975,4} = 2.776 -> [0.020, 0.524].
  assert_t_interval(ebpo, "hard_gain", [0.30, 0.11, 0.25, 0.10, 0.60], df=4)  # ddof=0: low 0.044
  assert ebpo["grad_norm"] == pytest.approx(np.mean([2, 3, 4, 5, 7]))
  assert ebpo["all_equal_frac"] == 0.25 and ebpo["zero_frac"] == 0.3 and ebpo["entropy"] == 0.4
  rloo = rows["rloo"]
  assert rloo["hard_gain_mean"] == pytest.approx(0.2)
  assert rloo["hard_gain_low"] is None and rloo["hard_gain_high"] is None


def test_differences_to_grpo_are_paired_by_seed(report):
  rows = {r["variant"]: r for r in report["rows"]}
  ebpo, rloo, grpo = rows["ebpo_running"], rows["rloo"], rows["grpo"]
  assert ebpo["vs_grpo_seeds"] == [0, 1, 2, 3]  # seed 4 (grpo only) and 5 (ebpo only) dropped
  # Hard-cluster gain, per seed: 0.30-0.10, 0.11-0.05, 0.25-0.15, 0.10-0.00 = 0.20, 0.06, 0.10,
  # 0.10: mean 0.115, t_{0.975,3} = 3.182 -> [0.020, 0.210]. Unpaired, over all seeds:
  # 0.272 - 0.140 = 0.132; unpaired on the shared seeds (Welch) the interval is about twice as wide.
  gain_diffs = [0.20, 0.06, 0.10, 0.10]
  assert ebpo["vs_grpo_gain_diffs"] == pytest.approx(gain_diffs)
  assert_t_interval(ebpo, "vs_grpo", gain_diffs, df=3)
  # Final accuracy, per seed: 0.04, 0.05, -0.01, 0.08: mean 0.04 -> [-0.020, 0.100].
  acc_diffs = [0.04, 0.05, -0.01, 0.08]
  assert ebpo["vs_grpo_acc_diffs"] == pytest.approx(acc_diffs)
  assert_t_interval(ebpo, "vs_grpo_acc", acc_diffs, df=3)
  # One shared seed: a difference, no interval. GRPO's own row has no difference to itself.
  assert rloo["vs_grpo_seeds"] == [0]
  assert rloo["vs_grpo_mean"] == pytest.approx(0.2 - 0.10)
  assert rloo["vs_grpo_acc_mean"] == pytest.approx(0.7 - 0.60)
  assert rloo["vs_grpo_low"] is None and rloo["vs_grpo_acc_high"] is None
  assert grpo["vs_grpo_mean"] is None and grpo["vs_grpo_seeds"] is None
  json.dumps(report)  # ablation.json holds the report as it is


def test_markdown_and_summary_show_the_intervals(report):
  markdown = ablate.render_markdown(report, {"config": "c.py", "date": "2026-12-01"})
  table = markdown.split("Final accuracy per cluster")[0]  # the main table's rows, by variant
  lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
  # Gain, gain minus grpo, accuracy minus grpo (the numbers of the two tests above).
  ebpo = "+0.272 [+0.020, +0.524] (n=5); per seed +0.30, +0.11, +0.25, +0.10, +0.60 | "
  ebpo += "+0.115 [+0.020, +0.210] (n=4) | +0.040 [-0.020, +0.100] (n=4) |"
  assert ebpo in lines["ebpo_running"]
  rloo = "+0.200 (n=1, no CI); per seed +0.20 | +0.100 (n=1, no CI) | +0.100 (n=1, no CI) |"
  assert rloo in lines["rloo"]
  assert "| 0.250 | 0.300 | 4.200 | 0.400 |" in lines["ebpo_running"]  # all-equal, zero, grad, H
  paired = [line for line in report["summary"] if "minus grpo paired by seed" in line]
  assert len(paired) == 1 and "ebpo_running +0.115 [+0.020, +0.210] (n=4)" in paired[0]
  assert "rloo +0.100 (n=1, no CI)" in paired[0]
  assert "Cells with 1 seed have no interval" in report["summary"][-1]


def test_without_grpo_there_are_no_paired_differences():
  results = [summary("ebpo_running", s, gain=0.1 * s, acc=0.5) for s in range(3)]
  report = ablate.build_report(results)
  (row,) = report["rows"]
  assert row["vs_grpo_mean"] is None and row["vs_grpo_acc_mean"] is None
  assert row["hard_gain_low"] is not None  # the variant's own interval is still there
  markdown = ablate.render_markdown(report, {})
  assert "- no grpo run at G=8: no paired differences" in markdown
  assert "| no grpo | no grpo |" in markdown
  assert any("no grpo run at this G" in line for line in report["summary"])


def test_run_summary_averages_the_diagnostics_over_the_rl_steps(tmp_path):
  lines = [
    {"step": 0, "eval/accuracy": 0.5, "eval/accuracy/a": 0.5},
    {"step": 1, "reward/mean": 0.1, "adv/all_equal_frac": 0.5, "adv/zero_frac": 0.6,
     "grad_norm": 1.0, "entropy": 0.9},
    {"step": 2, "reward/mean": 0.2, "adv/all_equal_frac": 0.25, "adv/zero_frac": 0.2,
     "grad_norm": 3.0, "entropy": 0.7},
    {"step": 2, "eval/accuracy": 0.6, "eval/accuracy/a": 0.6},
  ]  # fmt: skip
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  result = ablate.summarize_run(tmp_path, ablate.Run("grpo", 4, 0))
  assert result["all_equal_frac"] == pytest.approx(0.375)
  assert result["zero_frac"] == pytest.approx(0.4) and result["grad_norm"] == pytest.approx(2.0)
  assert result["entropy_final"] == pytest.approx(0.7)  # the last tenth of the steps: step 2
  assert result["curve"] == {"step": [0, 2], "all": [0.5, 0.6], "a": [0.5, 0.6]}


# ----------------------------------------------------------------------------- advantage mass

# (step, prompt, cluster, rewards, advantages) of a G=2 run's samples.jsonl.
SAMPLES = [
  (10, "1+1=", "easy", [0.0, 0.0], [-0.5, -0.3]),  # all_fail
  (10, "9+9=", "hard", [1.0, 0.0], [0.8, -0.8]),  # mixed
  (10, "9+9=", "hard", [1.0, 1.0], [0.2, 0.4]),  # the same prompt again: a group of its own
  (20, "1+1=", "easy", [1.0, 1.0], [0.6, 0.6]),  # all_success
  (20, "2+2=", "easy", [0.0, 0.0], [-0.1, -0.1]),  # all_fail
  (20, "3+3=", "easy", [0.5, 0.5], [0.3, 0.3]),  # all_equal_other (the same partial credit)
  (20, "4+4=", "easy", [0.5], [0.9]),  # cut short by logging.num_samples: left out
]


def write_run(run_dir, samples=SAMPLES):
  """A run dir with a two-evaluation metrics.jsonl and, unless `samples` is None, samples.jsonl."""
  run_dir.mkdir(parents=True, exist_ok=True)
  lines = [
    {"step": 0, "eval/accuracy": 0.5, "eval/accuracy/easy": 0.8, "eval/accuracy/hard": 0.2},
    {"step": 20, "reward/mean": 0.4, "adv/zero_frac": 0.1, "entropy": 0.5},
    {"step": 20, "eval/accuracy": 0.6, "eval/accuracy/easy": 0.9, "eval/accuracy/hard": 0.3},
  ]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  if samples is None:
    return
  rows = [
    {"step": step, "prompt": prompt, "completion": "x", "answer": "y", "reward": r, "advantage": a,
     "cluster": cluster}
    for step, prompt, cluster, rewards, advantages in samples
    for r, a in zip(rewards, advantages, strict=True)
  ]  # fmt: skip
  (run_dir / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def cell(cluster, outcome, groups, count, adv_mean, abs_mean):
  return {"cluster": cluster, "outcome": outcome, "groups": groups, "count": count,
          "adv_mean": pytest.approx(adv_mean), "abs_mean": pytest.approx(abs_mean)}  # fmt: skip


def test_group_outcomes():
  outcome = advantage_mass.outcome
  assert outcome([0.0, 0.0, 0.0]) == "all_fail" and outcome([-0.2, 0.0]) == "all_fail"
  assert outcome([1.0, 1.0]) == "all_success" and outcome([0.0, 1.0]) == "mixed"
  assert outcome([0.5, 0.5]) == "all_equal_other" and outcome([0.5, 1.0]) == "mixed"
  assert outcome([0.0, 0.5]) == "mixed"


def test_run_summary_has_the_advantages_by_cluster_and_outcome(tmp_path):
  write_run(tmp_path)
  result = ablate.summarize_run(tmp_path, ablate.Run("ebpo_running", 2, 0))
  # The trainer's cluster order (easy, hard), then all_fail, mixed, all_equal_other, all_success.
  # easy all_fail: -0.5, -0.3, -0.1, -0.1 -> mean -0.25, |A| 0.25 (2 groups, 4 completions).
  # hard: the repeated prompt makes [1, 0] mixed and [1, 1] all_success; merged into one group of
  # 4 they would be one mixed group of mean 0.15.
  assert result[advantage_mass.KEY] == [
    cell("easy", "all_fail", 2, 4, -0.25, 0.25),
    cell("easy", "all_equal_other", 1, 2, 0.3, 0.3),
    cell("easy", "all_success", 1, 2, 0.6, 0.6),
    cell("hard", "mixed", 1, 2, 0.0, 0.8),
    cell("hard", "all_success", 1, 2, 0.3, 0.3),
  ]
  json.dumps(result)  # result.json holds it as it is


def test_runs_without_samples_have_no_advantage_mass(tmp_path):
  write_run(tmp_path / "none", samples=None)
  result = ablate.summarize_run(tmp_path / "none", ablate.Run("grpo", 2, 0))
  assert result[advantage_mass.KEY] is None
  report = ablate.build_report([result])
  assert report["rows"][0][advantage_mass.KEY] is None
  assert report["rows"][0]["advantage_mass_seeds"] == 0
  assert "Where the advantages go" not in ablate.render_markdown(report, {})


def test_advantage_mass_is_pooled_over_the_seeds_by_completion(tmp_path):
  # Seed 0: easy all_fail, 4 completions of mean -0.25; seed 1: 2 completions of mean +0.5 (|A|
  # 0.5); seed 2: an old result without the field. Pooled over the 6 completions: mean
  # (4 * -0.25 + 2 * 0.5) / 6 = 0, |A| (4 * 0.25 + 2 * 0.5) / 6 = 0.333; the mean of the two seeds'
  # means would be +0.125 and 0.375.
  write_run(tmp_path / "s0")
  write_run(tmp_path / "s1", samples=[(10, "5+5=", "easy", [0.0, 0.0], [0.5, 0.5])])
  results = [
    ablate.summarize_run(tmp_path / f"s{s}", ablate.Run("ebpo_running", 2, s)) for s in (0, 1)
  ]
  old = summary("ebpo_running", 2, gain=0.1, acc=0.5, g=2)
  results.append(old)
  report = ablate.build_report(results)
  (row,) = report["rows"]
  assert row["advantage_mass_seeds"] == 2
  assert row[advantage_mass.KEY][0] == cell("easy", "all_fail", 3, 6, 0.0, 1 / 3)
  assert row[advantage_mass.KEY][1] == cell("easy", "all_equal_other", 1, 2, 0.3, 0.3)
  json.dumps(report)
  markdown = ablate.render_markdown(report, {})
  table = markdown.split("Where the advantages go")[1].split("## Summary")[0]
  head = "| variant | G | seeds with samples | easy all_fail | easy all_equal_other | "
  assert head + "easy all_success | hard mixed | hard all_success |" in table
  row_line = "| ebpo_running | 2 | 2/3 | 0.33 (+0.00, n=6) | 0.30 (+0.30, n=2) | "
  assert row_line + "0.60 (+0.60, n=2) | 0.80 (+0.00, n=2) | 0.30 (+0.30, n=2) |" in table
