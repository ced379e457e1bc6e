"""A user's own data set as `datasets.save_to_disk` writes it: text questions with GSM8K-shaped
answers (`#### <n>`) and named topic clusters, for the tests of `data.path` and `eval.path`."""

import datasets

datasets.disable_progress_bars()

ANSWER_REGEX = r"####\s*(.+)"
# The config keys that read own_data's columns: the data.md recipe's.
COLUMNS = {
  "data.prompt_column": "question",
  "data.cluster_column": "topic",
  "data.answer_regex": ANSWER_REGEX,
}


def own_rows(n: int, offset: int = 0) -> dict[str, list]:
  """n rows: "What is a plus b?", "... #### a+b", topic "small" (sum < 10) or "large"."""
  pairs = [(i % 7 + offset, i // 7 + offset) for i in range(n)]
  return {
    "question": [f"What is {a} plus {b}?" for a, b in pairs],
    "answer": [f"{a} and {b} make {a + b}.\n#### {a + b}" for a, b in pairs],
    "topic": ["small" if a + b < 10 else "large" for a, b in pairs],
  }


def save_own_dataset(path, n_train: int = 48, n_test: int = 8) -> str:
  """A DatasetDict (splits train and test) of own_rows at `path`; returns the path."""
  splits = {
    "train": datasets.Dataset.from_dict(own_rows(n_train)),
    "test": datasets.Dataset.from_dict(own_rows(n_test, offset=20)),
  }
  datasets.DatasetDict(splits).save_to_disk(str(path))
  return str(path)
