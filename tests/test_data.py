"""Tests for electra_jax.data: corpus extraction, tokenizer, packing, caching and batching.

Pipeline tests share one small cached build (120 documents, 400-piece vocab) per module.
"""

import ast
import io
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece as spm

from conftest import base
from electra_jax.data import (
    SPECIAL_TOKENS,
    PretrainingData,
    SentencePieceTokenizer,
    builtin_documents,
    get_batch,
    load_pretraining_data,
    train_sentencepiece,
)
from electra_jax.data import corpus, prepare
from electra_jax.data.config import check_config
from electra_jax.data.packing import pack_documents

CLS, SEP, PAD = 2, 3, 0


def _pack(documents, max_seq_len, seed=0, **kwargs):
  special = SimpleNamespace(cls_id=CLS, sep_id=SEP, pad_id=PAD)
  return pack_documents(documents, max_seq_len, special, seed, **kwargs)


def _random_documents(rng, num_documents=40):
  """Documents whose tokens encode their document (1000 * (d + 1) + k) and are increasing."""
  documents = []
  for d in range(num_documents):
    next_token = 1000 * (d + 1)
    document = []
    for _ in range(rng.randint(1, 12)):
      length = rng.choice([0, 1, 2, 5, 9, 20, 40])
      document.append(list(range(next_token, next_token + length)))
      next_token += length
    documents.append(document)
  return documents


def _row_tokens(row):
  """Non-special, non-padding tokens of an example row."""
  return [int(t) for t in row if t not in (CLS, SEP, PAD)]


# ---------------------------------------------------------------- packing


def test_pack_hand_worked_example():
  documents = [
      [[10, 11], [12], [13, 14, 15], [16]],
      [[20, 21, 22, 23, 24, 25], [], [26, 27, 28], [29]],
  ]
  packed = _pack(documents, 8, single_segment_prob=0.0, short_seq_prob=0.0)
  # Doc 1 ends with 7 buffered tokens; the A target is (8 - 3) // 2 = 2, so A = [10, 11]
  # and B = [12 .. 16] is cut to 8 - 2 - 3 = 3 tokens.
  # Doc 2 reaches 9 >= 8 tokens at [26, 27, 28]: A = the 6-token sentence, which leaves
  # no room for B; [29] then ends the document on its own.
  expected_ids = [
      [CLS, 10, 11, SEP, 12, 13, 14, SEP],
      [CLS, 20, 21, 22, 23, 24, 25, SEP],
      [CLS, 29, SEP, PAD, PAD, PAD, PAD, PAD],
  ]
  expected_types = [
      [0, 0, 0, 0, 1, 1, 1, 1],
      [0, 0, 0, 0, 0, 0, 0, 0],
      [0, 0, 0, 0, 0, 0, 0, 0],
  ]
  np.testing.assert_array_equal(packed["input_ids"], expected_ids)
  np.testing.assert_array_equal(packed["token_type_ids"], expected_types)
  assert packed["input_ids"].dtype == np.int32
  assert packed["token_type_ids"].dtype == np.int32


def test_pack_puts_sentences_that_fit_the_a_target_into_a():
  # max_seq_len 12 gives an A target of 4: [40] and [41, 42] (3 tokens) both fit in A.
  packed = _pack([[[40], [41, 42]]], 12, single_segment_prob=0.0, short_seq_prob=0.0)
  np.testing.assert_array_equal(packed["input_ids"], [[CLS, 40, 41, 42, SEP] + [PAD] * 7])
  np.testing.assert_array_equal(packed["token_type_ids"], [[0] * 12])


