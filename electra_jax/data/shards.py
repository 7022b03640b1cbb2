"""The prepared-directory format: every source becomes these shards, and training reads only them.

A prepared directory (`data.prepared_dir`, or a cache's len<L>/) holds manifest.json (counts, per-file
rows/bytes/sha256, tokenizer, max_seq_len, format version, source; "complete" once all shards exist),
spm.model when prepare_data trained it, and for shard k of each split (documents [k*S, (k+1)*S), S =
data.shard_documents) <split>-<k:05d>.npy, uint16 (int32 beyond 65536 ids) [rows, 2, max_seq_len] of
input ids ([:, 0]) and token type ids ([:, 1]), and <split>-<k:05d>.lengths.npy, each example's length.
Files are written under temporary names (".tmp-*") and renamed; a shard is done once the manifest lists it.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading

import numpy as np
from absl import logging

from electra_jax import workdir_files
from electra_jax.data.packing import example_lengths
from electra_jax.errors import ConfigError

# Bump when the shard layout or the manifest's meaning changes.
PREPARED_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPM_MODEL = "spm.model"
SPLITS = ("train", "eval")
# How a missing or damaged file of a prepared directory is mended.
REDO = "run --mode=prepare_data again with the same config to re-create it"


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def write_split(
    out_dir: str, split: str, index: int, input_ids, token_type_ids, pad_id: int, dtype: str
) -> dict:
  """Writes shard `index` of `split` (rows and lengths files); returns their manifest fields."""
  lengths_dtype = np.uint16 if input_ids.shape[1] <= np.iinfo(np.uint16).max else np.int32
  entry = {}
  for prefix, suffix, array in (
      ("", ".npy", np.stack([input_ids, token_type_ids], axis=1).astype(dtype)),
      ("lengths_", ".lengths.npy", example_lengths(input_ids, pad_id).astype(lengths_dtype)),
  ):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    data, name = buffer.getvalue(), f"{split}-{index:05d}{suffix}"
    workdir_files.write_bytes(os.path.join(out_dir, name), data)
    sha256 = hashlib.sha256(data).hexdigest()
    entry.update({f"{prefix}file": name, f"{prefix}bytes": len(data), f"{prefix}sha256": sha256})
  return entry


def read_manifest(out_dir: str) -> dict | None:
  """`out_dir`'s manifest; None when it has none, ConfigError naming the file when it is damaged."""
  path = os.path.join(out_dir, MANIFEST)
  return workdir_files.read_json(path, dict) if os.path.exists(path) else None


def open_manifest(directory: str) -> dict:
  """The manifest of a finished preparation, or a ConfigError saying what to run."""
  manifest = read_manifest(directory)
  if manifest is None:
    raise ConfigError(
        f"data.prepared_dir={directory!r} has no {MANIFEST}; create it with "
        "`python -m electra_jax.main --mode=prepare_data --config=...` (same data config, with "
        "data.source set to the corpus), then train with data.source='prepared'."
    )
  if manifest["format_version"] != PREPARED_FORMAT_VERSION:
    raise ConfigError(
        f"{directory} was prepared in format {manifest['format_version']}, this version reads "
        f"format {PREPARED_FORMAT_VERSION}; prepare the corpus again into a new data.prepared_dir."
    )
  if not manifest["complete"]:
    raise ConfigError(
        f"The preparation of {directory} did not finish ({len(manifest['shards'])} shards "
        "so far); run --mode=prepare_data again with the same config: it resumes."
    )
  return manifest


def sha256_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def shard_is_intact(out_dir: str, entry: dict, checksums: bool = True) -> bool:
  """Whether a manifest's shard `entry` has its files, of their sizes (and `checksums`, sha256)."""
  for split_entry in entry["splits"].values():
    for prefix in ("", "lengths_") if split_entry["rows"] else ():
      if (
          f"{prefix}file" not in split_entry
      ):  # shards prepared before data.pack_rows have no lengths file
        continue
      path = os.path.join(out_dir, split_entry[f"{prefix}file"])
      if not os.path.exists(path) or os.path.getsize(path) != split_entry[f"{prefix}bytes"]:
        return False
      if checksums and sha256_file(path) != split_entry[f"{prefix}sha256"]:
        return False
  return True


def _load(path: str, mmap_mode=None) -> np.ndarray:
  try:
    return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ConfigError(f"Cannot read shard {path} ({e}); {REDO}.") from e


