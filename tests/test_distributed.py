"""Multi-process runs: two local CPU processes of four devices each (jax.distributed with gloo)
train like one process of eight devices, and only process 0 writes metrics."""

import json
import socket
import subprocess

import pytest

from conftest import EIGHT_DEVICE_OVERRIDES, REPO, cli_args
from electra_jax import distributed


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def test_two_processes_of_four_devices_match_one_process_of_eight(tmp_path, eight_device_run):
  # The same run as conftest's eight-device one (small learning rate: see
  # EIGHT_DEVICE_OVERRIDES), split over two processes of four devices each.
  overrides = EIGHT_DEVICE_OVERRIDES
  one_dir, _ = eight_device_run

  port = _free_port()
  env = dict(__import__("os").environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             ELECTRA_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", ELECTRA_JAX_NUM_PROCESSES="2")
  procs = [
      subprocess.Popen(cli_args(tmp_path / "two", **overrides), cwd=REPO,
                       env=dict(env, ELECTRA_JAX_PROCESS_ID=str(i)),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  outputs = [proc.communicate(timeout=600) for proc in procs]
  for proc, (_, stderr) in zip(procs, outputs):
    assert proc.returncode == 0, stderr[-3000:]
  assert "Process 1 of 2, 4 local and 8 global devices" in outputs[1][1]
  assert "step 5/5" in outputs[0][1] and "step 5/5" not in outputs[1][1]  # only process 0 logs

  def metrics(name):
    return [json.loads(line) for line in (name / "metrics.jsonl").read_text().splitlines()]

  single, multi = metrics(one_dir), metrics(tmp_path / "two")
  assert [m["step"] for m in multi] == [1, 2, 3, 4, 5]  # written once, by process 0
  for a, b in zip(single, multi, strict=True):
    for name in ("loss", "masked_lm_loss", "disc_loss"):
      assert abs(a[name] - b[name]) < 1e-4, (a["step"], name, a[name], b[name])
  assert (tmp_path / "two" / "checkpoints" / "5").is_dir()


def test_incomplete_coordinator_settings_are_refused(monkeypatch):
  monkeypatch.delenv("ELECTRA_JAX_PROCESS_ID", raising=False)
  with pytest.raises(ValueError, match="process_id=None"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2)
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2)


@pytest.mark.parametrize("env, joins", [
    ({"ELECTRA_JAX_DISTRIBUTED": "auto"}, True),  # what launch/tpu_vm.py sets on every worker
    ({"SLURM_NTASKS": "4"}, True),
    ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, True),  # GKE
    ({"SLURM_NTASKS": "1"}, False),
    ({}, False),
])
def test_schedulers_are_joined_through_jax_detection(monkeypatch, env, joins):
  for name in ("ELECTRA_JAX_DISTRIBUTED", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES",
               "ELECTRA_JAX_COORDINATOR_ADDRESS", "ELECTRA_JAX_NUM_PROCESSES", "ELECTRA_JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *args: calls.append(args))
  distributed.initialize()
  assert calls == ([()] if joins else [])  # no arguments: JAX reads the cluster itself
