"""From a data config to pre-training batches: build or load the cached examples, then batch them.

Owns choosing the source and tokenizer, the on-disk cache layout (tokenizer + packed .npy
arrays, all written atomically), the train/eval document split, and the step-indexed,
process-sharded batch order. Large corpora go through prepare.py instead (the same split and
packing, in parallel, into shards); data.source="prepared" reads those shards, memory-mapped
and checked, through the same batching. The shard format (manifest, file names) lives here.

Why resuming needs no saved loader state: `get_batch(data, step, ...)` is a pure function of
the step (epoch e of the stream is a permutation seeded by (seed, e); global batch `step` is
stream positions [step * B, (step + 1) * B); process p takes its contiguous slice). A run
restored at step s asks for batch s and gets exactly what an uninterrupted run got, mid-epoch
too, with nothing to checkpoint beyond the step the train state already holds. A grain
iterator would give the same guarantee only by saving its state in every checkpoint, and
would add a dependency; random access to memory-mapped rows is all this needs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import time

import numpy as np
from absl import logging

from electra_jax.data import corpus, sources
from electra_jax.data.packing import (
    ROW_PACKING_VERSION,
    RowPacking,
    assemble_rows,
    example_lengths,
    pack_documents,
    plan_rows,
)
from electra_jax.errors import ConfigError
from electra_jax.data.tokenizer import SentencePieceTokenizer, atomic_write_bytes, train_sentencepiece
from electra_jax.data.wordpiece import WordPieceTokenizer

# Sources of documents; "prepared" instead reads the shards `prepare_data` wrote.
DOCUMENT_SOURCES = ("builtin",) + sources.FILE_SOURCES + ("tfds",)
SUPPORTED_SOURCES = DOCUMENT_SOURCES + ("prepared",)
SUPPORTED_TOKENIZERS = ("sentencepiece", "wordpiece")
SPLITS = ("train", "eval")

# Bump whenever extraction or packing would produce different arrays: it keys the cache and
# enters the data fingerprint, so stale arrays are rebuilt and checkpoints are not resumed
# on data that changed under them.
# 3: every document packs with its own generator (see pack_documents); binary files and
# over-long lines are skipped.
_CACHE_FORMAT_VERSION = 3

# Fixed packing seeds: the packed data must be a function of the config alone.
PACKING_SEEDS = {"train": 0, "eval": 1}

_CACHE_ENV_VAR = "ELECTRA_JAX_CACHE"

# Above this much text, building the cache in memory warns and points to prepare_data.
_LARGE_IN_MEMORY_BYTES = 1 << 30

# Bump when the shard layout or the manifest's meaning changes.
PREPARED_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPM_MODEL = "spm.model"


@dataclasses.dataclass
class PretrainingData:
  """Packed examples of one split, with the tokenizer that produced them."""

  tokenizer: SentencePieceTokenizer | WordPieceTokenizer
  input_ids: np.ndarray  # int32 [num_examples, max_seq_len]
  token_type_ids: np.ndarray  # int32 [num_examples, max_seq_len]
  # Identifies tokenizer, max_seq_len and the split's documents; a checkpoint can store
  # it and refuse to resume on different data.
  fingerprint: str
  # data.pack_rows: which examples each row of a batch holds (None: one example per row).
  packing: RowPacking | None = None

  @property
  def num_examples(self) -> int:
    return int(self.input_ids.shape[0])

  @property
  def num_rows(self) -> int:
    """Rows get_batch draws from: packed rows under data.pack_rows, else the examples."""
    return self.packing.num_rows if self.packing is not None else self.num_examples

  @property
  def max_seq_len(self) -> int:
    return int(self.input_ids.shape[1])

  @property
  def num_tokens(self) -> int:
    """Number of non-padding tokens over all examples."""
    return int(np.count_nonzero(self.input_ids != self.tokenizer.pad_id))


def _resolve_cache_dir(cache_dir: str) -> str:
  if cache_dir:
    return os.path.expanduser(cache_dir)
  return os.environ.get(_CACHE_ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "electra_jax")


def is_eval_document(index: int, eval_fraction: float) -> bool:
  # Document i is held out when floor((i + 1) * f) steps past floor(i * f): this spreads
  # exactly floor(n * f) held-out documents evenly over the corpus, for any fraction.
  return int((index + 1) * eval_fraction) > int(index * eval_fraction)


def _split_documents(documents, eval_fraction):
  splits = {"train": [], "eval": []}
  for index, document in enumerate(documents):
    splits["eval" if is_eval_document(index, eval_fraction) else "train"].append(document)
  return splits


def _split_indices(num_documents: int, eval_fraction: float) -> dict[str, list[int]]:
  """The corpus indices of each split's documents (they seed each document's packing)."""
  splits = {"train": [], "eval": []}
  for index in range(num_documents):
    splits["eval" if is_eval_document(index, eval_fraction) else "train"].append(index)
  return splits


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  atomic_write_bytes(path, buffer.getvalue())


def _read_config(data_config):
  """Validated plain values from the data ConfigDict."""
  source = data_config.source
  if source not in SUPPORTED_SOURCES:
    raise ConfigError(
        f"Unknown data.source {source!r}; supported sources are {list(SUPPORTED_SOURCES)} "
        f"(text and jsonl read the files named by data.files, tfds the dataset data.tfds_name, "
        f"prepared the shards in data.prepared_dir)."
    )
  tokenizer = str(data_config.get("tokenizer", "sentencepiece"))
  if tokenizer not in SUPPORTED_TOKENIZERS:
    raise ConfigError(
        f"Unknown data.tokenizer {tokenizer!r}; use one of {list(SUPPORTED_TOKENIZERS)} "
        f"(wordpiece reads a BERT vocab.txt given by data.vocab_file)."
    )
  vocab_file = str(data_config.get("vocab_file", "") or "")
  if tokenizer == "wordpiece":
    if not vocab_file:
      raise ConfigError(
          "data.tokenizer='wordpiece' needs data.vocab_file, the path of a BERT vocab.txt "
          "(one token per line), e.g. --config.data.vocab_file=uncased_L-12_H-768_A-12/vocab.txt."
      )
    vocab_file = os.path.abspath(os.path.expanduser(vocab_file))
    if not os.path.isfile(vocab_file):
      raise ConfigError(f"data.vocab_file={vocab_file!r} is not a file; give the path of a BERT vocab.txt.")
  strip_accents = data_config.get("strip_accents", None)
  if strip_accents is not None and not isinstance(strip_accents, bool):
    raise ConfigError(
        f"data.strip_accents must be None (follow data.lowercase, as BERT does), True or False, "
        f"got {strip_accents!r}."
    )
  spm_model_file = str(data_config.get("spm_model_file", "") or "")
  if spm_model_file:
    spm_model_file = os.path.abspath(os.path.expanduser(spm_model_file))
    if tokenizer != "sentencepiece":
      raise ConfigError(
          f"data.spm_model_file={spm_model_file!r} is set but data.tokenizer={tokenizer!r}; set "
          f"data.tokenizer='sentencepiece' to use that model, or clear data.spm_model_file."
      )
    if not os.path.isfile(spm_model_file):
      raise ConfigError(
          f"data.spm_model_file={spm_model_file!r} is not a file; give a model written by "
          f"--mode=train_tokenizer (or clear it to train one in the cache)."
      )
  prepared_dir = str(data_config.get("prepared_dir", "") or "")
  prepared_dir = os.path.abspath(os.path.expanduser(prepared_dir)) if prepared_dir else ""
  if source == "prepared" and not prepared_dir:
    raise ConfigError(
        "data.source='prepared' needs data.prepared_dir, the directory --mode=prepare_data wrote."
    )
  shard_documents = int(data_config.get("shard_documents", 10_000))
  if shard_documents < 1:
    raise ConfigError(f"data.shard_documents must be >= 1, got {shard_documents}.")
  text_field = str(data_config.get("text_field", "text"))
  if source == "jsonl" and not text_field:
    raise ConfigError("data.text_field is empty; name the JSON field holding each document's text.")
  max_seq_len = int(data_config.max_seq_len)
  vocab_size = int(data_config.get("spm_vocab_size", 8192))
  model_type = str(data_config.get("spm_model_type", "unigram"))
  max_documents = int(data_config.get("max_documents", 0))
  eval_fraction = float(data_config.get("eval_fraction", 0.02))
  if max_documents < 0:
    raise ConfigError(f"data.max_documents must be >= 0 (0 means all), got {max_documents}.")
  if not 0.0 <= eval_fraction < 1.0:
    raise ConfigError(
        f"data.eval_fraction must be in [0, 1) (e.g. 0.02 holds out 2% of documents), "
        f"got {eval_fraction}."
    )
  pack_rows = data_config.get("pack_rows", False)
  if not isinstance(pack_rows, (bool, np.bool_)):
    raise ConfigError(
        f"data.pack_rows must be True (several whole examples per row) or False (one per row), "
        f"got {pack_rows!r}."
    )
  return {
      "source": source,
      # Resolving the globs here reports a pattern matching nothing before anything is built.
      "files": sources.resolve_files(data_config.get("files", "")) if source in sources.FILE_SOURCES else [],
      "text_field": text_field,
      "tokenizer": tokenizer,
      "vocab_file": vocab_file,
      "lowercase": bool(data_config.get("lowercase", True)),
      "strip_accents": strip_accents,
      "max_seq_len": max_seq_len,
      "cache_dir": _resolve_cache_dir(str(data_config.get("cache_dir", ""))),
      "spm_vocab_size": vocab_size,
      "spm_model_type": model_type,
      "max_documents": max_documents,
      "eval_fraction": eval_fraction,
      "spm_model_file": spm_model_file,
      "prepared_dir": prepared_dir,
      "shard_documents": shard_documents,
      "tfds_name": str(data_config.get("tfds_name", "") or ""),
      "tfds_split": str(data_config.get("tfds_split", "train") or "train"),
      "tfds_text_field": str(data_config.get("tfds_text_field", "text") or "text"),
      "tfds_data_dir": str(data_config.get("tfds_data_dir", "") or ""),
      "pack_rows": bool(pack_rows),
  }


def _tfds_corpus(config):
  from electra_jax.data.tfds_source import TfdsCorpus  # noqa: PLC0415  (imports tfds, ~1 s)

  return TfdsCorpus(config["tfds_name"], config["tfds_split"], config["tfds_text_field"], config["tfds_data_dir"])


def source_fingerprint(config) -> dict:
  """What identifies the source's documents, for cache keys and prepared manifests."""
  if config["source"] == "builtin":
    # The source-bytes hash is cheap to recompute, unlike the document-text hash, so a
    # warm cache is found without parsing the stdlib.
    return {"sources": corpus.builtin_sources_fingerprint()}
  if config["source"] == "tfds":
    return {"tfds": _tfds_corpus(config).fingerprint}
  # Paths, sizes and mtimes (and small files' bytes): an edited corpus gets a new key.
  key_fields = {"files": sources.files_fingerprint(config["files"])}
  if config["source"] == "jsonl":
    key_fields["text_field"] = config["text_field"]
    # Records end at "\n" only (before, also at U+2028, U+2029, U+0085, dropping the record):
    # caches of the earlier reading are rebuilt.
    key_fields["jsonl_lines"] = "newline"
  return key_fields


