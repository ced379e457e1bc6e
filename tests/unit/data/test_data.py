"""Tests for ebpo_jax.data: row validation with FILE:LINE messages, and the three batch orders."""

import json
import math

import numpy as np
import pytest

from ebpo_jax.data import BatchIndexer, DataError, load_rows, load_rows_and_clusters, make_batches

# ---------------------------------------------------------------------------------------------
# Rows


def _write_jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return path


def test_load_rows_fills_defaults_and_keeps_extra_keys(tmp_path):
  path = _write_jsonl(
    tmp_path / "d.jsonl",
    [
      json.dumps({"prompt": "1+1=", "answer": "2", "meta": {"x": 1}}),
      "",  # blank lines are skipped but still counted
      json.dumps({"prompt": "2+2=", "answer": "4", "difficulty": 3}),
    ],
  )
  rows = load_rows(path)
  assert [r["prompt"] for r in rows] == ["1+1=", "2+2="]
  assert rows[0]["cluster"] == 0 and math.isnan(rows[0]["difficulty"])
  assert rows[0]["meta"] == {"x": 1}
  assert rows[1]["difficulty"] == 3.0 and isinstance(rows[1]["difficulty"], float)


def test_string_clusters_numbered_in_order_of_first_appearance(tmp_path):
  names = ["geometry", "algebra", "geometry", "number theory", "algebra"]
  lines = [
    json.dumps({"prompt": f"q{i}", "answer": "a", "cluster": c}) for i, c in enumerate(names)
  ]
  rows, cluster_names = load_rows_and_clusters(_write_jsonl(tmp_path / "d.jsonl", lines))
  assert cluster_names == ["geometry", "algebra", "number theory"]
  assert [r["cluster"] for r in rows] == [0, 1, 0, 2, 1]


def test_int_clusters_kept_and_named_by_number(tmp_path):
  lines = [json.dumps({"prompt": f"q{c}", "answer": "a", "cluster": c}) for c in (2, 0)]
  rows, cluster_names = load_rows_and_clusters(_write_jsonl(tmp_path / "d.jsonl", lines))
  assert [r["cluster"] for r in rows] == [2, 0]
  assert cluster_names == ["0", "1", "2"]


GOOD = json.dumps({"prompt": "1+1=", "answer": "2", "cluster": 1})


@pytest.mark.parametrize(
  "bad_line, message",
  [
    ('{"prompt": "1+1=", "answer": "2"', "malformed JSON"),
    ('["1+1=", "2"]', "a row must be a JSON object"),
    ('{"answer": "2", "cluster": 0}', "missing 'prompt'"),
    ('{"prompt": "  ", "answer": "2", "cluster": 0}', "'prompt' must be a non-empty string"),
    ('{"prompt": "1+1=", "cluster": 0}', "missing 'answer'"),
    ('{"prompt": "1+1=", "answer": 2, "cluster": 0}', "'answer' must be a string, got int 2"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": 1.5}', "cluster must be an int or a string"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": true}', "cluster must be an int or a string"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": -1}', "cluster id must be >= 0"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": "alg"}', "use one kind per file"),
    ('{"prompt": "1+1=", "answer": "2"}', "missing 'cluster' while earlier rows have one"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": 0, "difficulty": "hard"}', "'difficulty'"),
    ('{"prompt": "1+1=", "answer": "2", "cluster": 0, "difficulty": NaN}', "finite number"),
    # These two raised RecursionError and ValueError tracebacks out of json.loads.
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ('{"prompt": "1+1=", "answer": "2", "x": ' + "9" * 5001 + "}", "an integer of 5001 digits"),
  ],
  ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_row_names_file_and_line(tmp_path, bad_line, message):
  path = _write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad_line, GOOD])
  with pytest.raises(DataError) as info:
    load_rows(path)
  assert str(info.value).startswith(f"{path}:3: ") and "\n" not in str(info.value)
  assert message in str(info.value)
  assert isinstance(info.value, ValueError)


def test_bad_files(tmp_path):
  with pytest.raises(DataError, match="no such file"):
    load_rows(tmp_path / "missing.jsonl")
  (tmp_path / "d.csv").write_text("prompt,answer\n")
  with pytest.raises(DataError, match="unknown file type '.csv'"):
    load_rows(tmp_path / "d.csv")
  with pytest.raises(DataError, match="no rows"):
    load_rows(_write_jsonl(tmp_path / "empty.jsonl", [""]))
  no_cluster_first = [json.dumps({"prompt": "q", "answer": "a"}), GOOD]
  with pytest.raises(DataError, match=r":2: has a 'cluster' but .*:1 has none"):
    load_rows(_write_jsonl(tmp_path / "mixed.jsonl", no_cluster_first))


def test_parquet(tmp_path):
  path = tmp_path / "d.parquet"
  try:
    import pyarrow
    import pyarrow.parquet as pq
  except ImportError:
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs pyarrow"):
      load_rows(path)
    return
  good = pyarrow.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "cluster": ["a", "b"]})
  pq.write_table(good, path)
  rows, names = load_rows_and_clusters(path)
  assert [(r["prompt"], r["answer"], r["cluster"]) for r in rows] == [
    ("1+1=", "2", 0),
    ("2+2=", "4", 1),
  ]
  assert names == ["a", "b"]
  pq.write_table(pyarrow.table({"prompt": ["1+1=", None], "answer": ["2", "4"]}), path)
  with pytest.raises(DataError, match=f"{path}:2: missing 'prompt'"):
    load_rows(path)


# ---------------------------------------------------------------------------------------------
# Batches

NUM_ROWS = 23


