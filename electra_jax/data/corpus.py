"""The built-in English corpus: docstrings and help topics of the running Python's stdlib.

Owns finding the stdlib sources, extracting their prose with `ast` (never importing them),
splitting it into documents of sentences, and fingerprinting the result for cache keys.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import os
import sysconfig
from collections.abc import Iterator

from electra_jax.errors import ConfigError

# Directories whose docstrings are not representative prose (test suites, vendored code,
# demos) or are not part of the stdlib proper.
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "site-packages", "idlelib", "__pycache__", "lib2to3", "turtledemo", "ensurepip"}
)

_HELP_TOPICS_RELPATH = os.path.join("pydoc_data", "topics.py")

# Bump when the extraction rules change, so caches keyed on the sources are rebuilt.
EXTRACTION_VERSION = 1

# A paragraph counts as prose when at least this fraction of its characters are letters
# or spaces; this drops code samples, tables and doctest output.
_MIN_PROSE_FRACTION = 0.75

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> str:
  """Directory holding the pure-Python standard library of this interpreter."""
  return sysconfig.get_paths()["stdlib"]


def _stdlib_source_files() -> list[str]:
  """Sorted relative paths of the stdlib `.py` files the corpus draws docstrings from."""
  root = stdlib_root()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Pruning and sorting in place makes os.walk skip those trees and visit the rest
    # in a fixed order, so the corpus is the same on every run.
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
    for name in sorted(filenames):
      if name.endswith(".py"):
        paths.append(os.path.relpath(os.path.join(dirpath, name), root))
  return paths


def builtin_sources_fingerprint() -> str:
  """Hash of the stdlib source bytes the built-in corpus is extracted from: unlike
  `builtin_corpus_fingerprint` it needs no parsing, and it changes whenever the corpus could."""
  root = stdlib_root()
  digest = hashlib.sha256(f"extraction-v{EXTRACTION_VERSION}\n".encode())
  for relpath in _stdlib_source_files():
    with open(os.path.join(root, relpath), "rb") as f:
      data = f.read()
    digest.update(f"{relpath}\n{len(data)}\n".encode())
    digest.update(data)
  return digest.hexdigest()[:16]


def _iter_docstrings(node: ast.AST) -> Iterator[str]:
  """Docstrings of `node` and everything nested in it, in source order."""
  if isinstance(node, _DOCSTRING_OWNERS):
    docstring = ast.get_docstring(node, clean=True)
    if docstring:
      yield docstring
  for child in ast.iter_child_nodes(node):
    yield from _iter_docstrings(child)


def _is_prose_line(line: str) -> bool:
  stripped = line.strip()
  # Doctest prompts and continuation lines are code, and a line with no letters or
  # digits is an underline or a rule ("*****", "-----").
  if stripped.startswith((">>>", "...")):
    return False
  return any(ch.isalnum() for ch in stripped)


def _is_prose(paragraph: str) -> bool:
  textual = sum(1 for ch in paragraph if ch.isalpha() or ch == " ")
  return textual >= _MIN_PROSE_FRACTION * len(paragraph)


def split_sentences(text: str) -> list[str]:
  """Split `text` into paragraphs on blank lines, one whitespace-normalized line each.

  Paragraphs that are mostly code or punctuation are dropped.
  """
  sentences = []
  paragraph_lines: list[str] = []
  for line in text.splitlines() + [""]:
    if line.strip():
      if _is_prose_line(line):
        paragraph_lines.append(line)
      continue
    paragraph = " ".join(" ".join(paragraph_lines).split())
    paragraph_lines = []
    if paragraph and _is_prose(paragraph):
      sentences.append(paragraph)
  return sentences


def _parse(path: str) -> ast.Module | None:
  with open(path, "rb") as f:
    source = f.read()
  try:
    # Parsing bytes lets ast honour each file's own coding declaration.
    return ast.parse(source, filename=path)
  except (SyntaxError, ValueError):
    # A stdlib file this interpreter cannot parse contributes nothing; it must not
    # stop the whole corpus from being built.
    return None


def _source_file_documents() -> Iterator[list[str]]:
  root = stdlib_root()
  for relpath in _stdlib_source_files():
    tree = _parse(os.path.join(root, relpath))
    if tree is None:
      continue
    document = []
    for docstring in _iter_docstrings(tree):
      document.extend(split_sentences(docstring))
    if document:
      yield document


def _help_topic_documents() -> Iterator[list[str]]:
  tree = _parse(os.path.join(stdlib_root(), _HELP_TOPICS_RELPATH))
  if tree is None:
    return
  topics = None
  for statement in tree.body:
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and statement.targets[0].id == "topics"
    ):
      topics = ast.literal_eval(statement.value)
  if not isinstance(topics, dict):
    return
  for name in sorted(topics):
    document = split_sentences(topics[name])
    if document:
      yield document


def _iter_documents() -> Iterator[list[str]]:
  yield from _source_file_documents()
  yield from _help_topic_documents()


@functools.lru_cache(maxsize=1)
def _all_documents() -> tuple[tuple[str, ...], ...]:
  return tuple(tuple(document) for document in _iter_documents())


def builtin_documents(max_documents: int | None = None) -> list[list[str]]:
  """The built-in corpus: a list of documents, each a list of one-line paragraphs.

  One document per stdlib source file (all its docstrings) and one per `pydoc` help
  topic, in a fixed order. `max_documents` keeps only the first that many, and stops
  parsing early, which keeps tests fast.
  """
  if max_documents is not None and max_documents < 0:
    raise ConfigError(
        f"max_documents must be None (all documents) or >= 0, got {max_documents}."
    )
  if max_documents is None:
    return [list(document) for document in _all_documents()]
  return list(itertools.islice(_iter_documents(), max_documents))


class DocumentsHasher:
  """Incremental `documents_fingerprint`, for corpora streamed one document at a time."""

  def __init__(self):
    self._digest = hashlib.sha256()

  def update(self, document) -> None:
    # Each sentence followed by a newline, then a separator marking the document boundary
    # (packing depends on it).
    self._digest.update(("".join(sentence + "\n" for sentence in document) + "\x00\n").encode("utf-8"))

  def hexdigest(self) -> str:
    return self._digest.hexdigest()[:16]


def documents_fingerprint(documents: list[list[str]]) -> str:
  """Short sha256 hex of the text of `documents` (order and boundaries included)."""
  hasher = DocumentsHasher()
  for document in documents:
    hasher.update(document)
  return hasher.hexdigest()


def builtin_corpus_fingerprint() -> str:
  """Short sha256 hex of the full built-in corpus text (parses the stdlib)."""
  return documents_fingerprint(builtin_documents())
