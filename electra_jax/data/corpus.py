"""The built-in English corpus: the running Python's stdlib docstrings (extracted with `ast`, never
imported) and pydoc's help topics, split into documents of sentences."""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import os
import pathlib
import sysconfig
from collections.abc import Iterator

# Directories of no representative prose (tests, vendored code, demos) or outside the stdlib proper.
_SKIPPED_DIRS = frozenset(
    "test tests site-packages idlelib __pycache__ lib2to3 turtledemo ensurepip".split()
)

# Bump when the extraction rules change: caches keyed on the sources are rebuilt.
EXTRACTION_VERSION = 1
# A paragraph is prose when this share of its characters are letters or spaces (not code or tables).
_MIN_PROSE_FRACTION = 0.75

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def _stdlib_source_files() -> list[str]:
  """Sorted relative paths of the stdlib `.py` files the corpus draws docstrings from."""
  root = stdlib_root()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)  # os.walk skips the rest
    paths += [
        os.path.relpath(os.path.join(dirpath, name), root)
        for name in sorted(filenames)
        if name.endswith(".py")
    ]
  return paths


def builtin_sources_fingerprint() -> str:
  """Hash of the stdlib sources the corpus comes from: it changes whenever the corpus could."""
  root = stdlib_root()
  digest = hashlib.sha256(f"extraction-v{EXTRACTION_VERSION}\n".encode())
  for relpath in _stdlib_source_files():
    data = pathlib.Path(root, relpath).read_bytes()
    digest.update(f"{relpath}\n{len(data)}\n".encode())
    digest.update(data)
  return digest.hexdigest()[:16]


def _iter_docstrings(node: ast.AST) -> Iterator[str]:
  if isinstance(node, _DOCSTRING_OWNERS) and (docstring := ast.get_docstring(node, clean=True)):
    yield docstring
  for child in ast.iter_child_nodes(node):
    yield from _iter_docstrings(child)


def split_sentences(text: str) -> list[str]:
  """`text`'s paragraphs, one whitespace-normalized line each; those mostly code or punctuation dropped."""
  sentences = []
  for _, lines in itertools.groupby(text.splitlines(), key=lambda line: not line.strip()):
    # Doctest prompts and continuations are code; a line of no letters or digits is a rule ("-----").
    prose = [line for line in lines if not line.strip().startswith((">>>", "..."))]
    paragraph = " ".join(" ".join(line for line in prose if any(map(str.isalnum, line))).split())
    letters = sum(ch.isalpha() or ch == " " for ch in paragraph)
    if paragraph and letters >= _MIN_PROSE_FRACTION * len(paragraph):
      sentences.append(paragraph)
  return sentences


def _parse(path: str) -> ast.Module | None:
  source = pathlib.Path(path).read_bytes()
  try:
    return ast.parse(source, filename=path)  # bytes: ast honours each file's coding declaration
  except (SyntaxError, ValueError):  # a file this interpreter cannot parse contributes nothing
    return None
  except SystemError:
    # CPython 3.11 (gh-106905): a parse on another thread can fail this one; the same bytes parse
    # again, and dropping the file would change the corpus.
    return ast.parse(source, filename=path)


def _iter_documents() -> Iterator[list[str]]:
  """One document per stdlib source file (its docstrings), then one per pydoc help topic."""
  from pydoc_data.topics import topics  # noqa: PLC0415 (a large dict of help texts: read here only)

  root = stdlib_root()
  trees = (_parse(os.path.join(root, relpath)) for relpath in _stdlib_source_files())
  docstrings = (list(_iter_docstrings(tree)) if tree is not None else [] for tree in trees)
  for texts in itertools.chain(docstrings, ([topics[name]] for name in sorted(topics))):
    document = [sentence for text in texts for sentence in split_sentences(text)]
    if document:
      yield document


@functools.lru_cache(maxsize=1)
def _all_documents() -> tuple[tuple[str, ...], ...]:
  return tuple(tuple(document) for document in _iter_documents())


def builtin_documents(max_documents: int | None = None) -> list[list[str]]:
  """The first `max_documents` documents (lists of one-line paragraphs) of the built-in corpus."""
  if max_documents is None:
    return [list(document) for document in _all_documents()]
  return list(itertools.islice(_iter_documents(), max_documents))
