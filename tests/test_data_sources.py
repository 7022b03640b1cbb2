"""Tests for a user's own corpus (data.source "text" and "jsonl") and the WordPiece tokenizer.

Every fixture file is tiny and written into tmp_path; the WordPiece tokenizer is checked
against transformers' pure-Python BertTokenizerLegacy as an oracle.
"""

import json
import os
import re

import numpy as np
import pytest

from conftest import base
from electra_jax.errors import ConfigError
from electra_jax.data import (
    WordPieceTokenizer,
    get_rows,
    keep_tokenizer,
    load_pretraining_data,
    load_tokenizer,
    pipeline,
    prepare_data,
    prepare,
    workdir_tokenizer,
)
from electra_jax.data.config import read_config
from electra_jax.data import sources
from electra_jax.data.sources import resolve_files

# ---------------------------------------------------------------- fixtures


def read_documents(source, paths, text_field="text", max_documents=None):
  """The first documents of `paths` and their stats, logged as prepare_data logs them; the error
  it raises when none is left."""
  stats = sources.SourceStats()
  documents = list(sources.iter_documents(source, paths, text_field, stats))[:max_documents]
  sources.log_stats(source, stats)
  if not documents:
    config = {"source": source, "files": paths, "text_field": text_field}
    raise prepare.no_documents_error(config, stats)
  return documents, stats


def _write(path, text, mode="w"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if mode == "wb":
    with open(path, "wb") as f:
      f.write(text)
  else:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  return str(path)


# Words of the oracle vocab: English, accented and stripped forms, cased forms, CJK
# characters, punctuation and a few continuation pieces.
_ORACLE_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "run",
    "The",
    "Hello",
    "World",
    "Café",
    "café",
    "cafe",
    "déjà",
    "deja",
    "vu",
    "naïve",
    "naive",
    "Über",
    "über",
    "uber",
    "résumé",
    "resume",
    "我",
    "爱",
    "北",
    "京",
    "中",
    "文",
    ",",
    ".",
    "!",
    "?",
    "'",
    "-",
    "##s",
    "##ning",
    "##ing",
    "##n",
    "jump",
    "##é",
]