def source_description(config) -> dict:
  """A human-readable account of the source, for manifests."""
  if config["source"] == "builtin":
    return {"source": "builtin", "stdlib": corpus.stdlib_root()}
  if config["source"] == "tfds":
    return _tfds_corpus(config).description
  description = {"source": config["source"], "files": config["files"][:100], "num_files": len(config["files"])}
  if config["source"] == "jsonl":
    description["text_field"] = config["text_field"]
  return description


def iter_source_documents(config, stats: sources.SourceStats):
  """The source's documents in corpus order (max_documents of them), streamed.

  `stats` is updated as they are read: skips, and progress as stats.bytes_read of
  stats.total_bytes (bytes for files, records for TFDS, documents for the built-in corpus).
  """
  limit = config["max_documents"] or None
  if config["source"] == "builtin":
    documents = corpus.builtin_documents(limit)
    stats.total_bytes = len(documents)

    def counted():
      for document in documents:
        stats.bytes_read += 1
        stats.num_documents += 1
        yield document

    iterator = counted()
  elif config["source"] == "tfds":
    iterator = _tfds_corpus(config).iter_documents(stats)
  else:
    iterator = sources.iter_documents(config["source"], config["files"], config["text_field"], stats)
  for count, document in enumerate(iterator):
    if limit is not None and count >= limit:
      break
    yield document


