"""Pre-training batches from prepared shards (data.prepared_dir's, or the cache a document source is
prepared into on first use); get_batch is a pure function of the step: resuming needs no state."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from absl import logging

from electra_jax import workdir_files
from electra_jax.data import prepare, shards
from electra_jax.data.config import read_config
from electra_jax.data.packing import ROW_PACKING_VERSION, RowPacking, assemble_rows, plan_rows
from electra_jax.data.prepare import PACKING_FORMAT_VERSION
from electra_jax.data.shards import PREPARED_FORMAT_VERSION, ShardedRows
from electra_jax.data.tokenizer import TOKENIZER_FILES, SentencePieceTokenizer, WordPieceTokenizer
from electra_jax.data.tokenizer import configured_tokenizer, open_tokenizer
from electra_jax.errors import ConfigError


@dataclasses.dataclass
class PretrainingData:
  """Packed examples of one split, with the tokenizer that produced them."""

  tokenizer: SentencePieceTokenizer | WordPieceTokenizer
  input_ids: np.ndarray  # int32 [num_examples, max_seq_len] (ShardedRows when loaded from shards)
  token_type_ids: np.ndarray  # int32 [num_examples, max_seq_len]
  # Identifies tokenizer, max_seq_len and the split's documents: a checkpoint refuses other data.
  fingerprint: str
  packing: RowPacking | None = None  # data.pack_rows: the examples each row holds
  num_tokens: int = 0  # non-padding tokens, as the manifest counted them
  # The background check of the shards' files: its result is the first failure, or None.
  verification: concurrent.futures.Future | None = None

  @property
  def num_examples(self) -> int:
    return int(self.input_ids.shape[0])

  @property
  def num_rows(self) -> int:
    return self.packing.num_rows if self.packing is not None else self.num_examples

  @property
  def max_seq_len(self) -> int:
    return int(self.input_ids.shape[1])


def _corpus_cache_dir(config) -> str:
  """The cache directory of one corpus and tokenizer (any max_seq_len)."""
  key_fields = {
      "format": PACKING_FORMAT_VERSION,
      "prepared_format": PREPARED_FORMAT_VERSION,  # a cache of another is rebuilt, not refused
      "max_documents": config["max_documents"],
      "eval_fraction": config["eval_fraction"],
      **prepare.describe_source(config)[0],
  }
  if prepare.trains_spm(config):  # only the keys that change the tokenizer enter the key
    key_fields.update({key: config[key] for key in ("spm_vocab_size", "spm_model_type")})
  else:  # a given model or vocab.txt
    key_fields.update({config["tokenizer"]: configured_tokenizer(config).fingerprint})
  key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(config["cache_dir"], config["source"], key)


def _loadable(data_config, split: str | None = None) -> dict:
  """The read config, pointed at prepared shards (a document source's cache, prepared when missing
  or damaged); without a split only the tokenizer is readied."""
  config = read_config(data_config)
  trains_spm = prepare.trains_spm(config)
  if config["source"] == "prepared" or (split is None and not trains_spm):
    return config  # nothing to prepare or train
  corpus_dir = _corpus_cache_dir(config)
  os.makedirs(corpus_dir, exist_ok=True)
  directory = os.path.join(corpus_dir, f"len{config['max_seq_len']}")
  with open(os.path.join(corpus_dir, ".lock"), "a") as lock:  # one process fills a cache at a time
    fcntl.flock(lock, fcntl.LOCK_EX)
    if trains_spm:
      model = os.path.join(corpus_dir, TOKENIZER_FILES["sentencepiece"])
      if not os.path.exists(model):  # written atomically: a killed run leaves no model behind
        prepare.train_corpus_tokenizer(config, model)
      config = dict(config, spm_model_file=model)
    config = dict(config, prepared_dir=directory)
    if split is None:
      return config
    manifest, files = shards.read_manifest(directory), workdir_files.list_files(directory)
    intact = lambda entry: shards.shard_is_intact(directory, entry, files, checksums=False)
    if manifest is None or not manifest.get("complete") or not all(map(intact, manifest["shards"])):
      logging.info("no cached data in %s; preparing it", directory)
      prepare.prepare_config(config, num_workers=0)
  return config


def load_tokenizer(data_config) -> SentencePieceTokenizer | WordPieceTokenizer:
  """The tokenizer `load_pretraining_data(data_config)` uses (trained first if the cache lacks it)."""
  config = _loadable(data_config)
  if config["source"] == "prepared":
    return prepared_tokenizer(config, shards.open_manifest(config["prepared_dir"]))
  return configured_tokenizer(config)


def workdir_tokenizer(workdir, data_config) -> SentencePieceTokenizer | WordPieceTokenizer:
  """The tokenizer the pre-training run in `workdir` used: the copy keep_tokenizer wrote there, else
  (a workdir in a bucket, or from before the copy) the one its data group `data_config` names."""
  kept = os.path.join(os.fspath(workdir), TOKENIZER_FILES[data_config.tokenizer])
  if workdir_files.is_remote(workdir) or not os.path.isfile(kept):
    return load_tokenizer(data_config)
  return open_tokenizer(kept, data_config)


@functools.lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  # Modulo 2**64: numpy takes only non-negative seeds, and no non-negative seed changes.
  permutation = np.random.default_rng([seed % 2**64, epoch]).permutation(num_examples)
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
  """This process's rows of global batch `step`, a pure function of its arguments: the p-th slice
  of stream positions [stream_offset + step * B, +B) of epochs 0, 1, ..., each a permutation seeded
  by (seed, epoch) (stream_offset: where a checkpoint saw the batch size change)."""
  if data.num_rows == 0 or global_batch_size <= 0 or global_batch_size % max(process_count, 1):
    raise ConfigError(
        f"get_batch: a global batch of {global_batch_size} rows from {data.num_rows} over "
        f"{process_count} processes; give a positive multiple of the process count, and data."
    )
  if (
      not 0 <= process_index < process_count
      or min(step, stream_offset + step * global_batch_size) < 0
  ):
    raise ConfigError(
        f"get_batch: process {process_index} of {process_count}, step {step}, stream_offset "
        f"{stream_offset}; the process must be one of them, and the batch start at 0 or later."
    )
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
  """The arrays of a batch sent to the devices (position_ids derive from segment_ids)."""
  return ("input_ids", "token_type_ids", "attention_mask") + (("segment_ids",) if pack_rows else ())


def get_rows(data: PretrainingData, rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows `rows` (in [0, data.num_rows)) as a batch, in that order."""
  if data.verification is not None and data.verification.done() and data.verification.result():
    raise data.verification.result()
  rows = np.asarray(rows, dtype=np.int64)
  if data.packing is not None:
    return assemble_rows(
        data.packing, rows, data.input_ids, data.token_type_ids, data.tokenizer.pad_id
    )
  input_ids = data.input_ids[rows]
  return {
      "input_ids": input_ids,
      "token_type_ids": data.token_type_ids[rows],
      "attention_mask": (input_ids != data.tokenizer.pad_id).astype(np.int32),
  }