def _bert_like_vocab(path, words, drop=()):
  """A vocab.txt laid out like BERT's: [PAD] 0, [unusedK], [UNK] 100 .. [MASK] 103, then words."""
  lines = ["[PAD]"] + [f"[unused{k}]" for k in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  lines += list(words)
  lines = [line for line in lines if line not in drop]
  return _write(path, "\n".join(lines) + "\n")


def _config(tmp_path, **overrides):
  """configs/base.py's data group (every config is completed with it) for a tiny corpus."""
  config = base.get_config().data
  config.update(source="text", max_seq_len=32, cache_dir=str(tmp_path / "cache"))
  config.update(spm_vocab_size=60, max_documents=0, eval_fraction=0.0)
  config.update(overrides)
  return config


# ---------------------------------------------------------------- text source


def test_text_source_globs_and_blank_line_documents(tmp_path):
  _write(tmp_path / "corpus" / "b.txt", "Second file, first line.\nStill the same document.\n")
  _write(
      tmp_path / "corpus" / "a.txt", "  One sentence.  \nTwo sentence.\n\n\n\nA new document.\r\n"
  )
  _write(tmp_path / "extra" / "c.txt", "Third file.")
  _write(tmp_path / "corpus" / "skip.md", "not matched")
  files = f"{tmp_path}/corpus/*.txt, {tmp_path}/extra/c.txt,{tmp_path}/corpus/a.txt"
  paths = resolve_files(files)
  # Each glob's matches sorted, patterns in order, a file named twice read once.
  assert [os.path.relpath(p, tmp_path) for p in paths] == [
      "corpus/a.txt",
      "corpus/b.txt",
      "extra/c.txt",
  ]
  documents, stats = read_documents("text", paths)
  assert documents == [
      ["One sentence.", "Two sentence."],
      ["A new document."],
      ["Second file, first line.", "Still the same document."],
      ["Third file."],
  ]
  assert stats.num_documents == 4 and stats.problems == {}
  assert read_documents("text", paths, max_documents=2)[0] == documents[:2]


def test_text_source_recursive_glob(tmp_path):
  _write(tmp_path / "deep" / "x" / "y" / "doc.txt", "Deep down.")
  assert read_documents("text", resolve_files(f"{tmp_path}/**/*.txt"))[0] == [["Deep down."]]


# ---------------------------------------------------------------- jsonl source


def test_jsonl_source_documents_and_text_field(tmp_path):
  rows = [
      {"body": "First paragraph.\nSecond paragraph.\n\n  Third.  ", "id": 1},
      {"body": "Another document."},
      {"body": ""},  # no text: no document, not an error
  ]
  path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
  documents, stats = read_documents("jsonl", [path], text_field="body")
  assert documents == [["First paragraph.", "Second paragraph.", "Third."], ["Another document."]]
  assert "skipped_lines" not in stats.problems


def test_jsonl_records_holding_unicode_line_separators_are_kept(tmp_path):
  # JSON strings may hold U+2028, U+2029 and U+0085 unescaped (json.dumps(ensure_ascii=False)
  # writes them so); only "\n" ends a JSON Lines record. Inside the text they end sentences.
  rows = [
      {"text": "One.\u2028Two."},
      {"text": "Three\u2029four."},
      {"text": "Five\x85six."},
      {"text": "Seven."},
  ]
  lines = [json.dumps(r, ensure_ascii=False) for r in rows]
  path = _write(tmp_path / "sep.jsonl", "\n".join(lines) + "\n")
  # The same records after a line with a byte that is not UTF-8 (read line by line).
  bad = _write(
      tmp_path / "sep_bad.jsonl",
      b'{"text": "Caf\xe9."}\n' + "\n".join(lines).encode() + b"\r\n",
      "wb",
  )
  expected = [["One.", "Two."], ["Three", "four."], ["Five", "six."], ["Seven."]]
  documents, stats = read_documents("jsonl", [path])
  assert documents == expected and "skipped_lines" not in stats.problems
  documents, stats = read_documents("jsonl", [bad])
  assert documents == [["Caf\ufffd."]] + expected and "skipped_lines" not in stats.problems


@pytest.mark.fault
def test_jsonl_bad_lines_are_skipped_counted_and_located(tmp_path, caplog):
  lines = [
      json.dumps({"text": "Good one."}),
      "{not json",
      json.dumps({"other": "no text field"}),
      json.dumps(["a list"]),
      json.dumps({"text": 5}),
      json.dumps({"text": "Good two."}),
  ]
  path = _write(tmp_path / "bad.jsonl", "\n".join(lines))
  with caplog.at_level("WARNING"):
    documents, stats = read_documents("jsonl", [path])
  assert documents == [["Good one."], ["Good two."]]
  assert stats.problems["skipped_lines"] == 4
  assert stats.first_problems["skipped_lines"] == f"{path}:2: not valid JSON"
  assert "4 JSONL lines skipped" in caplog.text and f"{path}:2" in caplog.text


@pytest.mark.fault
def test_jsonl_without_usable_lines_is_refused(tmp_path):
  path = _write(tmp_path / "none.jsonl", '{"title": "x"}\n{"title": "y"}\n')
  with pytest.raises(
      ConfigError, match=r"no usable text.*none\.jsonl.*2 JSONL lines skipped.*'text'"
  ):
    read_documents("jsonl", [path])


# ---------------------------------------------------------------- bad input


@pytest.mark.fault
def test_non_utf8_bytes_are_replaced_and_counted(tmp_path, caplog):
  latin1 = "Good line.\nCaf\xe9 au lait.\n\nna\xefve \xff.\n".encode("latin-1")
  path = _write(tmp_path / "latin1.txt", latin1, "wb")
  with caplog.at_level("WARNING"):
    documents, stats = read_documents("text", [path])
  assert documents == [["Good line.", "Caf\ufffd au lait."], ["na\ufffdve \ufffd."]]
  assert (
      stats.problems["replaced_lines"] == 2
      and stats.first_problems["replaced_lines"] == f"{path}:2"
  )
  assert "2 lines with bytes that are not UTF-8" in caplog.text


@pytest.mark.fault
def test_empty_files_are_skipped_and_reported(tmp_path, caplog):
  empty = _write(tmp_path / "a_empty.txt", "")
  blank = _write(tmp_path / "b_blank.txt", "\n  \n\t\n")
  full = _write(tmp_path / "c_full.txt", "Some text.\n")
  with caplog.at_level("WARNING"):
    documents, stats = read_documents("text", [empty, blank, full])
  assert documents == [["Some text."]]
  assert stats.problems["empty_files"] == 2 and stats.first_problems["empty_files"] == empty
  assert "2 empty files skipped" in caplog.text and empty in caplog.text


@pytest.mark.fault
def test_no_usable_text_names_the_files(tmp_path):
  empty = _write(tmp_path / "empty.txt", "")
  blank = _write(tmp_path / "blank.txt", "\n\n")
  with pytest.raises(ConfigError, match=r"no usable text.*empty\.txt.*blank\.txt"):
    read_documents("text", [empty, blank])
  with pytest.raises(ConfigError, match=r"no usable text.*empty\.txt"):
    load_pretraining_data(_config(tmp_path, files=empty))


@pytest.mark.fault
def test_glob_matching_nothing_names_the_pattern(tmp_path):
  _write(tmp_path / "real.txt", "Text.")
  pattern = f"{tmp_path}/missing/*.txt"
  with pytest.raises(ConfigError, match=f"pattern {re.escape(repr(pattern))} matches no file"):
    resolve_files(f"{tmp_path}/real.txt,{pattern}")
  # The pipeline checks it before building anything.
  with pytest.raises(ConfigError, match="matches no file"):
    load_pretraining_data(_config(tmp_path, files=pattern))
  assert not os.path.exists(tmp_path / "cache")


@pytest.mark.fault
def test_missing_or_bad_files_setting_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="data.source='text' needs data.files"):
    load_pretraining_data(_config(tmp_path, files=" , "))
  with pytest.raises(ConfigError, match=f"matches '{tmp_path}', which is a directory"):
    resolve_files(str(tmp_path))


