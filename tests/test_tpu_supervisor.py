"""launch/tpu_supervisor.py: restart against a scripted sequence of slice and worker states."""

import pytest

from launch_helpers import _dry_run, _option, tpu_commands, tpu_supervisor, remote_job


# restart: the supervisor against a scripted slice
# ---------------------------------------------------------------------------------------
class FakeGcloud:
  """Answers describe and status calls from a script of (slice state, worker states) polls and
  records every command; worker states are run[:done] per worker, e.g. "exited:0:done"."""

  def __init__(self, polls, queued_states=None, create_fails=False):
    self.polls, self.queued_states = list(polls), list(queued_states or [])
    self.commands, self.current, self.create_fails = [], None, create_fails

  def __call__(self, argv, capture=False):
    argv = list(argv)
    self.commands.append(argv)
    if argv[3:5] == ["queued-resources", "describe"]:
      return remote_job.Result(0, self.queued_states.pop(0) + "\n")
    if argv[3:5] == ["tpu-vm", "describe"]:
      self.current = self.polls.pop(0)
      state = self.current[0]
      if state == "MISSING":
        return remote_job.Result(1, "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: pod")
      return remote_job.Result(0, state + "\n")
    if argv[3:5] == ["tpu-vm", "ssh"] and remote_job.STATUS_MARK in _option(argv, "command"):
      lines = []
      for host, worker in enumerate(self.current[1]):
        run, done, _ = worker.partition(":done")
        installed = "0" if run == "uninstalled" else "1"
        run = "none" if run == "uninstalled" else run
        lines.append(
            f"Using ssh batch size of 2. Attempting to SSH into 1 nodes with a total of 2 workers.\n"
            f"{remote_job.STATUS_MARK} host=t1w-{host} run={run} done={int(bool(done))} installed={installed}"
        )
      return remote_job.Result(0, "\n".join(lines))
    if self.create_fails and argv[4] == "create":
      return remote_job.Result(1, "", "ERROR: (gcloud.compute.tpus.tpu-vm.create) INVALID_ARGUMENT")
    return remote_job.Result(0, "")

  def kinds(self):
    """Each command but the polls, by what it does."""
    kinds = []
    for argv in self.commands:
      if argv[0] == "bash" or argv[3:5] in (
          ["tpu-vm", "describe"],
          ["queued-resources", "describe"],
      ):
        continue
      command = _option(argv, "command") if argv[4] == "ssh" else ""
      if remote_job.STATUS_MARK in command:
        continue
      if "git clone" in command:
        kinds.append("install")
      elif "setsid nohup" in command:
        kinds.append("start")
      elif "kill -TERM" in command:
        kinds.append("stop")
      else:
        kinds.append(f"{argv[3]} {argv[4]}")
    return kinds


def _supervise(fake, queued=False, max_restarts=20):
  tpu = tpu_commands.Slice(
      "pod", "us-central2-b", accelerator_type="v4-16", spot=True, queued=queued
  )
  install = tpu_commands.Install(repo_url="https://github.com/someone/electra-jax")
  run = tpu_commands.Run("gs://bucket/run", overrides=("--config.train.steps=100",))
  sleeps = []
  code = tpu_supervisor.supervise(
      tpu,
      install,
      run,
      fake,
      poll_seconds=7,
      max_restarts=max_restarts,
      sleep=sleeps.append,
      log=lambda line: None,
  )
  return code, sleeps


@pytest.mark.fault
def test_restart_recreates_a_preempted_slice_and_resumes_the_same_run():
  fake = FakeGcloud(
      [
          ("READY", ["running", "running"]),
          ("PREEMPTED", []),  # spot capacity taken back
          ("CREATING", []),
          ("READY", ["uninstalled", "uninstalled"]),  # a fresh slice: install, then start
          ("READY", ["running", "died"]),  # one worker lost: stop the other, start again
          ("READY", ["running", "running"]),
          ("READY", ["exited:0:done", "exited:0"]),  # process 0 logged "Done"
      ]
  )
  code, sleeps = _supervise(fake)
  assert code == 0 and sleeps == [7] * 6
  assert fake.kinds() == ["tpu-vm delete", "tpu-vm create", "install", "start", "stop", "start"]
  create = next(argv for argv in fake.commands if argv[3:5] == ["tpu-vm", "create"])
  assert "--spot" in create and "--accelerator-type=v4-16" in create
  starts = [_option(argv, "command") for argv in fake.commands if "setsid nohup" in " ".join(argv)]
  assert (
      len(set(starts)) == 1 and "--config.train.steps=100" in starts[0]
  )  # the same command each time


@pytest.mark.fault
def test_restart_with_a_queued_resource_and_a_missing_slice():
  fake = FakeGcloud(
      [("READY", ["exited:0:done"])], queued_states=["SUSPENDED", "WAITING_FOR_RESOURCES", "ACTIVE"]
  )
  code, _ = _supervise(fake, queued=True)
  assert code == 0
  # SUSPENDED: delete the queued resource (and its node), queue it again; then wait.
  assert fake.kinds() == ["queued-resources delete", "queued-resources create"]

  missing = FakeGcloud([("MISSING", []), ("READY", ["exited:0:done"])])
  assert _supervise(missing)[0] == 0
  assert missing.kinds() == ["tpu-vm create"]  # nothing to delete


