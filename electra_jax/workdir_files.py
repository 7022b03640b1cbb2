"""The workdir's small files (config.json, metrics.jsonl, eval results) on local disk or in a
bucket (`gs://...`, through etils.epath). Writes replace a file whole, atomically; a bucket's
`JsonlLog` is rewritten at most every `remote_flush_seconds` and on `flush()`."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import time

from absl import logging
from etils import epath

from electra_jax import gcs
from electra_jax.errors import ConfigError

SWEEP_FILE = "sweep.json"  # a sweep folder's record of its base config and runs


def is_remote(path) -> bool:
  return "://" in os.fspath(path)


def path(workdir, *parts) -> epath.Path:
  """`workdir`/parts; a local workdir is made absolute."""
  root = os.fspath(workdir)
  return epath.Path(root if is_remote(root) else os.path.abspath(root)).joinpath(*parts)


def check_usable(workdir, flag: str = "--workdir") -> None:
  """Refuses, naming `flag`, a workdir that cannot be made (a file on its path, a parent this user
  may not write to), or a bucket that is missing or refuses this account's writes."""
  if is_remote(workdir):
    if not os.fspath(workdir).startswith("gs://"):
      raise ConfigError(f"{flag}={workdir}: a remote workdir must be a gs:// path.")
    try:
      import gcsfs  # noqa: F401, PLC0415 (etils.epath reaches buckets through it)
    except ImportError:
      raise ConfigError(
          f"{flag}={workdir} needs gcsfs and google-cloud-storage: pip install 'electra-jax[gcs]'."
      ) from None
    gcs.check_writable(workdir, flag)
    return
  existing = os.path.abspath(os.fspath(workdir))
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(
        f"{flag}={workdir} cannot be a directory: {existing} is a file. Pick another {flag}."
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(
        f"{flag}={workdir}: {existing} is not writable by this user. Pick another {flag}."
    )


def makedirs(directory) -> None:
  epath.Path(directory).mkdir(parents=True, exist_ok=True)


def exists(file) -> bool:
  return epath.Path(file).exists()


def read_text(file) -> str:
  return epath.Path(file).read_text()


def read_json(file, parse=lambda value: value):
  """parse(the JSON of `file`), refused by name when it is not JSON or `parse` raises (an edited or damaged file)."""
  try:
    return parse(json.loads(read_text(file)))
  except ConfigError:  # `parse`'s own refusal, which names the file itself
    raise
  except (ValueError, KeyError, TypeError, AttributeError) as error:
    raise ConfigError(
        f"{file} is not as electra-jax writes it ({type(error).__name__}: {error}); it was edited or "
        "damaged. Put back a good copy, or move its folder aside and start again."
    ) from None


def read_sweep(folder) -> dict | None:
  """A sweep folder's sweep.json, its runs as (name, overrides) pairs; None for another folder."""
  file = path(folder, SWEEP_FILE)
  if not exists(file):
    return None
  return read_json(
      file,
      lambda record: dict(
          record,
          runs=[(str(r["name"]), [tuple(o) for o in r["overrides"]]) for r in record["runs"]],
      ),
  )


def read_jsonl(file) -> list:
  """The whole lines of a JSONL log (metrics.jsonl, eval_metrics.jsonl), parsed; [] if none."""
  records = []
  for line in read_text(file).splitlines() if exists(file) else []:
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # a line cut short by a crash
  return records


def last_record(file) -> dict:
  """The last whole line of a JSONL log; {} if none."""
  return (read_jsonl(file) or [{}])[-1]


def write_bytes(file, data: bytes) -> None:
  """Replaces `file` with `data` atomically: a local one (its folder made) via a fsynced `.tmp-` file, renamed."""
  if is_remote(file):
    epath.Path(file).write_bytes(data)
    return
  directory = os.path.dirname(os.path.abspath(file))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(file))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; a shared cache is read by others
    os.replace(tmp, file)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_text(file, text: str) -> None:
  write_bytes(file, text.encode())


def write_json(file, value) -> None:
  write_text(file, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _step_of(line: str) -> float:
  try:
    return int(json.loads(line)["step"])
  except (ValueError, KeyError, TypeError):
    return float("inf")


def _text(lines: list[str]) -> str:
  return "".join(line + "\n" for line in lines)


class JsonlLog:
  """One JSON object per line; appended as the run goes, cut back on resume. A bucket's log is
  rewritten only while `holds()` (if set: the run's lease, read afresh) says the run owns it."""

  def __init__(self, file, remote_flush_seconds: float = 60.0):
    self.file = epath.Path(file)
    self._remote = is_remote(self.file)
    self._flush_every = remote_flush_seconds
    self.holds = None
    self._lines: list[str] | None = None  # a bucket object's content, once read
    self._pending: list[str] = []
    self._last_flush = time.monotonic()

  def _content(self) -> list[str]:
    if self._lines is None:
      self._lines = self.file.read_text().splitlines() if self.file.exists() else []
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
          "Not writing the last %d lines of %s: another run took the workdir over and logs there.",
          len(self._pending),
          self.file,
      )
    elif self._remote:
      self._content().extend(self._pending)
      write_text(self.file, _text(self._lines))
    else:
      with open(self.file, "a") as f:
        f.write(_text(self._pending))
    self._pending = []
    self._last_flush = time.monotonic()


# Prepared data in a bucket (data/shards.py): listings that carry the bucket's own checksums,
# concurrent ranged reads, and local copies of the files a library must open by path.


def filesystem(url):
  """(the fsspec filesystem of bucket `url`, the path it takes): gcsfs for gs://, which reads
  STORAGE_EMULATOR_HOST at each request, so a cached instance follows the environment."""
  import fsspec  # noqa: PLC0415 (only buckets need it)

  return fsspec.core.url_to_fs(os.fspath(url))


def check_bucket(url, flag: str) -> None:
  """Refuses, naming `flag`, a bucket URL whose bucket does not exist or is out of reach."""
  fs, target = filesystem(url)
  bucket = target.split("/")[0]
  scheme = os.fspath(url).split("://")[0]
  try:
    found = fs.exists(bucket)
  except OSError as error:
    raise ConfigError(
        f"{flag}={url}: the bucket {scheme}://{bucket} cannot be reached ({error}); check the "
        "name and this machine's credentials."
    ) from error
  if not found:
    raise ConfigError(
        f"{flag}={url}: the bucket {scheme}://{bucket} does not exist (or these credentials "
        f"cannot see it); create it (gcloud storage buckets create {scheme}://{bucket}) or fix "
        "the name."
    )


def list_files(directory) -> dict[str, tuple[int, str | None]]:
  """What `directory` holds: name -> (bytes, crc32c as 8 hex digits where a bucket reports its
  own, else None), read fresh; {} when it does not exist."""
  root = os.fspath(directory)
  if not is_remote(root):
    try:
      return {entry.name: (entry.stat().st_size, None) for entry in os.scandir(root)}
    except FileNotFoundError:
      return {}
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
  data = epath.Path(file).read_bytes()
  name = os.fspath(file).rstrip("/").rsplit("/", 1)[-1]
  copy = os.path.join(cache_dir, "objects", f"{hashlib.sha256(data).hexdigest()[:16]}-{name}")
  if not os.path.exists(copy):
    write_bytes(copy, data)
  return copy
