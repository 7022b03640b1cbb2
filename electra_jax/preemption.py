"""Stopping a run cleanly: SIGTERM (a preempted VM), SIGHUP (a closed terminal) or a first Ctrl-C
ends the loop after a step, with a checkpoint; `sigterm_received` lets the sweep's loop stop too."""

import contextlib
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils

# Set by any SIGTERM this process took, a run's handler or a sweep's (sweep.py asks after each
# run, so one that came during a run's last step, or between runs, still stops the sweep).
_SIGTERM = threading.Event()
sigterm_received, clear_sigterm = _SIGTERM.is_set, _SIGTERM.clear


def note_sigterm(signum=None, frame=None) -> None:
  """A SIGTERM handler that only records the signal (for loops around several runs)."""
  _SIGTERM.set()


class Preemption:
  """SIGTERM or SIGHUP for a whole run: while it starts it unwinds at once (SystemExit(0)); once the
  loop runs, it or a first Ctrl-C ends the run after a step, with a checkpoint. Under
  jax.distributed, JAX's preemption service (no Python handler) picks a step all processes reach."""

  def __init__(self):
    self.requested = self.looping = self.unwound = False
    self.signal_name = "SIGTERM"
    self._previous = {}
    self._collective = jax.distributed.is_initialized()

  def _install(self, signum) -> None:
    if jax.process_count() == 1 and not self._collective:
      # ValueError: not the main thread (some notebook runners); no handler then.
      with contextlib.suppress(ValueError):
        self._previous[signum] = signal.signal(signum, self._handle)

  def __enter__(self):
    self._install(signal.SIGTERM)
    self._install(signal.SIGHUP)
    return self

  def start_loop(self) -> None:
    self.looping = True
    if jax.process_count() > 1 and not self._collective:  # joined by the runtime alone
      logging.warning(
          f"{jax.process_count()} processes without jax.distributed: a SIGTERM stops this run "
          "without a checkpoint; start it through electra_jax.main, which joins the job."
      )
    self._install(signal.SIGINT)  # a first Ctrl-C saves at the end of the step; a second stops

  def _handle(self, signum, frame):
    self.signal_name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    if not self.looping:  # said once unwound: logging in a handler may reenter a stderr write
      self.unwound = True
      raise SystemExit(0)
    self.requested = True
    _SIGTERM.set()
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))

  def stop_after(self, call: int) -> bool:
    if self._collective and not self.requested:
      try:
        self.requested = multihost_utils.reached_preemption_sync_point(call)
      except RuntimeError as error:  # jax_enable_preemption_service=False
        logging.warning("No preemption handling (%s): a SIGTERM stops this run unsaved.", error)
        self._collective = False
      if self.requested:
        _SIGTERM.set()
    return self.requested

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    if self.unwound:
      logging.warning(
          f"{self.signal_name} while the run was starting: it stops before its first step, "
          "saving nothing new. Run the same command to go on."
      )
