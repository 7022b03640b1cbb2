"""Files on local disk or in a bucket (`gs://`): the workdir's, the lease's conditional writes and
prepared shards. Writes replace a file whole, atomically; check_bucket refuses a bad bucket early.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import tempfile
import time
import uuid

from absl import logging
from etils import epath

from electra_jax.errors import ConfigError, OutOfSpace

SWEEP_FILE = "sweep.json"  # a sweep folder's record of its base config and runs
FILE_MODE = 0o644  # of every local file we write (mkstemp's are owner-only; others read caches)


def is_remote(path) -> bool:
  return "://" in os.fspath(path)


def _epath(file) -> epath.Path:
  """`file` as etils.epath reaches it; a bucket's only with the gcs extra installed."""
  if is_remote(file):
    _google(os.fspath(file))
  return epath.Path(file)


def path(workdir, *parts) -> epath.Path:
  """`workdir`/parts; a local workdir is made absolute."""
  root = os.fspath(workdir)
  return _epath(root if is_remote(root) else os.path.abspath(root)).joinpath(*parts)


def check_usable(workdir, flag: str = "--workdir") -> None:
  """Refuses, naming `flag`, a directory that cannot be made (a file on its path, a parent this
  user may not write to), or a bucket that check_bucket(write=True) refuses."""
  if is_remote(workdir):
    return check_bucket(workdir, flag, write=True)
  existing = os.path.abspath(os.fspath(workdir))
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(
        f"{flag}={workdir} cannot be a directory: {existing} is a file. Pick another."
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"{flag}={workdir}: {existing} is not writable by this user. Pick another.")


def makedirs(directory) -> None:
  _epath(directory).mkdir(parents=True, exist_ok=True)


def exists(file) -> bool:
  return _epath(file).exists()


def read_text(file) -> str:
  return _epath(file).read_text()


def read_json(file, parse=lambda value: value, data=None, fix: str | None = None):
  """parse(the JSON of `file`, or of its `data` already read), refused naming the file and `fix`
  when it is not JSON or `parse` raises (ValueError, LookupError, TypeError, AttributeError)."""
  try:
    return parse(json.loads(read_text(file) if data is None else data))
  except ConfigError:  # `parse`'s own refusal, which names the file itself
    raise
  except (ValueError, LookupError, TypeError, AttributeError) as error:
    fix = fix or "Put back a good copy, or move its folder aside and start again"
    why = f"{type(error).__name__}: {error}"
    raise ConfigError(
        f"{file} is not as electra-jax writes it ({why}); it was edited or damaged. {fix}."
    ) from None


def read_sweep(folder, check_base=None) -> dict | None:
  """A sweep folder's sweep.json, its runs as (name of a folder inside it, overrides) pairs, its base
  config passed to `check_base` (which raises ValueError on a bad one); None for another folder."""
  file = path(folder, SWEEP_FILE)
  if not exists(file):
    return None

  def parse(record: dict) -> dict:
    if not isinstance(base := record["base_config"], dict):
      raise ValueError(f"base_config is a {type(base).__name__}, not an object")
    if check_base is not None:
      check_base(base)
    runs = [(run["name"], [tuple(o) for o in run["overrides"]]) for run in record["runs"]]
    for name, overrides in runs:
      if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
        raise ValueError(f"runs: {name!r} is not the name of a folder inside the sweep folder")
      if not all(len(o) == 2 and all(isinstance(v, str) for v in o) for o in overrides):
        raise ValueError(f"runs: {name}'s overrides are not [key, value] pairs of strings")
    return dict(record, runs=runs)

  return read_json(file, parse)