def no_documents_error(config, stats: sources.SourceStats) -> ConfigError:
  """The error for a source that gave no usable document."""
  if config["source"] in sources.FILE_SOURCES:
    return sources.no_usable_text_error(config["source"], config["files"], config["text_field"], stats)
  if config["source"] == "tfds":
    return ConfigError(
        f"TFDS dataset {config['tfds_name']!r} split {config['tfds_split']!r} gave no usable text in "
        f"field {config['tfds_text_field']!r} ({stats.counts()}); check data.tfds_text_field."
    )
  return ConfigError(f"The built-in corpus gave no documents (max_documents={config['max_documents']}).")


def _corpus_cache_dir(config) -> str:
  """Directory for everything derived from one corpus + tokenizer configuration."""
  key_fields = {
      "format": _CACHE_FORMAT_VERSION,
      "max_documents": config["max_documents"],
      "eval_fraction": config["eval_fraction"],
      **source_fingerprint(config),
  }
  # Only keys that change the tokenizer enter the key.
  if config["spm_model_file"]:
    key_fields["spm_model"] = SentencePieceTokenizer(config["spm_model_file"]).fingerprint
  elif config["tokenizer"] == "sentencepiece":
    key_fields["spm_vocab_size"] = config["spm_vocab_size"]
    key_fields["spm_model_type"] = config["spm_model_type"]
  else:
    key_fields["tokenizer"] = config["tokenizer"]
    key_fields["wordpiece"] = _wordpiece_tokenizer(config).fingerprint
  key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(config["cache_dir"], config["source"], key)


def _wordpiece_tokenizer(config) -> WordPieceTokenizer:
  return WordPieceTokenizer(config["vocab_file"], config["lowercase"], config["strip_accents"])


def _tokenizer_tag(config) -> str:
  return "spm" if config["tokenizer"] == "sentencepiece" else "wp"


