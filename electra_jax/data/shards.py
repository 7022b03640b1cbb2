"""The prepared-directory format (docs/data.md describes it): writing and checking its files, and
ShardedRows, which reads their rows (memory maps locally, ranged reads in a bucket)."""

from __future__ import annotations

import concurrent.futures
import io
import itertools
import os
import threading

import numpy as np
from absl import logging
from etils import epath

from electra_jax import workdir_files
from electra_jax.data.packing import example_lengths
from electra_jax.errors import ConfigError

# Bump when the shard layout or the manifest's meaning changes (2: crc32c, the one checksum).
PREPARED_FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
# How a missing or damaged file of a prepared directory is mended.
REDO = "run --mode=prepare_data again with the same config to re-create it"


def token_dtype(vocab_size: int) -> str:
  return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def write_split(task: dict, split: str, rows: np.ndarray, pad_id: int) -> dict:
  """Writes `split` of shard task["index"] into task["out_dir"]: its [rows, 2, L] ids and types in
  task["dtype"], and their lengths; returns the files' manifest fields."""
  lengths = example_lengths(rows[:, 0], pad_id)
  lengths_dtype = np.uint16 if rows.shape[2] <= np.iinfo(np.uint16).max else np.int32
  entry = {}
  for prefix, suffix, array in (
      ("", ".npy", rows.astype(task["dtype"])),
      ("lengths_", ".lengths.npy", lengths.astype(lengths_dtype)),
  ):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    data, name = buffer.getvalue(), f"{split}-{task['index']:05d}{suffix}"
    workdir_files.write_bytes(os.path.join(task["out_dir"], name), data)
    entry[f"{prefix}file"], entry[f"{prefix}bytes"] = name, len(data)
    entry[f"{prefix}crc32c"] = workdir_files.crc32c(data)
  return entry


def read_manifest(out_dir: str) -> dict | None:
  """`out_dir`'s manifest, None without one; refused by name when damaged, edited (a shard outside
  `out_dir`), of another format, or in a bucket that does not exist."""
  path = os.path.join(out_dir, MANIFEST)

  def checked(manifest: dict) -> dict:
    if manifest["format_version"] != PREPARED_FORMAT_VERSION:
      raise ConfigError(
          f"{path} is of prepared format {manifest['format_version']}, this version reads "
          f"{PREPARED_FORMAT_VERSION}; prepare the corpus again into a new data.prepared_dir."
      )
    for index, entry in enumerate(manifest["shards"]):
      for split, files in entry["splits"].items():
        for prefix in ("", "lengths_") if files["rows"] else ():
          name, _, _ = (files[prefix + key] for key in ("file", "bytes", "crc32c"))
          if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
            raise ConfigError(
                f"{path}: shards[{index}].splits.{split}.{prefix}file={name!r} is not a file name "
                f"in {out_dir}, the manifest was edited; {REDO} in a new data.prepared_dir."
            )
    return manifest

  if workdir_files.exists(path):
    return workdir_files.read_json(path, checked)
  if workdir_files.is_remote(out_dir):
    workdir_files.check_bucket(out_dir, "data.prepared_dir")
  return None


def open_manifest(directory: str) -> dict:
  """The manifest of a finished preparation, or a ConfigError saying what to run."""
  manifest = read_manifest(directory)
  if manifest is None:
    raise ConfigError(
        f"data.prepared_dir={directory!r} has no {MANIFEST}; create it with --mode=prepare_data "
        "(data.source set to the corpus), then train with data.source='prepared'."
    )
  if not manifest["complete"]:
    raise ConfigError(
        f"The preparation of {directory} did not finish; run --mode=prepare_data again: it resumes."
    )
  return manifest


def _problem(directory: str, entry: dict, prefix: str, files: dict, hashed: bool = False):
  """What is wrong with the file `entry[prefix + "file"]` of `files` (list_files of `directory`),
  else None: a local link out, its size, its crc32c (a bucket's own; a local file's if `hashed`)."""
  name, wanted = entry[f"{prefix}file"], entry[f"{prefix}bytes"]
  path, (size, crc32c) = os.path.join(directory, name), files.get(name, (None, None))
  local = size is not None and not workdir_files.is_remote(directory)
  real, inside = os.path.realpath(path), os.path.realpath(directory)
  if local and os.path.commonpath([real, inside]) != inside:  # (a link: followed only inside)
    return f"links to {real}, outside {directory}"
  if size != wanted:
    return "is missing" if size is None else f"has {size} bytes, the manifest says {wanted}"
  if local and hashed:  # (a shard was written from memory whole: it is read back so)
    crc32c = workdir_files.crc32c(epath.Path(path).read_bytes())
  if crc32c not in (None, entry[f"{prefix}crc32c"]):
    return f"is not the file prepare_data wrote (its crc32c, {crc32c}, differs from {MANIFEST}'s)"
  return None