# ---------------------------------------------------------------- wordpiece


ORACLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, World! The dogs' running?",
    "Café déjà vu naïve",
    "CAFÉ Über résumé über-uber",
    "我爱北京 hello",
    "中文,world!北京。",
    "unknownword café's jumping foxes",
    "tab\tand\u00a0nbsp  spaces\nnewline \x00control",
    "",
]


@pytest.fixture
def oracle_vocab(tmp_path):
  return _bert_like_vocab(tmp_path / "vocab.txt", _ORACLE_WORDS)


@pytest.mark.parametrize("lowercase", [True, False])
@pytest.mark.parametrize("strip_accents", [None, True, False])
def test_wordpiece_equals_bert_reference(oracle_vocab, lowercase, strip_accents):
  legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
  reference = legacy.BertTokenizerLegacy(
      oracle_vocab, do_lower_case=lowercase, strip_accents=strip_accents
  )
  tokenizer = WordPieceTokenizer(oracle_vocab, lowercase=lowercase, strip_accents=strip_accents)
  expected = [reference.encode(text, add_special_tokens=False) for text in ORACLE_TEXTS]
  assert [tokenizer.encode(text) for text in ORACLE_TEXTS] == expected
  assert tokenizer.encode_batch(ORACLE_TEXTS) == expected
  # Not vacuous: known words map to real pieces, unknown ones to [UNK].
  assert tokenizer.unk_id not in expected[0] and tokenizer.unk_id in expected[6]


