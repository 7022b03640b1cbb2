"""Background prefetching of step-indexed batches, so host-side gathering overlaps the device step.
Batches are a pure function of the step (see get_batch), so prefetching changes no batch."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_PUT_TIMEOUT_S = 0.1  # the producer's blocking put polls close() this often


class Prefetcher:
  """Iterates over fetch_fn(start_step), fetch_fn(start_step + 1), ... up to `stop_step` (exclusive;
  None: endless), computed up to `depth` steps ahead in a background thread. An exception of fetch_fn is
  re-raised, as itself, where that step's batch would come. Use as a context manager, or call close().
  """

  def __init__(self, fetch_fn: Callable[[int], Any], start_step: int, depth: int = 2, stop_step: int | None = None):
    if depth < 1:
      raise ValueError(f"Prefetcher depth must be >= 1, got {depth}.")
    self._fetch_fn = fetch_fn
    self._next_step = start_step
    self._stop_step = stop_step
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._finished = False
    self._thread = threading.Thread(target=self._produce, args=(start_step,), name="electra-prefetch", daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=_PUT_TIMEOUT_S)
        return True
      except queue.Full:
        continue
    return False

  def _produce(self, step: int) -> None:
    while not self._stop.is_set():
      if self._stop_step is not None and step >= self._stop_step:
        self._put(("end", step, None))
        return
      try:
        batch = self._fetch_fn(step)
      except BaseException as e:  # noqa: BLE001 -- handed to the consumer
        self._put(("error", step, e))
        return
      if not self._put(("batch", step, batch)):
        return
      step += 1

  @property
  def next_step(self) -> int:
    """The step whose batch the next iteration returns."""
    return self._next_step

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    kind, step, payload = self._queue.get()
    if kind == "end":
      self._finished = True
      raise StopIteration
    if kind == "error":
      self._finished = True
      self.close()
      # The original exception, so a ConfigError stays one (its traceback shows the fetch).
      raise payload
    assert step == self._next_step, (step, self._next_step)
    self._next_step += 1
    return payload

  def close(self) -> None:
    """Stop the thread (it finishes at most the fetch in progress)."""
    self._stop.set()
    self._thread.join()

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