def _rows(num_rows=NUM_ROWS, cluster_sizes=(10, 3, 10)):
  clusters = np.repeat(np.arange(len(cluster_sizes)), cluster_sizes)
  assert clusters.size == num_rows
  return [
    {"prompt": f"q{i}", "answer": "a", "cluster": int(c), "difficulty": float(i % 4)}
    for i, c in enumerate(clusters)
  ]


def _take(iterator, k):
  return np.stack([next(iterator) for _ in range(k)])


@pytest.mark.parametrize("order", ["shuffle", "clustered", "curriculum", "sampled"])
def test_deterministic_and_exact_resume(order):
  rows = _rows()
  straight = _take(make_batches(rows, batch_size=4, order=order, seed=7), 12)
  assert straight.dtype == np.int32 and straight.shape == (12, 4)
  assert straight.min() >= 0 and straight.max() < NUM_ROWS

  first = make_batches(rows, batch_size=4, order=order, seed=7)
  _take(first, 5)
  state = first.get_state()
  resumed = make_batches(rows, batch_size=4, order=order, seed=7)
  resumed.set_state(state)
  np.testing.assert_array_equal(_take(resumed, 7), straight[5:])

  other_seed = _take(make_batches(rows, batch_size=4, order=order, seed=8), 12)
  assert not np.array_equal(other_seed, straight)


def test_shuffle_each_epoch_is_a_fresh_permutation():
  # 23 rows in batches of 5: the first 23 stream items are epoch 0, the next 23 epoch 1.
  stream = _take(make_batches(NUM_ROWS, batch_size=5, seed=0), 10).ravel()
  epoch0, epoch1 = stream[:NUM_ROWS], stream[NUM_ROWS : 2 * NUM_ROWS]
  np.testing.assert_array_equal(np.sort(epoch0), np.arange(NUM_ROWS))
  np.testing.assert_array_equal(np.sort(epoch1), np.arange(NUM_ROWS))
  assert not np.array_equal(epoch0, epoch1)


def test_sampled_batches_are_one_generators_draws_in_turn():
  # The warm start's order: batch k is draw k of default_rng(seed) (its batches before the grain
  # iterator took them over), read in order, after a resume, or going back.
  rng = np.random.default_rng(3)
  expected = np.stack([rng.integers(0, NUM_ROWS, 5) for _ in range(6)])
  np.testing.assert_array_equal(
    _take(make_batches(NUM_ROWS, batch_size=5, order="sampled", seed=3), 6), expected
  )
  indexer = BatchIndexer(
    num_rows=NUM_ROWS,
    cluster_ids=None,
    difficulties=None,
    batch_size=5,
    order="sampled",
    seed=3,
    run_length=1,
  )
  for k in (4, 5, 1, 5, 0):
    np.testing.assert_array_equal(indexer(k), expected[k])


def test_clustered_batches_are_single_cluster_and_rotate():
  rows = _rows()
  cluster_of = np.array([r["cluster"] for r in rows])
  batches = _take(make_batches(rows, batch_size=4, order="clustered", seed=0), 9)
  batch_clusters = [np.unique(cluster_of[b]) for b in batches]
  assert all(c.size == 1 for c in batch_clusters)
  assert [int(c[0]) for c in batch_clusters] == [0, 1, 2] * 3
  # Cluster 1 has 3 rows, fewer than a batch: its 3 batches (12 items) wrap through 4 epochs,
  # each epoch a permutation of its rows {10, 11, 12}.
  small = batches[1::3].ravel()
  for epoch in range(4):
    assert sorted(small[3 * epoch : 3 * epoch + 3]) == [10, 11, 12]


def test_clustered_run_length_and_skips_empty_clusters():
  cluster_ids = np.array([0, 0, 0, 5, 5, 5])  # ids 1-4 have no rows
  batches = _take(make_batches(6, cluster_ids, batch_size=2, order="clustered", run_length=2), 8)
  assert [int(cluster_ids[b][0]) for b in batches] == [0, 0, 5, 5, 0, 0, 5, 5]


def test_curriculum_is_monotone_within_an_epoch_and_ties_shuffled():
  rows = _rows()
  difficulty = np.array([r["difficulty"] for r in rows])
  stream = _take(make_batches(rows, batch_size=1, order="curriculum", seed=3), 2 * NUM_ROWS)
  epoch0, epoch1 = stream[:NUM_ROWS, 0], stream[NUM_ROWS:, 0]
  np.testing.assert_array_equal(np.sort(epoch0), np.arange(NUM_ROWS))
  assert np.all(np.diff(difficulty[epoch0]) >= 0)
  assert np.all(np.diff(difficulty[epoch1]) >= 0)
  # Difficulty 0 rows are 0, 4, 8, ...: a plain stable sort would list them in index order.
  assert not np.array_equal(epoch0, epoch1)


def test_bad_arguments():
  with pytest.raises(ValueError, match="order must be one of"):
    make_batches(4, batch_size=2, order="random")
  with pytest.raises(ValueError, match="batch_size"):
    make_batches(4, batch_size=0)
  with pytest.raises(ValueError, match="needs cluster ids"):
    make_batches(4, batch_size=2, order="clustered")
  with pytest.raises(ValueError, match="finite difficulty on every row; 1 rows"):
    make_batches(2, difficulties=[0.0, math.nan], batch_size=2, order="curriculum")


def test_orbax_checkpoint_round_trip(tmp_path):
  import grain
  import orbax.checkpoint as ocp

  rows = _rows()
  straight = _take(make_batches(rows, batch_size=4, order="clustered", seed=1), 6)
  iterator = make_batches(rows, batch_size=4, order="clustered", seed=1)
  _take(iterator, 2)
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
    restored = make_batches(rows, batch_size=4, order="clustered", seed=1)
    manager.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  np.testing.assert_array_equal(_take(restored, 4), straight[2:])