def data_fingerprint(config, tokenizer, split: str, documents_fingerprint: str) -> str:
  """Identifies a split's examples: packing format, tokenizer, max_seq_len and documents,
  and under data.pack_rows the row packing (a checkpoint trained on unpacked rows is refused
  on packed ones, and the other way round).

  The in-memory cache and prepared shards of the same config give the same string (and the
  same examples), so a checkpoint resumes on either.
  """
  fingerprint = (
      f"format:{_CACHE_FORMAT_VERSION}|{_tokenizer_tag(config)}:{tokenizer.fingerprint}|"
      f"max_seq_len:{config['max_seq_len']}|{split}_documents:{documents_fingerprint}"
  )
  if config.get("pack_rows"):
    fingerprint += f"|pack_rows:{ROW_PACKING_VERSION}"
  return fingerprint


def _load_tokenizer(config, directory: str):
  """The cache's tokenizer, or None if it is not there yet."""
  if config["spm_model_file"]:
    return SentencePieceTokenizer(config["spm_model_file"])
  if config["tokenizer"] == "sentencepiece":
    model_path = os.path.join(directory, "spm.model")
    return SentencePieceTokenizer(model_path) if os.path.exists(model_path) else None
  # The vocab file is read where the user keeps it; its bytes and settings are in the
  # cache key and the tokenizer fingerprint, so the arrays always match it.
  return _wordpiece_tokenizer(config)


def _array_paths(directory: str, split: str, max_seq_len: int, tokenizer_fingerprint: str, tag: str = "spm"):
  # The tokenizer fingerprint in the name ties the arrays to the exact model that made
  # them, even if two concurrent builds each wrote a model.
  stem = os.path.join(directory, f"{split}.len{max_seq_len}.{tag}{tokenizer_fingerprint}")
  return {
      "input_ids": stem + ".input_ids.npy",
      "token_type_ids": stem + ".token_type_ids.npy",
  }


def _build(config, directory: str) -> None:
  """Write the corpus metadata and both splits' packed arrays; train the tokenizer if absent."""
  start = time.time()
  stats = sources.SourceStats()
  documents = list(iter_source_documents(config, stats))
  stats.num_documents = len(documents)
  if config["source"] != "builtin":
    sources.log_stats(config["source"], stats)
  if not documents:
    raise no_documents_error(config, stats)
  splits = _split_documents(documents, config["eval_fraction"])
  indices = _split_indices(len(documents), config["eval_fraction"])
  num_bytes = sum(len(sentence.encode("utf-8")) for document in documents for sentence in document)
  logging.info(
      "building %s corpus: %d documents (%d train, %d eval), %.1f MB, in %.1f s",
      config["source"], len(documents), len(splits["train"]), len(splits["eval"]), num_bytes / 1e6,
      time.time() - start,
  )
  if num_bytes > _LARGE_IN_MEMORY_BYTES:
    logging.warning(
        "the %s corpus holds %.1f GB of text, all of it held in memory while it is packed; for "
        "corpora this size, --mode=prepare_data (all cores, resumable) and data.source='prepared' "
        "are faster and use little memory.", config["source"], num_bytes / 1e9,
    )
  metadata = {
      "num_documents": len(documents),
      "num_bytes": num_bytes,
      "documents_fingerprint": {split: corpus.documents_fingerprint(splits[split]) for split in SPLITS},
  }
  atomic_write_bytes(os.path.join(directory, "corpus.json"), json.dumps(metadata, indent=1).encode())

  model_path = os.path.join(directory, "spm.model")
  if config["tokenizer"] == "sentencepiece" and not config["spm_model_file"] and not os.path.exists(model_path):
    start = time.time()
    logging.info(
        "training sentencepiece %s vocab %d on %d train documents ...",
        config["spm_model_type"], config["spm_vocab_size"], len(splits["train"]),
    )
    train_sentencepiece(
        (sentence for document in splits["train"] for sentence in document),
        model_path,
        vocab_size=config["spm_vocab_size"],
        model_type=config["spm_model_type"],
    )
    logging.info("trained sentencepiece in %.1f s", time.time() - start)
  tokenizer = _load_tokenizer(config, directory)

  # Both splits are packed together: the eval split is small, and building it later
  # would mean parsing the corpus again.
  for split in SPLITS:
    start = time.time()
    sentences = [sentence for document in splits[split] for sentence in document]
    token_ids = iter(tokenizer.encode_batch(sentences))
    tokenized_documents = [[next(token_ids) for _ in document] for document in splits[split]]
    packed = pack_documents(
        tokenized_documents,
        config["max_seq_len"],
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        pad_id=tokenizer.pad_id,
        seed=PACKING_SEEDS[split],
        document_indices=indices[split],
    )
    paths = _array_paths(
        directory, split, config["max_seq_len"], tokenizer.fingerprint, _tokenizer_tag(config)
    )
    for name, path in paths.items():
      _save_npy_atomic(path, packed[name])
    logging.info(
        "packed %s split: %d examples of length %d, %d tokens, in %.1f s",
        split, packed["input_ids"].shape[0], config["max_seq_len"],
        int(np.count_nonzero(packed["input_ids"] != tokenizer.pad_id)), time.time() - start,
    )


