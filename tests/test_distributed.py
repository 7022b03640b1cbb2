"""Multi-device and multi-process runs: one process of eight CPU devices and two local processes
of four devices each (jax.distributed with gloo) train like one device, only process 0 writes
metrics, and a SIGTERM that reaches one process stops both at the same step with one
checkpoint."""

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import EIGHT_DEVICE_OVERRIDES, REPO, cli, cli_args, run_cli, with_devices
from electra_jax import distributed, xla_flags


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _start_two(command_of, devices: int) -> list[subprocess.Popen]:
  """Two processes, `command_of(i)` each, joined through a fresh local coordinator. Each has its
  own XLA cache directory: JAX writes a cache entry in place, so a process could otherwise read
  one that its twin, compiling the same program at the same moment, is still writing."""
  env = dict(
      os.environ,
      **with_devices(devices),
      ELECTRA_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
      ELECTRA_JAX_NUM_PROCESSES="2",
  )
  return [
      subprocess.Popen(
          command_of(i),
          cwd=REPO,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
          env=dict(
              env,
              ELECTRA_JAX_PROCESS_ID=str(i),
              JAX_COMPILATION_CACHE_DIR=os.path.join(
                  env["JAX_COMPILATION_CACHE_DIR"], f"process{i}"
              ),
          ),
      )
      for i in range(2)
  ]


def _two_processes(workdir, **overrides):
  """Two CLI processes of four CPU devices each."""
  return _start_two(lambda i: cli_args(workdir, **overrides), devices=4)


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_one_device_eight_devices_and_two_processes_of_four_train_alike(tmp_path):
  # Sharded reductions sum in another order, and Adam's first updates are about lr * sign(g):
  # see conftest.EIGHT_DEVICE_OVERRIDES for the small learning rate that keeps this in bounds.
  overrides = EIGHT_DEVICE_OVERRIDES
  one = cli(
      cli_args(
          tmp_path / "one", **{k: v for k, v in overrides.items() if not k.startswith("mesh.")}
      )
  )
  assert one.returncode == 0, one.stderr[-3000:]
  eight = run_cli(cli_args(tmp_path / "eight", **overrides), env_extra=with_devices(8))
  assert eight.returncode == 0, eight.stderr[-3000:]
  assert "over 8 cpu devices" in eight.stderr

  procs = _two_processes(tmp_path / "two", **overrides)
  outputs = [proc.communicate(timeout=600) for proc in procs]
  for proc, (_, stderr) in zip(procs, outputs):
    assert proc.returncode == 0, stderr[-3000:]
  assert "Process 1 of 2, 4 local and 8 global devices" in outputs[1][1]
  assert "step 5/5" in outputs[0][1] and "step 5/5" not in outputs[1][1]  # only process 0 logs
  assert [m["step"] for m in _metrics(tmp_path / "two")] == [
      1,
      2,
      3,
      4,
      5,
  ]  # written once, by process 0
  assert (tmp_path / "two" / "checkpoints" / "5").is_dir()

  for name in ("eight", "two"):
    for a, b in zip(_metrics(tmp_path / "one"), _metrics(tmp_path / name), strict=True):
      for metric in ("loss", "masked_lm_loss", "disc_loss"):
        assert abs(a[metric] - b[metric]) < 1e-4, (name, a["step"], metric, a[metric], b[metric])
      # The gradients too: XLA once swapped two batch shards' rows in the MLM head's gradient
      # on this mesh (models.vocab_head), which left the losses of 5 small steps within
      # 1e-4 but the gradient norm 3e-4 off from the first step on (now ~1e-7).
      assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-5), (
          name,
          a["step"],
          a["grad_norm"],
          b["grad_norm"],
      )