def load_split(directory: str, manifest: dict, split: str, pad_id: int, with_lengths: bool):
  """The non-empty shards of `split`, memory-mapped after the cheap checks (shape, dtype, size):
  (arrays, their manifest entries, the examples' int32 lengths or None). Shards prepared before
  lengths files existed have their rows scanned instead."""
  max_seq_len = manifest["max_seq_len"]
  shards, entries, lengths = [], [], []
  for split_entry in (entry["splits"][split] for entry in manifest["shards"]):
    rows = split_entry["rows"]
    if not rows:
      continue
    path = os.path.join(directory, split_entry["file"])
    array = _load(path, mmap_mode="r")
    if array.shape != (rows, 2, max_seq_len) or array.dtype != np.dtype(manifest["dtype"]):
      raise ConfigError(
          f"Shard {path} has shape {array.shape} and dtype {array.dtype}; the manifest says "
          f"({rows}, 2, {max_seq_len}) {manifest['dtype']}; {REDO}."
      )
    if os.path.getsize(path) != split_entry["bytes"]:
      raise ConfigError(
          f"Shard {path} has {os.path.getsize(path)} bytes, the manifest says {split_entry['bytes']}; "
          f"{REDO}."
      )
    shards.append(array)
    entries.append(split_entry)
    if not with_lengths:
      continue
    if "lengths_file" not in split_entry:
      lengths.append(example_lengths(array[:, 0], pad_id))
      continue
    path = os.path.join(directory, split_entry["lengths_file"])
    found = _load(path)
    if (
        found.shape != (rows,)
        or found.dtype.kind not in "iu"
        or (found.size and not 1 <= found.min() <= found.max() <= max_seq_len)
    ):
      raise ConfigError(
          f"{path} does not hold {rows} example lengths in [1, {max_seq_len}]; {REDO}."
      )
    lengths.append(found.astype(np.int32))
  return shards, entries, np.concatenate(lengths) if with_lengths and shards else None


class ShardedRows:
  """The rows of several memory-mapped [rows, 2, L] shards as one read-only int32 [N, L] array, indexed by
  an integer array, a slice or an int (a fresh ndarray). `channel` 0 selects input ids, 1 token type ids.
  """

  def __init__(self, shards: list[np.ndarray], channel: int, max_seq_len: int):
    self._shards, self._channel = shards, channel
    self._offsets = np.cumsum([0] + [shard.shape[0] for shard in shards])
    self.shape = (int(self._offsets[-1]), max_seq_len)
    self.dtype = np.dtype(np.int32)
    self.ndim = 2

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, index):
    index, columns = index if isinstance(index, tuple) else (index, slice(None))
    if isinstance(index, slice):
      rows = np.arange(*index.indices(self.shape[0]), dtype=np.int64)
    else:
      rows = np.asarray(index, dtype=np.int64)
      rows = np.where(rows < 0, rows + self.shape[0], rows)
    flat = rows.reshape(-1)
    out = np.empty((flat.shape[0], self.shape[1]), np.int32)
    if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
      raise IndexError(f"row index out of range for {self.shape[0]} rows")
    shard_of_row = np.searchsorted(self._offsets, flat, side="right") - 1
    for shard in np.unique(shard_of_row):
      selected = shard_of_row == shard
      out[selected] = self._shards[shard][flat[selected] - self._offsets[shard], self._channel]
    return out.reshape(rows.shape + (self.shape[1],))[..., columns]

  def __array__(self, dtype=None, copy=None):
    array = self[:]
    return array if dtype is None else array.astype(dtype)


class ShardVerification(threading.Thread):
  """Checks a split's shard files (sha256, every id below the vocabulary size) on a background thread, so a
  run starts at once; raise_if_failed raises the first failure."""

  def __init__(self, directory: str, entries: list[dict], vocab_size: int, split: str):
    super().__init__(name="electra-verify-shards", daemon=True)
    self.error: ConfigError | None = None
    self._directory, self._entries, self._vocab_size, self._split = (
        directory,
        entries,
        vocab_size,
        split,
    )
    self.start()

  def run(self) -> None:
    for entry in self._entries:
      path = os.path.join(self._directory, entry["file"])
      try:
        if sha256_file(path) != entry["sha256"]:
          problem = f"is not the file prepare_data wrote (its sha256 differs from {MANIFEST}'s)"
        elif (largest := int(np.max(_load(path, mmap_mode="r")[:, 0]))) >= self._vocab_size:
          problem = f"holds token id {largest}, outside the tokenizer's {self._vocab_size} ids"
        else:
          continue
        self.error = ConfigError(f"Shard {path} {problem}; {REDO}.")
      except OSError as error:
        self.error = ConfigError(f"Cannot read shard {path} ({error}); {REDO}.")
      except ConfigError as error:
        self.error = error
      return
    logging.info(
        "verified the %d %s shards of %s against %s",
        len(self._entries),
        self._split,
        self._directory,
        MANIFEST,
    )

  wait = threading.Thread.join

  def raise_if_failed(self) -> None:
    if self.error is not None:
      raise self.error