def test_wordpiece_normalization_options(oracle_vocab):
  def pieces(tokenizer, text):
    return [tokenizer.id_to_piece(i) for i in tokenizer.encode(text)]

  uncased = WordPieceTokenizer(oracle_vocab)
  assert pieces(uncased, "Café déjà vu naïve") == ["cafe", "deja", "vu", "naive"]
  assert pieces(uncased, "我爱北京 hello") == ["我", "爱", "北", "京", "hello"]
  keep_accents = WordPieceTokenizer(oracle_vocab, lowercase=True, strip_accents=False)
  assert pieces(keep_accents, "Café déjà vu naïve") == ["café", "déjà", "vu", "naïve"]
  cased = WordPieceTokenizer(oracle_vocab, lowercase=False)
  assert pieces(cased, "Café Hello hello") == ["Café", "Hello", "hello"]
  assert pieces(uncased, "the jumping dogs") == ["the", "jump", "##ing", "dog", "##s"]
  assert uncased.decode(uncased.encode("the jumping dogs")) == "the jumping dogs"
  assert len({uncased.fingerprint, keep_accents.fingerprint, cased.fingerprint}) == 3


def test_wordpiece_special_ids_come_from_the_vocab(oracle_vocab):
  tokenizer = WordPieceTokenizer(oracle_vocab)
  assert (
      tokenizer.pad_id,
      tokenizer.unk_id,
      tokenizer.cls_id,
      tokenizer.sep_id,
      tokenizer.mask_id,
  ) == (
      0,
      100,
      101,
      102,
      103,
  )
  assert tokenizer.vocab_size == 104 + len(_ORACLE_WORDS)
  assert tokenizer.encode("the [MASK] dog") == [
      tokenizer.encode("the")[0],
      103,
      tokenizer.encode("dog")[0],
  ]
  assert (
      tokenizer.decode([101, *tokenizer.encode("hello world"), 102, 0, 0])
      == "[CLS] hello world [SEP]"
  )
  assert len(tokenizer.fingerprint) == 16


@pytest.mark.fault
def test_a_vocab_with_a_utf8_bom_reads_as_without(oracle_vocab, tmp_path):
  with_bom = tmp_path / "bom_vocab.txt"
  with_bom.write_bytes(b"\xef\xbb\xbf" + open(oracle_vocab, "rb").read())
  plain, bom = WordPieceTokenizer(oracle_vocab), WordPieceTokenizer(str(with_bom))
  assert bom.pad_id == plain.pad_id == 0 and bom.vocab_size == plain.vocab_size
  assert bom.encode("the jumping dogs [MASK]") == plain.encode("the jumping dogs [MASK]")


@pytest.mark.fault
def test_wordpiece_vocab_missing_mask_is_refused(tmp_path):
  path = _bert_like_vocab(tmp_path / "no_mask_vocab.txt", ["the"], drop=("[MASK]",))
  with pytest.raises(ConfigError, match=r"no_mask_vocab\.txt lacks the special token \[MASK\]"):
    WordPieceTokenizer(path)


def test_a_workdir_keeps_a_wordpiece_vocabulary_with_its_case_settings(oracle_vocab, tmp_path):
  """keep_tokenizer copies the vocab.txt into the workdir; workdir_tokenizer reads it back with the
  data settings' case rules (the same fingerprint), the original file gone."""
  source = tmp_path / "gone" / "vocab.txt"
  _write(source, open(oracle_vocab, "rb").read(), mode="wb")
  settings = _config(
      tmp_path, tokenizer="wordpiece", vocab_file=str(source), lowercase=False, strip_accents=True
  )
  original = WordPieceTokenizer(str(source), lowercase=False, strip_accents=True)
  keep_tokenizer(original, tmp_path / "workdir")
  os.remove(source)
  kept = workdir_tokenizer(tmp_path / "workdir", settings)
  assert kept.vocab_file == str(tmp_path / "workdir" / "vocab.txt")
  assert (kept.fingerprint, kept.lowercase, kept.strip_accents) == (
      original.fingerprint,
      False,
      True,
  )
  assert (
      kept.encode("Café Über")
      == original.encode("Café Über")
      != WordPieceTokenizer(kept.vocab_file).encode("Café Über")
  )  # the default rules (lowercase) would tokenize otherwise


