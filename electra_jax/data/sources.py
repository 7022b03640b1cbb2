"""A user's own corpus as documents: text and JSON Lines files (local or gs://), their problems
counted, and the record sources: a local Hugging Face dataset, and the reader TFDS's shares."""

from __future__ import annotations

import codecs
import collections
import dataclasses
import glob
import hashlib
import io
import itertools
import json
import os
import stat

from absl import logging

from electra_jax import workdir_files
from electra_jax.errors import ConfigError

FILE_SOURCES = ("text", "jsonl")
RECORD_SOURCES = ("tfds", "hf_datasets")
DOCUMENT_SOURCES = ("builtin", *FILE_SOURCES, *RECORD_SOURCES)

# Up to this size a corpus's bytes enter its fingerprint (an edit may keep size and mtime).
_HASHED_CORPUS_BYTES = 64 << 20
# A longer "sentence" is junk (minified code, base64): skipped, it cannot stall a tokenizer worker.
MAX_SENTENCE_CHARS = 1 << 16
_SNIFF_BYTES = 8192  # a NUL in a file's first block marks it binary
_BLOCK_BYTES = 8 << 20  # files are decoded this many bytes (rounded to whole lines) at a time
_READ_BLOCK = 1024  # records a RecordCorpus reads at a time
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's files
PROBLEMS = {  # what can go wrong reading a source, as the log and the errors name it
    "empty_files": "empty files skipped",
    "binary_files": f"binary files skipped (NUL bytes in the first {_SNIFF_BYTES} bytes)",
    "replaced_lines": "lines with bytes that are not UTF-8 kept with U+FFFD in their place",
    "skipped_lines": "JSONL lines skipped (not a JSON object with a string text field)",
    "long_sentences": f"lines over {MAX_SENTENCE_CHARS} characters skipped (not prose)",
}


@dataclasses.dataclass
class SourceStats:
  """What reading a source found: files, documents, progress (bytes, or a dataset's records), and
  how often each of PROBLEMS happened, and where first."""

  files: list[str] = dataclasses.field(default_factory=list)
  num_documents: int = 0
  bytes_read: int = 0
  total_bytes: int = 0
  problems: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_problems: dict[str, str] = dataclasses.field(default_factory=dict)

  def counts(self) -> dict:
    counts = {problem: self.problems[problem] for problem in PROBLEMS}
    return {"files": len(self.files), **counts, "documents": self.num_documents}

  def skip(self, problem: str, place: str) -> None:
    self.problems[problem] += 1
    self.first_problems.setdefault(problem, place)

  def summary(self) -> str:
    return "; ".join(  # in the order they first happened
        f"{count} {PROBLEMS[problem]}, the first {self.first_problems[problem]}"
        for problem, count in self.problems.items()
    )


def decode_utf8(raw: bytes, where: str, stats: SourceStats) -> str:
  """UTF-8 text of `raw`; other bytes become U+FFFD, counted (`where` the place)."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    stats.skip("replaced_lines", where)
    return raw.decode("utf-8", errors="replace")


def keep_sentence(sentence: str, where: str, stats: SourceStats) -> bool:
  """False (and counted) for a sentence too long to be text."""
  if len(sentence) <= MAX_SENTENCE_CHARS:
    return True
  stats.skip("long_sentences", f"{where}: {len(sentence)} characters")
  return False


def not_a_regular_file(path: str) -> str | None:
  """Why `path` is no file to read ("is a FIFO, ..."), seen without opening it (a device reads
  without end, a FIFO waits for a writer); None for a regular file or a link to one."""
  try:
    mode = os.stat(path).st_mode
  except (FileNotFoundError, NotADirectoryError):
    return "does not exist"
  except OSError as error:  # a folder on its way that we may not read
    return f"cannot be read ({error.strerror})"
  if stat.S_ISREG(mode):
    return None if os.access(path, os.R_OK) else "cannot be read (permission denied)"
  if stat.S_ISDIR(mode):
    return "is a directory"
  kind = "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"
  return f"is a {kind}, not a regular file"


def refuse_repeated(where: str, names: list[str]) -> None:
  """Refuses a header or JSON object naming a column twice: read by name, one copy would be used
  silently."""
  if repeated := [name for name, count in collections.Counter(names).items() if count > 1]:
    raise ConfigError(
        f"{where}: column {repeated[0]!r} appears more than once (in {names}); give each column "
        "its own name."
    )


def unique_object(where: str):
  """json's object_pairs_hook for the object at `where`, refusing one that names a key twice."""
  return lambda pairs: refuse_repeated(where, [key for key, _ in pairs]) or dict(pairs)


