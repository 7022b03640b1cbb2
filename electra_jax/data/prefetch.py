"""Background prefetching of step-indexed batches, so host-side gathering overlaps the device step.
Batches are a pure function of the step (see get_batch), so prefetching changes no batch."""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any


class Prefetcher:
  """Iterates over fetch_fn(start_step), fetch_fn(start_step + 1), ... up to `stop_step` (exclusive; None:
  endless), computed in order by one thread, at most `depth` steps ahead; an exception of fetch_fn is
  re-raised (as itself) in its step, which ends the iteration. Its thread ends with the iteration or
  close()."""

  def __init__(self, fetch_fn: Callable[[int], Any], start_step: int, depth: int = 2, stop_step: int | None = None):
    if depth < 1:
      raise ValueError(f"Prefetcher depth must be >= 1, got {depth}.")
    self.next_step = start_step  # the step whose batch the next iteration returns
    self._fetch, self._stop_step, self._submitted = fetch_fn, stop_step, start_step
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="electra-prefetch")
    self._ahead: collections.deque[concurrent.futures.Future] = collections.deque()
    for _ in range(depth):
      self._submit()

  def _submit(self) -> None:
    if self._stop_step is None or self._submitted < self._stop_step:
      self._ahead.append(self._pool.submit(self._fetch, self._submitted))
      self._submitted += 1

  def __iter__(self) -> Iterator[Any]:
    return self

  def __next__(self):
    if not self._ahead:
      self.close()
      raise StopIteration
    try:
      batch = self._ahead.popleft().result()
    except BaseException:
      self.close()
      raise
    self._submit()
    self.next_step += 1
    return batch

  def close(self) -> None:
    """Stop fetching: what has not started is dropped, the fetch in progress finishes."""
    while self._ahead:
      self._ahead.popleft().cancel()
    self._pool.shutdown(wait=True)

  def __enter__(self) -> Prefetcher:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
