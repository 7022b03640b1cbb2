"""From a data config to shards (shards.py): its checks, source, train/eval split, tokenizer, and the
tokenize-and-pack workers. Shards depend on the config alone; a re-run packs only what is missing.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import tempfile
import threading
import time

import numpy as np
from absl import logging

from electra_jax import config_lib, workdir_files
from electra_jax.errors import ConfigError
from electra_jax.data import corpus, shards, sources
from electra_jax.data.packing import MIN_SEQ_LEN, pack_documents
from electra_jax.data.shards import PREPARED_FORMAT_VERSION, SPLITS, SPM_MODEL
from electra_jax.data.tokenizer import TRAINING_THREADS, NoSentencesError, SentencePieceTokenizer, train_sentencepiece
from electra_jax.data.wordpiece import WordPieceTokenizer

_LOG_EVERY_S = 10.0
_MANIFEST_EVERY_S = 2.0

RECORD_SOURCES = ("tfds", "hf_datasets")
DOCUMENT_SOURCES = ("builtin",) + sources.FILE_SOURCES + RECORD_SOURCES
SUPPORTED_SOURCES = DOCUMENT_SOURCES + ("prepared",)
SUPPORTED_TOKENIZERS = ("sentencepiece", "wordpiece")
# Bump whenever extraction or packing would produce different arrays: it keys the cache and
# enters the data fingerprint, so stale arrays are rebuilt and checkpoints refuse changed data.
PACKING_FORMAT_VERSION = 3
PACKING_SEEDS = {"train": 0, "eval": 1}
_CACHE_ENV_VAR = "ELECTRA_JAX_CACHE"
# The data keys a config may leave out, with their defaults (each value is cast to its default's type).
_DEFAULTS = {
    "tokenizer": "sentencepiece",
    "text_field": "text",
    "lowercase": True,
    "spm_vocab_size": 8192,
    "spm_model_type": "unigram",
    "max_documents": 0,
    "eval_fraction": 0.02,
    "shard_documents": 10_000,
}
# An empty value of these means the default too.
_RECORD_SOURCE_KEYS = {
    "tfds_name": "",
    "tfds_split": "train",
    "tfds_text_field": "text",
    "tfds_data_dir": "",
    "hf_path": "",
    "hf_split": "train",
}


def is_eval_document(index: int, eval_fraction: float) -> bool:
  # Document i is held out when floor((i + 1) * f) steps past floor(i * f): this spreads
  # exactly floor(n * f) held-out documents evenly over the corpus, for any fraction.
  return int((index + 1) * eval_fraction) > int(index * eval_fraction)


def read_config(data_config) -> dict:
  """The data config as a dict of checked values, paths absolute; raises ConfigError naming a bad one."""
  source = data_config.source
  if source not in SUPPORTED_SOURCES:
    raise ConfigError(
        f"Unknown data.source {source!r}; supported sources are {list(SUPPORTED_SOURCES)} (text "
        "and jsonl read the files named by data.files, tfds the dataset data.tfds_name, hf_datasets "
        "the local dataset data.hf_path, prepared the shards in data.prepared_dir)."
    )
  config = {key: type(default)(data_config.get(key, default)) for key, default in _DEFAULTS.items()}
  config.update(
      {
          key: str(data_config.get(key, default) or default)
          for key, default in _RECORD_SOURCE_KEYS.items()
      }
  )
  for key in ("vocab_file", "spm_model_file", "prepared_dir"):
    value = str(data_config.get(key, "") or "")
    if workdir_files.is_remote(value):  # a bucket: gs://bucket/path
      config[key] = value.rstrip("/")
    else:
      config[key] = os.path.abspath(os.path.expanduser(value)) if value else ""
  tokenizer, vocab_file, spm_model_file = (
      config["tokenizer"],
      config["vocab_file"],
      config["spm_model_file"],
  )
  strip_accents, pack_rows = data_config.get("strip_accents", None), data_config.get(
      "pack_rows", False
  )
  problems = (  # (whether it is wrong, what to say), the first wrong one is raised
      (
          tokenizer not in SUPPORTED_TOKENIZERS,
          f"Unknown data.tokenizer {tokenizer!r}; use one of "
          f"{list(SUPPORTED_TOKENIZERS)} (wordpiece reads a BERT vocab.txt given by data.vocab_file).",
      ),
      (
          tokenizer == "wordpiece" and not vocab_file,
          "data.tokenizer='wordpiece' needs data.vocab_file, the path of a "
          "BERT vocab.txt (one token per line), e.g. --config.data.vocab_file=uncased_L-12_H-768_A-12/vocab.txt.",
      ),
      (
          tokenizer == "wordpiece" and not os.path.isfile(vocab_file),
          f"data.vocab_file={vocab_file!r} is not a file; give the path of a BERT vocab.txt.",
      ),
      (
          strip_accents is not None and not isinstance(strip_accents, bool),
          "data.strip_accents must be None (follow "
          f"data.lowercase, as BERT does), True or False, got {strip_accents!r}.",
      ),
      (
          spm_model_file and tokenizer != "sentencepiece",
          f"data.spm_model_file={spm_model_file!r} is set but "
          f"data.tokenizer={tokenizer!r}; set data.tokenizer='sentencepiece' to use that model, or clear "
          "data.spm_model_file.",
      ),
      (
          spm_model_file
          and not (
              workdir_files.exists(spm_model_file)
              if workdir_files.is_remote(spm_model_file)
              else os.path.isfile(spm_model_file)
          ),
          f"data.spm_model_file={spm_model_file!r} is not a "
          "file; give a model written by --mode=train_tokenizer (or clear it to train one in the cache).",
      ),
      (
          source == "prepared" and not config["prepared_dir"],
          "data.source='prepared' needs data.prepared_dir, the directory --mode=prepare_data wrote.",
      ),
      (
          config["shard_documents"] < 1,
          f"data.shard_documents must be >= 1, got {config['shard_documents']}.",
      ),
      (
          source in ("jsonl", "hf_datasets") and not config["text_field"],
          "data.text_field is empty; name the JSON field holding each document's text.",
      ),
      (
          config["max_documents"] < 0,
          f"data.max_documents must be >= 0 (0 means all), got {config['max_documents']}.",
      ),
      (
          not 0.0 <= config["eval_fraction"] < 1.0,
          "data.eval_fraction must be in [0, 1) (e.g. 0.02 holds out 2% of "
          f"documents), got {config['eval_fraction']}.",
      ),
      (
          not isinstance(pack_rows, (bool, np.bool_)),
          "data.pack_rows must be True (several whole examples per row) "
          f"or False (one per row), got {pack_rows!r}.",
      ),
  )
  for wrong, message in problems:
    if wrong:
      raise ConfigError(message)
  cache_dir = (
      os.path.expanduser(str(data_config.get("cache_dir", "")))
      or os.environ.get(_CACHE_ENV_VAR)
      or (os.path.join(os.path.expanduser("~"), ".cache", "electra_jax"))
  )
  config.update(
      source=source,
      strip_accents=strip_accents,
      pack_rows=bool(pack_rows),
      cache_dir=cache_dir,
      max_seq_len=int(data_config.max_seq_len),
      files=sources.resolve_files(data_config.get("files", ""))
      if source in sources.FILE_SOURCES
      else [],
  )
  return config


def _record_corpus(config):
  if config["source"] == "hf_datasets":
    return sources.HfDatasetCorpus(config["hf_path"], config["hf_split"], config["text_field"])
  from electra_jax.data.tfds_source import TfdsCorpus  # noqa: PLC0415  (imports tfds, which is heavy)

  return TfdsCorpus(
      config["tfds_name"], config["tfds_split"], config["tfds_text_field"], config["tfds_data_dir"]
  )


def describe_source(config) -> tuple[dict, dict]:
  """(what identifies the source's documents, for cache keys; an account of it, for manifests)"""
  source = config["source"]
  if source == "builtin":
    # The source bytes, cheap to hash unlike the extracted text: a warm cache needs no parsing.
    return {"sources": corpus.builtin_sources_fingerprint()}, {
        "source": "builtin",
        "stdlib": corpus.stdlib_root(),
    }
  if source in RECORD_SOURCES:
    record_corpus = _record_corpus(config)
    return {source: record_corpus.fingerprint}, record_corpus.description
  fingerprint = {"files": sources.files_fingerprint(config["files"])}
  description = {
      "source": source,
      "files": config["files"][:100],
      "num_files": len(config["files"]),
  }
  if source == "jsonl":
    fingerprint.update(
        text_field=config["text_field"], jsonl_lines="newline"
    )  # records end at "\n" only
    description["text_field"] = config["text_field"]
  return fingerprint, description


def iter_source_documents(config, stats: sources.SourceStats):
  """The source's first max_documents documents, streamed; `stats` counts skips and progress."""
  limit = config["max_documents"] or None
  if config["source"] == "builtin":
    documents = corpus.builtin_documents(limit)
    stats.total_bytes = len(documents)
    for document in documents:
      stats.bytes_read += 1
      stats.num_documents += 1
      yield document
    return
  if config["source"] in RECORD_SOURCES:
    documents = _record_corpus(config).iter_documents(stats)
  else:
    documents = sources.iter_documents(
        config["source"], config["files"], config["text_field"], stats
    )
  yield from itertools.islice(documents, limit)


def no_documents_error(config, stats: sources.SourceStats) -> ConfigError:
  source = config["source"]
  if source in sources.FILE_SOURCES:
    return sources.no_usable_text_error(source, config["files"], config["text_field"], stats)
  if source == "builtin":
    return ConfigError(
        f"The built-in corpus gave no documents (max_documents={config['max_documents']})."
    )
  what, field = (
      (f"TFDS dataset {config['tfds_name']!r} split {config['tfds_split']!r}", "tfds_text_field")
      if source == "tfds"
      else (f"The dataset {config['hf_path']!r} split {config['hf_split']!r}", "text_field")
  )
  return ConfigError(
      f"{what} gave no usable text in field {config[field]!r} ({stats.counts()}); check data.{field}."
  )


def _require_documents(config, mode: str) -> None:
  if config["source"] not in DOCUMENT_SOURCES:
    raise ConfigError(
        f"{mode} reads documents; data.source={config['source']!r} has none. Set data.source to the "
        f"corpus, one of {list(DOCUMENT_SOURCES)}."
    )


def _default_workers() -> int:
  if hasattr(os, "sched_getaffinity"):  # Linux
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def train_tokenizer(data_config, out_path: str, num_threads: int | None = None) -> dict:
  """Train a sentencepiece model on the train documents of data.source into `out_path` (for
  data.spm_model_file); returns what was trained."""
  config = read_config(data_config)
  _require_documents(config, "train_tokenizer")
  if not out_path:
    raise ConfigError("train_tokenizer needs an output path (--out=PATH/spm.model).")
  out_path = os.path.abspath(os.path.expanduser(out_path))
  if os.path.isdir(out_path):
    raise ConfigError(
        f"--out={out_path!r} is a directory; give a file name such as {out_path}/spm.model."
    )
  if os.path.exists(out_path):
    raise ConfigError(
        f"--out={out_path!r} already exists: prepared data or a workdir may use that model. "
        "Nothing was written; give a new path, or delete the file first to replace it."
    )
  start, stats = time.time(), sources.SourceStats()
  tokenizer = train_corpus_tokenizer(config, out_path, num_threads or _default_workers(), stats)
  if config["source"] != "builtin":
    sources.log_stats(config["source"], stats)
  info = {
      "path": out_path,
      "fingerprint": tokenizer.fingerprint,
      "vocab_size": tokenizer.vocab_size,
      "model_type": config["spm_model_type"],
      "documents_read": stats.num_documents,
      "seconds": round(time.time() - start, 1),
  }
  logging.info("wrote %s: %s", out_path, info)
  return info


def configured_tokenizer(config, directory: str = ""):
  """The tokenizer a read config names: WordPiece, data.spm_model_file, or else the sentencepiece
  model trained into `directory`; None while that model does not exist."""
  if config["tokenizer"] == "wordpiece":
    return WordPieceTokenizer(config["vocab_file"], config["lowercase"], config["strip_accents"])
  if config["spm_model_file"]:
    return _sentencepiece(config["spm_model_file"], config)
  model_path = os.path.join(directory, SPM_MODEL)
  return (
      _sentencepiece(model_path, config) if directory and workdir_files.exists(model_path) else None
  )


def _sentencepiece(model_path: str, config) -> SentencePieceTokenizer:
  """The model at `model_path`; one in a bucket is read from a local copy in the cache named by
  its content (export and the workdir's copy need a local file)."""
  return SentencePieceTokenizer(workdir_files.local_copy(model_path, config["cache_dir"]))


def trains_spm(config) -> bool:
  return config["tokenizer"] == "sentencepiece" and not config["spm_model_file"]


def train_corpus_tokenizer(config, path: str, num_threads: int = TRAINING_THREADS, stats=None):
  """A sentencepiece model trained on the train documents of `config` into `path`; the fixed default
  thread count makes it (and so the shards) the same on any machine."""
  stats = stats or sources.SourceStats()
  logging.info(
      "training a sentencepiece %s model of %d pieces on the train documents of %s ...",
      config["spm_model_type"],
      config["spm_vocab_size"],
      config["source"],
  )
  sentences = (
      sentence
      for index, document in enumerate(iter_source_documents(config, stats))
      if not is_eval_document(index, config["eval_fraction"])
      for sentence in document
  )
  try:
    train_sentencepiece(
        sentences,
        path,
        vocab_size=config["spm_vocab_size"],
        model_type=config["spm_model_type"],
        num_threads=num_threads,
    )
  except (
      NoSentencesError
  ) as e:  # the source's own errors (a TFDS dataset not prepared) pass as they are
    raise no_documents_error(config, stats) from e
  return SentencePieceTokenizer(path)


_WORKER_TOKENIZER = None


def _init_worker(config: dict, out_dir: str, fingerprint: str, parent: int) -> None:
  global _WORKER_TOKENIZER
  os.environ["RAYON_NUM_THREADS"] = "1"
  _WORKER_TOKENIZER = configured_tokenizer(config, out_dir)
  if (found := _WORKER_TOKENIZER and _WORKER_TOKENIZER.fingerprint) != fingerprint:
    raise ConfigError(
        f"The tokenizer file changed during preparation (fingerprint {found}, "
        f"expected {fingerprint}); leave it alone and run prepare_data again."
    )
  _exit_with_parent(parent)


def _exit_with_parent(parent: int) -> None:
  """Ends this worker once `parent` is gone (it would wait on its task queue forever); the parent passes
  its pid, as a parent dead before this ran shows another one here."""

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(1)

  threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _tokenize_documents(tokenizer, documents, skipped: dict):
  """Token ids of every sentence of `documents`; a document the tokenizer fails on becomes empty, counted."""
  sentences = [sentence for document in documents for sentence in document]
  try:
    token_ids = iter(tokenizer.encode_batch(sentences, num_threads=1))
    return [[next(token_ids) for _ in document] for document in documents]
  except Exception:  # noqa: BLE001 -- find the culprits one document at a time
    pass
  tokenized = []
  for document in documents:
    try:
      tokenized.append([tokenizer.encode(sentence) for sentence in document])
    except Exception as e:  # noqa: BLE001 -- a bad document is a counted skip, not a dead worker
      skipped["documents"] += 1
      skipped.setdefault("first", f"{type(e).__name__}: {e}"[:300])
      tokenized.append([])
  return tokenized


def pack_shard(task: dict, tokenizer=None) -> dict:
  """Tokenize and pack one shard's documents into a file per split; a failure comes back as {"error": ...}."""
  index = task["index"]
  try:
    tokenizer, skipped = tokenizer or _WORKER_TOKENIZER, {"documents": 0}
    result = {
        "index": index,
        "first_document": task["first_document"],
        "num_documents": len(task["documents"]),
        "splits": {},
    }
    by_split = {split: ([], []) for split in SPLITS}
    for document_index, document in enumerate(task["documents"], task["first_document"]):
      documents, indices = by_split[
          "eval" if is_eval_document(document_index, task["eval_fraction"]) else "train"
      ]
      documents.append(document)
      indices.append(document_index)
    for split, (documents, indices) in by_split.items():
      packed = pack_documents(
          _tokenize_documents(tokenizer, documents, skipped),
          task["max_seq_len"],
          cls_id=tokenizer.cls_id,
          sep_id=tokenizer.sep_id,
          pad_id=tokenizer.pad_id,
          seed=PACKING_SEEDS[split],
          document_indices=indices,
      )
      input_ids = packed["input_ids"]
      entry = {
          "documents": len(documents),
          "rows": input_ids.shape[0],
          "tokens": int(np.count_nonzero(input_ids != tokenizer.pad_id)),
      }
      if entry["rows"]:
        entry.update(
            shards.write_split(
                task["out_dir"],
                split,
                index,
                input_ids,
                packed["token_type_ids"],
                tokenizer.pad_id,
                task["dtype"],
            )
        )
      result["splits"][split] = entry
    result["skipped_documents"] = skipped["documents"]
    if "first" in skipped:
      result["first_skip"] = f"document {task['first_document']}+: {skipped['first']}"
    return result
  except BaseException as e:  # noqa: BLE001 -- reported by the main process, naming the shard
    return {"index": index, "error": f"{type(e).__name__}: {e}"}


# The settings only the tokenizer's file gives; before a model is trained the others are checked.
_TOKENIZER_FILE_SETTINGS = ("tokenizer_fingerprint", "dtype")


def _settings(config, source_key: dict, tokenizer) -> dict:
  """What the shards depend on; a directory is only resumed by a run with equal settings."""
  settings = {
      "prepared_format": PREPARED_FORMAT_VERSION,
      "packing_format": PACKING_FORMAT_VERSION,
      "source": config["source"],
      "source_key": source_key,
      **{
          key: config[key]
          for key in (
              "tokenizer",
              "max_seq_len",
              "eval_fraction",
              "max_documents",
              "shard_documents",
          )
      },
  }
  if tokenizer is not None:
    settings.update(
        tokenizer_fingerprint=tokenizer.fingerprint, dtype=shards.token_dtype(tokenizer.vocab_size)
    )
  if trains_spm(config):
    settings["spm_trained_here"] = {
        "vocab_size": config["spm_vocab_size"],
        "model_type": config["spm_model_type"],
    }
  return settings


def config_key(settings: dict) -> str:
  """A short hash of `settings` (a prepared directory's, or the cache's key)."""
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _refuse_another_config(
    out_dir: str, existing: dict | None, settings: dict, hint: str = ""
) -> None:
  """Raises unless out_dir is new or its manifest `existing` was written with `settings`."""
  if existing is None:
    return
  old, known = existing["settings"], "tokenizer_fingerprint" in settings
  keys = list(settings) + [
      k for k in old if k not in settings and (known or k not in _TOKENIZER_FILE_SETTINGS)
  ]
  differences = {k: (old.get(k), settings.get(k)) for k in keys if old.get(k) != settings.get(k)}
  if differences:
    raise ConfigError(
        f"data.prepared_dir={out_dir!r} holds shards of another config (was -> now: {differences})"
        f"{hint}. Nothing was changed; choose another data.prepared_dir, or delete that directory "
        "to prepare it again."
    )


def prepare_data(data_config, num_workers: int | None = None) -> dict:
  """Tokenize and pack the corpus of `data_config` into shards in data.prepared_dir; returns the manifest.
  `num_workers` spawned processes (default: every core; 0: this one) need `if __name__ == "__main__":`.
  Re-running resumes; a prepared_dir of another config is refused untouched."""
  return prepare_config(read_config(data_config), num_workers)


def _accepted_tokenizer(config, out_dir: str, existing: dict | None, source_key: dict):
  """(tokenizer, settings) once out_dir is accepted, before training a tokenizer where possible; a model
  trained here is written into out_dir."""
  tokenizer = configured_tokenizer(
      config, out_dir
  )  # the configured one, or one an earlier run trained
  model_path = os.path.join(out_dir, SPM_MODEL)
  if (
      tokenizer is not None
      and trains_spm(config)
      and tokenizer.vocab_size != config["spm_vocab_size"]
  ):
    raise ConfigError(
        f"{model_path} (trained by an earlier prepare_data) has {tokenizer.vocab_size} pieces, but "
        f"data.spm_vocab_size={config['spm_vocab_size']}. Nothing was changed; choose another "
        "data.prepared_dir, or delete that directory to prepare it again."
    )
  settings = _settings(config, source_key, tokenizer)
  _refuse_another_config(out_dir, existing, settings)
  if tokenizer is not None:
    return tokenizer, settings
  with tempfile.TemporaryDirectory(prefix="electra_jax_spm-") as scratch:
    # Trained outside the directory, moved in only once it is accepted: a refused or killed run
    # leaves no model there that training would later pick up.
    trained = train_corpus_tokenizer(config, os.path.join(scratch, SPM_MODEL))
    settings = _settings(config, source_key, trained)
    _refuse_another_config(
        out_dir,
        existing,
        settings,
        hint=f" ({model_path}, which the shards were made with, is "
        "missing, and training it again gave another model; put that file back to resume)",
    )
    with open(trained.model_path, "rb") as f:
      workdir_files.write_bytes(model_path, f.read())
  return _sentencepiece(model_path, config), settings


def prepare_config(config: dict, num_workers: int | None = None) -> dict:
  _require_documents(config, "prepare_data")
  out_dir = config["prepared_dir"]
  if not out_dir:
    raise ConfigError(
        "prepare_data needs data.prepared_dir, the directory the shards go to, e.g. "
        "--config.data.prepared_dir=/data/electra_prepared."
    )
  remote = workdir_files.is_remote(out_dir)
  if remote:  # before any work: the bucket exists, and takes this account's writes
    workdir_files.check_bucket(out_dir, "data.prepared_dir", write=True)
  if not remote and os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(
        f"data.prepared_dir={out_dir!r} is a file; give a directory (new, or one "
        "prepare_data wrote) for the shards."
    )
  existing = shards.read_manifest(out_dir)  # (a bucket that does not exist is refused here)
  files = workdir_files.list_files(out_dir)
  # (A run killed before its first manifest leaves at most its tokenizer and temporary files.)
  if existing is None and any(not name.startswith(".tmp-") and name != SPM_MODEL for name in files):
    raise ConfigError(
        f"data.prepared_dir={out_dir!r} holds files but no manifest.json: it is not a "
        "directory prepare_data wrote. Give an empty or new directory."
    )
  num_workers = _default_workers() if num_workers is None else num_workers
  if num_workers < 0:
    raise ConfigError(f"num_workers must be >= 0 (0 = in this process), got {num_workers}.")
  if config["max_seq_len"] < MIN_SEQ_LEN:
    raise ConfigError(
        f"data.max_seq_len must be at least {MIN_SEQ_LEN}, got {config['max_seq_len']}."
    )
  source_key, description = describe_source(config)
  tokenizer, settings = _accepted_tokenizer(config, out_dir, existing, source_key)

  # Accepted: the directory is ours. A killed run's half-written local files have temporary names;
  # clear them. (An object in a bucket exists only once its upload completed.)
  if not remote:
    os.makedirs(out_dir, exist_ok=True)
    for name in files:
      if name.startswith(".tmp-"):
        os.remove(os.path.join(out_dir, name))
  # A model in out_dir is recorded by a relative path: the directory can move.
  spec = {
      "kind": config["tokenizer"],
      "fingerprint": tokenizer.fingerprint,
      "vocab_size": tokenizer.vocab_size,
  }
  if config["tokenizer"] == "wordpiece":
    spec.update(
        vocab_file=tokenizer.vocab_file,
        lowercase=tokenizer.lowercase,
        strip_accents=tokenizer.strip_accents,
    )
  else:
    model_file = config["spm_model_file"]
    spec["model_file"] = (
        SPM_MODEL if model_file in ("", os.path.join(out_dir, SPM_MODEL)) else model_file
    )
  done: dict[int, dict] = {}
  for entry in existing["shards"] if existing is not None else ():
    if shards.shard_is_intact(out_dir, entry, files):
      done[entry["index"]] = entry
    else:
      logging.warning(
          "shard %d in %s is missing or damaged; packing it again", entry["index"], out_dir
      )
  if existing is not None and existing["complete"] and len(done) == len(existing["shards"]):
    logging.info("%s is already prepared (%d shards verified); nothing to do", out_dir, len(done))
    return existing

  manifest = {
      "format_version": PREPARED_FORMAT_VERSION,
      "config_key": config_key(settings),
      "settings": settings,
      "source": description,
      "tokenizer": spec,
      "max_seq_len": config["max_seq_len"],
      "dtype": settings["dtype"],
      "complete": False,
  }

  def save_manifest() -> None:
    manifest["shards"] = sorted(done.values(), key=lambda e: e["index"])
    workdir_files.write_json(os.path.join(out_dir, shards.MANIFEST), manifest)

  save_manifest()
  start = time.time()
  stats, documents_fingerprint = _pack_missing(
      config, tokenizer, settings["dtype"], num_workers, done, save_manifest
  )
  stats.num_documents = sum(entry["num_documents"] for entry in done.values())
  if config["source"] != "builtin":
    sources.log_stats(config["source"], stats)
  if not done:
    raise no_documents_error(config, stats)
  if sorted(done) != list(range(len(done))):
    raise RuntimeError(
        f"prepare_data: shards {sorted(set(range(len(done))) - set(done))} are missing; run it again."
    )
  entries = manifest["shards"]
  totals = {
      "documents": stats.num_documents,
      "skipped_documents": sum(e["skipped_documents"] for e in entries),
  }
  for split in SPLITS:
    for total, key in (("documents", "documents"), ("examples", "rows"), ("tokens", "tokens")):
      totals[f"{split}_{total}"] = sum(e["splits"][split][key] for e in entries)
  if totals["skipped_documents"]:
    logging.warning(
        "skipped %d documents the tokenizer failed on; the first: %s",
        totals["skipped_documents"],
        next(e["first_skip"] for e in entries if e.get("first_skip")),
    )
  manifest.update(
      complete=True,
      totals=totals,
      source_stats=stats.counts(),
      documents_fingerprint=documents_fingerprint,
  )
  save_manifest()
  logging.info(
      "prepared %s: %d shards, %d train / %d eval examples, %d train tokens, in %s",
      out_dir,
      len(entries),
      totals["train_examples"],
      totals["eval_examples"],
      totals["train_tokens"],
      config_lib.format_duration(time.time() - start),
  )
  return manifest


def _pack_missing(config, tokenizer, dtype: str, num_workers: int, done: dict, save_manifest):
  """Packs the shards not in `done` into it (on `num_workers` processes, 0: here); the manifest lists every
  finished shard whenever this returns or raises. Returns the source's stats and each split's fingerprint.
  """
  out_dir, stats = config["prepared_dir"], sources.SourceStats()
  hashers = {split: hashlib.sha256() for split in SPLITS}
  start = last_log = last_manifest_write = time.time()
  packed_documents = packed_tokens = 0  # in this run
  skipped_position = done_position = 0  # input consumed by shards done before / in this run
  if num_workers:
    executor = concurrent.futures.ProcessPoolExecutor(
        num_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(config, out_dir, tokenizer.fingerprint, os.getpid()),
    )
  else:  # a thread of this process, with this tokenizer (SIGTERM stops the main thread's loop)
    executor = concurrent.futures.ThreadPoolExecutor(1)
  pending: dict[concurrent.futures.Future, int] = {}  # each task's position in the input

  def drain() -> None:
    nonlocal last_log, last_manifest_write, packed_documents, packed_tokens, done_position
    finished, _ = concurrent.futures.wait(
        list(pending), return_when=concurrent.futures.FIRST_COMPLETED
    )
    for (
        future
    ) in finished:  # each stays in `pending` until `done` has it (a SIGTERM may stop this loop)
      try:
        result = future.result()
      except (
          concurrent.futures.BrokenExecutor
      ) as e:  # (BrokenProcessPool, importable without the process pool)
        raise RuntimeError(
            f"prepare_data: a worker process died (killed, or out of memory) ({e}). The finished "
            f"shards are kept in {out_dir}; run prepare_data again to resume (fewer workers use "
            "less memory)."
        ) from e
      if "error" in result:
        raise RuntimeError(
            f"prepare_data: shard {result['index']} failed ({result['error']}). The {len(done)} "
            f"finished shards are kept in {out_dir}; fix the cause and run prepare_data again to "
            "resume."
        )
      done[result["index"]] = result
      done_position = max(done_position, pending.pop(future))
      packed_documents += result["num_documents"]
      packed_tokens += sum(entry["tokens"] for entry in result["splits"].values())
      now = time.time()
      if now - last_log >= _LOG_EVERY_S:  # an ETA from the share of the input consumed
        last_log = now
        total, worked, elapsed = stats.total_bytes, done_position - skipped_position, now - start
        eta = (
            config_lib.format_duration(elapsed * (total - done_position) / worked)
            if worked > 0 and total
            else "?"
        )
        logging.info(
            "prepare_data: %d shards, %d documents, %d tokens, %.0f tokens/s, %s of the input, ETA %s",
            len(done),
            packed_documents,
            packed_tokens,
            packed_tokens / max(elapsed, 1e-9),
            f"{100 * done_position / total:.1f}%" if total else "?",
            eta,
        )
      if now - last_manifest_write > _MANIFEST_EVERY_S:
        save_manifest()
        last_manifest_write = now

  def stop(signum, frame):  # raised in the loop below, so its cleanup (workers, manifest) runs
    raise SystemExit(
        f"prepare_data stopped by SIGTERM: the finished shards are kept and listed in "
        f"{os.path.join(out_dir, shards.MANIFEST)}; run the same command to resume."
    )

  try:
    previous_handler = signal.signal(signal.SIGTERM, stop)
  except ValueError:  # not the main thread: SIGTERM keeps its handler
    previous_handler = None
  try:
    source_documents, size = iter_source_documents(config, stats), config["shard_documents"]
    for index in itertools.count():
      documents, first = list(itertools.islice(source_documents, size)), index * size
      if not documents:
        break
      for document_index, document in enumerate(documents, first):
        split = "eval" if is_eval_document(document_index, config["eval_fraction"]) else "train"
        hashers[split].update(corpus.document_bytes(document))
      if index in done:
        skipped_position = stats.bytes_read
        continue
      task = {
          "out_dir": out_dir,
          "max_seq_len": config["max_seq_len"],
          "eval_fraction": config["eval_fraction"],
          "dtype": dtype,
          "index": index,
          "first_document": first,
          "documents": documents,
      }
      pending[executor.submit(pack_shard, task, None if num_workers else tokenizer)] = (
          stats.bytes_read
      )
      if len(pending) >= 2 * num_workers:
        drain()
    while pending:
      drain()
  finally:
    if previous_handler is not None:
      signal.signal(signal.SIGTERM, previous_handler)
    executor.shutdown(wait=True, cancel_futures=True)
    # Shards the workers finished while this loop stopped are written: keep them too.
    for future in pending:
      if not future.cancelled() and future.exception() is None:
        result = future.result()
        if "error" not in result:
          done[result["index"]] = result
    save_manifest()
  return stats, {split: hashers[split].hexdigest()[:16] for split in SPLITS}
