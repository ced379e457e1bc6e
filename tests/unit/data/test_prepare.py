"""Tests for ebpo_jax.data.prepare: each math source in its Hugging Face layout, champ, the CLI."""

import json
import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ebpo_jax.data import DataError, load_rows_and_clusters
from ebpo_jax.data.prepare import SOURCES, prepare, read_source

DAPO_WRAPPER = (
  "Solve the following math problem step by step. The last line of your response should be of "
  "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
  '{}\n\nRemember to put your answer on its own line after "Answer:".'
)


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def _write_parquet(path, records):
  pq.write_table(pa.Table.from_pylist(records), path)
  return path


def _dapo_record(problem, answer, index):
  return {
    "data_source": "math_dapo",
    "prompt": [{"content": DAPO_WRAPPER.format(problem), "role": "user"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": index},
  }


# ---------------------------------------------------------------------------------------------
# One fixture per source, in its published layout


def test_dapo_parquet_unwraps_prompts_and_drops_repeated_ones(tmp_path):
  records = [
    _dapo_record("Find $x$ if $x+1=3$.", "2", "uuid-a"),
    _dapo_record("How many primes are below 10?", "4", "uuid-b"),
    _dapo_record("Find $x$ if $x+1=3$.", "2", "uuid-a"),  # the set repeats each prompt
    _dapo_record("How many primes are below 10?", "4", "uuid-b"),
    _dapo_record("Find $x$ if $x+1=3$.", "5", "uuid-c"),  # a repeat with another answer
  ]
  path = _write_parquet(tmp_path / "dapo-math-17k.parquet", records)
  rows = read_source("dapo_math_17k", str(path))
  assert rows[0] == {
    "prompt": "Find $x$ if $x+1=3$.",
    "answer": "2",
    "cluster": "dapo_math_17k",
    "difficulty": rows[0]["difficulty"],
    "source": "dapo_math_17k",
    "id": "uuid-a",
  }
  assert math.isnan(rows[0]["difficulty"])
  assert [r["prompt"] for r in rows] == ["Find $x$ if $x+1=3$.", "How many primes are below 10?"]
  summary = prepare("dapo_math_17k", str(path), str(tmp_path / "out.jsonl"))
  assert "2 rows" in summary
  assert "3 dropped (2 duplicate prompts, 1 duplicate prompts (other answer))" in summary


def test_dapo_processed_copy_with_string_prompt(tmp_path):
  # open-r1/DAPO-Math-17k-Processed: `prompt` is the bare problem, `solution` the answer.
  path = _write_jsonl(
    tmp_path / "train.jsonl",
    [{"prompt": "What is $2^{10}$?", "solution": "1024", "data_source": "math_dapo"}],
  )
  [row] = read_source("dapo_math_17k", str(path))
  assert (row["prompt"], row["answer"], row["id"]) == (
    "What is $2^{10}$?",
    "1024",
    "dapo_math_17k-0",
  )


def test_math500_jsonl_subject_level_and_boxed_answers(tmp_path):
  path = _write_jsonl(
    tmp_path / "test.jsonl",
    [
      {
        "problem": "Compute $\\dbinom{5}{2}$.",
        "solution": "We get $\\boxed{10}$.",
        "answer": "10",
        "subject": "Counting & Probability",
        "level": 2,
        "unique_id": "test/counting_and_probability/1.json",
      },
      {
        "problem": "Simplify $\\frac{2}{4}$.",
        "solution": "It is $\\boxed{\\frac{1}{2}}$.",
        "answer": "\\boxed{\\frac{1}{2}}",  # some copies keep the box
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/7.json",
      },
    ],
  )
  rows = read_source("math500", str(path))
  assert [r["answer"] for r in rows] == ["10", "\\frac{1}{2}"]
  assert [r["cluster"] for r in rows] == ["Counting & Probability", "Prealgebra"]
  assert [r["difficulty"] for r in rows] == [2.0, 1.0]
  assert rows[0]["id"] == "test/counting_and_probability/1.json"


def test_math_original_layout_takes_the_last_boxed_answer_of_the_solution(tmp_path):
  # hendrycks MATH: no `answer` column, `level` as "Level 4", `type` as the subject.
  solution = "First $\\boxed{3}$ is wrong; so the answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$."
  path = _write_jsonl(
    tmp_path / "math.jsonl",
    [
      {
        "problem": "Find $\\sin 60^\\circ$.",
        "solution": solution,
        "level": "Level 4",
        "type": "Geometry",
      }
    ],
  )
  [row] = read_source("math500", str(path))
  assert row["answer"] == "\\frac{\\sqrt{3}}{2}"  # the last box, braces balanced (not "\\frac{")
  assert (row["cluster"], row["difficulty"]) == ("Geometry", 4.0)


def test_aime24_both_layouts(tmp_path):
  maxwell = _write_parquet(
    tmp_path / "aime_2024_problems.parquet",
    [{"ID": "2024-I-1", "Problem": "Every morning Aya walks...", "Solution": "...", "Answer": 204}],
  )
  h4 = _write_jsonl(
    tmp_path / "aime_2024.jsonl",
    [
      {
        "id": 60,
        "problem": "Let $b\\geq 2$ be an integer...",
        "solution": "...",
        "answer": "211",
        "url": "https://artofproblemsolving.com/...",
        "year": "2024",
      }
    ],
  )
  [a] = read_source("aime24", str(maxwell))
  [b] = read_source("aime24", str(h4))
  assert (a["prompt"], a["answer"], a["id"]) == ("Every morning Aya walks...", "204", "2024-I-1")
  assert (b["answer"], b["id"], b["cluster"]) == ("211", "60", "aime24")


def test_aime25_opencompass_jsonl_gets_ids_from_positions(tmp_path):
  path = _write_jsonl(
    tmp_path / "aime2025-I.jsonl",
    [
      {"question": "Find the sum of all integer bases $b>9$ ...", "answer": "70"},
      {"question": "On $\\triangle ABC$ points ...", "answer": "588"},
    ],
  )
  rows = read_source("aime25", str(path))
  assert [(r["answer"], r["id"]) for r in rows] == [("70", "aime25-0"), ("588", "aime25-1")]


def test_verl_layout_of_an_eval_set(tmp_path):
  # verl-preprocessed copies (e.g. an AIME 2025 parquet for RL): chat prompt + boxed instruction.
  content = "Find $n$. Let's think step by step and output the final answer within \\boxed{}."
  record = {
    "data_source": "aime25",
    "prompt": [{"content": content, "role": "user"}],
    "ability": "math",
    "reward_model": {"ground_truth": "\\boxed{70}", "style": "rule"},
    "extra_info": {"index": 7},
  }
  [row] = read_source("aime25", str(_write_parquet(tmp_path / "test.parquet", [record])))
  assert (row["prompt"], row["answer"], row["id"]) == ("Find $n$.", "70", "7")


def test_amc23_float_answers_become_plain_numbers(tmp_path):
  # zwhe99/amc23 and AI-MO copies store answers as float64.
  path = _write_parquet(
    tmp_path / "test-00000-of-00001.parquet",
    [
      {"id": 0, "question": "Cities $A$ and $B$ are $45$ miles apart...", "answer": 27.0},
      {"id": 1, "question": "What is the probability ...?", "answer": 0.5},
    ],
  )
  rows = read_source("amc23", str(path))
  assert [r["answer"] for r in rows] == ["27", "0.5"]  # not "27.0"


def test_olympiadbench_answer_lists_subfields_and_images(tmp_path):
  base = {
    "solution": ["..."],
    "context": None,
    "image_1": None,
    "modality": "Text-only",
    "difficulty": "Competition",
    "is_multiple_answer": False,
    "unit": None,
    "answer_type": "Numerical",
    "question_type": "Open-ended",
    "subject": "Math",
    "language": "English",
  }
  records = [
    {**base, "id": 1606, "question": "Find all $n$ ...", "final_answer": ["$5$"]},
    {**base, "id": 1607, "question": "Solve ...", "final_answer": ["$1$", "$2$"]},
    {**base, "id": 1608, "question": "In the figure <image_1> ...", "final_answer": ["3"]},
  ]
  records[0]["subfield"], records[1]["subfield"], records[2]["subfield"] = (
    "Combinatorics",
    "Algebra",
    "Geometry",
  )
  records[1]["is_multiple_answer"] = True
  records[2].update(image_1={"bytes": b"\x89PNG", "path": None}, modality="Multimodal")
  proof = {**base, "id": 9, "question": "Prove that ...", "final_answer": None}
  records.append({**proof, "subfield": "Algebra", "question_type": "Theorem proof"})
  path = _write_parquet(tmp_path / "OE_TO_maths_en_COMP.parquet", records)
  rows = read_source("olympiadbench", str(path))
  assert [(r["answer"], r["cluster"], r["id"]) for r in rows] == [
    ("5", "Combinatorics", "1606"),
    ("1, 2", "Algebra", "1607"),
  ]
  assert math.isnan(rows[0]["difficulty"])  # "Competition" is not a number
  summary = prepare("olympiadbench", str(path), str(tmp_path / "o.jsonl"))
  assert "2 dropped (1 proofs, 1 with images)" in summary
  only_images = _write_parquet(tmp_path / "OE_MM_maths_en_COMP.parquet", records[2:3])
  with pytest.raises(DataError, match="no rows left \\(1 with images dropped\\)"):
    read_source("olympiadbench", str(only_images))


def test_champ_offline_set():
  rows = read_source("champ")
  assert len(rows) == 270
  assert all(r["prompt"].strip() and r["answer"].strip() for r in rows)
  assert len({r["id"] for r in rows}) == 270 and all(r["source"] == "champ" for r in rows)
  assert sorted({r["cluster"] for r in rows}) == [
    "Combinatorics",
    "Inequality",
    "Number-Theory",
    "Polynomial",
    "Sequence",
  ]
  assert not any("@@" in r["prompt"] + r["answer"] for r in rows)  # the package's markup is gone


def test_directory_reads_every_data_file_in_sorted_order(tmp_path):
  (tmp_path / "data").mkdir()
  _write_parquet(tmp_path / "data" / "b.parquet", [{"problem": "second", "answer": "2"}])
  _write_jsonl(tmp_path / "data" / "a.jsonl", [{"problem": "first", "answer": "1"}])
  (tmp_path / "README.md").write_text("not data")
  (tmp_path / "dataset_info.json").write_text('{"features": {}}')  # metadata, not rows
  (tmp_path / ".cache").mkdir()
  _write_jsonl(tmp_path / ".cache" / "c.jsonl", [{"problem": "hidden", "answer": "3"}])
  rows = read_source("aime25", str(tmp_path))
  assert [r["prompt"] for r in rows] == ["first", "second"]


def test_json_array_file(tmp_path):
  path = tmp_path / "OE_TO_maths_en_COMP.json"
  path.write_text(json.dumps([{"id": 1, "question": "q1", "final_answer": ["7"]}], indent=2))
  [row] = read_source("olympiadbench", str(path))
  assert (row["prompt"], row["answer"], row["cluster"]) == ("q1", "7", "olympiadbench")


# ---------------------------------------------------------------------------------------------
# Bad input


def test_missing_column_names_file_line_and_expected_columns(tmp_path):
  path = _write_jsonl(
    tmp_path / "test.jsonl",
    [{"problem": "p1", "answer": "1"}, {"problem": "p2", "final": "2"}],
  )
  with pytest.raises(DataError, match=rf"^{path}:2: missing column 'answer' or 'Answer'"):
    read_source("aime24", str(path))


def test_missing_column_in_parquet_names_the_row(tmp_path):
  path = _write_parquet(
    tmp_path / "t.parquet", [{"question": "q1", "answer": 1.0}, {"question": None, "answer": 2.0}]
  )
  with pytest.raises(DataError, match=rf"^{path}:2: missing column 'problem' or 'question'"):
    read_source("amc23", str(path))


def test_malformed_json_line_and_array_name_the_line(tmp_path):
  path = tmp_path / "test.jsonl"
  path.write_text('{"problem": "p", "answer": "1"}\n\n{"problem": "q", "answer": \n')
  with pytest.raises(DataError, match=rf"^{path}:3: malformed JSON"):
    read_source("aime25", str(path))
  array = tmp_path / "a.json"
  array.write_text('[\n  {"problem": "p", "answer": "1"},\n  {"problem": "q" "answer": "2"}\n]\n')
  with pytest.raises(DataError, match=rf"^{array}:3: malformed JSON"):
    read_source("aime25", str(array))


@pytest.mark.parametrize(
  ("answer", "message"),
  [("", "empty answer"), ("\\boxed{}", "empty answer"), (True, "answer must be a string")],
)
def test_bad_answers(tmp_path, answer, message):
  path = _write_jsonl(tmp_path / "t.jsonl", [{"problem": "p", "answer": answer}])
  with pytest.raises(DataError, match=rf"^{path}:1: {message}"):
    read_source("aime25", str(path))


def test_bad_source_or_path(tmp_path):
  with pytest.raises(DataError, match="unknown source 'gsm8k'"):
    read_source("gsm8k", str(tmp_path))
  with pytest.raises(DataError, match="math500 needs a path"):
    read_source("math500")
  with pytest.raises(DataError, match="champ .* takes no path"):
    read_source("champ", str(tmp_path))
  with pytest.raises(DataError, match="no .jsonl/.json/.parquet files"):
    read_source("math500", str(tmp_path))
  with pytest.raises(DataError, match="no such file or directory"):
    read_source("math500", str(tmp_path / "missing.jsonl"))
  # generic: any data set by its column names (tests/unit/data/test_saved_dataset.py)
  names = "dapo_math_17k math500 aime24 aime25 amc23 olympiadbench champ generic"
  assert tuple(names.split()) == SOURCES


# ---------------------------------------------------------------------------------------------
# CLI


def _run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "ebpo_jax.data.prepare", *args], capture_output=True, text=True
  )


