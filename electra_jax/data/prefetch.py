"""Background prefetching of step-indexed batches, so host-side gathering overlaps the device step.
Batches are a pure function of the step (see get_batch), so prefetching changes no batch."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_PUT_TIMEOUT_S = 0.1  # the producer's blocking put polls close() this often


class Prefetcher:
  """Iterates over fetch_fn(start_step), fetch_fn(start_step + 1), ... up to `stop_step` (exclusive; None:
  endless), computed `depth` steps ahead in a thread; an exception of fetch_fn is re-raised in its step."""

  def __init__(self, fetch_fn: Callable[[int], Any], start_step: int, depth: int = 2, stop_step: int | None = None):
    if depth < 1:
      raise ValueError(f"Prefetcher depth must be >= 1, got {depth}.")
    self.next_step = start_step  # the step whose batch the next iteration returns
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._finished = False
    self._thread = threading.Thread(target=self._produce, args=(fetch_fn, start_step, stop_step),
                                    name="electra-prefetch", daemon=True)
    self._thread.start()

  def _produce(self, fetch_fn, step: int, stop_step: int | None) -> None:
    while not self._stop.is_set():
      if stop_step is not None and step >= stop_step:
        item = ("end", None)
      else:
        try:
          item = ("batch", fetch_fn(step))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
          item = ("error", e)
      while not self._stop.is_set():  # a blocking put that notices close()
        try:
          self._queue.put(item, timeout=_PUT_TIMEOUT_S)
          break
        except queue.Full:
          pass
      if item[0] != "batch":
        return
      step += 1

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self):
    if self._finished:
      raise StopIteration
    kind, payload = self._queue.get()
    if kind == "batch":
      self.next_step += 1
      return payload
    self._finished = True
    if kind == "end":
      raise StopIteration
    self.close()
    raise payload  # the original exception, so a ConfigError stays one (its traceback shows the fetch)

  def close(self) -> None:
    """Stop the thread (it finishes at most the fetch in progress)."""
    self._stop.set()
    self._thread.join()

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
