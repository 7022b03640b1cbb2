"""One run per workdir: <workdir>/lease.json names the holder. A run takes it when absent, released or
dead (pid gone on this host, or no heartbeat for `stale_seconds`) with conditional writes only, so
two runs never both get it; the holder stops once another run's id is there (the newest wins)."""

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
  """A lease as this version writes it: the keys of _FIELD_TYPES, each of its type, and no other."""
  for key, value in {**dict.fromkeys(_FIELD_TYPES), **holder}.items():
    if not isinstance(value, _FIELD_TYPES.get(key, ())):
      raise ValueError(f"{key}={value!r}: a lease holds {', '.join(_FIELD_TYPES)}, of their types")
  return holder


def read_lease(workdir) -> dict | None:
  """The lease of `workdir`, checked; None when there is none."""
  return WorkdirLease(workdir)._read()[0]  # noqa: SLF001


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
    self.run_id = uuid.uuid4().hex[:12]
    self.record = dict(run_id=self.run_id, host=socket.gethostname(), pid=os.getpid())
    self.record.update(started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), released=False)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.RLock()  # the main thread's check/release against the heartbeat's write
    self.taken_by: dict | None = None  # set once another run's id is found in the file
    self._last_read = -float("inf")  # time.monotonic() of the last read of the file
    self._version = None  # of the file as last read: what the next write replaces

  def _who(self, holder: dict) -> str:
    return (
        f"run {holder['run_id']} on host {holder['host']} (pid {holder['pid']}, started "
        f"{holder['started']}, last heartbeat {self._clock() - holder['heartbeat']:.0f} s ago)"
    )

  def _alive(self, holder: dict | None) -> bool:
    """Whether `holder` (another run's lease) still counts as running."""
    if holder is None or holder["released"]:
      return False
    if self._clock() - holder["heartbeat"] > self.stale_seconds:
      return False
    if holder["host"] != self.record["host"]:
      return True
    if holder["pid"] == os.getpid():  # alive if this process runs it (a notebook's thread)
      return holder["run_id"] in _LIVE_RUN_IDS
    try:
      os.kill(holder["pid"], 0)
    except ProcessLookupError:
      return False
    except (PermissionError, OverflowError, ValueError):
      pass  # someone else's process, or a pid this system cannot have: assume alive
    return True

  def _read(self, take_over: bool = False) -> tuple[dict | None, object]:
    """(the lease or None, its version), noted as read now; an edited lease is refused (taken over
    with a warning if `take_over`)."""
    data, version = workdir_files.read_versioned(self.file)
    self._last_read = time.monotonic()
    fix = "If no run uses it, pass --take_over_workdir"
    try:
      holder = None if data is None else workdir_files.read_json(self.file, _checked, data, fix)
      return holder, version
    except ConfigError:
      if not take_over:
        raise
      logging.warning("--take_over_workdir: taking over %s, which was edited.", self.file)
      return None, version

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
      alive = self._alive(holder)
      if alive and not take_over:
        here = (holder["host"], holder["pid"]) == (self.record["host"], os.getpid())
        raise WorkdirInUse(
            f"{self.name} {self.workdir} is in use by {self._who(holder)}"
            + (", this very process (a notebook cell's run)" if here else "")
            + f": wait for it, or use another --workdir; if it is dead (no heartbeat for "
            f"{self.stale_seconds:.0f} s), pass --take_over_workdir. Nothing was written."
        )
      if holder is not None and not holder["released"]:
        how = "--take_over_workdir: taking" if alive else "A run ended without releasing it; taking"
        logging.warning("%s %s from %s.", how, self.workdir, self._who(holder))
      if self._write(version):
        break
    else:
      raise WorkdirInUse(
          f"{self.name} {self.workdir}: its {LEASE_FILE} changed under each of {_TRIES} tries to "
          "take it, as other runs start there. Run one job per workdir. Nothing was written."
      )
    _LIVE_RUN_IDS.add(self.run_id)
    self._thread = threading.Thread(target=self._beat, name="workdir-lease", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.beat_seconds):
      try:
        with self._lock:
          self._renew()
      except Exception as error:  # noqa: BLE001 (a bucket that did not answer: the next beat tries)
        logging.warning("Could not renew the lease on %s: %r", self.workdir, error)

  def _renew(self, **fields) -> None:
    """Writes this run's lease again (with `fields`) while it is this run's; notes a taker."""
    for _ in range(_TRIES):
      if not self.holds() or self._write(self._version, **fields):
        return

  def holds(self) -> bool:
    """Whether the file still names this run (read afresh until another run is found there)."""
    with self._lock:
      if self.taken_by is None:
        holder, self._version = self._read()
        if holder is not None and holder["run_id"] != self.run_id:
          self.taken_by = holder
      return self.taken_by is None

  def check(self, max_age_seconds: float = 0.0) -> None:
    """Raises WorkdirInUse if another run's lease replaced this one's. The file is read unless
    it was read less than `max_age_seconds` ago (a bucket's read takes tens of ms)."""
    with self._lock:
      fresh = time.monotonic() - self._last_read < max_age_seconds
      if not (self.taken_by is None if fresh else self.holds()):
        raise WorkdirInUse(
            f"Another run took over the workdir {self.workdir}: {self._who(self.taken_by)}. This "
            f"run ({self.run_id}) stopped without saving, not to overwrite its checkpoints."
        )

  def release(self) -> None:
    """Marks the lease released, unless another run holds it by now. Stops the heartbeat."""
    self._stop.set()
    _LIVE_RUN_IDS.discard(self.run_id)
    if self._thread is not None:  # joined first: its last beat is not written after this
      self._thread.join()
      self._renew(released=True)


# --- A run of several processes: process 0 holds the lease, and its refusals stop them all.
def _refused_everywhere(attempt: Callable[[], None] | None) -> None:
  """Runs `attempt` (None off process 0); a ConfigError it raises, every process raises."""
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


@contextlib.contextmanager
def held(workdir, take_over: bool, name: str = "The workdir"):
  """`workdir`'s lease (`name` in refusals) for every process of a run (process 0 holds it, the
  others get None), once all see it (they save checkpoints together); released at the end."""
  lease = WorkdirLease(workdir, name=name) if jax.process_index() == 0 else None
  _refused_everywhere(lease and (lambda: lease.acquire(take_over=take_over)))
  try:
    if jax.process_count() > 1:
      seen = zlib.crc32((read_lease(workdir) or {}).get("run_id", "").encode())
      views = np.asarray(multihost_utils.process_allgather(np.int64(seen))).reshape(-1)
      if blind := [i for i, view in enumerate(views) if view != views[0]]:
        raise ConfigError(
            f"--workdir={workdir} is not one directory every process sees: process(es) {blind} "
            f"cannot read the {LEASE_FILE} process 0 wrote there. Use a bucket or a shared mount."
        )
    yield lease
  finally:
    if lease is not None:
      lease.release()
