"""From a data config to pre-training batches: prepared shards, loaded and batched.

Every source ends up as shards in the format of prepare.py. data.source="prepared" reads the
directory --mode=prepare_data wrote; a document source (builtin, text, jsonl, tfds, hf_datasets) is prepared
on first use into the cache, <cache_dir>/<source>/<key>/ (tokenizer) and its len<L>/ (shards).
Shards are memory-mapped and checked, then served by the step-indexed, process-sharded batch order.

`get_batch(data, step, ...)` is a pure function of the step, so resuming needs no loader state
(a grain iterator would have to save its state in every checkpoint).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import tempfile
import threading
import time

import numpy as np
from absl import logging

from electra_jax.data import prepare
from electra_jax.data.packing import ROW_PACKING_VERSION, RowPacking, assemble_rows, example_lengths, plan_rows
from electra_jax.data.prepare import MANIFEST, PACKING_FORMAT_VERSION, PREPARED_FORMAT_VERSION, SPLITS, SPM_MODEL
from electra_jax.data.tokenizer import SentencePieceTokenizer
from electra_jax.data.wordpiece import WordPieceTokenizer
from electra_jax.errors import ConfigError

# How a missing or damaged file of a prepared directory is mended.
_REDO = "run --mode=prepare_data again with the same config to re-create it"


@dataclasses.dataclass
class PretrainingData:
  """Packed examples of one split, with the tokenizer that produced them."""

  tokenizer: SentencePieceTokenizer | WordPieceTokenizer
  input_ids: np.ndarray  # int32 [num_examples, max_seq_len] (ShardedRows when loaded from shards)
  token_type_ids: np.ndarray  # int32 [num_examples, max_seq_len]
  # Identifies tokenizer, max_seq_len and the split's documents; a checkpoint can store
  # it and refuse to resume on different data.
  fingerprint: str
  # data.pack_rows: which examples each row of a batch holds (None: one example per row).
  packing: RowPacking | None = None
  token_count: int | None = None  # non-padding tokens, when the manifest counted them
  # data.pack_rows: each example's token count, from the shards' lengths files.
  lengths: np.ndarray | None = None
  # The background check of the shards against the manifest (None: nothing to check).
  verification: ShardVerification | None = None

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
    if self.token_count is not None:
      return self.token_count
    return int(np.count_nonzero(np.asarray(self.input_ids) != self.tokenizer.pad_id))


def _corpus_cache_dir(config) -> str:
  """The cache directory of one corpus and tokenizer configuration (any max_seq_len)."""
  key_fields = {
      "format": PACKING_FORMAT_VERSION,
      "max_documents": config["max_documents"],
      "eval_fraction": config["eval_fraction"],
      **prepare.source_fingerprint(config),
  }
  # Only keys that change the tokenizer enter the key.
  if prepare.trains_spm(config):
    key_fields["spm_vocab_size"] = config["spm_vocab_size"]
    key_fields["spm_model_type"] = config["spm_model_type"]
  elif config["spm_model_file"]:
    key_fields["spm_model"] = prepare.configured_tokenizer(config).fingerprint
  else:
    key_fields["tokenizer"] = config["tokenizer"]
    key_fields["wordpiece"] = prepare.configured_tokenizer(config).fingerprint
  key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(config["cache_dir"], config["source"], key)


def cached_prepared(config, shards: bool = True) -> dict:
  """`config` pointed at the cache's prepared directory for its document source, preparing it
  first (in this process) when it is missing, unfinished or damaged; `shards=False` only
  readies the tokenizer. A sentencepiece model is trained once per corpus (every max_seq_len
  reuses it)."""
  corpus_dir = _corpus_cache_dir(config)
  os.makedirs(corpus_dir, exist_ok=True)
  directory = os.path.join(corpus_dir, f"len{config['max_seq_len']}")
  # One process fills a cache at a time; closing the file releases the lock.
  with open(os.path.join(corpus_dir, ".lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if prepare.trains_spm(config):
      model = os.path.join(corpus_dir, SPM_MODEL)
      if not os.path.exists(model):
        with tempfile.TemporaryDirectory(dir=corpus_dir) as scratch:
          trained = prepare.train_corpus_tokenizer(config, os.path.join(scratch, SPM_MODEL))
          os.replace(trained.model_path, model)
      config = dict(config, spm_model_file=model)
    config = dict(config, prepared_dir=directory)
    manifest = prepare.read_manifest(directory) if shards else None
    if shards and (manifest is None or not manifest.get("complete") or not all(
        prepare.shard_is_intact(directory, entry, checksums=False) for entry in manifest["shards"])):
      logging.info("no cached data in %s; preparing it", directory)
      prepare.prepare_config(config, num_workers=0)
  return config


def _loadable(data_config, split: str | None = None) -> dict:
  """The read config, pointed at prepared shards (the cache's, for a document source); without
  a split, only its tokenizer is readied."""
  if split is not None and split not in SPLITS:
    raise ConfigError(f"Unknown split {split!r}; use one of {list(SPLITS)}.")
  config = prepare.read_config(data_config)
  if config["source"] == "prepared":
    return config
  if split == "eval" and config["eval_fraction"] == 0:
    raise ConfigError(
        "The eval split is empty because data.eval_fraction is 0; set it above 0 "
        "(e.g. 0.02) to hold out documents for evaluation, or set eval.every_steps=0 to train "
        "without held-out evaluation."
    )
  if split is None and not prepare.trains_spm(config):
    return config  # nothing to train
  return cached_prepared(config, shards=split is not None)


def load_pretraining_data(data_config, split: str = "train") -> PretrainingData:
  """Packed pre-training examples of `split` ("train" or "eval") for `data_config`.

  A document source is prepared into the cache on first use (see the module docstring); its
  key includes a fingerprint of data.files, so an edited corpus is prepared again. With
  data.pack_rows the result also carries the plan that packs several examples per row (made
  at load time from the examples' lengths), which get_batch then serves.
  """
  config = _loadable(data_config, split)
  data = load_prepared(config, split)
  if not config["pack_rows"]:
    return data
  # The plan is made from the stored lengths, not stored itself: the same shards serve packed
  # and unpacked training.
  start = time.time()
  packing = plan_rows(data.lengths, data.max_seq_len)
  unpacked = packing.lengths.sum(dtype=np.int64) / max(1, data.num_examples * data.max_seq_len)
  logging.info(
      "packed %s rows: %d examples into %d rows of %d; real tokens %.1f%% -> %.1f%% of positions, "
      "in %.1f s", split, data.num_examples, packing.num_rows, data.max_seq_len, 100 * unpacked,
      100 * packing.real_token_fraction(), time.time() - start,
  )
  return dataclasses.replace(data, packing=packing)


def load_tokenizer(data_config) -> SentencePieceTokenizer | WordPieceTokenizer:
  """The tokenizer `load_pretraining_data(data_config)` uses, for tools that need only its ids
  (a sentencepiece model the cache lacks is trained first, as load_pretraining_data would)."""
  config = _loadable(data_config)
  if config["source"] == "prepared":
    return prepared_tokenizer(config, open_manifest(config["prepared_dir"]))
  return prepare.configured_tokenizer(config)


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

  The row stream is epoch 0, epoch 1, ... each a permutation of all rows seeded by (seed, epoch);
  global batch `step` is stream positions [stream_offset + step * B, stream_offset + (step + 1) * B),
  and process p takes the p-th contiguous slice of it (stream_offset: the position a checkpoint
  recorded when the batch size changed).

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
  """The arrays of a batch the model reads, so the ones to send to the devices: packed rows add
  their segment ids (the model derives position_ids from them)."""
  keys = ("input_ids", "token_type_ids", "attention_mask")
  return keys + ("segment_ids",) if pack_rows else keys


def get_rows(data: PretrainingData, rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows `rows` (indices in [0, data.num_rows)) as a batch, in that order.

  Unpacked: the examples themselves, with attention_mask 1 on non-padding tokens. Packed
  (data.pack_rows): several whole examples a row, with segment_ids and position_ids (see
  packing.assemble_rows).
  """
  if data.verification is not None:
    data.verification.raise_if_failed()
  rows = np.asarray(rows, dtype=np.int64)
  if data.packing is not None:
    return assemble_rows(data.packing, rows, data.input_ids, data.token_type_ids, data.tokenizer.pad_id)
  input_ids = data.input_ids[rows]
  return {
      "input_ids": input_ids,
      "token_type_ids": data.token_type_ids[rows],
      "attention_mask": (input_ids != data.tokenizer.pad_id).astype(np.int32),
  }


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
      rows = np.arange(*index.indices(self.shape[0]), dtype=np.int64)
    else:
      rows = np.asarray(index, dtype=np.int64)
      rows = np.where(rows < 0, rows + self.shape[0], rows)
    result = self._gather(rows.reshape(-1)).reshape(rows.shape + (self.shape[1],))
    if not rest:
      return result
    # Column indices apply to the gathered rows (an int row index leaves a 1-D row).
    return result[rest] if isinstance(index, (int, np.integer)) else result[(slice(None),) + rest]

  def __array__(self, dtype=None, copy=None):
    array = self[:]
    return array if dtype is None else array.astype(dtype)


def open_manifest(directory: str) -> dict:
  """The manifest of a finished preparation, or a ConfigError saying what to run."""
  manifest = prepare.read_manifest(directory)
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
  made_with = (f"were made with the {recorded['kind']} tokenizer "
               f"{recorded.get('model_file') or recorded.get('vocab_file')} (fingerprint {recorded['fingerprint']})")
  tokenizer = prepare.configured_tokenizer(config, directory)
  if tokenizer is None:
    raise ConfigError(
        f"data.tokenizer='sentencepiece' without data.spm_model_file reads {os.path.join(directory, SPM_MODEL)}, "
        f"which does not exist: the shards in {directory} {made_with}. Configure that tokenizer."
    )
  if config["tokenizer"] == "wordpiece":
    described = (f"wordpiece {config['vocab_file']} (lowercase={config['lowercase']}, "
                 f"strip_accents={config['strip_accents']})")
  else:
    described = f"sentencepiece {tokenizer.model_path}"
  if recorded["kind"] != config["tokenizer"] or tokenizer.fingerprint != recorded["fingerprint"]:
    raise ConfigError(
        f"The shards in {directory} {made_with}, but this config gives {described} (fingerprint "
        f"{tokenizer.fingerprint}). Configure the tokenizer the shards were made with, or prepare the "
        f"corpus again with this one into another data.prepared_dir."
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
    raise ConfigError(f"Cannot read {path} ({e}); {_REDO}.") from e
  if lengths.shape != (split_entry["rows"],) or lengths.dtype.kind not in "iu" or (
      lengths.size and not 1 <= lengths.min() <= lengths.max() <= max_seq_len
  ):
    raise ConfigError(f"{path} does not hold {split_entry['rows']} example lengths in [1, {max_seq_len}]; {_REDO}.")
  return lengths.astype(np.int32)


class ShardVerification:
  """Checks a split's shard files against the manifest on a background thread, so a run starts
  at once and its steps do not wait: each file's sha256, and every input id below the
  tokenizer's vocabulary size. get_rows (and so get_batch) raises the first failure (a
  ConfigError naming the file) at the next rows it reads."""

  def __init__(self, directory: str, entries: list[dict], vocab_size: int, split: str):
    self._error: ConfigError | None = None
    self._thread = threading.Thread(
        target=self._run, args=(directory, entries, vocab_size, split), name="electra-verify-shards", daemon=True
    )
    self._thread.start()

  def _run(self, directory: str, entries: list[dict], vocab_size: int, split: str) -> None:
    for entry in entries:
      path = os.path.join(directory, entry["file"])
      try:
        if prepare.sha256_file(path) != entry["sha256"]:
          self._error = ConfigError(f"Shard {path} is not the file prepare_data wrote (its sha256 differs "
                                    f"from {prepare.MANIFEST}'s); {_REDO}.")
          return
        largest = int(np.max(np.load(path, mmap_mode="r", allow_pickle=False)[:, 0]))
      except (OSError, ValueError) as error:
        self._error = ConfigError(f"Cannot read shard {path} ({error}); {_REDO}.")
        return
      if largest >= vocab_size:
        self._error = ConfigError(f"Shard {path} holds token id {largest}, outside the tokenizer's "
                                  f"{vocab_size} ids; {_REDO}.")
        return
    logging.info("verified the %d %s shards of %s against %s", len(entries), split, directory, prepare.MANIFEST)

  def wait(self) -> None:
    self._thread.join()

  def raise_if_failed(self) -> None:
    if self._error is not None:
      raise self._error


def load_prepared(config, split: str) -> PretrainingData:
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
               if key in manifest.get("settings", {}) and config[key] != manifest["settings"][key]]
    if ignored:
      logging.warning("data.source=prepared: the shards in %s decide these, so the config's values "
                      "are not used: %s.", directory, "; ".join(ignored))
  tokenizer = prepared_tokenizer(config, manifest)
  max_seq_len = manifest["max_seq_len"]
  shards, lengths, entries = [], [], []
  for entry in manifest["shards"]:
    split_entry = entry["splits"][split]
    if not split_entry["rows"]:
      continue
    entries.append(split_entry)
    path = os.path.join(directory, split_entry["file"])
    try:
      array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
      raise ConfigError(f"Cannot read shard {path} ({e}); {_REDO}.") from e
    if array.shape != (split_entry["rows"], 2, max_seq_len) or array.dtype != np.dtype(manifest["dtype"]):
      raise ConfigError(
          f"Shard {path} has shape {array.shape} and dtype {array.dtype}; the manifest says "
          f"({split_entry['rows']}, 2, {max_seq_len}) {manifest['dtype']}; {_REDO}."
      )
    if os.path.getsize(path) != split_entry["bytes"]:
      raise ConfigError(f"Shard {path} has {os.path.getsize(path)} bytes, the manifest says {split_entry['bytes']}; "
                        f"{_REDO}.")
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
  # Identifies the split's examples; the cache and a prepared directory of the same config give
  # the same string (and examples), so a checkpoint resumes on either, and packed rows differ.
  fingerprint = (
      f"format:{PACKING_FORMAT_VERSION}|{'spm' if config['tokenizer'] == 'sentencepiece' else 'wp'}:"
      f"{tokenizer.fingerprint}|max_seq_len:{config['max_seq_len']}|{split}_documents:"
      f"{manifest['documents_fingerprint'][split]}"
  )
  if config["pack_rows"]:
    fingerprint += f"|pack_rows:{ROW_PACKING_VERSION}"
  data = PretrainingData(
      tokenizer=tokenizer,
      input_ids=ShardedRows(shards, 0, max_seq_len),
      token_type_ids=ShardedRows(shards, 1, max_seq_len),
      fingerprint=fingerprint,
      token_count=int(manifest["totals"][f"{split}_tokens"]),
      lengths=np.concatenate(lengths) if config["pack_rows"] else None,
      verification=ShardVerification(directory, entries, tokenizer.vocab_size, split),
  )
  logging.info(
      "loaded prepared %s data: %d examples of length %d in %d shards, %d tokens, from %s",
      split, data.num_examples, max_seq_len, len(shards), data.num_tokens, directory,
  )
  return data
