"""One run per workdir: <workdir>/lease.json names the holder (run id, host, pid, heartbeat). A run
takes a lease that is absent, released or dead (pid gone on this host, or no heartbeat for
`stale_seconds`), else refuses unless `take_over`. Every write is conditional
(workdir_files.write_if), so two runs never both take it; the holder re-reads it before each
checkpoint and on every beat, and stops once another run's id is there (the newest run wins)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import zlib
from typing import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from electra_jax import distributed, workdir_files
from electra_jax.errors import ConfigError, WorkdirInUse

LEASE_FILE = "lease.json"
_FIELD_TYPES = dict(
    run_id=str, host=str, pid=int, heartbeat=(int, float), released=bool, started=str
)
# The runs this process holds: alive, unlike a dead run with the same pid (a restarted container).
_LIVE_RUN_IDS: set[str] = set()
_TRIES = 20  # reads and conditional writes before acquire() gives up on a lease that keeps changing


def _checked(holder: dict) -> dict:
  """A lease as this version writes it: a run_id, and only the keys of _FIELD_TYPES, typed so."""
  for key, value in {"run_id": None, **holder}.items():
    if not isinstance(value, _FIELD_TYPES.get(key, ())):
      raise ValueError(f"{key}={value!r}: a lease holds {', '.join(_FIELD_TYPES)}, of their types")
  return holder


def _parse(data: bytes | None, file, take_over: bool = False) -> dict | None:
  """The lease in `data`, None when there is none; an edited one is refused (taken if `take_over`)."""
  if data is None:
    return None
  try:
    return workdir_files.read_json(
        file, _checked, data, "If no run uses it, pass --take_over_workdir"
    )
  except ConfigError:
    if not take_over:
      raise
    logging.warning("--take_over_workdir: taking over %s, which was edited.", file)
    return None


def read_lease(workdir) -> dict | None:
  """The lease of `workdir`, checked; None when there is none."""
  file = workdir_files.path(workdir, LEASE_FILE)
  return _parse(workdir_files.read_versioned(file)[0], file)


class WorkdirLease:
  """Process 0's claim on a workdir: `acquire()` before writing anything, `check()` before each
  checkpoint, `release()` at the end (also after an error)."""

  def __init__(
      self,
      workdir,
      beat_seconds: float = 30.0,
      stale_seconds: float = 120.0,
      clock: Callable[[], float] = time.time,
      name: str = "The workdir",
  ):
    self.workdir, self.name = workdir, name  # name: how a refusal names it ("The sweep folder")
    self.file = workdir_files.path(workdir, LEASE_FILE)
    self.beat_seconds, self.stale_seconds, self._clock = beat_seconds, stale_seconds, clock
    self.record = {
        "run_id": uuid.uuid4().hex[:12],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "released": False,
    }
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()  # the main thread's check/release against the heartbeat's write
    self.taken_by: dict | None = None  # set once another run's id is found in the file
    self._last_read = -float("inf")  # time.monotonic() of the last read of the file
    self._version = None  # of the file as last read: what the next write replaces

  @property
  def run_id(self) -> str:
    return self.record["run_id"]

  def _who(self, holder: dict) -> str:
    age = self._clock() - float(holder.get("heartbeat", 0.0))
    return (
        f"run {holder['run_id']} on host {holder.get('host', '?')} (pid {holder.get('pid', '?')}, "
        f"started {holder.get('started', '?')}, last heartbeat {age:.0f} s ago)"
    )

  def _alive(self, holder: dict | None) -> bool:
    """Whether `holder` (another run's lease) still counts as running."""
    if holder is None or holder.get("released"):
      return False
    if self._clock() - holder.get("heartbeat", 0.0) > self.stale_seconds:
      return False
    if holder.get("host") != self.record["host"]:
      return True
    pid = holder.get("pid", -1)
    if pid == os.getpid():  # alive if this process runs it (a notebook's thread), not if restarted
      return holder["run_id"] in _LIVE_RUN_IDS
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except (PermissionError, OverflowError, ValueError):
      pass  # someone else's process, or a pid this system cannot have: assume alive
    return True

  def _read(self, take_over: bool = False) -> tuple[dict | None, object]:
    """(the lease, its version), noted as read now."""
    data, version = workdir_files.read_versioned(self.file)
    self._last_read = time.monotonic()
    return _parse(data, self.file, take_over), version

  def _write(self, version, **fields) -> bool:
    """This run's lease with a fresh heartbeat, written if the file is still `version`."""
    record = dict(self.record, heartbeat=self._clock(), **fields)
    return workdir_files.write_if(self.file, json.dumps(record, sort_keys=True).encode(), version)

  def acquire(self, take_over: bool = False) -> None:
    """Takes the workdir, or raises WorkdirInUse naming the run that holds it."""
    workdir_files.makedirs(workdir_files.path(self.workdir))
    for _ in range(_TRIES):
      holder, version = self._read(take_over)
      if holder is not None and holder["run_id"] == self.run_id:
        break  # this run's own write, which a retried request reported as failed
      if self._alive(holder):
        held_here = (holder.get("host"), holder.get("pid")) == (self.record["host"], os.getpid())
        if not take_over:
          raise WorkdirInUse(
              f"{self.name} {self.workdir} is in use by {self._who(holder)}."
              + (" That is this very process (a notebook cell's run)." if held_here else "")
              + f" Wait for it to end, or use another --workdir; if it is dead (on another host: "
              f"no heartbeat for {self.stale_seconds:.0f} s), pass --take_over_workdir. Nothing "
              "was written."
          )
        logging.warning("--take_over_workdir: taking %s from %s.", self.workdir, self._who(holder))
      elif holder is not None and not holder.get("released"):
        logging.warning(
            "The last run on %s ended without releasing it (%s); taking it over.",
            self.workdir,
            self._who(holder),
        )
      if self._write(version):
        break
    else:
      raise WorkdirInUse(
          f"{self.name} {self.workdir}: its {LEASE_FILE} changed under each of {_TRIES} tries to "
          "take it; other runs are starting there. Run one job per workdir. Nothing was written."
      )
    _LIVE_RUN_IDS.add(self.run_id)
    self._thread = threading.Thread(target=self._beat, name="workdir-lease", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.beat_seconds):
      try:
        with self._lock:
          if not self._stop.is_set():
            self._renew()
      except Exception as error:  # noqa: BLE001 (a bucket that did not answer: the next beat tries)
        logging.warning("Could not renew the lease on %s: %r", self.workdir, error)

  def _renew(self, **fields) -> None:
    """Writes this run's lease again (with `fields`) while it is this run's; notes a taker."""
    for _ in range(_TRIES):
      if not self._still_held() or self._write(self._version, **fields):
        return

  def _still_held(self) -> bool:
    """Whether the file still names this run (read afresh until another run is found there)."""
    if self.taken_by is None:
      holder, self._version = self._read()
      if holder is not None and holder["run_id"] != self.run_id:
        self.taken_by = holder
    return self.taken_by is None

  def holds(self) -> bool:
    """Whether this run still holds the workdir, the file read afresh."""
    with self._lock:
      return self._still_held()

  def check(self, max_age_seconds: float = 0.0) -> None:
    """Raises WorkdirInUse if another run's lease replaced this one's. The file is read unless
    it was read less than `max_age_seconds` ago (a bucket's read takes tens of ms)."""
    with self._lock:
      fresh = time.monotonic() - self._last_read < max_age_seconds
      if not (self.taken_by is None if fresh else self._still_held()):
        raise WorkdirInUse(
            f"Another run took over the workdir {self.workdir}: {self._who(self.taken_by)}. This "
            f"run ({self.run_id}) stopped without saving, not to overwrite its checkpoints. Run "
            "one job per workdir."
        )

  def release(self) -> None:
    """Marks the lease released, unless another run holds it by now. Stops the heartbeat."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    _LIVE_RUN_IDS.discard(self.run_id)
    with self._lock:
      if self._thread is not None:
        self._renew(released=True)


# --- A run of several processes: process 0 holds the lease, and its refusals stop them all.
def _refused_everywhere(attempt: Callable[[], None] | None) -> None:
  """Runs `attempt` (None off process 0); a WorkdirInUse it raises, every process raises."""
  problem = None
  try:
    if attempt is not None:
      attempt()
  except ConfigError as error:  # WorkdirInUse, or an edited lease.json
    problem = error
  if distributed.from_process_0(problem is not None):
    raise problem or WorkdirInUse("Process 0 stopped the run; its log says why.")


def hold(lease: WorkdirLease | None, max_age_seconds: float = 0.0) -> None:
  """Raises WorkdirInUse on every process once another run has taken the workdir over."""
  _refused_everywhere(lease and (lambda: lease.check(max_age_seconds)))


def acquire(directory: str, take_over: bool, name: str = "The workdir") -> WorkdirLease | None:
  """Process 0 takes `directory`'s lease (returned; None on the others), or all raise."""
  lease = WorkdirLease(directory, name=name) if jax.process_index() == 0 else None
  _refused_everywhere(lease and (lambda: lease.acquire(take_over=take_over)))
  return lease


def check_shared(workdir: str) -> None:
  """Every process must see the lease process 0 just wrote: checkpoints are saved by all together,
  and a workdir local to each host would leave orbax waiting forever."""
  if jax.process_count() == 1:
    return
  seen = zlib.crc32((read_lease(workdir) or {}).get("run_id", "").encode())
  views = np.asarray(multihost_utils.process_allgather(np.int64(seen))).reshape(-1)
  blind = [i for i, view in enumerate(views) if view != views[0]]
  if blind:
    raise ConfigError(
        f"--workdir={workdir} is not one directory every process sees: process(es) {blind} cannot "
        f"read the {LEASE_FILE} process 0 wrote there, and checkpoints are saved by all processes "
        "together. On a multi-host slice use a bucket (gs://...) or a shared mount."
    )


@contextlib.contextmanager
def held(workdir, take_over: bool):
  """The workdir's lease for a run of every process (process 0 holds it; the others get None),
  once every process sees it; released at the end."""
  lease = acquire(workdir, take_over)
  try:
    check_shared(workdir)
    yield lease
  finally:
    if lease is not None:
      lease.release()