def resolve_files(files: str) -> list[str]:
  """The files of `files`, comma-separated paths and globs (`~`, `**`; `gs://` objects with the gcs
  extra) in order, each glob's matches sorted, a file named twice read once."""
  paths: dict[str, None] = {}  # ordered, each path once
  for pattern in filter(None, map(str.strip, files.split(","))):
    remote = workdir_files.is_remote(pattern)
    if remote:
      workdir_files.check_bucket(pattern, "data.files")  # the gcs extra, the bucket, the account
      fs, root = workdir_files.filesystem(pattern)
      objects = fs.glob(root, detail=True).items()
      matches = sorted(f"gs://{name}" for name, info in objects if info["type"] == "file")
    else:
      matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      start = "" if remote else f" (relative paths start from {os.getcwd()})"
      raise ConfigError(
          f"data.files pattern {pattern!r} matches no file; check the path{start} or remove it "
          "from data.files."
      )
    for match in matches:
      if not remote and (problem := not_a_regular_file(match)):
        raise ConfigError(
            f"data.files entry {pattern!r} matches {match!r}, which {problem}; name regular files"
            + (f", e.g. {os.path.join(match, '*.txt')!r}." if os.path.isdir(match) else ".")
        )
      paths[match if remote else os.path.abspath(match)] = None
  return list(paths)


def files_fingerprint(paths: list[str]) -> str:
  """Short sha256 hex of the paths, sizes and versions (mtime, a bucket's generation) of `paths`,
  and of their bytes up to 64 MB in all."""
  infos = [_info(path) for path in paths]
  hash_contents = sum(info["size"] for info in infos) <= _HASHED_CORPUS_BYTES
  digest = hashlib.sha256(f"contents={hash_contents}\n".encode())
  for path, info in zip(paths, infos):
    digest.update(f"{path}\n{info['size']}\n{info.get('generation', info['mtime'])}\n".encode())
    if hash_contents:
      with _open(path) as f:
        digest.update(hashlib.sha256(f.read()).digest())
  return digest.hexdigest()[:16]


def _info(path: str) -> dict:  # size, mtime, a bucket's generation
  fs, name = workdir_files.filesystem(path)
  return fs.info(name)


def _open(path: str) -> io.BufferedReader:
  if not workdir_files.is_remote(path):
    return open(path, "rb")
  return io.BufferedReader(workdir_files.filesystem(path)[0].open(path, "rb"))  # (readlines(hint))


def _iter_lines(path: str, stats: SourceStats, newline_only: bool = False):
  """(line number, text) of `path` as str.splitlines splits it, or (`newline_only`, for JSON
  strings that hold U+2028 unescaped) at "\\n"; nothing for a binary file."""
  with _open(path) as f:
    head = f.read(_SNIFF_BYTES)
    if b"\0" in head:
      stats.skip("binary_files", path)
      stats.bytes_read += f.seek(0, os.SEEK_END)
      return
    # A byte-order mark is not text: dropped, as fine-tuning's readers do (utf-8-sig).
    f.seek(len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0)
    stats.bytes_read += f.tell()
    number = 0
    # Blocks of whole lines: in UTF-8 the byte b"\n" only ever means a newline.
    for raw_lines in iter(lambda: f.readlines(_BLOCK_BYTES), []):
      data = b"".join(raw_lines)
      stats.bytes_read += len(data)
      try:
        texts = [data.decode("utf-8")]  # the common case: the whole block at C speed
      except UnicodeDecodeError:  # only this block, line by line, to find the bad lines
        texts = (decode_utf8(raw, f"{path}:{number + 1}", stats) for raw in raw_lines)
      for text in texts:
        # A text's final "\n" ends its last line; it does not start another.
        lines = text.removesuffix("\n").split("\n") if newline_only else text.splitlines()
        yield from enumerate(lines, number + 1)
        number += len(lines)


def _text_file_documents(path: str, _: str, stats: SourceStats):
  """One document per run of non-blank lines; each stripped line is one sentence."""
  lines = ((f"{path}:{number}", line.strip()) for number, line in _iter_lines(path, stats))
  for nonblank, run in itertools.groupby(lines, key=lambda placed: bool(placed[1])):
    if nonblank and (
        document := [line for where, line in run if keep_sentence(line, where, stats)]
    ):
      yield document


def _jsonl_file_documents(path: str, text_field: str, stats: SourceStats):
  for number, line in _iter_lines(path, stats, newline_only=True):
    if not line.strip():
      continue
    try:
      record = json.loads(line, object_pairs_hook=unique_object(f"{path}:{number}"))
    except ConfigError:  # (a ValueError too)
      raise
    except (ValueError, RecursionError):  # (nesting deeper than the interpreter's stack)
      stats.skip("skipped_lines", f"{path}:{number}: not valid JSON")
      continue
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      stats.skip("skipped_lines", f"{path}:{number}: no string {text_field!r} field in an object")
    elif document := split_text(text, f"{path}:{number}", stats):
      yield document