def _try_load(config, directory: str, split: str) -> PretrainingData | None:
  """The cached split, or None if any part of it is missing."""
  metadata_path = os.path.join(directory, "corpus.json")
  if not os.path.exists(metadata_path):
    return None
  tokenizer = _load_tokenizer(config, directory)
  if tokenizer is None:
    return None
  paths = _array_paths(directory, split, config["max_seq_len"], tokenizer.fingerprint, _tokenizer_tag(config))
  if not all(os.path.exists(path) for path in paths.values()):
    return None
  with open(metadata_path, "rb") as f:
    metadata = json.loads(f.read())
  arrays = {name: np.load(path, allow_pickle=False) for name, path in paths.items()}
  expected_shape = (arrays["input_ids"].shape[0], config["max_seq_len"])
  for name, array in arrays.items():
    if array.dtype != np.int32 or array.shape != expected_shape:
      raise ConfigError(
          f"Cached array {paths[name]} has dtype {array.dtype} and shape {array.shape}, "
          f"expected int32 {expected_shape}. The cache is damaged; delete {directory} "
          f"and it will be rebuilt."
      )
  fingerprint = data_fingerprint(config, tokenizer, split, metadata["documents_fingerprint"][split])
  return PretrainingData(tokenizer, arrays["input_ids"], arrays["token_type_ids"], fingerprint)


def load_pretraining_data(data_config, split: str = "train") -> PretrainingData:
  """Packed pre-training examples of `split` ("train" or "eval") for `data_config`.

  The first call builds the corpus (data.source), trains the sentencepiece tokenizer on the
  train documents (or reads the WordPiece vocab.txt, data.tokenizer) and packs both splits,
  caching everything under <cache_dir>/<source>/<key>/; later calls load the cache in well
  under a second. The key includes a fingerprint of data.files, so an edited corpus is rebuilt.
  With data.pack_rows the result also carries the plan that packs several examples per row
  (made at load time from the examples' lengths), which get_batch then serves.
  """
  if split not in SPLITS:
    raise ConfigError(f"Unknown split {split!r}; use one of {list(SPLITS)}.")
  config = _read_config(data_config)
  if config["source"] == "prepared":
    return _with_row_packing(load_prepared(config, split), config, split)
  if split == "eval" and config["eval_fraction"] == 0:
    raise ConfigError(
        "The eval split is empty because data.eval_fraction is 0; set it above 0 "
        "(e.g. 0.02) to hold out documents for evaluation, or set eval.every_steps=0 to train "
        "without held-out evaluation."
    )
  directory = _corpus_cache_dir(config)
  data = _try_load(config, directory, split)
  if data is None:
    logging.info("no cached data in %s; building it", directory)
    _build(config, directory)
    data = _try_load(config, directory, split)
  if data is None:
    raise RuntimeError(
        f"Built the {split} data in {directory} but could not load it back; check that "
        f"the directory is writable and not being deleted concurrently."
    )
  if data.num_examples == 0:
    raise ConfigError(
        f"The {split} split has no examples (max_documents={config['max_documents']}"
        f"{' (all)' if not config['max_documents'] else ''}, eval_fraction={config['eval_fraction']}); "
        "use more documents or a larger "
        f"eval_fraction" + (", or eval.every_steps=0 to train without held-out evaluation." if split == "eval" else ".")
    )
  logging.info(
      "loaded %s data: %d examples of length %d, %d tokens, from %s",
      split, data.num_examples, data.max_seq_len, data.num_tokens, directory,
  )
  return _with_row_packing(data, config, split)


def _with_row_packing(data: PretrainingData, config, split: str) -> PretrainingData:
  """`data` with its row packing plan under data.pack_rows (the fingerprint already says so).

  The plan is made here from the examples' lengths rather than stored: about a second per
  million examples, and the same cache or prepared directory then serves packed and unpacked
  training. Prepared data brings the lengths prepare_data stored (PreparedData.lengths); the
  in-memory examples are scanned.
  """
  if not config["pack_rows"]:
    return data
  start = time.time()
  lengths = getattr(data, "lengths", None)
  if lengths is None:
    lengths = example_lengths(data.input_ids, data.tokenizer.pad_id)
  packing = plan_rows(lengths, data.max_seq_len)
  unpacked = packing.lengths.sum(dtype=np.int64) / max(1, data.num_examples * data.max_seq_len)
  logging.info(
      "packed %s rows: %d examples into %d rows of %d; real tokens %.1f%% -> %.1f%% of positions, "
      "in %.1f s", split, data.num_examples, packing.num_rows, data.max_seq_len, 100 * unpacked,
      100 * packing.real_token_fraction(), time.time() - start,
  )
  return dataclasses.replace(data, packing=packing)