@pytest.mark.fault
def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes(tmp_path):
  # Preemption notices reach a slice's hosts at different times. Each process stopping on its
  # own would leave the other waiting in a collective (or in orbax's save) until killed; the
  # run must instead agree on a step, save there once, and resume like any checkpoint.
  steps = 400
  overrides = dict(EIGHT_DEVICE_OVERRIDES, **{"train.steps": steps, "checkpoint.every_steps": 1000})
  workdir = tmp_path / "run"
  procs = _two_processes(workdir, **overrides)
  metrics_file = workdir / "metrics.jsonl"
  try:
    deadline = time.time() + 300
    while time.time() < deadline and not (
        metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5
    ):
      assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
      time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)  # the non-chief only
    outputs = [p.communicate(timeout=300) for p in procs]  # a deadlock times out here
  finally:
    for proc in procs:  # a hung process (a failed check) must not outlive the test
      if proc.poll() is None:
        proc.kill()
  for proc, (_, stderr) in zip(procs, outputs):
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received: saved a checkpoint at step" in stderr
  saved = [int(d) for d in os.listdir(workdir / "checkpoints")]
  assert len(saved) == 1 and 5 <= saved[0] < steps, saved
  assert f"saved a checkpoint at step {saved[0]};" in outputs[0][1] + outputs[1][1]
  logged = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
  assert logged == list(range(1, saved[0] + 1))  # the stop step is logged, nothing after it

  resumed = _two_processes(workdir, **dict(overrides, **{"train.steps": saved[0] + 2}))
  outputs = [p.communicate(timeout=600) for p in resumed]
  for proc, (_, stderr) in zip(resumed, outputs):
    assert proc.returncode == 0, stderr[-3000:]
  assert f"Resuming from the checkpoint at step {saved[0]}" in outputs[0][1]
  logged = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
  assert logged == list(range(1, saved[0] + 3))


def _run_two(command_of, devices: int) -> list[tuple[int, str]]:
  """(return code, stderr) of two processes, `command_of(i)` each, joined in one job."""
  procs = _start_two(command_of, devices)
  try:
    outputs = [p.communicate(timeout=300) for p in procs]
  finally:
    for proc in procs:  # a hung process (a failed check) must not outlive the test
      if proc.poll() is None:
        proc.kill()
  return [(proc.returncode, stderr) for proc, (_, stderr) in zip(procs, outputs)]


@pytest.mark.fault
def test_a_workdir_the_processes_do_not_share_is_refused_before_training(tmp_path):
  """A local --workdir on each host of a slice (here: another path per process) used to train
  and then hang at the first checkpoint, which orbax saves from every process together."""
  overrides = dict(EIGHT_DEVICE_OVERRIDES, **{"train.steps": 4, "checkpoint.every_steps": 2})
  for returncode, stderr in _run_two(
      lambda i: cli_args(tmp_path / f"host{i}", **overrides), devices=4
  ):
    assert returncode != 0
    assert "is not one directory every process sees: process(es) [1] cannot read" in stderr, stderr[
        -3000:
    ]
  assert not (tmp_path / "host0" / "metrics.jsonl").exists()


@pytest.mark.fault
def test_incomplete_coordinator_settings_are_refused(monkeypatch):
  monkeypatch.delenv("ELECTRA_JAX_PROCESS_ID", raising=False)
  with pytest.raises(ValueError, match="process_id=None"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2)
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="coordinator_address='notaport' must be HOST:PORT"):
    distributed.initialize(coordinator_address="notaport", num_processes=2, process_id=0)
  monkeypatch.setenv("ELECTRA_JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="ELECTRA_JAX_NUM_PROCESSES='two' is not a whole number"):
    distributed.initialize(coordinator_address="127.0.0.1:1", process_id=0)


@pytest.mark.fault
def test_single_process_modes_are_refused_in_a_multi_process_job(tmp_path):
  """Fine-tuning, export and import restore onto one device: process 1 cannot address process
  0's, so it used to crash while process 0 hung in the restore for minutes."""
  command = [
      "python",
      "-m",
      "electra_jax.main",
      "--mode=export_hf",
      f"--workdir={tmp_path}/run",
      f"--out={tmp_path}/hf",
  ]
  for i, (returncode, stderr) in enumerate(_run_two(lambda i: command, devices=1)):
    assert returncode != 0
    assert f"--mode=export_hf runs in one process, but this is process {i} of 2" in stderr, stderr[
        -2000:
    ]
  assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "mode, made", [("prepare_data", "prepared/manifest.json"), ("train_tokenizer", "spm.model")]
)
def test_modes_that_run_locally_join_no_multi_process_job(tmp_path, mode, made):
  """On worker 0 of a multi-host slice, prepare_data used to join the slice's job and wait for
  workers that never came: main.MODES marks it, train_tokenizer and compile as local."""
  from electra_jax import main  # noqa: PLC0415

  local = [name for name, entry in main.MODES.items() if entry.local]
  assert local == ["compile", "train_tokenizer", "prepare_data"]
  args = cli_args(tmp_path / "unused", **{"data.prepared_dir": tmp_path / "prepared"})
  args += [f"--mode={mode}", f"--out={tmp_path}/spm.model", "--workers=0"]
  # Process 0 of 2: joining would wait for a process 1 that is never started.
  env = dict(
      os.environ,
      ELECTRA_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
      ELECTRA_JAX_NUM_PROCESSES="2",
      ELECTRA_JAX_PROCESS_ID="0",
  )
  done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and "Process 0 of 2" not in done.stderr, done.stderr[-3000:]
  assert (tmp_path / made).is_file()