def split_text(text: str, where: str, stats: SourceStats) -> list[str]:
  """A document's text as sentences: its stripped non-blank lines, too long ones skipped."""
  sentences = (line.strip() for line in text.splitlines())
  return [sentence for sentence in sentences if sentence and keep_sentence(sentence, where, stats)]


class RecordCorpus:
  """One split of a dataset whose records' `text_field` hold documents. A subclass sets `name`,
  `num_records`, `text_field`, `description`, `fingerprint` and read_texts(start, stop)."""

  def iter_documents(self, stats: SourceStats):
    """The records' documents; a value neither str nor bytes is skipped and counted."""
    stats.total_bytes = stats.total_bytes or self.num_records
    for start in range(0, self.num_records, _READ_BLOCK):
      stop = min(start + _READ_BLOCK, self.num_records)
      for key, text in enumerate(self.read_texts(start, stop), start):
        stats.bytes_read += 1
        where = f"{self.name}[{key}]"
        if isinstance(text, bytes):
          text = decode_utf8(text, where, stats)
        elif not isinstance(text, str):
          stats.skip("skipped_lines", f"{where}: {self.text_field!r} is not text")
          continue
        if document := split_text(text, where, stats):
          stats.num_documents += 1
          yield document


def iter_documents(source: str, paths: list[str], text_field: str, stats: SourceStats):
  """The documents (lists of sentences) of `paths`, streamed, as docs/data.md describes; what
  cannot be read as text is skipped and counted in `stats`."""
  stats.files = list(paths)
  stats.total_bytes = sum(_info(path)["size"] for path in paths)
  for path in paths:
    # A file is empty when nothing came out of it and nothing in it was skipped for a reason.
    before = stats.num_documents + sum(stats.problems.values())
    read = _text_file_documents if source == "text" else _jsonl_file_documents
    for document in read(path, text_field, stats):
      stats.num_documents += 1
      yield document
    if stats.num_documents + sum(stats.problems.values()) == before:
      stats.skip("empty_files", path)


def log_stats(source: str, stats: SourceStats) -> None:
  logging.info("read %d documents from %d %s files", stats.num_documents, len(stats.files), source)
  if stats.problems:
    logging.warning("reading the %s files: %s", source, stats.summary())


class HfDatasetCorpus(RecordCorpus):
  """One split of a local Hugging Face dataset, each row's `text_field` a document."""

  def __init__(self, path: str, split: str, text_field: str):
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
      raise ConfigError(f"data.hf_path={path!r} is not a directory; give a local dataset's folder.")
    try:
      import datasets  # noqa: PLC0415 (optional: the hf_datasets extra)
    except ImportError as error:
      raise ConfigError(
          f"data.source='hf_datasets' needs the datasets package ({error}); "
          "pip install 'electra-jax[hf_datasets]'."
      ) from None
    try:
      saved = any(os.path.exists(os.path.join(path, marker)) for marker in _SAVED_MARKERS)
      loaded = datasets.load_from_disk(path) if saved else datasets.load_dataset(path, split=split)
    except Exception as error:  # noqa: BLE001 -- whatever datasets raises on a folder it cannot read
      raise ConfigError(
          f"data.hf_path={path!r} is not a dataset datasets can read locally "
          f"({type(error).__name__}: {str(error)[:300]})."
      ) from None
    if isinstance(loaded, datasets.DatasetDict):
      if split not in loaded:
        raise ConfigError(
            f"data.hf_split={split!r} is not a split of {path}; it has {sorted(loaded)}."
        )
      loaded = loaded[split]
    if text_field not in loaded.column_names:
      raise ConfigError(
          f"data.text_field={text_field!r} is not a column of {path}; its columns are "
          f"{loaded.column_names}. Name the one holding the document text."
      )
    self._dataset, self.name, self.text_field = loaded, f"{path}[{split}]", text_field
    self.num_records = loaded.num_rows  # datasets' hash of the rows below: new data, new key
    self.description = {
        "source": "hf_datasets",
        "hf_path": path,
        "hf_split": split,
        "text_field": text_field,
        "num_rows": loaded.num_rows,
    }
    self.fingerprint = f"{loaded._fingerprint}|{split}|{text_field}|{loaded.num_rows}"

  def read_texts(self, start: int, stop: int) -> list:
    return self._dataset[start:stop][self.text_field]