@pytest.mark.fault
def test_restart_gives_up_on_a_run_that_keeps_failing_but_not_on_preemptions():
  fake = FakeGcloud([("READY", ["exited:1", "exited:1"])] * 10)
  code, _ = _supervise(fake, max_restarts=2)
  assert code == 1 and fake.kinds() == ["start"] * 2
  # A run that exits 0 short of train.steps stopped at a SIGTERM (maintenance, a preemption
  # notice) and saved: it is resumed without counting as a failure.
  sigtermed = FakeGcloud(
      [("READY", ["exited:0", "exited:0"])] * 3 + [("READY", ["exited:0:done", "exited:0"])]
  )
  assert _supervise(sigtermed, max_restarts=0)[0] == 0 and sigtermed.kinds() == ["start"] * 3
  preempted_twice = FakeGcloud(
      [("PREEMPTED", []), ("READY", ["uninstalled"])] * 2 + [("READY", ["exited:0:done"])]
  )
  assert _supervise(preempted_twice, max_restarts=0)[0] == 0
  assert preempted_twice.kinds() == ["tpu-vm delete", "tpu-vm create", "install", "start"] * 2


@pytest.mark.fault
def test_restart_stops_on_a_failed_queued_resource_and_on_creates_that_keep_failing():
  # FAILED: the request was refused or its --valid-until-duration ran out; queuing it again
  # would wait forever. A create that keeps failing (wrong zone or type, no quota) is retried
  # a bounded number of times, not every poll until someone notices.
  failed = FakeGcloud([], queued_states=["FAILED"])
  assert _supervise(failed, queued=True)[0] == 1 and failed.kinds() == []
  refused = FakeGcloud([("MISSING", [])] * 10, create_fails=True)
  code, sleeps = _supervise(refused, max_restarts=2)
  assert code == 1 and refused.kinds() == ["tpu-vm create"] * 3 and len(sleeps) == 2


@pytest.mark.fault
def test_slice_state_ignores_gcloud_notices_on_stderr(tmp_path):
  # gcloud prints "Updates are available ..." to stderr; it must not be read as the state.
  gcloud = tmp_path / "gcloud"
  gcloud.write_text("#!/bin/sh\necho READY\necho 'To update: $ gcloud components update' >&2\n")
  gcloud.chmod(0o755)
  execute = remote_job.make_executor(dry_run=False)
  tpu = tpu_commands.Slice("pod", "us-central2-b", accelerator_type="v4-16")
  real = lambda argv, capture=False: execute([str(gcloud)] + list(argv[1:]), capture)  # noqa: E731
  assert tpu_supervisor.slice_state(tpu, real) == "READY"


@pytest.mark.fault
def test_restart_stops_live_workers_before_reinstalling_a_reimaged_one():
  fake = FakeGcloud(
      [("READY", ["running", "uninstalled"]), ("READY", ["exited:0:done", "exited:0"])]
  )
  assert _supervise(fake)[0] == 0
  assert fake.kinds() == ["stop", "install", "start"]


def test_restart_respects_a_stopped_slice():
  stopped = FakeGcloud([("STOPPED", [])])
  assert _supervise(stopped)[0] == 1 and stopped.kinds() == []


def test_decide_on_worker_states():
  def workers(*runs):
    return [remote_job.WorkerStatus(f"w{i}", run, False, True) for i, run in enumerate(runs)]

  # Every worker exited 0 without "Done": a graceful stop (SIGTERM), not the end of training.
  assert tpu_supervisor.decide("READY", workers("exited:0", "exited:0"), queued=False) == "run"
  assert (
      tpu_supervisor.decide("READY", workers("exited:143", "running"), queued=False)
      == "stop_and_run"
  )
  assert tpu_supervisor.decide("READY", None, queued=False) == "wait"  # ssh not answering yet
  assert tpu_supervisor.decide("REPAIRING", None, queued=False) == "wait"
  assert (
      tpu_supervisor.decide("SUSPENDED", None, queued=True) == "recreate"
  )  # spot capacity taken back
  assert tpu_supervisor.decide("FAILED", None, queued=True) == "failed"  # not queued again forever
  # `stop` marks the workers: a supervising `restart` leaves the run stopped.
  assert (
      tpu_supervisor.decide("READY", workers("stopped", "stopped"), queued=False) == "stopped_run"
  )
  stopped = FakeGcloud(
      [("READY", ["running", "running"]), ("READY", ["stopped", "stopped"])]
      + [("READY", ["none"])] * 3
  )
  code, _ = _supervise(stopped)
  assert code == 0 and stopped.kinds() == []  # nothing started again
  # A run stopped before `restart` began is what the user asks to restart: it starts.
  earlier = FakeGcloud(
      [
          ("READY", ["stopped", "stopped"]),
          ("READY", ["running", "running"]),
          ("READY", ["exited:0:done", "exited:0"]),
      ]
  )
  assert _supervise(earlier)[0] == 0 and earlier.kinds() == ["start"]


def test_restart_dry_run_prints_the_recovery_commands():
  lines = _dry_run(
      "tpu_vm.py",
      "restart",
      "--name=pod",
      "--zone=z",
      "--accelerator-type=v4-32",
      "--spot",
      "--repo-url=https://github.com/someone/electra-jax",
      "--workdir=gs://b/r",
      "--dry-run",
      "--",
      "--config.train.steps=9",
  )
  verbs = [" ".join(argv[3:5]) for argv in lines]
  assert verbs == [
      "tpu-vm describe",
      "tpu-vm ssh",
      "tpu-vm delete",
      "tpu-vm create",
      "tpu-vm ssh",
      "tpu-vm ssh",
      "tpu-vm ssh",
      "tpu-vm ssh",
  ]
  assert "--spot" in lines[3] and "--config.train.steps=9" in _option(lines[5], "command")
