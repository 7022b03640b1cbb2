"""Packing tokenized documents into right-padded ELECTRA examples ([CLS] A [SEP] B [SEP]), and
(data.pack_rows) several whole examples into one row, with segment ids and positions."""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Sequence

import numpy as np

# Smallest max_seq_len with room for [CLS], [SEP], [SEP] and some text; the shortest random target length.
MIN_SEQ_LEN = 5


def pack_documents(
    documents: Sequence[Sequence[Sequence[int]]],
    max_seq_len: int,
    special,
    seed: int,
    document_indices: Sequence[int] | None = None,
    single_segment_prob: float = 0.1,
    short_seq_prob: float = 0.05,
) -> dict[str, np.ndarray]:
  """int32 [num_examples, max_seq_len] `input_ids` and `token_type_ids` (1 on B [SEP]) of documents
  (lists of token-id sentences), with the special ids of `special`; examples never mix documents.
  Each document's generator is seeded by `seed` and its corpus index (`document_indices`), so any
  slice of a corpus packs, in any process, into the rows the whole corpus gives for it."""
  examples = []  # (tokens, how many of them are [CLS] A [SEP])
  for index, document in zip(document_indices or range(len(documents)), documents):
    # A string seed goes through SHA-512: nearby (seed, index) pairs give unrelated streams.
    rng = random.Random(f"electra-pack:{int(seed)}:{int(index)}")
    sentences = [sentence for sentence in document if len(sentence)]
    target_length, buffered, num_buffered_tokens = None, [], 0
    for i, sentence in enumerate(sentences):
      if target_length is None:  # occasional short examples, as fine-tuning's inputs are
        short = rng.random() < short_seq_prob
        target_length = rng.randint(MIN_SEQ_LEN, max_seq_len) if short else max_seq_len
      buffered.append(sentence)
      num_buffered_tokens += len(sentence)
      if num_buffered_tokens < target_length and i + 1 < len(sentences):
        continue
      a_target = None if rng.random() < single_segment_prob else (target_length - 3) // 2
      segment_a, segment_b = [], []
      for buffered_sentence in buffered:
        # The official builder's rule: a short sentence can join A after a longer one went to B;
        # one that would overfill A joins it on a coin flip only while B is empty.
        goes_to_a = (
            a_target is None
            or not segment_a
            or len(segment_a) + len(buffered_sentence) < a_target
            or (not segment_b and len(segment_a) < a_target and rng.random() < 0.5)
        )
        (segment_a if goes_to_a else segment_b).extend(buffered_sentence)
      segment_a = segment_a[: max_seq_len - 2]
      segment_b = segment_b[: max(0, max_seq_len - len(segment_a) - 3)]
      tokens = [special.cls_id, *segment_a, special.sep_id]
      examples.append((tokens + [*segment_b, special.sep_id] if segment_b else tokens, len(tokens)))
      target_length, buffered, num_buffered_tokens = None, [], 0
  input_ids = np.full((len(examples), max_seq_len), special.pad_id, dtype=np.int32)
  token_type_ids = np.zeros((len(examples), max_seq_len), dtype=np.int32)
  for row, (tokens, num_segment_a_tokens) in enumerate(examples):
    input_ids[row, : len(tokens)] = tokens
    token_type_ids[row, num_segment_a_tokens : len(tokens)] = 1
  return {"input_ids": input_ids, "token_type_ids": token_type_ids}


# Bump when the plan for the same lengths would change: it enters the data fingerprint.
ROW_PACKING_VERSION = 1
# Examples are packed within windows of this many consecutive ones: short best-fit searches, little padding.
ROW_PACKING_WINDOW = 4096


@dataclasses.dataclass(frozen=True)
class RowPacking:
  """Row r holds examples `examples[row_splits[r]:row_splits[r + 1]]` from column 0, in that order;
  `lengths[e]` is example e's token count."""

  row_splits: np.ndarray  # int64 [num_rows + 1]
  examples: np.ndarray  # int64 [num_examples], row by row
  lengths: np.ndarray  # int32 [num_examples], indexed by example
  max_seq_len: int

  @property
  def num_rows(self) -> int:
    return int(self.row_splits.shape[0] - 1)


