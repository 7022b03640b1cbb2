"""Packing tokenized documents into fixed-length ELECTRA pre-training examples.

Owns the example layout ([CLS] A [SEP] or [CLS] A [SEP] B [SEP], right-padded) and the
rules for how sentences of one document are grouped into the A and B segments.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from electra_jax.config_lib import ConfigError

# Smallest max_seq_len that leaves room for [CLS], [SEP], [SEP] and some text; it is also
# the lower end of the random short target lengths.
MIN_SEQ_LEN = 5


def document_rng(seed: int, document_index: int) -> random.Random:
  """The generator of one document's packing choices."""
  # A string seed goes through SHA-512, so nearby (seed, index) pairs give unrelated
  # streams and the result does not depend on Python's hash randomization.
  return random.Random(f"electra-pack:{int(seed)}:{int(document_index)}")


class _ExampleBuilder:
  """Accumulates the sentences of one document and turns them into examples."""

  def __init__(self, max_seq_len, cls_id, sep_id, single_segment_prob, short_seq_prob):
    self.max_seq_len = max_seq_len
    self.cls_id = cls_id
    self.sep_id = sep_id
    self.rng = random.Random(0)
    self.single_segment_prob = single_segment_prob
    self.short_seq_prob = short_seq_prob
    self.examples: list[tuple[list[int], int]] = []
    self.target_length = max_seq_len
    self.sentences: list[Sequence[int]] = []
    self.num_buffered_tokens = 0

  def start_document(self, rng: random.Random) -> None:
    """Begin a document whose random choices all come from its own `rng`."""
    self.rng = rng
    self._draw_target_length()

  def _draw_target_length(self) -> None:
    # Occasional short examples teach the model the short inputs it meets later in
    # fine-tuning, which full-length packing alone would never show it.
    if self.rng.random() < self.short_seq_prob:
      self.target_length = self.rng.randint(MIN_SEQ_LEN, self.max_seq_len)
    else:
      self.target_length = self.max_seq_len

  def add_sentence(self, sentence: Sequence[int]) -> None:
    if len(sentence) == 0:
      return
    self.sentences.append(sentence)
    self.num_buffered_tokens += len(sentence)
    if self.num_buffered_tokens >= self.target_length:
      self.flush()

  def flush(self) -> None:
    """Make an example of the buffered sentences (called when full, or at document end)."""
    if not self.sentences:
      return
    if self.rng.random() < self.single_segment_prob:
      a_target = None
    else:
      a_target = (self.target_length - 3) // 2
    segment_a: list[int] = []
    segment_b: list[int] = []
    for sentence in self.sentences:
      # The official builder's rule, checked anew for every sentence: a short sentence can
      # still join A after a longer one went to B; a sentence that would overfill A joins it
      # on a coin flip only while B is empty and A is below its target.
      goes_to_a = (
          a_target is None
          or not segment_a
          or len(segment_a) + len(sentence) < a_target
          or (not segment_b and len(segment_a) < a_target and self.rng.random() < 0.5)
      )
      (segment_a if goes_to_a else segment_b).extend(sentence)
    segment_a = segment_a[: self.max_seq_len - 2]
    segment_b = segment_b[: max(0, self.max_seq_len - len(segment_a) - 3)]

    tokens = [self.cls_id, *segment_a, self.sep_id]
    num_segment_a_tokens = len(tokens)
    if segment_b:
      tokens += [*segment_b, self.sep_id]
    self.examples.append((tokens, num_segment_a_tokens))

    self.sentences = []
    self.num_buffered_tokens = 0
    self._draw_target_length()


def pack_documents(
    documents: Sequence[Sequence[Sequence[int]]],
    max_seq_len: int,
    *,
    cls_id: int,
    sep_id: int,
    pad_id: int,
    seed: int,
    single_segment_prob: float = 0.1,
    short_seq_prob: float = 0.05,
    document_indices: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
  """Pack tokenized documents (lists of token-id sentences) into padded examples.

  Sentences of a document are buffered until they reach the current target length (or
  the document ends) and then split into segments A and B. Examples never mix
  documents. Returns int32 arrays `input_ids` and `token_type_ids` of shape
  [num_examples, max_seq_len]; token types are 0 on [CLS] A [SEP] and padding, 1 on
  B [SEP]. The output is a deterministic function of the inputs and `seed`.

  Every document draws its random choices (target lengths, single segments, coin flips) from
  its own generator, seeded by `seed` and its index in the corpus (`document_indices`, default
  0, 1, ...). A document's examples therefore do not depend on the documents before it, so
  any slice of a corpus packs, in any process, into exactly the rows the whole corpus gives
  for that slice: this is what lets `prepare_data` pack shards in parallel and still equal
  the in-memory path. (The official builder threads one generator through the corpus; the
  distribution of examples is the same.)
  """
  if max_seq_len < MIN_SEQ_LEN:
    raise ConfigError(
        f"max_seq_len must be at least {MIN_SEQ_LEN} to fit [CLS] A [SEP] B [SEP], "
        f"got {max_seq_len}."
    )
  for name, prob in (("single_segment_prob", single_segment_prob), ("short_seq_prob", short_seq_prob)):
    if not 0.0 <= prob <= 1.0:
      raise ConfigError(f"{name} must be a probability in [0, 1], got {prob}.")

  if document_indices is None:
    document_indices = range(len(documents))
  elif len(document_indices) != len(documents):
    raise ValueError(
        f"pack_documents: {len(document_indices)} document_indices for {len(documents)} documents."
    )
  builder = _ExampleBuilder(max_seq_len, cls_id, sep_id, single_segment_prob, short_seq_prob)
  for index, document in zip(document_indices, documents):
    builder.start_document(document_rng(seed, index))
    for sentence in document:
      builder.add_sentence(sentence)
    builder.flush()

  num_examples = len(builder.examples)
  input_ids = np.full((num_examples, max_seq_len), pad_id, dtype=np.int32)
  token_type_ids = np.zeros((num_examples, max_seq_len), dtype=np.int32)
  for row, (tokens, num_segment_a_tokens) in enumerate(builder.examples):
    input_ids[row, : len(tokens)] = tokens
    token_type_ids[row, num_segment_a_tokens : len(tokens)] = 1
  return {"input_ids": input_ids, "token_type_ids": token_type_ids}
