"""Training on prepared shards (data.source = "prepared"): memory-mapped, checked, step-indexed.

Owns opening `data.prepared_dir` (written by prepare_data), refusing shards made with another
tokenizer or max_seq_len, and presenting the shards of a split as one row-indexable array, so
the same `get_batch` serves them.

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
import os

import numpy as np
from absl import logging

from electra_jax.config_lib import ConfigError
from electra_jax.data import pipeline
from electra_jax.data.packing import example_lengths
from electra_jax.data.prepare import MANIFEST, PREPARED_FORMAT_VERSION, SPM_MODEL, read_manifest
from electra_jax.data.tokenizer import SentencePieceTokenizer
from electra_jax.data.wordpiece import WordPieceTokenizer


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
class PreparedData(pipeline.PretrainingData):
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
  fingerprint = pipeline.data_fingerprint(config, tokenizer, split, manifest["documents_fingerprint"][split])
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