def example_lengths(input_ids, pad_id: int) -> np.ndarray:
  """int32 [num_examples]: each right-padded example's length (to its last token that is not pad)."""
  real = np.asarray(input_ids) != pad_id
  # argmax over the reversed row finds the last real token; an all-padding row has length 0.
  last = real.shape[1] - np.argmax(real[:, ::-1], axis=1)
  return np.where(real.any(axis=1), last, 0).astype(np.int32)


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
  """Bins (lists of positions into `lengths`) by best-fit decreasing; ties go to the earlier example
  and bin."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  shortest = min(lengths)
  bins: list[list[int]] = []
  room: list[tuple[int, int]] = []  # (free columns, bin), sorted: the best fit is a bisection
  for i in order:
    length = lengths[i]
    k = bisect.bisect_left(room, (length, -1))
    if k < len(room):
      free, b = room.pop(k)
    else:
      free, b = capacity, len(bins)
      bins.append([])
    bins[b].append(i)
    free -= length
    if free >= shortest:  # a bin no remaining example fits into is closed
      bisect.insort(room, (free, b))
  return bins


def plan_rows(
    lengths: np.ndarray, max_seq_len: int, window: int = ROW_PACKING_WINDOW
) -> RowPacking:
  """Examples of these lengths (in [1, max_seq_len]: shards.load_split checks them) packed whole into
  rows, a pure function: in each window, those too long to share a row get their own (first), the
  rest go by best-fit decreasing."""
  lengths = np.asarray(lengths, dtype=np.int32)
  row_sizes, examples = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]  # per window
  for start in range(0, lengths.size, window):
    chunk = lengths[start : start + window]
    alone = chunk + chunk.min() > max_seq_len
    singles = np.flatnonzero(alone)
    row_sizes.append(np.ones(singles.size, np.int64))
    examples.append(singles + start)
    shared = np.flatnonzero(~alone)
    if shared.size:
      bins = _best_fit_decreasing(chunk[shared].tolist(), max_seq_len)
      row_sizes.append(np.array([len(b) for b in bins], np.int64))
      examples.append(np.concatenate([np.sort(shared[b]) for b in bins]) + start)
  row_splits = np.concatenate([[0], np.cumsum(np.concatenate(row_sizes))]).astype(np.int64)
  return RowPacking(
      row_splits, np.concatenate(examples).astype(np.int64), lengths, int(max_seq_len)
  )


def assemble_rows(
    packing: RowPacking, rows: np.ndarray, input_ids, token_type_ids, pad_id: int
) -> dict[str, np.ndarray]:
  """The packed rows `rows` as int32 [len(rows), max_seq_len] arrays: input_ids, token_type_ids,
  attention_mask, segment_ids (1, 2, ... for the row's examples) and position_ids (per example),
  0 (pad_id) on padding."""
  rows = np.asarray(rows, dtype=np.int64)
  batch, seq = rows.shape[0], packing.max_seq_len
  first = packing.row_splits[rows]
  counts = packing.row_splits[rows + 1] - first
  # Example k of the batch: its index and its 1-based segment number within its row.
  row_start = np.cumsum(counts) - counts
  segment = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(row_start, counts)
  examples = packing.examples[np.repeat(first, counts) + segment]
  lengths = packing.lengths[examples]
  # The batch's tokens in order fill the rows' first columns without gaps: two boolean masks (the
  # examples' real tokens, the rows' filled columns) place them with no per-token index arithmetic.
  source = np.arange(input_ids.shape[1]) < lengths[:, None]
  row_tokens = np.add.reduceat(lengths, row_start) if batch else np.zeros(0, np.int32)
  target = np.arange(seq) < row_tokens[:, None]
  out = {
      "input_ids": np.full((batch, seq), pad_id, np.int32),
      "token_type_ids": np.zeros((batch, seq), np.int32),
      "attention_mask": target.astype(np.int32),
      "segment_ids": np.zeros((batch, seq), np.int32),
      "position_ids": np.zeros((batch, seq), np.int32),
  }
  out["input_ids"][target] = np.asarray(input_ids[examples])[source]
  out["token_type_ids"][target] = np.asarray(token_type_ids[examples])[source]
  out["segment_ids"][target] = np.repeat(segment + 1, lengths)
  out["position_ids"][target] = np.nonzero(source)[1]
  return out