@pytest.mark.parametrize("seed", range(5))
def test_pack_invariants_on_random_documents(seed):
  rng = random.Random(seed)
  max_seq_len = 24
  packed = _pack(_random_documents(rng), max_seq_len, seed=seed, short_seq_prob=0.3)
  input_ids, token_types = packed["input_ids"], packed["token_type_ids"]
  assert input_ids.shape == token_types.shape
  assert input_ids.shape[1] == max_seq_len and input_ids.shape[0] > 0
  for row, types in zip(input_ids, token_types):
    length = int(np.count_nonzero(row != PAD))
    assert np.all(row[length:] == PAD), "padding must only be at the end"
    assert row[0] == CLS and row[length - 1] == SEP
    sep_positions = np.flatnonzero(row == SEP)
    assert len(sep_positions) in (1, 2)
    first_sep = sep_positions[0]
    assert np.all(types[: first_sep + 1] == 0), "[CLS] A [SEP] must be segment 0"
    assert np.all(types[first_sep + 1 : length] == 1), "B [SEP] must be segment 1"
    assert np.all(types[length:] == 0), "padding must be segment 0"
    if len(sep_positions) == 2:
      assert first_sep + 1 < sep_positions[1], "a B segment is never empty"
    tokens = _row_tokens(row)
    assert tokens, "an example has at least one real token"
    assert len({t // 1000 for t in tokens}) == 1, "an example mixes two documents"
    assert len(tokens) == len(set(tokens)), "a token appears once"
    segment_a, segment_b = tokens[: first_sep - 1], tokens[first_sep - 1 :]
    assert segment_a == sorted(segment_a) and segment_b == sorted(
        segment_b
    ), "segments keep text order"


def test_pack_rechecks_every_sentence_like_the_official_builder():
  s1, s2, s3 = list(range(100, 105)), list(range(200, 215)), [300, 301]
  outcomes = set()
  for seed in range(40):
    packed = _pack([[s1, s2, s3]], 40, seed=seed, single_segment_prob=0.0, short_seq_prob=0.0)
    row, types = packed["input_ids"][0], packed["token_type_ids"][0]
    real = row != PAD
    segment_a = tuple(
        t for t, ty, r in zip(row, types, real) if r and ty == 0 and t not in (CLS, SEP)
    )
    segment_b = tuple(t for t, ty, r in zip(row, types, real) if r and ty == 1 and t != SEP)
    outcomes.add((segment_a, segment_b))
  # A's target is (40 - 3) // 2 = 18. s2 would overfill A: it joins on a coin flip (then s3,
  # with A at 20, goes to B), or goes to B, after which the short s3 still fits A.
  assert outcomes == {(tuple(s1 + s2), tuple(s3)), (tuple(s1 + s3), tuple(s2))}


@pytest.mark.parametrize("seed", range(5))
def test_pack_keeps_every_token_when_nothing_needs_truncation(seed):
  rng = random.Random(seed)
  max_seq_len = 64
  documents = [
      [
          list(range(1000 * (d + 1) + 10 * s, 1000 * (d + 1) + 10 * s + rng.randint(0, 6)))
          for s in range(8)
      ]
      for d in range(30)
  ]
  # Each document holds at most 48 <= 64 - 3 tokens, so it becomes one untruncated example.
  packed = _pack(documents, max_seq_len, seed=seed, short_seq_prob=0.0)
  output_tokens = [t for row in packed["input_ids"] for t in _row_tokens(row)]
  input_tokens = [t for document in documents for sentence in document for t in sentence]
  assert sorted(output_tokens) == sorted(input_tokens)  # all distinct: each kept exactly once


def test_pack_single_segment_prob_one_never_makes_segment_b():
  packed = _pack(_random_documents(random.Random(0)), 32, single_segment_prob=1.0)
  assert np.all(packed["token_type_ids"] == 0)
  assert np.all(np.count_nonzero(packed["input_ids"] == SEP, axis=1) == 1)


def test_pack_short_seq_prob_makes_shorter_examples():
  long_document = [[[t] for t in range(100, 2100)]]
  full = _pack(long_document, 32, single_segment_prob=0.0, short_seq_prob=0.0)
  short = _pack(long_document, 32, single_segment_prob=0.0, short_seq_prob=1.0)
  full_lengths = np.count_nonzero(full["input_ids"], axis=1)
  short_lengths = np.count_nonzero(short["input_ids"], axis=1)
  assert np.all(full_lengths[:-1] == 32)
  assert short_lengths.mean() < 0.8 * full_lengths.mean()


def test_pack_is_deterministic_for_a_seed():
  documents = _random_documents(random.Random(7))
  first = _pack(documents, 20, seed=3, short_seq_prob=0.5)
  again = _pack(documents, 20, seed=3, short_seq_prob=0.5)
  other = _pack(documents, 20, seed=4, short_seq_prob=0.5)
  np.testing.assert_array_equal(first["input_ids"], again["input_ids"])
  np.testing.assert_array_equal(first["token_type_ids"], again["token_type_ids"])
  assert first["input_ids"].shape != other["input_ids"].shape or not np.array_equal(
      first["input_ids"], other["input_ids"]
  )


@pytest.mark.fault
def test_a_max_seq_len_too_short_to_pack_is_refused():
  with pytest.raises(ValueError, match="data.max_seq_len=4 must be >= 5"):
    check_config(_config("cache", max_seq_len=4))


def test_pack_empty_input_gives_empty_arrays():
  packed = _pack([[], [[]]], 16)
  assert packed["input_ids"].shape == (0, 16)
  assert packed["token_type_ids"].shape == (0, 16)


# ---------------------------------------------------------------- corpus


def test_split_sentences_drops_code_and_normalizes_whitespace():
  text = (
      "Return the  sum of\n   the values.\n"
      "\n"
      "Example heading\n"
      "***************\n"
      "\n"
      ">>> add(1, 2)\n"
      "3\n"
      "\n"
      "   {1: [2, 3], 4: (5, 6)}\n"
  )
  assert corpus.split_sentences(text) == ["Return the sum of the values.", "Example heading"]


def test_builtin_corpus_is_large_deterministic_and_clean():
  documents = builtin_documents()
  num_bytes = sum(len(s.encode()) for document in documents for s in document)
  # Python 3.11 gives ~580 documents and ~1.9 MB; the bounds leave room for other versions.
  assert len(documents) > 400
  assert num_bytes > 1_000_000
  # The truncated path parses afresh, so equality also shows parsing is deterministic.
  assert builtin_documents(50) == documents[:50]
  for document in documents:
    assert document
    for sentence in document:
      assert sentence and sentence == " ".join(sentence.split())
      assert not sentence.startswith(">>>")
  all_text = " ".join(s for document in documents for s in document)
  # Help topics are part of the corpus, not only docstrings.
  assert 'The "if" statement is used for conditional execution' in all_text


@pytest.mark.fault
def test_a_spurious_ast_depth_error_does_not_drop_a_file(monkeypatch):
  # CPython 3.11's AST builder can fail a parse when another thread parses at the same moment.
  path = os.path.join(corpus.stdlib_root(), "textwrap.py")
  expected = ast.dump(corpus._parse(path))
  real_parse, calls = ast.parse, []

  def flaky_parse(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
      raise SystemError("AST constructor recursion depth mismatch (before=177, after=230)")
    return real_parse(*args, **kwargs)

  monkeypatch.setattr(ast, "parse", flaky_parse)
  assert ast.dump(corpus._parse(path)) == expected
  assert len(calls) == 2
  monkeypatch.setattr(ast, "parse", lambda *a, **k: (_ for _ in ()).throw(SystemError("always")))
  with pytest.raises(SystemError, match="always"):  # a lasting failure is not a missing file
    corpus._parse(path)


@pytest.mark.fault
def test_a_negative_max_documents_is_refused():
  with pytest.raises(ValueError, match="max_documents.*-1"):
    check_config(_config("cache", max_documents=-1))


# ---------------------------------------------------------------- tokenizer


def _train_plain_spm(path, **kwargs):
  """A sentencepiece model trained with sentencepiece's own defaults (no ELECTRA tokens)."""
  model = io.BytesIO()
  sentences = [s for document in builtin_documents(20) for s in document]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, vocab_size=200, minloglevel=2, **kwargs
  )
  with open(path, "wb") as f:
    f.write(model.getvalue())
  return str(path)


def test_tokenizer_special_ids_and_round_trip(train_data):
  tokenizer = train_data.tokenizer
  assert tokenizer.vocab_size == 400
  assert [tokenizer.id_to_piece(i) for i in range(5)] == list(SPECIAL_TOKENS)
  assert (
      tokenizer.pad_id,
      tokenizer.unk_id,
      tokenizer.cls_id,
      tokenizer.sep_id,
      tokenizer.mask_id,
  ) == (
      0,
      1,
      2,
      3,
      4,
  )
  text = "Return the number of items in the list, and raise an error if it is empty."
  ids = tokenizer.encode(text)
  assert tokenizer.unk_id not in ids
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == text
  texts = [text, "Open the file.", ""]
  assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
  # The special tokens are single pieces even when they appear in text.
  assert tokenizer.encode("[MASK]")[-1] == tokenizer.mask_id
  assert len(tokenizer.fingerprint) == 16


@pytest.mark.fault
def test_tokenizer_refuses_model_without_special_tokens(tmp_path):
  path = _train_plain_spm(tmp_path / "plain.model")
  with pytest.raises(
      ValueError, match=r"plain\.model has \['<unk>', '<s>', '</s>'.* ELECTRA needs \['\[PAD\]'"
  ):
    SentencePieceTokenizer(path)


@pytest.mark.fault
def test_tokenizer_refuses_misplaced_special_token(tmp_path):
  path = _train_plain_spm(
      tmp_path / "swapped.model",
      pad_id=0,
      pad_piece="[PAD]",
      unk_id=1,
      unk_piece="[UNK]",
      bos_id=-1,
      eos_id=-1,
      user_defined_symbols=["[SEP]", "[CLS]", "[MASK]"],
  )
  with pytest.raises(
      ValueError, match=r"swapped\.model has \['\[PAD\]', '\[UNK\]', '\[SEP\]', '\[CLS\]'"
  ):
    SentencePieceTokenizer(path)


@pytest.mark.fault
def test_train_sentencepiece_errors_are_actionable(tmp_path):
  sentences = ["a tiny corpus", "with few pieces"]
  with pytest.raises(ValueError, match="vocabulary of 500 pieces.*Lower the vocab size"):
    train_sentencepiece(sentences, str(tmp_path / "big.model"), vocab_size=500)
  assert os.listdir(tmp_path) == [], "a failed training run must leave no files behind"
  with pytest.raises(ValueError, match="data.spm_model_type='word' is not one of"):
    check_config(_config(tmp_path, spm_model_type="word"))
  with pytest.raises(ValueError, match="data.spm_vocab_size=5 must be > 5"):
    check_config(_config(tmp_path, spm_vocab_size=5))


@pytest.mark.fault
def test_lines_over_sentencepieces_limit_are_trained_on_in_pieces(tmp_path):
  """Sentencepiece silently drops sentences over its byte limit (16 KiB as we call it); the
  readers keep lines up to 64 Ki characters. A corpus of only such lines used to stop
  training with sentencepiece's internal error; now every word of it is in the vocabulary."""
  from electra_jax.data.tokenizer import _MAX_SENTENCE_BYTES, UNK_ID, _within_limit  # noqa: PLC0415

  rng = np.random.default_rng(0)
  words = ["naïve", "café", "über", "straße", "ж", "日本"] + [f"w{i}" for i in range(40)]
  lines = [" ".join(rng.choice(words, 9000)) for _ in range(3)]  # ~50 k characters each
  assert all(len(line.encode()) > _MAX_SENTENCE_BYTES for line in lines)
  pieces = list(_within_limit(lines[0]))
  assert len(pieces) > 1 and all(len(p.encode()) <= _MAX_SENTENCE_BYTES for p in pieces)
  assert " ".join(pieces).split() == lines[0].split()  # cut only between words
  assert list(_within_limit("".join(["é"] * 20000)))[0] == "é" * (
      _MAX_SENTENCE_BYTES // 4
  )  # no space: cut anyway
  tokenizer = SentencePieceTokenizer(
      train_sentencepiece(lines, str(tmp_path / "long.model"), vocab_size=45)
  )
  ids = tokenizer.encode(" ".join(words))
  assert UNK_ID not in ids and tokenizer.decode(ids) == " ".join(words)


_TRAIN_CAPPED = """
import hashlib, sys
from electra_jax.data import builtin_documents, tokenizer
tokenizer._MAX_TRAINING_SENTENCES = 300  # stands for the 1M cap of a big corpus
sentences = [s for d in builtin_documents(60) for s in d]
assert len(sentences) > 1000
tokenizer.train_sentencepiece(sentences, sys.argv[1], vocab_size=300)
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())
"""


def test_sentencepiece_on_a_corpus_over_the_sentence_cap_is_the_same_in_every_process(tmp_path):
  # Each host of a job (and each rebuild of a cache) trains its own model when no
  # spm_model_file is given: a corpus over the cap must still give one model, or hosts
  # tokenize differently and their rows are not one global batch.
  digests = set()
  for run in range(2):
    result = subprocess.run(
        [sys.executable, "-c", _TRAIN_CAPPED, str(tmp_path / f"{run}.model")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    digests.add(result.stdout.split()[-1])
  assert len(digests) == 1, "two processes trained different models on the same sentences"


def test_train_sentencepiece_bpe_writes_only_the_model(tmp_path):
  sentences = [s for document in builtin_documents(20) for s in document]
  out = train_sentencepiece(
      sentences, str(tmp_path / "bpe.model"), vocab_size=300, model_type="bpe"
  )
  assert os.listdir(tmp_path) == ["bpe.model"], "no temporary files may be left behind"
  tokenizer = SentencePieceTokenizer(out)
  assert tokenizer.vocab_size == 300
  assert tokenizer.decode(tokenizer.encode("the file")) == "the file"


# ---------------------------------------------------------------- pipeline


def _config(cache_dir, **overrides):
  """configs/base.py's data group (every config is completed with it) for a slice of the built-in
  corpus."""
  config = base.get_config().data
  config.update(max_seq_len=64, cache_dir=str(cache_dir), spm_vocab_size=400, max_documents=120)
  config.update(eval_fraction=0.1)
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("electra_cache")


@pytest.fixture(scope="module")
def train_data(cache_dir):
  return load_pretraining_data(_config(cache_dir), "train")


def _cache_files(cache_dir):
  return sorted(
      os.path.relpath(os.path.join(root, name), cache_dir)
      for root, _, names in os.walk(cache_dir)
      for name in names
  )


def test_load_pretraining_data_shapes_and_content(train_data):
  assert train_data.input_ids.dtype == np.int32 and train_data.token_type_ids.dtype == np.int32
  assert train_data.input_ids.shape == train_data.token_type_ids.shape
  assert train_data.input_ids.shape[1] == 64 and train_data.num_examples > 100
  input_ids = np.asarray(train_data.input_ids)
  assert np.all(input_ids[:, 0] == train_data.tokenizer.cls_id)
  assert input_ids.max() < train_data.tokenizer.vocab_size
  assert 0 < train_data.num_tokens <= input_ids.size
  assert train_data.num_tokens == int(np.count_nonzero(input_ids))
  assert "max_seq_len:64" in train_data.fingerprint
  assert train_data.tokenizer.fingerprint in train_data.fingerprint
  text = train_data.tokenizer.decode(train_data.input_ids[0])
  assert sum(ch.isalpha() for ch in text) > 0.5 * len(
      text
  ), f"decoded example is not prose: {text!r}"


def test_load_pretraining_data_second_call_uses_cache(cache_dir, train_data, monkeypatch):
  files_before = _cache_files(cache_dir)
  for builder in ("prepare_config", "train_corpus_tokenizer"):
    monkeypatch.setattr(
        prepare, builder, lambda *a, name=builder, **k: pytest.fail(f"{name} ran again")
    )
  again = load_pretraining_data(_config(cache_dir), "train")
  assert _cache_files(cache_dir) == files_before, "a cached load must not rebuild anything"
  np.testing.assert_array_equal(again.input_ids, train_data.input_ids)
  np.testing.assert_array_equal(again.token_type_ids, train_data.token_type_ids)
  assert again.fingerprint == train_data.fingerprint
  assert all(not os.path.basename(f).startswith(".tmp") for f in files_before), files_before
  assert all(f.endswith((".npy", ".model", ".json", ".lock")) for f in files_before), files_before


@pytest.mark.fault
def test_damaged_cache_is_rebuilt_identically(cache_dir, train_data):
  [array_path] = [
      f
      for f in _cache_files(cache_dir)
      if f.startswith(os.path.join("builtin", ""))
      and os.path.basename(f) == "train-00000.npy"
      and "len64" in f
  ]
  os.remove(os.path.join(cache_dir, array_path))
  rebuilt = load_pretraining_data(_config(cache_dir), "train")
  np.testing.assert_array_equal(rebuilt.input_ids, train_data.input_ids)
  assert rebuilt.fingerprint == train_data.fingerprint


def test_train_and_eval_splits_share_no_document(cache_dir, train_data):
  documents = builtin_documents(120)
  splits = {"train": [], "eval": []}
  for index, document in enumerate(documents):
    splits["eval" if prepare.is_eval_document(index, 0.1) else "train"].append(document)
  assert len(splits["eval"]) == 12 and len(splits["train"]) == 108
  train_texts = {"\n".join(d) for d in splits["train"]}
  assert not any("\n".join(d) in train_texts for d in splits["eval"])

  eval_data = load_pretraining_data(_config(cache_dir), "eval")
  assert eval_data.num_examples > 0
  assert eval_data.tokenizer.fingerprint == train_data.tokenizer.fingerprint
  assert eval_data.fingerprint != train_data.fingerprint
  train_rows = {row.tobytes() for row in train_data.input_ids}
  assert not any(row.tobytes() in train_rows for row in eval_data.input_ids)


def test_other_max_seq_len_reuses_the_tokenizer(cache_dir, train_data):
  data = load_pretraining_data(_config(cache_dir, max_seq_len=32), "train")
  assert data.input_ids.shape[1] == 32
  assert data.tokenizer.fingerprint == train_data.tokenizer.fingerprint
  assert data.num_examples > train_data.num_examples
  assert data.fingerprint != train_data.fingerprint


@pytest.mark.fault
def test_unknown_source_lists_supported_sources(tmp_path):
  with pytest.raises(
      ValueError, match=r"'c4'.*\['builtin', 'text', 'jsonl', 'tfds', 'hf_datasets', 'prepared'\]"
  ):
    load_pretraining_data(_config(tmp_path, source="c4"))


@pytest.mark.fault
def test_eval_split_with_zero_eval_fraction_is_refused(tmp_path):
  with pytest.raises(
      ValueError, match=r"data.eval_fraction=0 holds out no documents.*every_steps=0"
  ):
    check_config(_config(tmp_path, eval_fraction=0.0), eval_every_steps=100)
  check_config(_config(tmp_path, eval_fraction=0.0), eval_every_steps=0)
  with pytest.raises(ValueError, match=r"eval split .* has no examples \(eval_fraction=0.0"):
    load_pretraining_data(_config(tmp_path, eval_fraction=0.0), "eval")


# ---------------------------------------------------------------- batching


def _indexed_data(tokenizer, num_examples):
  """Data whose row i carries the unique token i + 10, so batches reveal their row indices."""
  input_ids = np.zeros((num_examples, 6), dtype=np.int32)
  input_ids[:, 0] = tokenizer.cls_id
  input_ids[:, 1] = np.arange(num_examples) + 10
  input_ids[:, 2] = tokenizer.sep_id
  return PretrainingData(tokenizer, input_ids, np.zeros_like(input_ids), "indexed")


def _batch_rows(batch):
  return (batch["input_ids"][:, 1] - 10).tolist()


def test_get_batch_visits_each_example_once_per_epoch(train_data):
  num_examples, batch_size = 37, 8
  data = _indexed_data(train_data.tokenizer, num_examples)
  stream = []
  for step in range(10):  # 80 positions: two full epochs, with a batch crossing each boundary
    stream += _batch_rows(get_batch(data, step, batch_size, seed=5))
  first_epoch, second_epoch = stream[:num_examples], stream[num_examples : 2 * num_examples]
  assert sorted(first_epoch) == list(range(num_examples))
  assert sorted(second_epoch) == list(range(num_examples))
  assert first_epoch != second_epoch, "each epoch must be shuffled differently"
  assert first_epoch != list(range(num_examples)), "examples must be shuffled"


def test_get_batch_is_a_pure_function_of_its_arguments(train_data):
  out_of_order = get_batch(train_data, 7, 16, seed=1)
  for step in range(7):
    get_batch(train_data, step, 16, seed=1)
  in_order = get_batch(train_data, 7, 16, seed=1)
  for key in ("input_ids", "token_type_ids", "attention_mask"):
    np.testing.assert_array_equal(out_of_order[key], in_order[key])
  other_seed = get_batch(train_data, 7, 16, seed=2)
  assert not np.array_equal(other_seed["input_ids"], in_order["input_ids"])


def test_get_batch_process_slices_partition_the_global_batch(train_data):
  data = _indexed_data(train_data.tokenizer, 50)
  for step in (0, 3, 12):
    whole = get_batch(data, step, 16, seed=0)
    for process_count in (2, 4):
      parts = [
          get_batch(data, step, 16, seed=0, process_index=p, process_count=process_count)
          for p in range(process_count)
      ]
      for part in parts:
        assert part["input_ids"].shape == (16 // process_count, 6)
      for key in whole:
        np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), whole[key])


def test_get_batch_keys_shapes_and_attention_mask(train_data):
  batch = get_batch(train_data, 0, 8, seed=0)
  assert set(batch) == {"input_ids", "token_type_ids", "attention_mask"}
  for array in batch.values():
    assert array.shape == (8, 64) and array.dtype == np.int32
  np.testing.assert_array_equal(batch["attention_mask"], (batch["input_ids"] != 0).astype(np.int32))
  assert batch["attention_mask"].sum() > 0


@pytest.mark.fault
def test_get_batch_errors(train_data):
  with pytest.raises(ValueError, match="a global batch of 10 rows from .* over 4 processes"):
    get_batch(train_data, 0, 10, seed=0, process_index=0, process_count=4)
  empty = PretrainingData(
      train_data.tokenizer, np.zeros((0, 8), np.int32), np.zeros((0, 8), np.int32), "empty"
  )
  with pytest.raises(ValueError, match="a global batch of 8 rows from 0 over 1 processes"):
    get_batch(empty, 0, 8, seed=0)
  with pytest.raises(ValueError, match="process 2 of 2, step -1"):
    get_batch(train_data, -1, 8, seed=0, process_index=2, process_count=2)