def load_tokenizer(data_config) -> SentencePieceTokenizer | WordPieceTokenizer:
  """The tokenizer `load_pretraining_data(data_config)` uses, for tools that need only its ids.

  WordPiece reads data.vocab_file; sentencepiece takes the cached model, building the data
  first (as load_pretraining_data would) if the cache does not hold it yet.
  """
  config = _read_config(data_config)
  if config["source"] == "prepared":
    return prepared_tokenizer(config, open_manifest(config["prepared_dir"]))
  tokenizer = _load_tokenizer(config, _corpus_cache_dir(config))
  if tokenizer is None:
    tokenizer = load_pretraining_data(data_config, "train").tokenizer
  return tokenizer


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  # Reducing the seed modulo 2**64 lets negative seeds work (numpy only takes
  # non-negative ones) without changing any non-negative seed.
  permutation = np.random.default_rng([seed % 2**64, epoch]).permutation(num_examples)
  # The array is shared by every caller through the cache, so nobody may modify it.
  permutation.flags.writeable = False
  return permutation


def get_batch(
    data: PretrainingData,
    step: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    stream_offset: int = 0,
) -> dict[str, np.ndarray]:
  """This process's rows of global batch `step`; a pure function of its arguments.

  The row stream is epoch 0, epoch 1, ... each a seeded permutation of all rows (examples, or
  packed rows under data.pack_rows); global batch `step` is stream positions
  [stream_offset + step * B, stream_offset + (step + 1) * B), and process p takes the p-th
  contiguous slice of it. Resuming at a step therefore needs no loader state, only the offset
  when the batch size changed (a checkpoint records its stream position: see train.py).

  Returns int32 [B / process_count, max_seq_len] input_ids, token_type_ids and attention_mask;
  packed rows add segment_ids and position_ids (see `get_rows`).
  """
  if data.num_rows == 0:
    raise ConfigError("get_batch: the dataset has no examples; check the data config.")
  if global_batch_size <= 0:
    raise ConfigError(f"global_batch_size must be positive, got {global_batch_size}.")
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ConfigError(
        f"process_index must be in [0, process_count), got process_index={process_index}, "
        f"process_count={process_count}."
    )
  if global_batch_size % process_count:
    raise ConfigError(
        f"global_batch_size {global_batch_size} is not divisible by process_count "
        f"{process_count}; choose a batch size that is a multiple of the process count."
    )
  if step < 0 or stream_offset + step * global_batch_size < 0:
    raise ConfigError(f"step must be >= 0 and start a batch at a stream position >= 0, got step {step} "
                      f"with stream_offset {stream_offset}.")
  per_process = global_batch_size // process_count
  start = stream_offset + step * global_batch_size + process_index * per_process
  positions = np.arange(start, start + per_process, dtype=np.int64)
  epochs, offsets = np.divmod(positions, data.num_rows)
  rows = np.empty(per_process, dtype=np.int64)
  for epoch in np.unique(epochs):
    in_epoch = epochs == epoch
    rows[in_epoch] = _epoch_permutation(seed, int(epoch), data.num_rows)[offsets[in_epoch]]
  return get_rows(data, rows)


def batch_keys(pack_rows: bool) -> tuple[str, ...]:
  """The arrays of a batch the model reads, so the ones to send to the devices: packed rows
  add their segment ids. (Packed batches also carry position_ids, for inspection; the model
  derives the same positions from the segment ids, so they need not travel.)"""
  keys = ("input_ids", "token_type_ids", "attention_mask")
  return keys + ("segment_ids",) if pack_rows else keys


