"""One run per workdir: a live holder is refused, a dead one is taken over, and a run whose
workdir was taken over stops before it saves over the new holder's checkpoints."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import cli_args, run_cli, tiny_config

from electra_jax import checkpointing, errors, train, train_state, workdir_lease
from electra_jax.workdir_lease import WorkdirInUse, WorkdirLease


class Clock:

  def __init__(self):
    self.now = 1_000_000.0

  def __call__(self):
    return self.now


def _lease_file(workdir):
  return json.loads((workdir / workdir_lease.LEASE_FILE).read_text())


def _write_holder(workdir, clock_now, **fields):
  """A lease as another run would have written it."""
  holder = dict(
      run_id="othersrun123",
      host="elsewhere",
      pid=12345,
      started="earlier",
      heartbeat=clock_now,
      released=False,
  )
  holder.update(fields)
  workdir.mkdir(parents=True, exist_ok=True)
  # Whole at once, as a run writes it (a reader never sees the file half-written).
  (workdir / "lease.tmp").write_text(json.dumps(holder))
  os.replace(workdir / "lease.tmp", workdir / workdir_lease.LEASE_FILE)
  return holder


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_a_released_lease_is_taken_and_released_again(tmp_path):
  clock = Clock()
  first = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  first.acquire()
  held = _lease_file(tmp_path)
  assert held["run_id"] == first.run_id and held["pid"] == os.getpid() and not held["released"]
  assert held["heartbeat"] == clock.now
  first.release()
  assert _lease_file(tmp_path)["released"]
  second = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  second.acquire()  # no live holder: taken at once
  assert _lease_file(tmp_path)["run_id"] == second.run_id != first.run_id
  second.release()


@pytest.mark.fault
def test_a_live_holder_on_another_host_is_refused_until_its_heartbeat_is_stale(tmp_path):
  clock = Clock()
  _write_holder(tmp_path, clock.now - 30)
  before = (tmp_path / workdir_lease.LEASE_FILE).read_text()
  lease = WorkdirLease(tmp_path, beat_seconds=30, stale_seconds=120, clock=clock)
  with pytest.raises(WorkdirInUse) as refused:
    lease.acquire()
  message = str(refused.value)
  for named in (
      "othersrun123",
      "host elsewhere",
      "pid 12345",
      "30 s ago",
      "--take_over_workdir",
      "Nothing was written",
  ):
    assert named in message, (named, message)
  assert (tmp_path / workdir_lease.LEASE_FILE).read_text() == before
  clock.now += 91  # the last heartbeat is now 121 s old: the holder counts as dead
  lease.acquire()
  assert _lease_file(tmp_path)["run_id"] == lease.run_id
  lease.release()


@pytest.mark.fault
def test_same_host_holder_counts_as_dead_when_its_pid_is_gone(tmp_path):
  clock = Clock()
  first = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  first.acquire()  # a run of this very process, still going (a notebook cell's thread)
  lease = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  with pytest.raises(WorkdirInUse, match=f"is in use by run {first.run_id}.*this very process"):
    lease.acquire()
  first.release()
  _write_holder(
      tmp_path, clock.now, host=lease.record["host"], pid=_dead_pid()
  )  # kill -9, fresh heartbeat
  lease.acquire()
  assert _lease_file(tmp_path)["run_id"] == lease.run_id
  lease.release()
  # A restarted container: the same host name and pid as the dead run it replaces (often 1),
  # which this process never held. It is taken at once, not after the heartbeat goes stale.
  _write_holder(tmp_path, clock.now, host=lease.record["host"], pid=os.getpid())
  restarted = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  restarted.acquire()
  assert _lease_file(tmp_path)["run_id"] == restarted.run_id
  restarted.release()


@pytest.mark.fault
def test_take_over_takes_a_live_lease_and_the_old_holder_is_fenced_off(tmp_path):
  clock = Clock()
  old = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  old.acquire()
  old.check()  # still its own
  new = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  with pytest.raises(WorkdirInUse):
    new.acquire()
  new.acquire(take_over=True)
  with pytest.raises(
      WorkdirInUse, match=f"Another run took over .*run {new.run_id}.*stopped without saving"
  ):
    old.check()
  old.release()  # must not mark the new holder's lease released
  held = _lease_file(tmp_path)
  assert held["run_id"] == new.run_id and not held["released"]
  new.release()


def test_the_heartbeat_renews_the_lease_and_stops_once_taken_over(tmp_path):
  lease = WorkdirLease(tmp_path, beat_seconds=0.05, stale_seconds=1.0)
  lease.acquire()
  first = _lease_file(tmp_path)["heartbeat"]
  deadline = time.time() + 30
  while _lease_file(tmp_path)["heartbeat"] == first and time.time() < deadline:
    time.sleep(0.02)
  assert _lease_file(tmp_path)["heartbeat"] > first
  foreign = _write_holder(tmp_path, time.time(), host="elsewhere")
  while lease.taken_by is None and time.time() < deadline:
    time.sleep(0.02)
  assert lease.taken_by["run_id"] == "othersrun123"  # found by the heartbeat, not by check()
  time.sleep(0.2)  # several beats: none of them may write over the new holder
  assert _lease_file(tmp_path) == foreign
  lease.release()
  assert _lease_file(tmp_path) == foreign


@pytest.mark.fault
def test_training_refuses_a_held_workdir_before_writing_anything(tmp_path):
  workdir = tmp_path / "run"
  _write_holder(workdir, time.time())  # a live run on another host (its heartbeat is fresh)
  config = tiny_config()
  with pytest.raises(WorkdirInUse, match="is in use by run othersrun123"):
    train.train_and_evaluate(config, str(workdir))
  assert [p.name for p in workdir.iterdir()] == [workdir_lease.LEASE_FILE]  # only the holder's
  metrics = train.train_and_evaluate(config, str(workdir), take_over_workdir=True)
  assert metrics["step"] == 6 and sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
  assert _lease_file(workdir)["released"]


@pytest.mark.fault
def test_a_run_taken_over_mid_way_stops_before_its_next_checkpoint(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  config = tiny_config(**{"train.steps": 9, "checkpoint.every_steps": 3, "train.log_every": 1})
  real_save = checkpointing.Checkpointer.save

  def save_then_lose_the_workdir(self, step, state, meta):
    real_save(self, step, state, meta)
    if step == 3:  # another run takes the workdir right after this save
      _write_holder(workdir, time.time(), run_id="newerrun4567", host="elsewhere")

  monkeypatch.setattr(checkpointing.Checkpointer, "save", save_then_lose_the_workdir)
  with pytest.raises(WorkdirInUse, match="Another run took over .*newerrun4567"):
    train.train_and_evaluate(config, str(workdir))
  assert os.listdir(workdir / "checkpoints") == ["3"]  # steps 6 and 9 were not saved
  # Nor logged: the new run writes the logs from step 3 on (it used to find steps 4-6 there).
  logged = [
      json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]
  assert logged == [1, 2, 3]
  held = _lease_file(workdir)
  assert held["run_id"] == "newerrun4567" and not held["released"]


@pytest.mark.fault
def test_cli_names_the_holder_and_exits_without_a_traceback(tmp_path):
  workdir = tmp_path / "run"
  # A run on this machine that is still alive: this test process.
  _write_holder(workdir, time.time(), host=socket.gethostname(), pid=os.getpid())
  result = run_cli(cli_args(workdir))
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert (
      "electra-jax: error: The workdir" in result.stderr
      and "in use by run othersrun123" in result.stderr
  )
  assert not (workdir / "config.json").exists()
  result = run_cli(cli_args(workdir) + ["--take_over_workdir"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--take_over_workdir: taking" in result.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]


@pytest.mark.fault
@pytest.mark.parametrize(
    "garbage, named",
    [
        (dict(heartbeat="yesterday"), "heartbeat='yesterday'"),
        (dict(pid="12345"), "pid='12345'"),
        (dict(run_id=7), "run_id=7"),
        (dict(run_id=None), "run_id=None"),
        (dict(released="no"), "released='no'"),
        (dict(host=["a"]), "host=['a']"),
        (dict(expires="never"), "expires='never'"),
    ],
)
def test_an_edited_lease_is_refused_naming_the_file_and_key_unless_taken_over(
    tmp_path, garbage, named
):
  clock = Clock()
  _write_holder(tmp_path, clock.now, **garbage)
  file = tmp_path / workdir_lease.LEASE_FILE
  for read in (lambda: workdir_lease.read_lease(tmp_path), WorkdirLease(tmp_path).acquire):
    with pytest.raises(errors.ConfigError, match=f"{file} is not as electra-jax writes it") as no:
      read()
    assert named in str(no.value) and "--take_over_workdir" in str(no.value)
  lease = WorkdirLease(tmp_path, beat_seconds=60, clock=clock)
  lease.acquire(take_over=True)
  assert _lease_file(tmp_path)["run_id"] == lease.run_id
  lease.release()
  # The same lease with well-typed fields is a live holder and is refused.
  _write_holder(tmp_path, clock.now)
  with pytest.raises(WorkdirInUse):
    WorkdirLease(tmp_path, beat_seconds=60, clock=clock).acquire()


@pytest.mark.fault
def test_a_lease_that_is_not_json_is_refused_by_the_cli_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / workdir_lease.LEASE_FILE).write_text('{"run_id": "ab')
  result = run_cli(cli_args(workdir))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  # The error line, though the corpus's background check may log after it.
  errors = [line for line in result.stderr.splitlines() if line.startswith("electra-jax: error: ")]
  assert len(errors) == 1 and f"{workdir}/lease.json" in errors[0], result.stderr[-3000:]
  assert not (workdir / "config.json").exists()


@pytest.mark.fault
def test_a_sigterm_while_the_run_starts_releases_the_lease(tmp_path, monkeypatch):
  """Before the training loop's own handler (compile, the first state): SIGTERM unwinds with
  exit code 0, as a stop in the loop does, instead of killing the process with its lease held."""
  import signal  # noqa: PLC0415

  def stopped_while_compiling(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises before this ends
    raise AssertionError("SIGTERM did not stop the run")

  monkeypatch.setattr(train_state, "compile_train_step", stopped_while_compiling)
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as stopped:
    train.train_and_evaluate(tiny_config(), str(tmp_path))
  assert stopped.value.code == 0
  assert json.loads((tmp_path / workdir_lease.LEASE_FILE).read_text())["released"] is True
  assert signal.getsignal(signal.SIGTERM) is before  # put back for whatever runs next


# A run taking the lease, made to read it and then wait for its rival to have read it too: the
# moment two runs started at once both decide that the lease is theirs to take.
_CONTENDER = """
import json, os, sys, time
from electra_jax import workdir_lease
workdir, ready, rival_ready = sys.argv[1:]
lease = workdir_lease.WorkdirLease(workdir, beat_seconds=3600)
read = lease._read
def read_then_wait_for_the_rival(*args):
  lease._read = read
  found = read(*args)
  open(ready, "w").close()
  while not os.path.exists(rival_ready):
    time.sleep(0.01)
  return found