def test_prepared_wordpiece_shards_carry_their_vocab(oracle_vocab, tmp_path):
  corpus = _write(tmp_path / "c.txt", "The quick brown fox.\n\nHello world.\n")
  wordpiece = dict(tokenizer="wordpiece", lowercase=False, prepared_dir=str(tmp_path / "prep"))
  manifest = prepare_data(
      _config(tmp_path, files=corpus, vocab_file=oracle_vocab, **wordpiece), num_workers=0
  )
  with open(oracle_vocab, "rb") as f:
    assert (tmp_path / "prep" / "vocab.txt").read_bytes() == f.read()
  # Trained on without data.vocab_file: the shards' copy, with the config's case rules.
  loaded = load_tokenizer(_config(tmp_path, source="prepared", **wordpiece))
  assert loaded.fingerprint == manifest["tokenizer"]["fingerprint"]
  with pytest.raises(ConfigError, match="were made with the wordpiece tokenizer vocab.txt"):
    load_tokenizer(_config(tmp_path, source="prepared", **dict(wordpiece, lowercase=True)))


@pytest.mark.fault
def test_wordpiece_config_errors(tmp_path):
  corpus = _write(tmp_path / "c.txt", "the dog")
  with pytest.raises(ConfigError, match="needs data.vocab_file"):
    load_pretraining_data(_config(tmp_path, files=corpus, tokenizer="wordpiece"))
  with pytest.raises(ConfigError, match="is not a file"):
    missing = str(tmp_path / "nope")
    load_pretraining_data(
        _config(tmp_path, files=corpus, tokenizer="wordpiece", vocab_file=missing)
    )
  with pytest.raises(ConfigError, match=r"data.tokenizer='bpe' is not one of"):
    load_pretraining_data(_config(tmp_path, files=corpus, tokenizer="bpe"))


# ---------------------------------------------------------------- pipeline


def _cache_key_directory(config):
  return pipeline._corpus_cache_dir(read_config(config))


