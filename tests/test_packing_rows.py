"""Data side of data.pack_rows: several whole examples per row, with segment ids and positions.

A packed batch must hold every example of an epoch exactly once, each unchanged (its tokens and
token types, positions 0..n-1), and must spend less of the row on padding than one example per
row. Hand-worked plans pin the algorithm; the pipeline tests run on the session's tiny built-in
corpus (conftest), and on prepared shards of it.
"""

import collections
import os

import ml_collections
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax.errors import ConfigError
from electra_jax.data import get_batch, load_pretraining_data, load_tokenizer, pipeline, prepare_data
from electra_jax.data.packing import assemble_rows, example_lengths, plan_rows
from electra_jax.data.pipeline import PretrainingData

PAD = 0
PACKED_KEYS = {"input_ids", "token_type_ids", "attention_mask", "segment_ids", "position_ids"}


def _real_token_fraction(plan):
  """Share of the packed rows' positions that hold tokens (1 - the padding share)."""
  return float(plan.lengths.sum(dtype=np.int64)) / max(1, plan.num_rows * plan.max_seq_len)


def _examples(lengths, max_seq_len):
  """Right-padded examples whose tokens name them (1000 * (e + 1) + position) and whose second
  half has token type 1, as [CLS] A [SEP] B [SEP] examples do."""
  input_ids = np.full((len(lengths), max_seq_len), PAD, np.int32)
  token_type_ids = np.zeros((len(lengths), max_seq_len), np.int32)
  for e, n in enumerate(lengths):
    input_ids[e, :n] = 1000 * (e + 1) + np.arange(n)
    token_type_ids[e, n // 2 : n] = 1
  return input_ids, token_type_ids


def _segments(batch):
  """(row, segment number, tokens, types, positions) of every example in a packed batch, after
  checking that the row's layout is consistent: segments 1, 2, ... side by side from column 0,
  positions 0..n-1 in each, attention on exactly the segments, padding (0 everywhere) after."""
  found = []
  for r, segment_row in enumerate(batch["segment_ids"]):
    real = segment_row > 0
    n_real = int(real.sum())
    assert real[:n_real].all(), "the examples fill the row from column 0, padding only after"
    np.testing.assert_array_equal(batch["attention_mask"][r], real.astype(np.int32))
    for key in ("input_ids", "token_type_ids", "position_ids"):
      assert not batch[key][r, n_real:].any(), f"{key} must be 0 on padding"
    numbers = segment_row[:n_real]
    assert numbers[0] == 1 and np.all(np.diff(numbers) >= 0) and np.all(np.diff(numbers) <= 1)
    for number in np.unique(numbers):
      columns = np.flatnonzero(segment_row == number)
      positions = batch["position_ids"][r, columns]
      np.testing.assert_array_equal(
          positions, np.arange(columns.size), "positions restart at each example"
      )
      tokens = tuple(batch["input_ids"][r, columns].tolist())
      found.append((r, int(number), tokens, tuple(batch["token_type_ids"][r, columns].tolist())))
  return found


def _real(input_ids, token_type_ids, pad_id):
  """(tokens, types) of each unpacked example, without its padding."""
  result = []
  for ids, types in zip(np.asarray(input_ids), np.asarray(token_type_ids)):
    n = int(np.count_nonzero(ids != pad_id))
    assert not (ids[n:] != pad_id).any(), "examples are right-padded"
    result.append((tuple(ids[:n].tolist()), tuple(types[:n].tolist())))
  return result


# ---------------------------------------------------------------- the plan


def test_plan_hand_worked_best_fit_decreasing():
  # Capacity 8, shortest example 2: example 2 (8 tokens) cannot share and gets a row first.
  # The rest, longest first: 6 (ex 4) opens bin A (2 free); 5 (ex 0) fits nowhere, opens bin B
  # (3 free); 3 (ex 1) fits B exactly (the tightest of A=2, B=3 that holds it); 2 (ex 3) fills A.
  plan = plan_rows(np.array([5, 3, 8, 2, 6]), 8, window=100)
  np.testing.assert_array_equal(plan.row_splits, [0, 1, 3, 5])
  np.testing.assert_array_equal(plan.examples, [2, 3, 4, 0, 1])
  assert plan.num_rows == 3 and _real_token_fraction(plan) == 1.0


def test_plan_windows_pack_separately_and_in_order():
  # Windows of 2: (4, 4) share a row; (4 | 7) cannot; the last window is the single 3.
  plan = plan_rows(np.array([4, 4, 4, 7, 3]), 8, window=2)
  rows = [plan.examples[a:b].tolist() for a, b in zip(plan.row_splits[:-1], plan.row_splits[1:])]
  assert rows == [[0, 1], [3], [2], [4]]


def test_assemble_hand_worked_row():
  input_ids, token_type_ids = _examples([5, 3, 8, 2, 6], 8)
  plan = plan_rows(np.array([5, 3, 8, 2, 6]), 8, window=100)
  batch = assemble_rows(plan, np.array([1, 2]), input_ids, token_type_ids, PAD)
  assert set(batch) == PACKED_KEYS and all(
      a.dtype == np.int32 and a.shape == (2, 8) for a in batch.values()
  )
  # Row 1 = example 3 (2 tokens) then example 4 (6 tokens); row 2 = example 0 then example 1.
  np.testing.assert_array_equal(
      batch["input_ids"][0], [4000, 4001, 5000, 5001, 5002, 5003, 5004, 5005]
  )
  np.testing.assert_array_equal(batch["token_type_ids"][0], [0, 1, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 2, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(batch["position_ids"][0], [0, 1, 0, 1, 2, 3, 4, 5])
  np.testing.assert_array_equal(
      batch["input_ids"][1], [1000, 1001, 1002, 1003, 1004, 2000, 2001, 2002]
  )
  np.testing.assert_array_equal(batch["segment_ids"][1], [1, 1, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(batch["position_ids"][1], [0, 1, 2, 3, 4, 0, 1, 2])
  np.testing.assert_array_equal(batch["attention_mask"], np.ones((2, 8)))


@pytest.mark.parametrize("window", [1, 3, 16, 10_000])
def test_random_plans_hold_every_example_once_unchanged(window):
  rng = np.random.default_rng(window)
  max_seq_len = 24
  lengths = rng.integers(1, max_seq_len + 1, size=300)
  lengths[rng.random(300) < 0.3] = max_seq_len
  input_ids, token_type_ids = _examples(lengths, max_seq_len)
  plan = plan_rows(lengths, max_seq_len, window=window)
  assert sorted(plan.examples.tolist()) == list(range(300)), "every example in exactly one row"
  per_row = np.add.reduceat(lengths[plan.examples], plan.row_splits[:-1])
  assert per_row.max() <= max_seq_len
  assert plan_rows(lengths, max_seq_len, window=window).examples.tolist() == plan.examples.tolist()
  # Rows in a shuffled order, as get_batch asks for them.
  order = rng.permutation(plan.num_rows)
  batch = assemble_rows(plan, order, input_ids, token_type_ids, PAD)
  segments = _segments(batch)
  assert len(segments) == 300
  want = {
      e: (tuple(input_ids[e, :n].tolist()), tuple(token_type_ids[e, :n].tolist()))
      for e, n in enumerate(lengths)
  }
  for r, number, tokens, types in segments:
    example = tokens[0] // 1000 - 1
    # The row's segment number k is its k-th example, in the plan's order.
    assert plan.examples[plan.row_splits[order[r]] + number - 1] == example
    assert (tokens, types) == want[example]
  if window == 1:
    assert plan.num_rows == 300
  else:
    assert _real_token_fraction(plan) > lengths.sum() / (300 * max_seq_len)


def test_example_lengths_keep_inner_padding():
  input_ids, _ = _examples([3, 1, 7, 5, 2], 7)
  input_ids[3, 2] = PAD  # a pad id inside an example keeps the example whole
  np.testing.assert_array_equal(example_lengths(input_ids, PAD), [3, 1, 7, 5, 2])


# ---------------------------------------------------------------- the pipeline


def _config(pack_rows, **overrides):
  config = tiny_config(**overrides)
  config.data.pack_rows = pack_rows
  return config


@pytest.mark.fault
def test_pack_rows_must_be_a_bool():
  # base.py types the field (ml_collections refuses "yes" there); a config of another origin
  # reaches the pipeline untyped.
  data_config = ml_collections.ConfigDict(dict(tiny_config().data.to_dict(), pack_rows="yes"))
  with pytest.raises(ConfigError, match="data.pack_rows='yes' is not one of \\[False, True\\]"):
    load_pretraining_data(data_config)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_packed_epoch_holds_every_example_once_with_less_padding(split):
  unpacked = load_pretraining_data(_config(False).data, split)
  packed = load_pretraining_data(_config(True).data, split)
  pad_id = packed.tokenizer.pad_id
  assert unpacked.packing is None and unpacked.num_rows == unpacked.num_examples
  np.testing.assert_array_equal(packed.input_ids, unpacked.input_ids)  # the same stored examples
  assert packed.fingerprint != unpacked.fingerprint, "a checkpoint must not resume across pack_rows"
  assert packed.fingerprint.startswith(unpacked.fingerprint)

  # One epoch of packed rows, in get_batch's order, holds each example exactly once.
  batch_size = 4
  steps = -(-packed.num_rows // batch_size)
  seen = []
  for step in range(steps):
    batch = get_batch(packed, step, batch_size, seed=7)
    assert set(batch) == PACKED_KEYS
    rows = _segments(batch)
    if (step + 1) * batch_size > packed.num_rows:  # the last batch wraps into epoch 1
      keep = packed.num_rows - step * batch_size
      rows = [entry for entry in rows if entry[0] < keep]
    seen += [(tokens, types) for _, _, tokens, types in rows]
  examples = _real(unpacked.input_ids, unpacked.token_type_ids, pad_id)
  assert collections.Counter(seen) == collections.Counter(examples)

  # Less padding: the same tokens in fewer rows.
  seq = packed.max_seq_len
  tokens = sum(len(tokens) for tokens, _ in seen)
  assert tokens == unpacked.num_tokens
  assert _real_token_fraction(packed.packing) == pytest.approx(tokens / (packed.num_rows * seq))
  if split == "train":
    assert packed.num_rows < unpacked.num_rows
    assert _real_token_fraction(packed.packing) > tokens / (unpacked.num_rows * seq)
  else:  # two held-out documents, whose short examples may have nothing to share a row with
    assert packed.num_rows <= unpacked.num_rows


def test_unpacked_batches_keep_their_keys_and_processes_split_packed_batches():
  unpacked = load_pretraining_data(_config(False).data)
  assert set(get_batch(unpacked, 0, 8, seed=1)) == {"input_ids", "token_type_ids", "attention_mask"}
  packed = load_pretraining_data(_config(True).data)
  for step in (0, 5):
    whole = get_batch(packed, step, 8, seed=1)
    parts = [get_batch(packed, step, 8, seed=1, process_index=p, process_count=2) for p in range(2)]
    for key in whole:
      np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), whole[key])
    np.testing.assert_array_equal(
        get_batch(packed, step, 8, seed=1)["input_ids"], whole["input_ids"]
    )


def test_prepared_shards_give_the_cached_packed_batches(tmp_path):
  # Both paths share one tokenizer, as a prepared directory and a cache of the same config do.
  model = load_tokenizer(tiny_config().data).model_path
  overrides = {
      "data.spm_model_file": model,
      "data.shard_documents": 25,
      "data.prepared_dir": str(tmp_path / "prepared"),
  }
  prepare_data(_config(True, **overrides).data, num_workers=0)
  for split in ("train", "eval"):
    cached = load_pretraining_data(_config(True, **overrides).data, split)
    prepared = load_pretraining_data(
        _config(True, **overrides, **{"data.source": "prepared"}).data, split
    )
    assert isinstance(prepared, PretrainingData) and len(prepared.input_ids._shards) > 1
    assert prepared.fingerprint == cached.fingerprint
    unpacked = load_pretraining_data(
        _config(False, **overrides, **{"data.source": "prepared"}).data, split
    )
    assert unpacked.fingerprint != prepared.fingerprint
    np.testing.assert_array_equal(prepared.packing.row_splits, cached.packing.row_splits)
    np.testing.assert_array_equal(prepared.packing.examples, cached.packing.examples)
    for step in (0, 3):
      ours, theirs = get_batch(prepared, step, 8, seed=2), get_batch(cached, step, 8, seed=2)
      assert set(ours) == PACKED_KEYS
      for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key])
    every_row = pipeline.get_rows(prepared, np.arange(prepared.num_rows))
    assert sum(len(t) for _, _, t, _ in _segments(every_row)) == prepared.num_tokens
    # The plan came from the shards' lengths files, which hold what scanning the rows gives.
    np.testing.assert_array_equal(prepared.packing.lengths, example_lengths(cached.input_ids, PAD))
  for lengths_file in (tmp_path / "prepared").glob("*.lengths.npy"):
    os.remove(lengths_file)  # unpacked training reads no lengths files
  load_pretraining_data(_config(False, **overrides, **{"data.source": "prepared"}).data)


@pytest.mark.fault
def test_prepare_rebuilds_a_damaged_lengths_file(tmp_path):
  model = load_tokenizer(tiny_config().data).model_path
  overrides = {
      "data.spm_model_file": model,
      "data.shard_documents": 40,
      "data.prepared_dir": str(tmp_path),
  }
  config = _config(True, **overrides).data
  first = prepare_data(config, num_workers=0)
  damaged = tmp_path / first["shards"][1]["splits"]["train"]["lengths_file"]
  original = damaged.read_bytes()
  damaged.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size, other bytes
  # The last length's high byte: it now exceeds max_seq_len, refused before rows are planned.
  prepared = _config(True, **overrides, **{"data.source": "prepared"}).data
  with pytest.raises(ConfigError, match=rf"Shard {damaged} lacks \d+ lengths in \[1, 32\]"):
    load_pretraining_data(prepared)
  again = prepare_data(config, num_workers=0)
  assert damaged.read_bytes() == original and again["shards"] == first["shards"]
