"""Stopping a run (preemption.py): SIGTERM, SIGHUP and a first Ctrl-C save at the end of a step,
and the resumed run is bit-exact."""

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import REPO, cli, cli_args
from run_helpers import REQUIRED_METRICS, _metrics  # noqa: F401

from electra_jax import preemption


def _signal_after_logged(workdir, overrides: dict, lines: int, signum):
  """(process, stdout, stderr) of a CLI run sent `signum` once metrics.jsonl has `lines` lines."""
  proc = subprocess.Popen(
      cli_args(workdir, **overrides),
      cwd=REPO,
      env=dict(os.environ),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  metrics_file = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and not (
      metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= lines
  ):
    time.sleep(0.02)
  proc.send_signal(signum)
  stdout, stderr = proc.communicate(timeout=300)
  return proc, stdout, stderr


@pytest.mark.fault
def test_sigterm_saves_and_resume_is_bit_exact(tmp_path):
  steps = 150
  overrides = {"train.steps": steps, "checkpoint.every_steps": 1000}
  reference = tmp_path / "reference"
  assert cli(cli_args(reference, **overrides)).returncode == 0  # in this process: the same numbers

  interrupted = tmp_path / "interrupted"
  proc, _, stderr = _signal_after_logged(interrupted, overrides, 5, signal.SIGTERM)
  assert proc.returncode == 0, stderr[-3000:]
  saved = [int(d) for d in os.listdir(interrupted / "checkpoints")]
  assert len(saved) == 1 and 5 <= saved[0] < steps, saved  # stopped early, saved where it stopped
  assert "SIGTERM" in stderr

  resumed = cli(cli_args(interrupted, **overrides))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming from the checkpoint at step" in resumed.stderr
  want, got = _metrics(reference), _metrics(interrupted)
  assert [m["step"] for m in got] == list(range(1, steps + 1))
  for a, b in zip(want, got):
    for name in REQUIRED_METRICS - {"tokens_per_sec", "steps_per_sec"}:
      assert a[name] == b[name], (a["step"], name, a[name], b[name])  # to the last bit


def _stopped_after_step_3_of_400(workdir, signum):
  """`signum` once 3 steps are logged: the run ends cleanly with its one checkpoint, where it
  stopped; returns ([that step], stdout, stderr)."""
  proc, stdout, stderr = _signal_after_logged(
      workdir, {"train.steps": 400, "checkpoint.every_steps": 1000}, 3, signum
  )
  assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
  saved = [int(d) for d in os.listdir(workdir / "checkpoints")]
  assert len(saved) == 1 and 3 <= saved[0] < 400, saved
  return saved, stdout, stderr


@pytest.mark.fault
def test_ctrl_c_saves_where_it_stops_like_sigterm(tmp_path):
  """Ctrl-C lost every step since the last checkpoint, with a traceback; it now ends the run
  after the step like SIGTERM, and the end summary says where it stopped."""
  workdir = tmp_path / "run"
  saved, stdout, stderr = _stopped_after_step_3_of_400(workdir, signal.SIGINT)
  assert (
      f"Ctrl-C (SIGINT) received: saved a checkpoint at step {saved[0]}; run the same command"
      in stderr
  )
  assert f"Stopped: step {saved[0]} of 400" in stdout
  assert [m["step"] for m in _metrics(workdir)][-1] == saved[0]


@pytest.mark.fault
def test_sighup_saves_and_releases_the_lease_like_sigterm(tmp_path):
  """A closed terminal or ssh session (SIGHUP) killed the run at once: no save, no message, the
  lease left held. It now stops after the step with a checkpoint, as SIGTERM does."""
  workdir = tmp_path / "run"
  saved, _, stderr = _stopped_after_step_3_of_400(workdir, signal.SIGHUP)
  assert f"SIGHUP received: saved a checkpoint at step {saved[0]}" in stderr
  assert json.loads((workdir / "lease.json").read_text())["released"] is True


def test_a_sigterm_while_the_run_starts_unwinds_at_once_and_says_so(caplog):
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as stopped, preemption.Preemption():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises at the next bytecode, long before this ends
  assert stopped.value.code == 0 and signal.getsignal(signal.SIGTERM) is before
  assert "SIGTERM while the run was starting: it stops before its first step" in caplog.text