@pytest.mark.fault
def test_changed_input_file_changes_the_cache_key(tmp_path, oracle_vocab):
  path = _write(tmp_path / "corpus.txt", "the lazy dog\n")
  for tokenizer in ("sentencepiece", "wordpiece"):
    config = _config(tmp_path, files=str(path), tokenizer=tokenizer, vocab_file=oracle_vocab)
    before = _cache_key_directory(config)
    assert _cache_key_directory(config) == before
    stat = os.stat(path)
    _write(path, "the quick fox\n")  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    assert _cache_key_directory(config) != before
    _write(path, "the lazy dog\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _cache_key_directory(config) == before
  spm_config = _config(tmp_path, files=str(path))
  jsonl_config = _config(tmp_path, files=str(path), source="jsonl")
  assert _cache_key_directory(jsonl_config) != _cache_key_directory(spm_config)
  wp = dict(files=str(path), tokenizer="wordpiece", vocab_file=oracle_vocab)
  assert _cache_key_directory(_config(tmp_path, **wp)) != _cache_key_directory(
      _config(tmp_path, **wp, lowercase=False)
  )


# Documents of distinct words: word "d<i>w<k>" belongs to document i.
_DOCUMENT_WORDS = [[f"d{d}w{k}" for k in range(3 + 2 * d)] for d in range(8)]


def _packing_corpus(tmp_path):
  text = ""
  for words in _DOCUMENT_WORDS:
    sentences = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    text += "\n".join(sentences) + "\n\n"
  half = text.index("d4w0")
  _write(tmp_path / "docs" / "part1.txt", text[:half])
  _write(tmp_path / "docs" / "part2.txt", text[half:])
  vocab = _bert_like_vocab(
      tmp_path / "docs_vocab.txt", [w for words in _DOCUMENT_WORDS for w in words]
  )
  return f"{tmp_path}/docs/*.txt", vocab


def test_packed_text_examples_never_mix_documents(tmp_path):
  files, vocab = _packing_corpus(tmp_path)
  config = _config(tmp_path, files=files, tokenizer="wordpiece", vocab_file=vocab, max_seq_len=12)
  data = load_pretraining_data(config)
  tokenizer = data.tokenizer
  specials = {tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id}
  seen = []
  for row in data.input_ids:
    assert row[0] == tokenizer.cls_id
    words = [tokenizer.id_to_piece(t) for t in row if int(t) not in specials]
    assert words and tokenizer.unk_id not in row
    assert len({w.split("w")[0] for w in words}) == 1, f"an example mixes documents: {words}"
    seen += words
  # Documents longer than max_seq_len may be truncated; all short ones are kept whole.
  assert set(seen) >= {w for words in _DOCUMENT_WORDS[:3] for w in words}


def test_wordpiece_text_pipeline_decodes_back_to_the_text(tmp_path, monkeypatch):
  text = (
      "Hello World the quick brown fox\n"
      "jumps over the lazy dog\n"
      "\n"
      "Café déjà vu\n"
      "naïve résumé\n"
      "\n"
      "我爱北京 hello\n"
  )
  for copy in range(4):
    _write(tmp_path / "tiny" / f"{copy}.txt", text)
  vocab = _bert_like_vocab(tmp_path / "vocab.txt", _ORACLE_WORDS)
  config = _config(
      tmp_path,
      files=f"{tmp_path}/tiny/*.txt",
      tokenizer="wordpiece",
      vocab_file=vocab,
      eval_fraction=0.25,
  )
  train = load_pretraining_data(config, "train")
  held_out = load_pretraining_data(config, "eval")
  tokenizer = train.tokenizer
  assert (
      isinstance(tokenizer, WordPieceTokenizer)
      and tokenizer.pad_id == 0
      and tokenizer.cls_id == 101
  )
  assert train.input_ids.dtype == np.int32 and train.input_ids.shape[1] == 32
  assert held_out.num_examples > 0 and "|wp:" in train.fingerprint
  # Every document fits in one example, so the rows hold exactly the corpus' words (A and B
  # may swap sentences), lowercased and without accents.
  words = []
  for row in np.concatenate([train.input_ids, held_out.input_ids]):
    assert row[0] == 101 and np.all(row[np.count_nonzero(row) :] == 0)
    decoded = tokenizer.decode(row)
    assert decoded.startswith("[CLS] ") and decoded.endswith(" [SEP]")
    words += [w for w in decoded.split() if w not in ("[CLS]", "[SEP]")]
  expected = (
      "hello world the quick brown fox jumps over the lazy dog cafe deja vu naive resume "
      "我 爱 北 京 hello"
  )
  assert sorted(words) == sorted(expected.split() * 4)
  # A second load is served from the cache: nothing is tokenized or packed again.
  monkeypatch.setattr(prepare, "prepare_config", lambda *a, **k: pytest.fail("prepared again"))
  again = load_pretraining_data(config, "train")
  np.testing.assert_array_equal(again.input_ids, train.input_ids)
  assert again.fingerprint == train.fingerprint


@pytest.mark.fault
def test_pad_written_in_the_text_never_becomes_padding_inside_an_example(tmp_path):
  # A corpus about BERT may write "[PAD]"; its id inside an example would read as padding
  # (attention mask 0 mid-example, no loss there). Only the tail of a row is padding.
  vocab = _bert_like_vocab(tmp_path / "vocab.txt", _ORACLE_WORDS + ["[", "]", "pad"])
  tokenizer = WordPieceTokenizer(vocab)
  assert tokenizer.pad_id not in tokenizer.encode("the [PAD] dog")
  assert tokenizer.encode("the [MASK] dog")[1] == tokenizer.mask_id  # kept whole, as tested above
  text = "the quick [PAD] fox\njumps over the [PAD]\n\nhello [PAD] world\n"
  for copy in range(3):
    _write(tmp_path / "pads" / f"{copy}.txt", text)
  config = _config(
      tmp_path, files=f"{tmp_path}/pads/*.txt", tokenizer="wordpiece", vocab_file=vocab
  )
  data = load_pretraining_data(config)
  for row, mask in zip(
      data.input_ids, get_rows(data, np.arange(data.num_examples))["attention_mask"]
  ):
    length = int(np.count_nonzero(row != tokenizer.pad_id))
    assert np.all(row[length:] == tokenizer.pad_id), f"padding inside an example: {row.tolist()}"
    assert mask.tolist() == [1] * length + [0] * (len(row) - length)


def test_jsonl_source_with_sentencepiece_builds(tmp_path):
  rows = [
      {"text": f"Document number {i}.\nIt has two lines about the lazy dog."} for i in range(30)
  ]
  _write(tmp_path / "c.jsonl", "\n".join(json.dumps(r) for r in rows))
  config = _config(
      tmp_path,
      source="jsonl",
      files=str(tmp_path / "c.jsonl"),
      spm_vocab_size=40,
      max_documents=20,
      max_seq_len=128,
  )
  data = load_pretraining_data(config)
  assert data.tokenizer.vocab_size == 40 and "|spm:" in data.fingerprint
  decoded = [data.tokenizer.decode(row) for row in data.input_ids]
  assert any("Document number 3." in text for text in decoded)
  assert not any(
      "Document number 25." in text for text in decoded
  ), "max_documents keeps the first 20"


def test_load_tokenizer_matches_the_data(tmp_path, oracle_vocab):
  path = _write(tmp_path / "c.txt", "the lazy dog\njumps over the fox\n\nhello world\n")
  wordpiece = _config(tmp_path, files=path, tokenizer="wordpiece", vocab_file=oracle_vocab)
  assert load_tokenizer(wordpiece).fingerprint == WordPieceTokenizer(oracle_vocab).fingerprint
  assert not os.path.exists(tmp_path / "cache"), "a WordPiece tokenizer needs no build"
  spm_config = _config(tmp_path, files=path, spm_vocab_size=27)
  tokenizer = load_tokenizer(spm_config)  # builds the cache first
  assert tokenizer.fingerprint == load_pretraining_data(spm_config).tokenizer.fingerprint
  assert (tokenizer.pad_id, tokenizer.mask_id) == (0, 4)


@pytest.mark.fault
def test_large_corpus_cache_key_uses_sizes_and_mtimes(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, "_HASHED_CORPUS_BYTES", 0)  # every corpus counts as large
  path = _write(tmp_path / "big.txt", "the lazy dog\n")
  config = _config(tmp_path, files=path)
  before = _cache_key_directory(config)
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
  assert _cache_key_directory(config) != before
  _write(path, "the lazy dogs\n")
  assert _cache_key_directory(config) != before


def test_a_corpus_in_a_bucket_reads_as_the_same_files_on_disk(tmp_path, bucket):
  from electra_jax import workdir_files  # noqa: PLC0415

  local = [
      _write(tmp_path / "a.txt", "First document.\n\nSecond one.\n"),
      _write(tmp_path / "b" / "c.txt", "In a folder.\n"),
      _write(tmp_path / "d.bin", b"\0binary", mode="wb"),
  ]
  for path in local:
    with open(path, "rb") as f:
      workdir_files.write_bytes(f"{bucket}/corpus/{os.path.relpath(path, tmp_path)}", f.read())
  remote = resolve_files(f"{bucket}/corpus/**")
  assert remote == [f"{bucket}/corpus/a.txt", f"{bucket}/corpus/b/c.txt", f"{bucket}/corpus/d.bin"]
  (documents, stats), (local_documents, local_stats) = (
      read_documents("text", paths) for paths in (remote, local)
  )
  assert documents == local_documents and stats.counts() == local_stats.counts()
  assert stats.bytes_read == stats.total_bytes == local_stats.total_bytes
  # A replaced object (same name, same size) is another corpus: the cache key changes.
  before = sources.files_fingerprint(remote)
  workdir_files.write_bytes(remote[1], b"In a folder?\n")
  assert sources.files_fingerprint(remote) != before


@pytest.mark.fault
def test_a_file_this_process_may_not_read_is_named_before_it_is_opened(tmp_path, monkeypatch):
  # open() raised PermissionError: a traceback from every reader of data, task and sweep files.
  # (The suite may run as root, who reads anything: the permission is what os.access says.)
  path = tmp_path / "corpus.txt"
  path.write_text("text\n")
  monkeypatch.setattr(os, "access", lambda name, mode: mode != os.R_OK)
  assert sources.not_a_regular_file(str(path)) == "cannot be read (permission denied)"
