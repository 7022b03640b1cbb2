"""From a read data config to shards (shards.py): the train/eval split, the tokenizer and the
tokenize-and-pack workers. Shards depend on the config alone; a re-run packs what is missing."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import multiprocessing
import os
import signal
import tempfile
import threading
import time

import numpy as np
from absl import logging

from electra_jax import config_lib, workdir_files
from electra_jax.data import corpus, shards, sources
from electra_jax.data.config import read_config
from electra_jax.data.sources import DOCUMENT_SOURCES, RECORD_SOURCES
from electra_jax.data.tfds_source import TfdsCorpus
from electra_jax.data.packing import pack_documents
from electra_jax.data.shards import PREPARED_FORMAT_VERSION, SPLITS
from electra_jax.data.tokenizer import TOKENIZER_FILES, TRAINING_THREADS, NoSentencesError
from electra_jax.data.tokenizer import SentencePieceTokenizer, configured_tokenizer, keep_tokenizer
from electra_jax.data.tokenizer import open_tokenizer, train_sentencepiece
from electra_jax.errors import ConfigError, OutOfSpace

_LOG_EVERY_S = 10.0
_MANIFEST_EVERY_S = 2.0
_PROGRESS = (
    "prepare_data: %d shards, %d documents, %d tokens, %.0f tokens/s, %s of the input, ETA %s"
)
# Bump whenever extraction or packing would produce different arrays: it keys the cache and
# enters the data fingerprint, so stale arrays are rebuilt and checkpoints refuse changed data.
PACKING_FORMAT_VERSION = 3
PACKING_SEEDS = {"train": 0, "eval": 1}


def is_eval_document(index: int, eval_fraction: float) -> bool:
  # Document i is held out when floor((i + 1) * f) steps past floor(i * f): this spreads
  # exactly floor(n * f) held-out documents evenly over the corpus, for any fraction.
  return int((index + 1) * eval_fraction) > int(index * eval_fraction)


def _record_corpus(config):
  if config["source"] == "hf_datasets":
    return sources.HfDatasetCorpus(config["hf_path"], config["hf_split"], config["text_field"])
  return TfdsCorpus(  # (tensorflow_datasets is imported only here)
      config["tfds_name"], config["tfds_split"], config["tfds_text_field"], config["tfds_data_dir"]
  )


def describe_source(config) -> tuple[dict, dict]:
  """(what identifies the source's documents, for cache keys; an account of it, for manifests)"""
  source = config["source"]
  if source == "builtin":
    # The source bytes, cheap to hash unlike the extracted text: a warm cache needs no parsing.
    fingerprint = {"sources": corpus.builtin_sources_fingerprint()}
    return fingerprint, {"source": "builtin", "stdlib": corpus.stdlib_root()}
  if source in RECORD_SOURCES:
    record_corpus = _record_corpus(config)
    return {source: record_corpus.fingerprint}, record_corpus.description
  files = config["files"]
  fingerprint = {"files": sources.files_fingerprint(files)}
  description = {"source": source, "files": files[:100], "num_files": len(files)}
  if source == "jsonl":  # records end at "\n" only
    fingerprint.update(text_field=config["text_field"], jsonl_lines="newline")
    description["text_field"] = config["text_field"]
  return fingerprint, description


def iter_source_documents(config, stats: sources.SourceStats):
  """The source's first max_documents documents, streamed; `stats` counts skips and progress."""
  limit = config["max_documents"] or None
  if config["source"] == "builtin":
    documents = corpus.builtin_documents(limit)
    stats.total_bytes = len(documents)
    for stats.bytes_read, document in enumerate(documents, 1):  # progress counts documents
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
  source, text_field = config["source"], config["text_field"]
  if source in RECORD_SOURCES:
    field = "tfds_text_field" if source == "tfds" else "text_field"
    return ConfigError(
        f"{_record_corpus(config).name} gave no usable text in field {config[field]!r} "
        f"({stats.counts()}); check data.{field}."
    )
  why = f" ({stats.summary()})" if stats.problems else ""
  wanted = (
      f"files whose JSON lines hold a string field {text_field!r} (data.text_field)."
      if source == "jsonl"
      else "files with one sentence or paragraph per line."
  )
  return ConfigError(
      f"data.source={source!r}: no usable text in data.files {config['files']}{why}. Point "
      f"data.files at non-empty UTF-8 {wanted}"
  )


def _require_documents(config, mode: str) -> None:
  if config["source"] not in DOCUMENT_SOURCES:
    raise ConfigError(
        f"{mode} reads documents; data.source={config['source']!r} has none. Set data.source to "
        f"the corpus, one of {list(DOCUMENT_SOURCES)}."
    )


def _default_workers() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def train_tokenizer(data_config, out_path: str, num_threads: int | None = None):
  """A sentencepiece tokenizer trained on data.source's train documents into the new `out_path`."""
  config = read_config(data_config)
  _require_documents(config, "train_tokenizer")
  out_path = os.path.abspath(os.path.expanduser(out_path))
  if os.path.exists(out_path):
    raise ConfigError(
        f"--out={out_path!r} already exists (prepared data or a workdir may use a model there); "
        "nothing was written: give a new file path, or delete that one first to replace it."
    )
  return train_corpus_tokenizer(config, out_path, num_threads or _default_workers())


def trains_spm(config) -> bool:
  return config["tokenizer"] == "sentencepiece" and not config["spm_model_file"]


def train_corpus_tokenizer(config, path: str, num_threads: int = TRAINING_THREADS):
  """A sentencepiece model trained on the train documents of `config` into `path`; the fixed default
  thread count makes it (and so the shards) the same on any machine."""
  stats = sources.SourceStats()
  model = (config["spm_model_type"], config["spm_vocab_size"], config["source"])
  logging.info(
      "training a sentencepiece %s model of %d pieces on the train documents of %s", *model
  )
  sentences = (
      sentence
      for index, document in enumerate(iter_source_documents(config, stats))
      if not is_eval_document(index, config["eval_fraction"])
      for sentence in document
  )
  try:
    train_sentencepiece(
        sentences, path, config["spm_vocab_size"], config["spm_model_type"], num_threads
    )
  except NoSentencesError as e:  # the source's own errors (a TFDS dataset not prepared) pass
    raise no_documents_error(config, stats) from e
  if config["source"] != "builtin":
    sources.log_stats(config["source"], stats)
  return SentencePieceTokenizer(path)


_WORKER_TOKENIZER = None


def _init_worker(tokenizer, parent: int) -> None:
  """Sets this worker's tokenizer; ends the worker once `parent` is gone (it would wait on its task
  queue forever): the parent passes its pid, as one dead before this ran shows another here."""
  global _WORKER_TOKENIZER
  os.environ["RAYON_NUM_THREADS"] = "1"  # the workers are the parallelism
  _WORKER_TOKENIZER = tokenizer

  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(1)

  threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _tokenize_documents(tokenizer, documents, skipped: dict):
  """Token ids of every sentence of `documents`; a document the tokenizer fails on becomes empty, counted."""
  sentences = [sentence for document in documents for sentence in document]
  with contextlib.suppress(Exception):  # a failure: the culprits are found one document at a time
    token_ids = iter(tokenizer.encode_batch(sentences, num_threads=1))
    return [[next(token_ids) for _ in document] for document in documents]
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
  index, first, documents = task["index"], task["first_document"], task["documents"]
  try:
    tokenizer, skipped = tokenizer or _WORKER_TOKENIZER, {"documents": 0}
    result = {"index": index, "first_document": first, "num_documents": len(documents)}
    held_out = [is_eval_document(first + i, task["eval_fraction"]) for i in range(len(documents))]
    result["splits"] = {}
    for split in SPLITS:  # each split's documents, and their indices in the corpus
      offsets = [i for i, held in enumerate(held_out) if held == (split == "eval")]
      tokenized = _tokenize_documents(tokenizer, [documents[i] for i in offsets], skipped)
      indices = [first + i for i in offsets]
      packed = pack_documents(
          tokenized, task["max_seq_len"], tokenizer, PACKING_SEEDS[split], indices
      )
      input_ids = packed["input_ids"]
      tokens = int(np.count_nonzero(input_ids != tokenizer.pad_id))
      entry = {"documents": len(offsets), "rows": input_ids.shape[0], "tokens": tokens}
      if entry["rows"]:
        rows = np.stack([input_ids, packed["token_type_ids"]], axis=1)
        entry.update(shards.write_split(task, split, rows, tokenizer.pad_id))
      result["splits"][split] = entry
    result["skipped_documents"] = skipped["documents"]
    if "first" in skipped:
      result["first_skip"] = f"document {first}+: {skipped['first']}"
    return result
  except OutOfSpace as e:  # raised again by the main process, as its own write would be
    return {"index": index, "error": str(e), "errno": e.errno}
  except BaseException as e:  # noqa: BLE001 -- reported by the main process, naming the shard
    return {"index": index, "error": f"{type(e).__name__}: {e}"}


def _settings(config, out_dir: str, existing: dict | None, source_key: dict, tokenizer, hint=""):
  """What the shards depend on (a tokenizer's keys once it is known), refused unless out_dir is new
  or its manifest `existing` agrees: a directory is only resumed by a run with equal settings."""
  keys = ("source", "tokenizer", "max_seq_len", "eval_fraction", "max_documents", "shard_documents")
  settings = {key: config[key] for key in keys}
  settings.update(packing_format=PACKING_FORMAT_VERSION, source_key=source_key)
  if tokenizer is not None:
    settings["tokenizer_fingerprint"] = tokenizer.fingerprint
    settings["dtype"] = shards.token_dtype(tokenizer.vocab_size)
  if trains_spm(config):
    settings["spm_trained_here"] = {
        "vocab_size": config["spm_vocab_size"],
        "model_type": config["spm_model_type"],
    }
  old = existing["settings"] if existing is not None else settings
  if differences := {
      key: (old.get(key), new) for key, new in settings.items() if old.get(key) != new
  }:
    raise ConfigError(
        f"data.prepared_dir={out_dir!r} holds shards of another config (was -> now: {differences})"
        f"{hint}. Nothing was changed; choose another data.prepared_dir, or delete that directory "
        "to prepare it again."
    )
  return settings


def prepare_data(data_config, num_workers: int | None = None) -> dict:
  """Tokenize and pack the corpus of `data_config` into shards in data.prepared_dir; returns the manifest.
  `num_workers` spawned processes (default: every core; 0: this one) need `if __name__ == "__main__":`.
  Re-running resumes; a prepared_dir of another config is refused untouched."""
  return prepare_config(read_config(data_config), num_workers)


def _accepted_tokenizer(config, out_dir: str, existing: dict | None, source_key: dict):
  """(tokenizer, settings) once out_dir is accepted, checked before training a tokenizer where
  possible; the tokenizer's file is then copied into out_dir (a model trained here too)."""
  # The given tokenizer, or the model an earlier run trained (a run killed before its first
  # manifest may have left another: it is trained again).
  tokenizer = configured_tokenizer(config, out_dir if existing is not None else "")
  kept = os.path.join(out_dir, TOKENIZER_FILES[config["tokenizer"]])
  settings = _settings(config, out_dir, existing, source_key, tokenizer)
  if tokenizer is None:
    with tempfile.TemporaryDirectory(prefix="electra_jax_spm-") as scratch:
      # Trained outside the directory, moved in only once it is accepted: a refused or killed run
      # leaves no model there that training would later pick up.
      tokenizer = train_corpus_tokenizer(
          config, os.path.join(scratch, TOKENIZER_FILES["sentencepiece"])
      )
      hint = (
          f" ({kept}, which the shards were made with, is missing, and training it again gave "
          "another model; put that file back to resume)"
      )
      settings = _settings(config, out_dir, existing, source_key, tokenizer, hint)
      keep_tokenizer(tokenizer, out_dir)
    tokenizer = open_tokenizer(kept, config)
  elif existing is None or not workdir_files.exists(kept):
    keep_tokenizer(tokenizer, out_dir)
  return tokenizer, settings


def _drop_unlisted(out_dir: str, manifest: dict | None) -> int:
  """Deletes the shard and temporary files `manifest` does not list; returns how many it lists."""
  entries = manifest["shards"] if manifest is not None else []
  splits = [split for entry in entries for split in entry["splits"].values()]
  listed = {split.get(key) for split in splits for key in ("file", "lengths_file")}
  for name in workdir_files.list_files(out_dir):
    if (name.endswith(".npy") or name.startswith(".tmp-")) and name not in listed:
      workdir_files.path(out_dir, name).unlink()
  return len(entries)


def prepare_config(config: dict, num_workers: int | None = None) -> dict:
  """prepare_data of a read config. A full disk or size limit (OutOfSpace, from any write) ends in
  one line, the shards on disk those the manifest lists."""
  _require_documents(config, "prepare_data")
  out_dir = config["prepared_dir"]
  if not out_dir:
    raise ConfigError(
        "prepare_data needs data.prepared_dir, where the shards go: --config.data.prepared_dir=DIR."
    )
  try:
    workdir_files.check_usable(out_dir, "data.prepared_dir")  # before any work
    existing, files = shards.read_manifest(out_dir), workdir_files.list_files(out_dir)
    # A run killed before its first manifest leaves at most its tokenizer and temporary files.
    ours = set(TOKENIZER_FILES.values())
    if existing is None and any(not n.startswith(".tmp-") and n not in ours for n in files):
      raise ConfigError(
          f"data.prepared_dir={out_dir!r} holds files but no manifest.json: it is not a directory "
          "prepare_data wrote. Give an empty or new directory."
      )
    num_workers = _default_workers() if num_workers is None else num_workers
    if num_workers < 0:
      raise ConfigError(f"num_workers must be >= 0 (0 = in this process), got {num_workers}.")
    source_key, description = describe_source(config)
    tokenizer, settings = _accepted_tokenizer(config, out_dir, existing, source_key)
    _drop_unlisted(out_dir, existing)  # accepted: the directory is ours
    listed = existing["shards"] if existing is not None else []
    done = {e["index"]: e for e in listed if shards.shard_is_intact(out_dir, e, files)}
    for index in sorted({e["index"] for e in listed} - set(done)):
      logging.warning("shard %d in %s is missing or damaged; packing it again", index, out_dir)
    if existing is not None and existing["complete"] and len(done) == len(listed):
      logging.info("%s is already prepared (%d shards verified); nothing to do", out_dir, len(done))
      return existing

    # The tokenizer is recorded by the name of its copy in out_dir: the directory can move.
    kind = config["tokenizer"]
    spec = {"kind": kind, "fingerprint": tokenizer.fingerprint}
    spec["vocab_file" if kind == "wordpiece" else "model_file"] = TOKENIZER_FILES[kind]
    manifest = {
        "format_version": PREPARED_FORMAT_VERSION,
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
        config, tokenizer, num_workers, done, save_manifest
    )
    stats.num_documents = sum(entry["num_documents"] for entry in done.values())
    if config["source"] != "builtin":
      sources.log_stats(config["source"], stats)
    if not done:
      raise no_documents_error(config, stats)
    entries = manifest["shards"]
    totals = {
        "documents": stats.num_documents,
        "skipped_documents": sum(e["skipped_documents"] for e in entries),
    }
    for split in SPLITS:
      for total, key in (("documents", "documents"), ("examples", "rows"), ("tokens", "tokens")):
        totals[f"{split}_{total}"] = sum(e["splits"][split][key] for e in entries)
    if skipped := totals["skipped_documents"]:
      first = next(e["first_skip"] for e in entries if e.get("first_skip"))
      logging.warning("skipped %d documents the tokenizer failed on; the first: %s", skipped, first)
    manifest.update(complete=True, totals=totals, source_stats=stats.counts())
    manifest["documents_fingerprint"] = documents_fingerprint
    save_manifest()
    duration = config_lib.format_duration(time.time() - start)
    logging.info("prepared %d shards in %s, in %s: %s", len(entries), out_dir, duration, totals)
    return manifest
  except OutOfSpace as error:
    kept = _drop_unlisted(out_dir, shards.read_manifest(out_dir))
    raise OutOfSpace(
        f"prepare_data: {str(error).rstrip('.')}; {out_dir} keeps the {kept} finished shards its "
        f"{shards.MANIFEST} lists.",
        error.errno,
    ) from None


def _pack_missing(config, tokenizer, num_workers: int, done: dict, save_manifest):
  """Packs the shards not in `done` into it (on `num_workers` processes, 0: here), saved whenever
  this returns or raises; returns the source's stats and each split's fingerprint."""
  out_dir, stats = config["prepared_dir"], sources.SourceStats()
  common = {key: config[key] for key in ("max_seq_len", "eval_fraction")}  # every shard's task
  common.update(out_dir=out_dir, dtype=shards.token_dtype(tokenizer.vocab_size))
  hashers = {split: hashlib.sha256() for split in SPLITS}
  start = last_log = last_save = time.time()
  packed_documents = packed_tokens = skipped_bytes = 0  # in this run; input of shards done before
  if num_workers:
    executor = concurrent.futures.ProcessPoolExecutor(
        num_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer, os.getpid()),
    )
  else:  # a thread of this process, with this tokenizer (SIGTERM stops the main thread's loop)
    executor = concurrent.futures.ThreadPoolExecutor(1)
  pending: set[concurrent.futures.Future] = set()  # each stays until `done` has its shard

  def drain() -> None:
    nonlocal last_log, last_save, packed_documents, packed_tokens
    finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
    for future in finished:
      try:
        result = future.result()
      except concurrent.futures.BrokenExecutor as e:  # (BrokenProcessPool's base)
        raise RuntimeError(
            f"prepare_data: a worker died, killed or out of memory ({e}); the finished shards are "
            f"kept in {out_dir}: run it again to resume (fewer workers use less memory)."
        ) from e
      if "errno" in result:
        raise OutOfSpace(result["error"], result["errno"])
      if "error" in result:
        raise RuntimeError(
            f"prepare_data: shard {result['index']} failed ({result['error']}); the finished ones "
            f"are kept in {out_dir}: fix the cause and run prepare_data again to resume."
        )
      done[result["index"]] = result
      pending.remove(future)
      packed_documents += result["num_documents"]
      packed_tokens += sum(entry["tokens"] for entry in result["splits"].values())
      now, read, total = time.time(), stats.bytes_read, stats.total_bytes
      if now - last_log >= _LOG_EVERY_S:  # an ETA from the share of the input read in this run
        last_log, elapsed = now, max(now - start, 1e-9)
        rate = (read - skipped_bytes) / elapsed
        eta = config_lib.format_duration((total - read) / rate) if rate and total else "?"
        share = f"{100 * read / total:.1f}%" if total else "?"
        counts = (len(done), packed_documents, packed_tokens, packed_tokens / elapsed)
        logging.info(_PROGRESS, *counts, share, eta)
      if now - last_save > _MANIFEST_EVERY_S:
        save_manifest()
        last_save = now

  # SIGTERM or SIGHUP raises in the loop below, so its cleanup (workers, manifest) runs; one that
  # lands in a submit (which may spawn a worker) is raised after it, or that shard would be lost.
  stopped, submitting = [], [False]

  def stop(signum, frame=None):
    stopped.append(signum)
    if not submitting[0]:
      raise SystemExit(
          f"prepare_data stopped by {signal.Signals(signum).name}: the finished shards are kept and "
          f"listed in {os.path.join(out_dir, shards.MANIFEST)}; run the same command to resume."
      )

  main_thread = threading.current_thread() is threading.main_thread()  # (others cannot handle)
  previous = {
      sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP) if main_thread
  }
  try:
    source_documents, size = iter_source_documents(config, stats), config["shard_documents"]
    for index in itertools.count():
      before = stats.bytes_read
      documents, first = list(itertools.islice(source_documents, size)), index * size
      if not documents:
        break
      for document_index, document in enumerate(documents, first):
        split = "eval" if is_eval_document(document_index, config["eval_fraction"]) else "train"
        # Each document's boundary is marked: packing depends on it.
        hashers[split].update(("".join(s + "\n" for s in document) + "\x00\n").encode("utf-8"))
      if index in done:
        skipped_bytes += stats.bytes_read - before
        continue
      task = dict(common, index=index, first_document=first, documents=documents)
      submitting[0] = True
      pending.add(executor.submit(pack_shard, task, None if num_workers else tokenizer))
      submitting[0] = False
      if stopped:
        stop(stopped[0])
      if len(pending) >= 2 * num_workers:
        drain()
    while pending:
      drain()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    executor.shutdown(wait=True, cancel_futures=True)
    # Shards the workers finished while this loop stopped are written: keep them too.
    results = [f.result() for f in pending if not f.cancelled() and f.exception() is None]
    done.update((result["index"], result) for result in results if "error" not in result)
    save_manifest()
  return stats, {split: hashers[split].hexdigest()[:16] for split in SPLITS}