def read_jsonl(file) -> list:
  """The lines of a JSONL log (metrics.jsonl, eval_metrics.jsonl), parsed; [] if none. A last line
  cut short by a crash is skipped with a warning; another line that is not JSON is refused."""
  data = _epath(file).read_bytes() if exists(file) else b""
  lines = [line for line in data.splitlines() if line.strip()]
  records = []
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line.decode())  # a UnicodeDecodeError is a ValueError
      if not isinstance(record, dict):
        raise TypeError(f"a {type(record).__name__}")
    except (ValueError, TypeError) as error:
      if number < len(lines):
        raise ConfigError(
            f"{file}, line {number}, is not a JSON object ({type(error).__name__}: {error}); it "
            "was edited or damaged. Delete that line, or put back a good copy."
        ) from None
      logging.warning("Skipping the last line of %s: it was cut short (a crash?).", file)
    else:
      records.append(record)
  return records


def last_record(file) -> dict:
  """The last whole line of a JSONL log; {} if none."""
  return (read_jsonl(file) or [{}])[-1]


_EXHAUSTED = {  # what a write's errno says, and what to do
    errno.ENOSPC: "the disk is full; free space there",
    errno.EDQUOT: "this user's disk quota is used up; free space there or raise the quota",
    errno.EFBIG: "the file would pass this process's size limit (`ulimit -f`); raise the limit",
}


@contextlib.contextmanager
def out_of_space_named(file=None):
  """Turns a write refused for want of space (a full disk or quota, `ulimit -f`) into OutOfSpace,
  and one to a path that is a directory into ConfigError: one line naming the file (`file`, else
  the error's own) and what to do."""
  try:
    yield
  except OSError as error:
    name = file or error.filename or "a file"
    if error.errno == errno.EISDIR:
      raise ConfigError(
          f"Writing {name}: it is a directory. Move it aside, or name a file."
      ) from None
    if error.errno not in _EXHAUSTED:
      raise
    fix = _EXHAUSTED[error.errno]
    message = f"Writing {name}: {fix}, then run the same command again (what was written is kept)."
    raise OutOfSpace(message, error.errno) from None


def short_of_space(folder, size: int) -> int | None:
  """The errno (ENOSPC, EDQUOT, EFBIG) a file of `size` bytes in local `folder` meets today, found
  by reserving that much in an unnamed file; None when it fits."""
  try:
    with tempfile.TemporaryFile(dir=folder) as probe:
      os.posix_fallocate(probe.fileno(), 0, max(size, 1))
  except OSError as error:
    return error.errno if error.errno in _EXHAUSTED else None
  return None


def write_bytes(file, data: bytes) -> None:
  """Replaces `file` with `data` atomically: a local one (its folder made) through a fsynced
  temporary file, renamed; a bucket object appears only once uploaded whole. A full disk or a
  size limit is OutOfSpace, the file as it was."""
  if is_remote(file):
    _epath(file).write_bytes(data)
    return
  directory = os.path.dirname(os.path.abspath(file))
  with out_of_space_named(file):
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(file))
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view) :]
      os.fchmod(fd, FILE_MODE)
      os.fsync(fd)
      os.replace(tmp, file)
    finally:
      os.close(fd)
      with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)


def write_text(file, text: str) -> None:
  write_bytes(file, text.encode())