def prepared_tokenizer(config, manifest: dict):
  """The configured tokenizer, else the shards' copy; refused unless the shards were made by it."""
  directory, recorded = config["prepared_dir"], manifest["tokenizer"]
  tokenizer = configured_tokenizer(config, directory)
  copy = os.path.join(directory, TOKENIZER_FILES[config["tokenizer"]])
  gives = repr(tokenizer) if tokenizer else f"none ({copy} does not exist)"
  made_with = (recorded["kind"], recorded["fingerprint"])
  if tokenizer is None or made_with != (config["tokenizer"], tokenizer.fingerprint):
    raise ConfigError(
        f"The shards in {directory} were made with the {made_with[0]} tokenizer "
        f"{TOKENIZER_FILES.get(made_with[0])} (fingerprint {made_with[1]}), but this config gives "
        f"{gives}; configure theirs, or prepare the corpus again into another data.prepared_dir."
    )
  return tokenizer


def load_pretraining_data(data_config, split: str = "train") -> PretrainingData:
  """The examples of `split` ("train" or "eval") from their shards, checked and memory-mapped (a
  bucket's read by ranges); with data.pack_rows, the plan that packs several into a row."""
  config = _loadable(data_config, split)
  directory, max_seq_len = config["prepared_dir"], config["max_seq_len"]
  manifest = shards.open_manifest(directory)
  if manifest["max_seq_len"] != max_seq_len:
    raise ConfigError(
        f"The shards in {directory} hold max_seq_len={manifest['max_seq_len']}, but data.max_seq_len="
        f"{max_seq_len}; set theirs, or prepare the corpus again into another data.prepared_dir."
    )
  settings = manifest["settings"]
  ignored = [
      f"data.{key}={config[key]!r} (the shards' {settings[key]!r})"
      for key in ("eval_fraction", "max_documents", "shard_documents")
      if config[key] != settings[key]
  ]
  if ignored and split == "train":  # once per run
    logging.warning("the shards in %s decide, not the config: %s.", directory, "; ".join(ignored))
  tokenizer = prepared_tokenizer(config, manifest)
  rows, entries, lengths, verification = shards.load_split(
      directory, manifest, split, config["pack_rows"], tokenizer.vocab_size
  )
  if not entries:
    eval_fix = "set eval.every_steps=0, or prepare it with data.eval_fraction > 0"
    raise ConfigError(
        f"The {split} split of {directory} has no examples (eval_fraction="
        f"{settings['eval_fraction']} when it was prepared); "
        f"{eval_fix if split == 'eval' else 'prepare more documents'}."
    )
  # The same for the cache and a prepared directory of one config: a checkpoint resumes on either.
  kind = "spm" if config["tokenizer"] == "sentencepiece" else "wp"
  fingerprint = (
      f"format:{PACKING_FORMAT_VERSION}|{kind}:{tokenizer.fingerprint}|max_seq_len:{max_seq_len}|"
      f"{split}_documents:{manifest['documents_fingerprint'][split]}"
      + (f"|pack_rows:{ROW_PACKING_VERSION}" if config["pack_rows"] else "")
  )
  data = PretrainingData(
      tokenizer,
      ShardedRows(rows, 0, max_seq_len),
      ShardedRows(rows, 1, max_seq_len),
      fingerprint,
      plan_rows(lengths, max_seq_len) if config["pack_rows"] else None,
      int(manifest["totals"][f"{split}_tokens"]),
      verification,
  )
  fill = 100 * data.num_tokens / (data.num_rows * max_seq_len)
  logging.info(
      f"loaded {split} data from {directory}: {data.num_examples} examples in {len(entries)} "
      f"shards, {data.num_tokens} tokens, {data.num_rows} rows ({fill:.1f}% tokens)"
  )
  return data


@contextlib.contextmanager
def prefetch(fetch_fn: Callable[[int], Any], start_step: int, stop_step=None, depth: int = 2):
  """An iterator over fetch_fn(step) for step in [start_step, stop_step) (None: endless), fetched on
  `depth` threads up to `depth` steps ahead; a fetch_fn error is raised at its step."""
  steps = itertools.count(start_step) if stop_step is None else iter(range(start_step, stop_step))
  with concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="electra-prefetch") as pool:
    ahead = collections.deque(
        pool.submit(fetch_fn, step) for step in itertools.islice(steps, depth)
    )

    def batches() -> Iterator[Any]:
      while ahead:
        batch = ahead.popleft().result()
        ahead.extend(pool.submit(fetch_fn, step) for step in itertools.islice(steps, 1))
        yield batch

    try:
      yield batches()
    finally:
      pool.shutdown(cancel_futures=True)
