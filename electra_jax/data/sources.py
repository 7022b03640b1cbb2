"""A user's own corpus as documents: plain-text files ("text") and JSON Lines files ("jsonl").

Owns resolving `data.files` (comma-separated paths and globs), reading the files with their
problems counted and logged, and fingerprinting the files for cache keys.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os

from absl import logging

from electra_jax.config_lib import ConfigError

FILE_SOURCES = ("text", "jsonl")

# A corpus up to this size enters the fingerprint with its content hash, so that even an edit
# that keeps the size and (on a coarse-clock filesystem) the mtime changes the cache key; a
# bigger one is identified by paths, sizes and mtimes only, to keep a warm start fast.
_HASHED_CORPUS_BYTES = 64 << 20


@dataclasses.dataclass
class SourceStats:
  """What reading the files found; logged, and returned for tools and tests."""

  files: list[str] = dataclasses.field(default_factory=list)
  empty_files: list[str] = dataclasses.field(default_factory=list)
  # Lines holding bytes that are not UTF-8: kept, with U+FFFD in place of the bad bytes.
  replaced_lines: int = 0
  first_replaced_line: str = ""  # "path:line" of the first such line
  # JSONL lines skipped: not JSON, not an object, or without a string under text_field.
  skipped_lines: int = 0
  first_skipped_line: str = ""  # "path:line: why" of the first skipped line
  num_documents: int = 0


def resolve_files(files: str) -> list[str]:
  """The files named by `files`, a comma-separated list of paths and globs, in that order.

  Each glob's matches are sorted; a file named twice is read once. `~` is expanded and `**`
  matches across directories.
  """
  patterns = [pattern.strip() for pattern in str(files or "").split(",") if pattern.strip()]
  if not patterns:
    raise ConfigError(
        "data.files is empty; give the corpus as a comma-separated list of paths or globs, "
        "e.g. --config.data.files='corpus/*.txt'."
    )
  paths: list[str] = []
  seen = set()
  for pattern in patterns:
    expanded = os.path.expanduser(pattern)
    matches = sorted(glob.glob(expanded, recursive=True))
    if not matches:
      raise ConfigError(
          f"data.files pattern {pattern!r} matches no file; check the path (relative paths "
          f"start from {os.getcwd()}) or remove it from data.files."
      )
    for match in matches:
      if os.path.isdir(match):
        raise ConfigError(
            f"data.files entry {pattern!r} matches the directory {match!r}; name the files, "
            f"e.g. {os.path.join(match, '*.txt')!r}."
        )
      absolute = os.path.abspath(match)
      if absolute not in seen:
        seen.add(absolute)
        paths.append(absolute)
  return paths


def files_fingerprint(paths: list[str]) -> str:
  """Short sha256 hex of the paths, sizes and mtimes of `paths` (and their bytes, up to 64 MB)."""
  stats = [os.stat(path) for path in paths]
  hash_contents = sum(stat.st_size for stat in stats) <= _HASHED_CORPUS_BYTES
  digest = hashlib.sha256(f"contents={hash_contents}\n".encode())
  for path, stat in zip(paths, stats):
    digest.update(f"{path}\n{stat.st_size}\n{stat.st_mtime_ns}\n".encode())
    if hash_contents:
      with open(path, "rb") as f:
        digest.update(hashlib.sha256(f.read()).digest())
  return digest.hexdigest()[:16]


def _decoded_lines(path: str, stats: SourceStats) -> list[str]:
  """The lines of `path` as text; lines with non-UTF-8 bytes are decoded with replacement."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8").splitlines()
  except UnicodeDecodeError:
    pass
  lines = []
  # Splitting the bytes on b"\n" is safe: in UTF-8 that byte only ever means a newline.
  for number, raw in enumerate(data.split(b"\n"), start=1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError:
      line = raw.decode("utf-8", errors="replace")
      stats.replaced_lines += 1
      if not stats.first_replaced_line:
        stats.first_replaced_line = f"{path}:{number}"
    lines.append(line.rstrip("\r"))
  return lines


def _text_file_documents(lines: list[str]) -> list[list[str]]:
  """One document per run of non-blank lines; each stripped line is one sentence."""
  documents, document = [], []
  for line in lines:
    line = line.strip()
    if line:
      document.append(line)
    elif document:
      documents.append(document)
      document = []
  if document:
    documents.append(document)
  return documents


def _jsonl_file_documents(path: str, lines: list[str], text_field: str, stats: SourceStats):
  documents = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    why = None
    try:
      record = json.loads(line)
    except ValueError:
      why = "not valid JSON"
    else:
      if not isinstance(record, dict):
        why = "not a JSON object"
      elif text_field not in record:
        why = f"no {text_field!r} field"
      elif not isinstance(record[text_field], str):
        why = f"{text_field!r} is not a string"
    if why:
      stats.skipped_lines += 1
      if not stats.first_skipped_line:
        stats.first_skipped_line = f"{path}:{number}: {why}"
      continue
    document = [sentence.strip() for sentence in record[text_field].splitlines() if sentence.strip()]
    if document:
      documents.append(document)
  return documents


def read_documents(
    source: str, paths: list[str], text_field: str = "text", max_documents: int | None = None
) -> tuple[list[list[str]], SourceStats]:
  """The documents (lists of sentence strings) of `paths` read as `source`, and their stats.

  "text": one sentence or paragraph per line; blank lines and file ends separate documents.
  "jsonl": one document per line, the string under `text_field`, split on its newlines; lines
  that are not a JSON object with that string are skipped and counted. Non-UTF-8 bytes are
  replaced with U+FFFD and the lines holding them counted; empty files are skipped and named.
  Raises ConfigError if no file holds any text. `max_documents` keeps only the first ones.
  """
  if source not in FILE_SOURCES:
    raise ConfigError(f"read_documents: source must be one of {FILE_SOURCES}, got {source!r}.")
  stats = SourceStats(files=list(paths))
  documents: list[list[str]] = []
  for path in paths:
    if max_documents is not None and len(documents) >= max_documents:
      break
    lines = _decoded_lines(path, stats)
    if not any(line.strip() for line in lines):
      stats.empty_files.append(path)
      continue
    if source == "text":
      documents.extend(_text_file_documents(lines))
    else:
      documents.extend(_jsonl_file_documents(path, lines, text_field, stats))
  if max_documents is not None:
    documents = documents[:max_documents]
  stats.num_documents = len(documents)
  _log_stats(source, stats)
  if not documents:
    why = f" ({stats.skipped_lines} JSONL lines skipped, first at {stats.first_skipped_line})" if (
        stats.skipped_lines) else ""
    raise ConfigError(
        f"data.source={source!r}: no usable text in data.files {paths}{why}. Point data.files "
        f"at non-empty UTF-8 files"
        + (f" whose JSON lines hold a string field {text_field!r} (data.text_field)." if source == "jsonl"
           else " with one sentence or paragraph per line.")
    )
  return documents, stats


def _log_stats(source: str, stats: SourceStats) -> None:
  logging.info(
      "read %d documents from %d %s files (%d empty)",
      stats.num_documents, len(stats.files), source, len(stats.empty_files),
  )
  if stats.empty_files:
    logging.warning("skipped %d empty files: %s", len(stats.empty_files), ", ".join(stats.empty_files))
  if stats.replaced_lines:
    logging.warning(
        "%d lines held bytes that are not UTF-8 and were kept with U+FFFD in their place; "
        "the first is %s", stats.replaced_lines, stats.first_replaced_line,
    )
  if stats.skipped_lines:
    logging.warning(
        "skipped %d JSONL lines that are not a JSON object with a string text field; the first "
        "is %s", stats.skipped_lines, stats.first_skipped_line,
    )
