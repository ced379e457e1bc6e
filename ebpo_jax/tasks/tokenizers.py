"""Tokenizers for random-init models: characters of arithmetic, or UTF-8 bytes of any text.

Both have `vocab_size`, `pad_id`, `bos_id`, `eos_id`; `encode(text)` gives the text's ids only
(add BOS/EOS yourself); `decode(ids)` stops at the first EOS and drops pad and BOS.
"""

from collections.abc import Sequence

_SPECIALS = 3  # ids 0, 1, 2: pad, BOS, EOS


class CharTokenizer:
  """The characters of arithmetic prompts and answers (18 ids)."""

  CHARS = "0123456789+-*= "

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self._id_of = {c: i + _SPECIALS for i, c in enumerate(self.CHARS)}
    self.vocab_size = _SPECIALS + len(self.CHARS)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._id_of[c] for c in text]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.CHARS!r}") from e

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.CHARS[i - _SPECIALS] for i in _content_ids(ids, self))


class ByteTokenizer:
  """UTF-8 bytes (259 ids): any text, for tiny models on reasoning-gym or file tasks."""

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.vocab_size = _SPECIALS + 256

  def encode(self, text: str) -> list[int]:
    return [b + _SPECIALS for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    data = bytes(i - _SPECIALS for i in _content_ids(ids, self))
    return data.decode("utf-8", errors="replace")


def _content_ids(ids: Sequence[int], tokenizer: CharTokenizer | ByteTokenizer) -> list[int]:
  """The ids before the first EOS, without pad and BOS; out-of-vocabulary ids raise."""
  out = []
  for i in map(int, ids):
    if i == tokenizer.eos_id:
      break
    if i in (tokenizer.pad_id, tokenizer.bos_id):
      continue
    if not _SPECIALS <= i < tokenizer.vocab_size:
      raise ValueError(f"token id {i} is outside the vocabulary (size {tokenizer.vocab_size})")
    out.append(i)
  return out