def test_cli_round_trip_through_load_rows_and_clusters(tmp_path):
  records = [
    {"problem": f"p{i}", "answer": str(i), "subject": s, "level": i % 5 + 1, "unique_id": f"u{i}"}
    for i, s in enumerate(["Algebra", "Geometry", "Algebra", "Precalculus"])
  ]
  path = _write_parquet(tmp_path / "test.parquet", records)
  out = tmp_path / "prepared" / "math500.jsonl"
  result = _run_cli("--source=math500", f"--path={path}", f"--out={out}", "--limit=3")
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == f"math500: 3 rows, 2 clusters, 0 dropped -> {out}"
  rows, cluster_names = load_rows_and_clusters(out)
  assert cluster_names == ["Algebra", "Geometry"]
  assert [(r["prompt"], r["answer"], r["cluster"], r["difficulty"]) for r in rows] == [
    ("p0", "0", 0, 1.0),
    ("p1", "1", 1, 2.0),
    ("p2", "2", 0, 3.0),
  ]
  assert [(r["source"], r["id"]) for r in rows] == [
    ("math500", "u0"),
    ("math500", "u1"),
    ("math500", "u2"),
  ]
  assert [p.name for p in out.parent.iterdir()] == ["math500.jsonl"]  # no temporary file left


def test_several_sources_into_one_file(tmp_path):
  raw = tmp_path / "raw"
  (raw / "aime24").mkdir(parents=True)
  _write_parquet(
    raw / "aime24" / "train.parquet", [{"Problem": f"a{i}", "Answer": i} for i in range(3)]
  )
  _write_jsonl(raw / "amc23.jsonl", [{"question": "b", "answer": 2.0}])
  out = tmp_path / "eval.jsonl"
  summary = prepare("aime24,amc23,champ", str(raw), str(out), limit=2)
  assert summary == (
    f"aime24,amc23,champ: 5 rows (aime24 2, amc23 1, champ 2), 3 clusters, 0 dropped -> {out}"
  )
  rows, names = load_rows_and_clusters(out)
  assert [r["source"] for r in rows] == ["aime24", "aime24", "amc23", "champ", "champ"]
  assert names == ["aime24", "amc23", "Combinatorics"]
  with pytest.raises(DataError, match=f"{raw}: no aime25 copy"):
    prepare("aime24,aime25", str(raw), str(out))


def test_prepare_champ_round_trip_keeps_nan_difficulty(tmp_path):
  out = tmp_path / "champ.jsonl"
  assert prepare("champ", None, str(out), limit=5).startswith("champ: 5 rows, 1 clusters")
  rows, names = load_rows_and_clusters(out)
  assert len(rows) == 5 and names == ["Combinatorics"]
  assert all(math.isnan(r["difficulty"]) and r["answer"] for r in rows)


def test_cli_bad_input_exits_with_one_message_and_writes_nothing(tmp_path):
  path = tmp_path / "test.jsonl"
  path.write_text('{"problem": "p", "answer": "1"}\n{"problem": oops}\n')
  out = tmp_path / "out.jsonl"
  result = _run_cli("--source=aime25", f"--path={path}", f"--out={out}")
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
    f"error: {path}:2: malformed JSON (Expecting value at column 13)"
  ]
  assert not out.exists()
