"""Our own calls to Google Cloud Storage, through google-cloud-storage: an object replaced only if
it is still the generation read (the lease), and a bucket checked before a run writes there. The
API's errors a user can act on become ConfigErrors here."""

from __future__ import annotations

import contextlib
import functools
import os
import uuid

from electra_jax.errors import ConfigError


def split(url) -> tuple[str, str]:
  """('bucket', 'name/in/it') of 'gs://bucket/name/in/it'."""
  bucket, _, name = os.fspath(url).removeprefix("gs://").partition("/")
  return bucket, name.strip("/")


def _libraries():
  """(google.cloud.storage, google.api_core.exceptions, google.auth.exceptions)."""
  try:
    from google.api_core import exceptions  # noqa: PLC0415 (needed for buckets only)
    from google.auth import exceptions as auth_exceptions  # noqa: PLC0415
    from google.cloud import storage  # noqa: PLC0415
  except ImportError:
    raise ConfigError(
        "A gs:// path needs gcsfs and google-cloud-storage: pip install 'electra-jax[gcs]'."
    ) from None
  return storage, exceptions, auth_exceptions


@functools.cache
def _client(endpoint: str | None):
  del endpoint  # the cache key: a client is bound to the address it was made for
  return _libraries()[0].Client(project=None)  # no project: an existing bucket's objects need none


def _bucket(url):
  return _client(os.environ.get("STORAGE_EMULATOR_HOST")).bucket(split(url)[0])


@contextlib.contextmanager
def answers(url, what: str, missing_bucket: bool = True):
  """Turns the API's refusals of `what` (a flag and its value, or an action) on `url` into a
  ConfigError naming the bucket and the fix. `missing_bucket`: whether a NotFound can only mean
  that the bucket does not exist (not so for reading an object)."""
  _, exceptions, auth_exceptions = _libraries()
  bucket, _ = split(url)
  try:
    yield
  except (exceptions.Forbidden, exceptions.Unauthorized) as error:
    raise ConfigError(
        f"{what}: gs://{bucket} refuses this account ({error.code} {type(error).__name__}). Give "
        f"it the role roles/storage.objectUser on gs://{bucket} (to read, write and delete "
        "objects), or use a bucket it may write to."
    ) from None
  except exceptions.NotFound:
    if not missing_bucket:
      raise
    raise ConfigError(
        f"{what}: the bucket gs://{bucket} does not exist. Create it in the region of the "
        f"machines that train (gcloud storage buckets create gs://{bucket} --location=REGION), "
        "or fix the path."
    ) from None
  except (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError) as error:
    raise ConfigError(
        f"{what}: no usable Google Cloud credentials to reach gs://{bucket} "
        f"({type(error).__name__}). Run `gcloud auth application-default login`, or train on a VM "
        "whose service account may use the bucket."
    ) from None


def read(url) -> tuple[bytes | None, int | None]:
  """(content, generation) of the object at `url`; (None, None) when there is none."""
  with answers(url, f"reading {url}", missing_bucket=False):
    blob = _bucket(url).blob(split(url)[1])
    try:
      data = blob.download_as_bytes()
    except _libraries()[1].NotFound:
      return None, None
  return data, blob.generation


def write(url, data: bytes, generation: int | None) -> bool:
  """Writes `data` at `url` only if the object there is still `generation` (None: only if there
  is none); False if another write came first."""
  with answers(url, f"writing {url}"):
    try:
      _bucket(url).blob(split(url)[1]).upload_from_string(data, if_generation_match=generation or 0)
    except _libraries()[1].PreconditionFailed:
      return False
  return True


def check_writable(url, flag: str) -> None:
  """Refuses, naming `flag`, a bucket that is missing or does not take this account's writes, by
  listing `url` and writing and deleting one empty object beside it."""
  _, prefix = split(url)
  with answers(url, f"{flag}={url}"):
    bucket = _bucket(url)
    list(bucket.list_blobs(prefix=prefix, max_results=1))
    probe = bucket.blob(f"{prefix}/.electra-jax-write-check-{uuid.uuid4().hex[:12]}".lstrip("/"))
    probe.upload_from_string(b"", if_generation_match=0)
    probe.delete()
