"""`restart`: keep one training run going on a TPU VM slice through preemptions and crashes,
by polling the slice's state and each worker's run, and recreating, reinstalling and starting
it again. Only the standard library and gcloud."""

import sys
import time
from typing import Callable, Optional

import remote_job
from tpu_commands import Install, Run, Slice

# Node states (`gcloud compute tpus tpu-vm describe`) and queued-resource states.
NODE_GONE = {"PREEMPTED", "TERMINATED", "MISSING"}
NODE_STOPPED = {"STOPPED", "STOPPING"}
QUEUED_GONE = {"SUSPENDING", "SUSPENDED", "MISSING"}
QUEUED_FAILED = "FAILED"  # refused, or --valid-until-duration ran out: not retried


def slice_state(tpu: Slice, execute: remote_job.Execute) -> str:
  """The node's state (READY, CREATING, PREEMPTED...), MISSING when it does not exist, the
  queued resource's state while it holds no active node, UNKNOWN when gcloud failed otherwise."""

  def ask(argv):
    result = execute(argv, capture=True)
    if result.returncode:
      text = (result.output + result.error).lower()
      return "MISSING" if ("not_found" in text or "not found" in text) else "UNKNOWN"
    # The state is gcloud's stdout; its notices ("Updates are available ...") are on stderr.
    return result.output.strip().splitlines()[-1].strip() if result.output.strip() else "UNKNOWN"

  if tpu.queued:
    queued_state = ask(tpu.describe_queued())
    if queued_state != "ACTIVE":
      return queued_state
  return ask(tpu.describe_node())


def decide(state: str, workers: Optional[list[remote_job.WorkerStatus]], queued: bool) -> str:
  """What the supervisor does next, from the slice's state and each worker's run:
  recreate | wait | stopped | stopped_run | failed | install_and_run | run | stop_and_run | finished.
  """
  if queued and state == QUEUED_FAILED:
    return "failed"
  if state in (QUEUED_GONE if queued else set()) | NODE_GONE:
    return "recreate"
  if state in NODE_STOPPED:
    return "stopped"  # someone stopped it on purpose; do not override that
  if state != "READY" or not workers:
    return "wait"  # creating, queued, repairing, or ssh not answering yet
  if any(w.run == "stopped" for w in workers) and not any(w.running for w in workers):
    return "stopped_run"  # someone ran `stop`: leave it so
  if not all(w.installed for w in workers):
    return "install_and_run"
  if all(w.running for w in workers):
    return "wait"
  if not any(w.running for w in workers):
    # train.py logs "Done" on process 0 only; the others just exit 0.
    return "finished" if any(w.done for w in workers) else "run"
  return "stop_and_run"  # a dead peer: the others are stuck in collectives


def supervise(
    tpu: Slice,
    install: Install,
    run: Run,
    execute: remote_job.Execute,
    poll_seconds: float = 120.0,
    max_restarts: int = 20,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
  """Keeps `run` going on `tpu` until it reaches train.steps: recreates the slice after a
  preemption, installs, starts the same command (which resumes from the workdir), and
  restarts the run when a worker died. Returns 0 when done, 1 when it gives up: after
  `max_restarts` restarts of runs that ended on a live slice (a crash at startup, a bad
  override) or failed installs, after `max_restarts` failed creates in a row (a wrong zone or
  type, no quota; a stockout that lasts), or when a queued resource FAILED. Preemptions do not
  count: a spot run may see many."""
  failures = failed_creates = 0
  watched = False  # a run this supervisor started or saw running
  while True:
    state = slice_state(tpu, execute)
    workers = None
    if state == "READY":
      workers = remote_job.parse_status(
          execute(tpu.ssh(remote_job.status_script(run.python)), capture=True).output
      )
    action = decide(state, workers, tpu.queued)
    if action == "stopped_run" and not watched:
      action = "run"  # stopped before this restart began: restarting it is what was asked
    watched = watched or any(w.running for w in workers or [])
    summary = ", ".join(f"{w.host}={w.run}" for w in workers or [])
    log(
        f"[{time.strftime('%H:%M:%S')}] slice {tpu.name}: {state}{' | ' + summary if summary else ''} -> {action}"
    )

    if action == "finished":
      log("The run reached train.steps.")
      return 0
    if action == "failed":
      log(
          f"The queued resource {tpu.name} FAILED (refused, or --valid-until-duration ran out): "
          f"`gcloud compute tpus queued-resources describe {tpu.name} --zone={tpu.zone}` says why. "
          "Delete it, then create it or run restart again."
      )
      return 1
    if action == "stopped_run":
      log(
          f"The run on {tpu.name} was stopped with `stop` (it saved a checkpoint): leaving it stopped. "
          "`run` or `restart` starts it again from its workdir."
      )
      return 0
    if action == "stopped":
      log(
          f"{tpu.name} is {state}: someone stopped it. Start it (gcloud compute tpus tpu-vm start) or "
          "delete it, then run restart again."
      )
      return 1
    if action == "recreate":
      if state != "MISSING":
        remote_job.run_all(execute, tpu.delete())
      if remote_job.run_all(execute, tpu.create()) == 0:
        failed_creates = 0
      else:  # capacity may be short: retried at the next poll, a bounded number of times
        failed_creates += 1
        if failed_creates > max_restarts:
          log(
              f"Gave up after {failed_creates} failed creates in a row; the gcloud errors above say why."
          )
          return 1
    elif action in ("install_and_run", "run", "stop_and_run"):
      if action != "install_and_run" and any(w.crashed for w in workers):  # on a slice still there
        failures += 1
        if failures > max_restarts:
          log(
              f"Gave up after {max_restarts} restarts; read the worker logs (follow) for the cause."
          )
          return 1
      if any(w.running for w in workers):
        # A dead peer (stop_and_run), or a reimaged worker that lost electra-jax while the
        # others still run (the install would replace the checkout under them): the live ones
        # would wait on it forever. Stop them first.
        execute(tpu.ssh(remote_job.stop_script()))
      if action != "install_and_run" or remote_job.run_all(execute, install.commands(tpu)) == 0:
        remote_job.run_all(execute, run.start(tpu))
        watched = True
      else:
        failures += 1
    sleep(poll_seconds)


def supervise_dry_run(tpu: Slice, install: Install, run: Run, execute: remote_job.Execute) -> None:
  print("# restart polls every --poll-seconds with:")
  for argv in tpu.describe():
    execute(argv)
  execute(tpu.ssh(remote_job.status_script(run.python)))
  print("# when the slice is preempted (or missing), it recreates it, installs and starts the run:")
  for argv in tpu.delete() + tpu.create() + install.commands(tpu) + run.start(tpu):
    execute(argv)
  print(
      "# when a worker's run died while others still run, it stops them and starts the run again:"
  )
  execute(tpu.ssh(remote_job.stop_script()))
  for argv in run.start(tpu):
    execute(argv)