lease._read = read_then_wait_for_the_rival
try:
  lease.acquire()
  print(json.dumps({"took": lease.run_id}), flush=True)
except workdir_lease.WorkdirInUse as error:
  print(json.dumps({"refused": str(error)}), flush=True)
sys.stdin.read()  # alive (a live holder) until the test has both answers
"""


@pytest.mark.fault
@pytest.mark.parametrize("before", ["no lease", "a released lease"])
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_two_runs_taking_the_lease_at_the_same_instant_do_not_both_get_it(
    tmp_path, request, where, before
):
  workdir = f"{request.getfixturevalue('bucket')}/run" if where == "bucket" else str(tmp_path)
  if before == "a released lease":
    released = WorkdirLease(workdir, beat_seconds=3600)
    released.acquire()
    released.release()
  ready = [str(tmp_path / f"ready{i}") for i in range(2)]
  contenders = [
      subprocess.Popen(
          [sys.executable, "-c", _CONTENDER, workdir, ready[i], ready[1 - i]],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  try:
    answers = [json.loads(contender.stdout.readline() or "{}") for contender in contenders]
  finally:
    for contender in contenders:
      contender.stdin.close()
      contender.wait(timeout=60)
  took = [answer["took"] for answer in answers if "took" in answer]
  refused = [answer["refused"] for answer in answers if "refused" in answer]
  assert len(took) == 1 and len(refused) == 1, (
      answers,
      [c.stderr.read()[-2000:] for c in contenders],
  )
  assert f"is in use by run {took[0]}" in refused[0]
  assert workdir_lease.read_lease(workdir)["run_id"] == took[0]