def write_json(file, value) -> None:
  write_text(file, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _step_of(line: str) -> float:
  with contextlib.suppress(ValueError, KeyError, TypeError):
    return int(json.loads(line)["step"])
  return float("inf")


def _text(lines: list[str]) -> str:
  return "".join(line + "\n" for line in lines)


class JsonlLog:
  """One JSON object per line; appended as the run goes, cut back on resume. A bucket's log is
  rewritten every `remote_flush_seconds` and on flush(), only while `holds()` (if set) is true."""

  def __init__(self, file, remote_flush_seconds: float = 60.0):
    self.file = _epath(file)
    self._remote = is_remote(self.file)
    self._flush_every = remote_flush_seconds
    self.holds = None
    self._lines: list[str] | None = None  # a bucket object's content, once read
    self._pending: list[str] = []
    self._last_flush = time.monotonic()

  def _content(self) -> list[str]:
    if self._lines is None:
      data = self.file.read_bytes() if self.file.exists() else b""
      self._lines = data.decode(errors="replace").splitlines()  # a damaged line is not JSON
    return self._lines

  def truncate_after(self, last_step: int) -> None:
    """Drops the lines past `last_step` (a run that got further than its last checkpoint) and any
    cut short by a crash, so a resumed run logs each step once."""
    lines = self._content()
    kept = [line for line in lines if _step_of(line) <= last_step]
    if len(kept) != len(lines):
      write_text(self.file, _text(kept))
    self._lines = kept if self._remote else None  # a local file is appended to, not kept here

  def append(self, record: dict) -> None:
    self._pending.append(json.dumps(record, sort_keys=True))
    if not self._remote or time.monotonic() - self._last_flush >= self._flush_every:
      self.flush()

  def flush(self) -> None:
    if not self._pending:
      return
    if self._remote and self.holds is not None and not self.holds():
      logging.warning(
          "Not writing %d lines of %s: another run took it over.", len(self._pending), self.file
      )
    elif self._remote:
      self._content().extend(self._pending)
      write_text(self.file, _text(self._lines))
    else:
      with out_of_space_named(self.file), open(self.file, "a") as f:
        f.write(_text(self._pending))  # a line cut short here is skipped when read
    self._pending = []
    self._last_flush = time.monotonic()


# --- Conditional writes (the lease): a file replaced only if it is still the version read.
def read_versioned(file) -> tuple[bytes | None, object]:
  """(content, version) of `file`, (None, None) when there is none. The version is a bucket
  object's generation, a local file's content."""
  if not is_remote(file):
    with contextlib.suppress(FileNotFoundError):
      data = _epath(file).read_bytes()
      return data, data
    return None, None
  # No object, or no bucket: the lease's first write_if says which.
  with _answers(file, f"reading {file}"), contextlib.suppress(_google()[1].NotFound):
    blob = _blob(file)
    return blob.download_as_bytes(), blob.generation
  return None, None


def write_if(file, data: bytes, version) -> bool:
  """Writes `data` at `file` only if it is still `version` (None: only if there is none); False if
  another write came first. In a bucket by GCS's preconditions; on disk under a flock beside it."""
  if is_remote(file):
    with _answers(file, f"writing {file}"):
      try:
        _blob(file).upload_from_string(data, if_generation_match=version or 0)
      except _google()[1].PreconditionFailed:
        return False
    return True
  with open(os.path.join(os.path.dirname(file), f".{os.path.basename(file)}.lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if read_versioned(file)[1] != version:
      return False
    write_bytes(file, data)
  return True


# --- Buckets: google-cloud-storage for our own calls, gcsfs (etils.epath's) for files and ranges.
def _google(what: str = "A gs:// path"):
  """(google.cloud.storage, google.api_core.exceptions, google.auth.exceptions)."""
  try:
    import gcsfs  # noqa: F401, PLC0415 (etils.epath reaches buckets through it)
    from google.api_core import exceptions  # noqa: PLC0415
    from google.auth import exceptions as auth_exceptions  # noqa: PLC0415
    from google.cloud import storage  # noqa: PLC0415
  except ImportError:
    raise ConfigError(
        f"{what} needs gcsfs and google-cloud-storage: pip install 'electra-jax[gcs]'."
    ) from None
  return storage, exceptions, auth_exceptions


@functools.cache
def _client(endpoint: str | None):
  del endpoint  # the cache key: a client is bound to the address it was made for
  return _google()[0].Client(project=None)  # no project: an existing bucket's objects need none


def _blob(url):
  """The object at gs:// `url` (`.bucket` is its bucket)."""
  bucket, _, name = os.fspath(url).removeprefix("gs://").partition("/")
  return _client(os.environ.get("STORAGE_EMULATOR_HOST")).bucket(bucket).blob(name.strip("/"))


@contextlib.contextmanager
def _answers(url, what: str):
  """Turns the API's refusals of `what` on `url` into a ConfigError naming the bucket and the fix."""
  _, exceptions, auth_exceptions = _google()
  bucket = "gs://" + os.fspath(url).removeprefix("gs://").split("/")[0]
  try:
    yield
    return
  except (exceptions.Forbidden, exceptions.Unauthorized) as error:
    why = f"{bucket} refuses this account ({error.code} {type(error).__name__})"
    fix = f"Give it roles/storage.objectUser on {bucket} (read, write, delete), or use another one"
  except exceptions.NotFound:  # what an object's absence raises is caught by our callers
    why = f"the bucket {bucket} does not exist"
    fix = f"Create it (gcloud storage buckets create {bucket} --location=REGION), or fix the path"
  except (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError) as error:
    why = f"no usable Google Cloud credentials to reach {bucket} ({type(error).__name__})"
    fix = "Run `gcloud auth application-default login`, or use a VM whose service account may"
  raise ConfigError(f"{what}: {why}. {fix}.") from None


def check_bucket(url, flag: str, write: bool = False) -> None:
  """Refuses, naming `flag` and the fix, a path that is not gs://, a bucket missing or out of reach,
  or (`write`) one that refuses writes (an object written and deleted beside `url`)."""
  if not os.fspath(url).startswith("gs://"):
    raise ConfigError(f"{flag}={url}: a remote path must be a gs:// path.")
  _google(f"{flag}={url}")
  with _answers(url, f"{flag}={url}"):
    prefix = _blob(url)
    list(prefix.bucket.list_blobs(prefix=prefix.name, max_results=1))
    if write:
      name = f"{prefix.name}/.electra-jax-write-check-{uuid.uuid4().hex[:12]}".lstrip("/")
      probe = prefix.bucket.blob(name)
      probe.upload_from_string(b"", if_generation_match=0)
      probe.delete()


def filesystem(url):
  """(the fsspec filesystem of bucket `url`, the path it takes): gcsfs, which reads
  STORAGE_EMULATOR_HOST at each request, so a cached instance follows the environment."""
  import fsspec  # noqa: PLC0415 (only buckets need it)

  return fsspec.core.url_to_fs(os.fspath(url))


def list_files(directory) -> dict[str, tuple[int, str | None]]:
  """What `directory` holds, read fresh: name -> (bytes, crc32c as 8 hex digits where a bucket
  reports its own, else None); {} when it does not exist."""
  root = os.fspath(directory)
  if not is_remote(root):
    files = {}
    with contextlib.suppress(FileNotFoundError):
      for entry in os.scandir(root):
        with contextlib.suppress(FileNotFoundError):  # a link to nothing: no file of that name
          files[entry.name] = (entry.stat().st_size, None)
    return files
  fs, prefix = filesystem(root)
  try:
    listed = fs.ls(prefix, detail=True, refresh=True)
  except FileNotFoundError:
    return {}
  files = {}
  for info in listed:  # gcsfs's copy of each object's resource: crc32c is base64, big-endian
    name, checksum = info["name"].rstrip("/").rsplit("/", 1)[-1], info.get("crc32c")
    files[name] = (int(info["size"]), base64.b64decode(checksum).hex() if checksum else None)
  return files


def crc32c(data: bytes) -> str:
  """CRC32C of `data` as 8 hex digits, the checksum a bucket reports for every object."""
  import google_crc32c  # noqa: PLC0415

  return f"{google_crc32c.value(data):08x}"


def local_copy(file, cache_dir) -> str:
  """A local path holding `file`'s bytes: `file` itself on local disk; for a bucket object, a copy
  in `cache_dir` named by its content, so a replaced object never reuses a stale copy."""
  if not is_remote(file):
    return os.fspath(file)
  data = _epath(file).read_bytes()
  name = os.fspath(file).rstrip("/").rsplit("/", 1)[-1]
  copy = os.path.join(cache_dir, "objects", f"{hashlib.sha256(data).hexdigest()[:16]}-{name}")
  if not os.path.exists(copy):
    write_bytes(copy, data)
  return copy
