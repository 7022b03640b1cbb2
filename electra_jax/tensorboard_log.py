"""TensorBoard event files beside the JSONL logs (<workdir>/tensorboard/{train,eval}), written
through tensorboardX without TensorFlow. The JSONL files stay the source of truth; the events are
a view of them: NaN as NaN, and a resumed run purges the points past its checkpoint. Without
tensorboardX, or for a bucket workdir, training logs to the JSONL files alone and says so once."""

from __future__ import annotations

import logging as std_logging
import numbers
import os
import time

from absl import logging

from electra_jax import workdir_files

SUBDIR = "tensorboard"
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
  if key not in _warned:
    _warned.add(key)
    logging.warning(message, *args)


def _tensorboardx():
  """The tensorboardX modules we write with, or None (warned once) when it is not installed."""
  try:
    from tensorboardX import event_file_writer, summary  # noqa: PLC0415 (optional at run time)
    from tensorboardX.proto import event_pb2  # noqa: PLC0415
  except ImportError:
    _warn_once(
        "missing", "tensorboardX is not installed: metrics go to the JSONL logs only "
        "(pip install tensorboardX for TensorBoard event files)."
    )
    return None
  # It warns at every NaN scalar; NaN is expected here (disc_auc on a one-class window).
  std_logging.getLogger("tensorboardX.x2num").setLevel(std_logging.ERROR)
  return event_file_writer, summary, event_pb2


class ScalarWriter:
  """Scalars into one new event file per writer, opened on first use (so that a resumed run
  can first set its purge step) and flushed after each record.

  tensorboardX's SummaryWriter flushes without waiting for its background queue, so its
  synchronous EventsWriter (the same file format) is used instead."""

  def __init__(self, logdir: str):
    self.logdir = logdir
    self._writer = None
    self._purge_step: int | None = None
    self._disabled = False
    self._modules = None

  def purge_after(self, last_step: int) -> None:
    """TensorBoard then drops the points earlier files logged past `last_step`."""
    self._purge_step = last_step + 1

  def _open(self):
    if self._writer is None and not self._disabled:
      self._modules = _tensorboardx()
      if self._modules is None:
        self._disabled = True
        return None
      event_file_writer, _, event_pb2 = self._modules
      os.makedirs(self.logdir, exist_ok=True)
      # The pid and a clock tick keep the names of writers opened in the same second apart.
      suffix = f".{os.getpid()}.{time.monotonic_ns()}"
      self._writer = event_file_writer.EventsWriter(os.path.join(self.logdir, "events"), suffix)
      if self._purge_step is not None:  # what SummaryWriter(purge_step=N) writes
        self._writer.write_event(event_pb2.Event(
            wall_time=time.time(), step=self._purge_step,
            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
        ))
    return self._writer

  def write(self, record: dict) -> None:
    writer = self._open()
    if writer is None:
      return
    _, summary, event_pb2 = self._modules
    step, now = int(record["step"]), time.time()
    for name, value in sorted(record.items()):
      if name == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
        continue
      writer.write_event(event_pb2.Event(wall_time=now, step=step, summary=summary.scalar(name, float(value))))
    writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


class TensorBoardLog:
  """A workdir_files.JsonlLog that also writes each record to a ScalarWriter (or to nothing:
  `writer=None`). Same methods as JsonlLog, plus close()."""

  def __init__(self, jsonl: workdir_files.JsonlLog, writer: ScalarWriter | None):
    self.jsonl = jsonl
    self.writer = writer

  @property
  def file(self):
    return self.jsonl.file

  def truncate_after(self, last_step: int) -> None:
    self.jsonl.truncate_after(last_step)
    if self.writer is not None:
      self.writer.purge_after(last_step)

  def append(self, record: dict) -> None:
    self.jsonl.append(record)
    if self.writer is not None:
      self.writer.write(record)

  def flush(self) -> None:
    self.jsonl.flush()  # the events are flushed at each record

  def close(self) -> None:
    self.flush()
    if self.writer is not None:
      self.writer.close()


def open_logs(workdir: str) -> tuple[TensorBoardLog, TensorBoardLog]:
  """(metrics.jsonl, eval_metrics.jsonl) logs of `workdir`, with TensorBoard events under
  <workdir>/tensorboard/{train,eval} when the workdir is local and tensorboardX installed."""
  writers = {"train": None, "eval": None}
  if workdir_files.is_remote(workdir):
    _warn_once(
        "remote", "TensorBoard event files are written for local workdirs only; %s is a bucket, "
        "so its metrics go to the JSONL logs alone.", workdir,
    )
  elif _tensorboardx() is not None:
    root = workdir_files.path(workdir, SUBDIR)
    writers = {split: ScalarWriter(str(root / split)) for split in writers}
  return (
      TensorBoardLog(workdir_files.JsonlLog(workdir_files.path(workdir, "metrics.jsonl")), writers["train"]),
      TensorBoardLog(workdir_files.JsonlLog(workdir_files.path(workdir, "eval_metrics.jsonl")), writers["eval"]),
  )