def shard_is_intact(out_dir: str, entry: dict, files: dict, checksums: bool = True) -> bool:
  """Whether a manifest's shard `entry` passes _problem's checks (`checksums`: `hashed`)."""
  splits = [split for split in entry["splits"].values() if split["rows"]]
  checks = itertools.product(splits, ("", "lengths_"))
  return all(_problem(out_dir, split, prefix, files, checksums) is None for split, prefix in checks)


def _load(path: str, mmap_mode=None) -> np.ndarray:
  try:
    if workdir_files.is_remote(path):
      return np.load(io.BytesIO(epath.Path(path).read_bytes()), allow_pickle=False)
    return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ConfigError(f"Cannot read shard {path} ({e}); {REDO}.") from e


def load_split(directory: str, manifest: dict, split: str, with_lengths: bool, vocab_size: int):
  """The non-empty shards of `split` after the cheap checks (sizes; a bucket's crc32c; on disk,
  shapes and dtypes): (their rows, memory maps or a BucketShards; their manifest entries; with
  `with_lengths`, the examples' int32 lengths, else None; verify_in_background's future)."""
  max_seq_len, dtype = manifest["max_seq_len"], np.dtype(manifest["dtype"])
  files = workdir_files.list_files(directory)
  entries = [e["splits"][split] for e in manifest["shards"] if e["splits"][split]["rows"]]
  for entry in entries:
    for prefix in ("", "lengths_") if with_lengths else ("",):
      if (problem := _problem(directory, entry, prefix, files)) is not None:
        path = os.path.join(directory, entry[f"{prefix}file"])
        raise ConfigError(f"Shard {path} {problem}; {REDO}.")
  paths = [os.path.join(directory, entry["file"]) for entry in entries]
  if workdir_files.is_remote(directory):
    rows = BucketShards(paths, entries, max_seq_len, dtype, vocab_size)
  else:
    rows = [_load(path, mmap_mode="r") for path in paths]
    for path, entry, array in zip(paths, entries, rows):
      if array.shape != (entry["rows"], 2, max_seq_len) or array.dtype != dtype:
        raise ConfigError(
            f"Shard {path} has shape {array.shape} and dtype {array.dtype}; the manifest says "
            f"({entry['rows']}, 2, {max_seq_len}) {dtype}; {REDO}."
        )
  lengths = []
  for entry in entries if with_lengths else ():
    path = os.path.join(directory, entry["lengths_file"])
    found = _load(path)
    of_rows = found.shape == (entry["rows"],) and found.dtype.kind in "iu"  # (then not empty)
    if not (of_rows and 1 <= found.min() <= found.max() <= max_seq_len):
      raise ConfigError(
          f"Shard {path} lacks {entry['rows']} lengths in [1, {max_seq_len}]; {REDO}."
      )
    lengths.append(found.astype(np.int32))
  lengths = np.concatenate(lengths) if lengths else None
  return rows, entries, lengths, verify_in_background(directory, entries, files, vocab_size, split)


class BucketShards:
  """ShardedRows' reader of [rows, 2, L] .npy objects in a bucket by byte ranges (docs/data.md):
  each run of consecutive rows is one range; a thread's last read serves the other channel."""

  def __init__(self, paths, entries: list[dict], max_seq_len: int, dtype, vocab_size: int):
    self.paths, self.num_rows = paths, [entry["rows"] for entry in entries]
    self._dtype, self._max_seq_len, self._vocab_size = np.dtype(dtype), max_seq_len, vocab_size
    self._row_bytes = 2 * max_seq_len * self._dtype.itemsize
    # A .npy file is its header, then the rows: the file's size gives the header's.
    self._header_bytes = [entry["bytes"] - entry["rows"] * self._row_bytes for entry in entries]
    self._last = threading.local()  # each thread's last read, kept for the other channel

  def read(self, parts: list[tuple[int, np.ndarray]], channel: int) -> list[np.ndarray]:
    """Channel `channel` [len(rows), L] of each (shard, its row indices) of `parts`."""
    key = b"".join(np.int64([shard, rows.size]).tobytes() + rows.tobytes() for shard, rows in parts)
    if getattr(self._last, "key", None) != key:
      self._last.rows, self._last.key = self._fetch(parts), key
    return [rows[:, channel] for rows in self._last.rows]

  def _fetch(self, parts) -> list[np.ndarray]:
    """Both channels [len(rows), 2, L] of each part, in its rows' order."""
    paths, starts, ends, sizes, inverses = [], [], [], [], []
    for shard, rows in parts:
      unique, where = np.unique(rows, return_inverse=True)
      header = self._header_bytes[shard]
      for run in np.split(unique, np.flatnonzero(np.diff(unique) != 1) + 1):
        paths.append(self.paths[shard])
        starts.append(header + int(run[0]) * self._row_bytes)
        ends.append(header + (int(run[-1]) + 1) * self._row_bytes)
      sizes.append(unique.size)
      inverses.append(where)
    fs, shape = workdir_files.filesystem(self.paths[0])[0], (-1, 2, self._max_seq_len)
    try:  # the ranges fetched concurrently
      blobs = fs.cat_ranges([fs._strip_protocol(p) for p in paths], starts, ends, on_error="raise")
    except FileNotFoundError as e:  # other errors (the network, permissions) pass as they are
      gone = os.path.dirname(self.paths[0])
      raise ConfigError(f"A shard of {gone} is gone from the bucket ({e}); {REDO}.") from e
    for path, blob, start, end in zip(paths, blobs, starts, ends):  # (every run has a row)
      if len(blob) != end - start:
        raise ConfigError(f"Shard {path} ends before its manifest's rows; {REDO}.")
      ids = np.frombuffer(blob, self._dtype).reshape(shape)[:, 0]
      if (largest := ids.max()) >= self._vocab_size:
        raise ConfigError(
            f"Shard {path} holds token id {largest}, outside the tokenizer's {self._vocab_size} ids; "
            f"{REDO}."
        )
    rows = np.frombuffer(b"".join(blobs), self._dtype).reshape(shape)
    return [part[where] for part, where in zip(np.split(rows, np.cumsum(sizes)[:-1]), inverses)]