@pytest.mark.fault
def test_a_sigterm_before_the_loop_stops_a_single_process_distributed_run(tmp_path):
  """launch/tpu_vm.py joins jax.distributed on single-host slices too; JAX's preemption notifier
  then catches SIGTERM from initialize on. One that arrived while the data loaded or the step
  compiled was swallowed and the run trained to the end (the VM would be gone by then)."""
  workdir = tmp_path / "run"
  env = dict(
      os.environ,
      ELECTRA_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
      ELECTRA_JAX_NUM_PROCESSES="1",
      ELECTRA_JAX_PROCESS_ID="0",
  )
  proc = subprocess.Popen(
      cli_args(workdir, **{"train.steps": 300, "checkpoint.every_steps": 1000}),
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  lines = []
  try:
    for line in proc.stderr:
      lines.append(line)
      if "Process 0 of 1" in line:
        proc.send_signal(signal.SIGTERM)  # before any step: the data and the compile come next
        break
    lines.extend(proc.stderr)
    proc.wait(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
  stderr = "".join(lines)
  assert proc.returncode == 0, stderr[-3000:]
  saved = [int(d) for d in os.listdir(workdir / "checkpoints")]
  assert len(saved) == 1 and saved[0] < 300 and "SIGTERM received" in stderr, (
      saved,
      stderr[-2000:],
  )


@pytest.mark.parametrize(
    "env, joins",
    [
        ({"ELECTRA_JAX_DISTRIBUTED": "auto"}, True),  # what launch/tpu_vm.py sets on every worker
        (
            {
                "SLURM_NTASKS": "4",
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "n[1-2]",
                "SLURM_PROCID": "1",
                "SLURM_LOCALID": "1",
            },
            True,
        ),  # a task of `srun`
        ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, False),  # an salloc shell: no peers will join
        ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, True),  # GKE
        ({"SLURM_NTASKS": "1"}, False),
        ({}, False),
    ],
)
def test_schedulers_are_joined_through_jax_detection(monkeypatch, env, joins):
  for name in (
      "ELECTRA_JAX_DISTRIBUTED",
      "SLURM_NTASKS",
      "SLURM_JOB_ID",
      "SLURM_STEP_NODELIST",
      "SLURM_PROCID",
      "SLURM_LOCALID",
      "TPU_WORKER_HOSTNAMES",
      "ELECTRA_JAX_COORDINATOR_ADDRESS",
      "ELECTRA_JAX_NUM_PROCESSES",
      "ELECTRA_JAX_PROCESS_ID",
  ):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *args: calls.append(args))
  distributed.initialize()
  assert calls == ([()] if joins else [])  # no arguments: JAX reads the cluster itself


@pytest.mark.parametrize(
    "chips, endpoints, joins",
    [
        (True, "t1v-w-0,t1v-w-1,t1v-w-2,t1v-w-3", True),  # a v4-32 slice: four workers
        (True, "t1v-w-0", False),  # one host (v4-8): nothing to join
        (False, "t1v-w-0,t1v-w-1", False),  # no TPU chips here: the metadata server is not asked
    ],
)
def test_tpu_vm_slices_are_detected_from_the_metadata_server(monkeypatch, chips, endpoints, joins):
  # The same command started on every worker of a gcloud-made slice, without launch/tpu_vm.py's
  # ELECTRA_JAX_DISTRIBUTED=auto: the workers must still join one job.
  asked = []

  class Metadata(http.server.BaseHTTPRequestHandler):

    def do_GET(self):  # noqa: N802
      asked.append((self.path, self.headers.get("Metadata-Flavor")))
      body = endpoints.encode()
      self.send_response(200)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    for name in ("ELECTRA_JAX_DISTRIBUTED", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
      monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{server.server_port}")
    monkeypatch.setattr(xla_flags, "tpu_chips_present", lambda: chips)
    found = distributed._multi_host_environment()
  finally:
    server.shutdown()
    server.server_close()
  assert (found is not None) == joins, found
  if chips:
    assert asked == [("/computeMetadata/v1/instance/attributes/worker-network-endpoints", "Google")]
  else:
    assert asked == []