def get_rows(data: PretrainingData, rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows `rows` (indices in [0, data.num_rows)) as a batch, in that order.

  Unpacked: the examples themselves, with attention_mask 1 on non-padding tokens. Packed
  (data.pack_rows): each row holds several whole examples, and the batch adds segment_ids
  (1, 2, ... for the row's 1st, 2nd, ... example, 0 on padding) and position_ids (0 .. n - 1
  within each example, 0 on padding); token types stay per example. The held-out evaluator
  reads its fixed rows through this too.
  """
  rows = np.asarray(rows, dtype=np.int64)
  if data.packing is not None:
    return assemble_rows(data.packing, rows, data.input_ids, data.token_type_ids, data.tokenizer.pad_id)
  input_ids = data.input_ids[rows]
  return {
      "input_ids": input_ids,
      "token_type_ids": data.token_type_ids[rows],
      "attention_mask": (input_ids != data.tokenizer.pad_id).astype(np.int32),
  }


# ---------------------------------------------------------------------------------------
# Prepared shards (data.source="prepared", written by prepare.py)
# ---------------------------------------------------------------------------------------
def shard_file(split: str, index: int) -> str:
  return f"{split}-{index:05d}.npy"


def lengths_file(split: str, index: int) -> str:
  return f"{split}-{index:05d}.lengths.npy"


def read_manifest(out_dir: str) -> dict | None:
  path = os.path.join(out_dir, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      return json.loads(f.read())
  except ValueError as e:
    raise ConfigError(
        f"{path} is not valid JSON ({e}); it was not written by prepare_data. Delete "
        f"{out_dir} (or choose another data.prepared_dir) and prepare again."
    ) from e


class ShardedRows:
  """The rows of several memory-mapped [rows, 2, L] shards as one read-only int32 [N, L] array.

  Supports what training and evaluation do with example arrays: `shape`, `len`, and indexing
  rows with an integer array, a slice or an int (the result is a fresh int32 ndarray).
  `channel` 0 selects input ids, 1 token type ids.
  """

  def __init__(self, shards: list[np.ndarray], channel: int, max_seq_len: int):
    self._shards = shards
    self._channel = channel
    self._offsets = np.cumsum([0] + [shard.shape[0] for shard in shards])
    self.shape = (int(self._offsets[-1]), max_seq_len)
    self.dtype = np.dtype(np.int32)
    self.ndim = 2

  def __len__(self) -> int:
    return self.shape[0]

  def _gather(self, rows: np.ndarray) -> np.ndarray:
    out = np.empty((rows.shape[0], self.shape[1]), np.int32)
    if rows.size == 0:
      return out
    if rows.min() < 0 or rows.max() >= self.shape[0]:
      raise IndexError(f"row index out of range for {self.shape[0]} rows")
    shard_of_row = np.searchsorted(self._offsets, rows, side="right") - 1
    for shard in np.unique(shard_of_row):
      selected = shard_of_row == shard
      local = rows[selected] - self._offsets[shard]
      out[selected] = self._shards[shard][local, self._channel]
    return out

  def __getitem__(self, index):
    rest = ()
    if isinstance(index, tuple):
      index, rest = index[0], index[1:]
    if isinstance(index, slice):
      result = self._gather(np.arange(*index.indices(self.shape[0]), dtype=np.int64))
    elif isinstance(index, (int, np.integer)):
      row = int(index) + (self.shape[0] if index < 0 else 0)
      result = self._gather(np.array([row], np.int64))[0]
    else:
      rows = np.asarray(index, dtype=np.int64)
      result = self._gather(np.where(rows < 0, rows + self.shape[0], rows).reshape(-1)).reshape(
          rows.shape + (self.shape[1],)
      )
    if not rest:
      return result
    # Column indices apply to the gathered rows (an int row index leaves a 1-D row).
    return result[rest] if isinstance(index, (int, np.integer)) else result[(slice(None),) + rest]

  def __array__(self, dtype=None, copy=None):
    array = self[:]
    return array if dtype is None else array.astype(dtype)


@dataclasses.dataclass
class PreparedData(PretrainingData):
  """Examples of one split of a prepared directory; the arrays are ShardedRows."""

  directory: str = ""
  token_count: int = 0
  # data.pack_rows: each example's token count, from the shards' lengths files (None without
  # pack_rows).
  lengths: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return self.token_count


def open_manifest(directory: str) -> dict:
  """The manifest of a finished preparation, or a ConfigError saying what to run."""
  manifest = read_manifest(directory)
  if manifest is None:
    raise ConfigError(
        f"data.prepared_dir={directory!r} has no {MANIFEST}; create it with "
        f"`python -m electra_jax.main --mode=prepare_data --config=...` (same data config, with "
        f"data.source set to the corpus), then train with data.source='prepared'."
    )
  if manifest.get("format_version") != PREPARED_FORMAT_VERSION:
    raise ConfigError(
        f"{directory} was prepared in format {manifest.get('format_version')}, this version reads "
        f"format {PREPARED_FORMAT_VERSION}; prepare the corpus again into a new data.prepared_dir."
    )
  if not manifest.get("complete"):
    raise ConfigError(
        f"The preparation of {directory} did not finish ({len(manifest.get('shards', []))} shards "
        f"so far); run --mode=prepare_data again with the same config: it resumes."
    )
  return manifest


def prepared_tokenizer(config, manifest: dict):
  """The configured tokenizer, refused unless it is the one the shards were made with."""
  directory = config["prepared_dir"]
  recorded = manifest["tokenizer"]
  if config["tokenizer"] == "wordpiece":
    tokenizer = WordPieceTokenizer(config["vocab_file"], config["lowercase"], config["strip_accents"])
    described = f"wordpiece {config['vocab_file']} (lowercase={config['lowercase']}, strip_accents={config['strip_accents']})"
  else:
    model_file = config["spm_model_file"] or os.path.join(directory, SPM_MODEL)
    if not os.path.exists(model_file):
      raise ConfigError(
          f"data.tokenizer='sentencepiece' without data.spm_model_file reads {model_file}, which "
          f"does not exist: the shards in {directory} were made with the {recorded['kind']} tokenizer "
          f"{recorded.get('model_file') or recorded.get('vocab_file')} (fingerprint "
          f"{recorded['fingerprint']}). Configure that tokenizer."
      )
    tokenizer = SentencePieceTokenizer(model_file)
    described = f"sentencepiece {model_file}"
  if recorded["kind"] != config["tokenizer"] or tokenizer.fingerprint != recorded["fingerprint"]:
    raise ConfigError(
        f"The shards in {directory} were made with the {recorded['kind']} tokenizer "
        f"{recorded.get('model_file') or recorded.get('vocab_file')} (fingerprint {recorded['fingerprint']}), "
        f"but this config gives {described} (fingerprint {tokenizer.fingerprint}). Configure the "
        f"tokenizer the shards were made with, or prepare the corpus again with this one into "
        f"another data.prepared_dir."
    )
  return tokenizer


def _shard_lengths(directory: str, split_entry: dict, shard: np.ndarray, pad_id: int) -> np.ndarray:
  """A shard's example lengths (int32 [rows]): its lengths file, or a scan of its rows where it
  has none (shards prepared before data.pack_rows existed)."""
  max_seq_len = shard.shape[2]
  if "lengths_file" not in split_entry:
    return example_lengths(shard[:, 0], pad_id)
  path = os.path.join(directory, split_entry["lengths_file"])
  try:
    lengths = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ConfigError(
        f"Cannot read {path} ({e}); run --mode=prepare_data again with the same config to "
        f"re-create missing or damaged files."
    ) from e
  if lengths.shape != (split_entry["rows"],) or lengths.dtype.kind not in "iu" or (
      lengths.size and not 1 <= lengths.min() <= lengths.max() <= max_seq_len
  ):
    raise ConfigError(
        f"{path} does not hold {split_entry['rows']} example lengths in [1, {max_seq_len}]; run "
        f"--mode=prepare_data again with the same config to re-create it."
    )
  return lengths.astype(np.int32)


def load_prepared(config, split: str) -> PreparedData:
  """`split` of the prepared directory config["prepared_dir"], memory-mapped, after checks."""
  directory = config["prepared_dir"]
  manifest = open_manifest(directory)
  if manifest["max_seq_len"] != config["max_seq_len"]:
    raise ConfigError(
        f"The shards in {directory} hold examples of max_seq_len={manifest['max_seq_len']}, but "
        f"data.max_seq_len={config['max_seq_len']}. Set data.max_seq_len={manifest['max_seq_len']}, "
        f"or prepare the corpus again with max_seq_len={config['max_seq_len']} into another "
        f"data.prepared_dir."
    )
  if split == "train":  # once per run
    ignored = [f"data.{key}={config[key]!r} (the shards' {manifest['settings'][key]!r})"
               for key in ("eval_fraction", "max_documents", "shard_documents")
               if key in config and key in manifest.get("settings", {}) and config[key] != manifest["settings"][key]]
    if ignored:
      logging.warning("data.source=prepared: the shards in %s decide these, so the config's values "
                      "are not used: %s.", directory, "; ".join(ignored))
  tokenizer = prepared_tokenizer(config, manifest)
  max_seq_len = manifest["max_seq_len"]
  shards, lengths = [], []
  for entry in manifest["shards"]:
    split_entry = entry["splits"][split]
    if not split_entry["rows"]:
      continue
    path = os.path.join(directory, split_entry["file"])
    try:
      array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
      raise ConfigError(
          f"Cannot read shard {path} ({e}); run --mode=prepare_data again with the same config "
          f"to re-create missing or damaged shards."
      ) from e
    if array.shape != (split_entry["rows"], 2, max_seq_len) or array.dtype != np.dtype(manifest["dtype"]):
      raise ConfigError(
          f"Shard {path} has shape {array.shape} and dtype {array.dtype}; the manifest says "
          f"({split_entry['rows']}, 2, {max_seq_len}) {manifest['dtype']}. Run --mode=prepare_data "
          f"again to re-create it."
      )
    shards.append(array)
    if config["pack_rows"]:
      lengths.append(_shard_lengths(directory, split_entry, array, tokenizer.pad_id))
  num_rows = sum(shard.shape[0] for shard in shards)
  if num_rows == 0:
    raise ConfigError(
        f"The {split} split of {directory} has no examples (eval_fraction="
        f"{manifest['settings']['eval_fraction']} when it was prepared); "
        + ("prepare it with data.eval_fraction > 0, or set eval.every_steps=0 to train without held-out "
           "evaluation." if split == "eval" else "prepare more documents.")
    )
  fingerprint = data_fingerprint(config, tokenizer, split, manifest["documents_fingerprint"][split])
  data = PreparedData(
      tokenizer=tokenizer,
      input_ids=ShardedRows(shards, 0, max_seq_len),
      token_type_ids=ShardedRows(shards, 1, max_seq_len),
      fingerprint=fingerprint,
      directory=directory,
      token_count=int(manifest["totals"][f"{split}_tokens"]),
      lengths=np.concatenate(lengths) if config["pack_rows"] else None,
  )
  logging.info(
      "loaded prepared %s data: %d examples of length %d in %d shards, %d tokens, from %s",
      split, data.num_examples, max_seq_len, len(shards), data.num_tokens, directory,
  )
  return data