class ShardedRows:
  """Channel `channel` (0: input ids, 1: token types) of several [rows, 2, L] shards (memory maps,
  or a BucketShards) as one read-only int32 [N, L] array; an index gives a fresh ndarray."""

  def __init__(self, shards, channel: int, max_seq_len: int):
    self._shards, self._channel = shards, channel
    bucket = isinstance(shards, BucketShards)
    self._offsets = np.cumsum([0] + (shards.num_rows if bucket else [a.shape[0] for a in shards]))
    self.shape = (int(self._offsets[-1]), max_seq_len)
    self.dtype = np.dtype(np.int32)

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, index):
    index, columns = index if isinstance(index, tuple) else (index, slice(None))
    num_rows = self.shape[0]
    rows = np.arange(*index.indices(num_rows)) if isinstance(index, slice) else np.asarray(index)
    if rows.size and not -num_rows <= rows.min() <= rows.max() < num_rows:
      raise IndexError(f"row index out of range for {num_rows} rows")
    flat = rows.reshape(-1).astype(np.int64) % num_rows  # (negative indices count from the end)
    out = np.empty((flat.shape[0], self.shape[1]), np.int32)
    shard_of_row = np.searchsorted(self._offsets, flat, side="right") - 1
    selections = [(int(shard), shard_of_row == shard) for shard in np.unique(shard_of_row)]
    parts = [(shard, flat[selected] - self._offsets[shard]) for shard, selected in selections]
    if isinstance(self._shards, BucketShards):
      values = self._shards.read(parts, self._channel)
    else:
      values = [self._shards[shard][rows, self._channel] for shard, rows in parts]
    for (_, selected), values in zip(selections, values):
      out[selected] = values
    return out.reshape(rows.shape + (self.shape[1],))[..., columns]

  def __array__(self, dtype=None, copy=None):
    return self[:].astype(np.int32 if dtype is None else dtype, copy=False)


def verify_in_background(directory: str, entries: list[dict], files: dict, vocab_size: int, split):
  """A future of the first failure (ConfigError) or None of _problem(hashed) and, on disk, the ids'
  range, for a split's shards, on a daemon thread so a run starts at once."""

  def first_failure() -> ConfigError | None:
    for entry in entries:
      path = os.path.join(directory, entry["file"])
      try:
        problem = _problem(directory, entry, "", files, hashed=True)
        if problem is None and not workdir_files.is_remote(directory):
          if (largest := int(np.max(_load(path, "r")[:, 0]))) >= vocab_size:
            problem = f"holds token id {largest}, outside the tokenizer's {vocab_size} ids"
      except OSError as error:
        return ConfigError(f"Cannot read shard {path} ({error}); {REDO}.")
      except ConfigError as error:
        return error
      if problem is not None:
        return ConfigError(f"Shard {path} {problem}; {REDO}.")
    logging.info(
        "verified the %d %s shards of %s against %s", len(entries), split, directory, MANIFEST
    )
    return None

  verification = concurrent.futures.Future()
  verify = lambda: verification.set_result(first_failure())  # noqa: E731
  threading.Thread(target=verify, name="electra-verify-shards", daemon=True).start()
  return verification
