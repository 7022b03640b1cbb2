"""A gs:// workdir against a real storage API (tests/gcs_server.py: fake-gcs-server on 127.0.0.1,
every client pointed at it by its own setting), through the CLI: train, stop and resume bit-exact,
kill -9 in the middle of a checkpoint's writes, a damaged step set aside, two processes saving one
checkpoint, the lease between two runs, export, and buckets that refuse writes or do not exist."""

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli, cli_args
from gcs_server import GcsProxy
from test_train import REQUIRED_METRICS
from electra_jax import checkpointing, preemption

EXACT_METRICS = REQUIRED_METRICS - {"tokens_per_sec", "steps_per_sec"}


def _jsonl(gcs_server, url) -> list[dict]:
  return [json.loads(line) for line in gcs_server.read(url).decode().splitlines()]


def _local_jsonl(file) -> list[dict]:
  return [json.loads(line) for line in file.read_text().splitlines()]


def _final_checksums(workdir, step=6) -> dict:
  """The checksum of every array of the state saved at `step`, as its checkpoint recorded them."""
  checkpointer = checkpointing.Checkpointer(str(workdir), keep=1)
  try:
    return checkpointer.read_meta(step)["checksums"]
  finally:
    checkpointer.close()


def _assert_same_run(want: dict, workdir, gcs_server):
  """The bucket run in `workdir` logged and saved, to the last bit, what the local run `want` did."""
  for log in ("metrics", "eval_metrics"):
    got = _jsonl(gcs_server, f"{workdir}/{log}.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want[log]], log
    for a, b in zip(want[log], got):
      for name in EXACT_METRICS & set(a):
        assert a[name] == b[name], (log, a["step"], name, a[name], b[name])
  assert _final_checksums(workdir) == want["checksums"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run of the tiny config in a local workdir: its logs and final arrays."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  result = cli(cli_args(workdir))
  assert result.returncode == 0, result.stderr[-3000:]
  return dict(
      workdir=workdir,
      metrics=_local_jsonl(workdir / "metrics.jsonl"),
      eval_metrics=_local_jsonl(workdir / "eval_metrics.jsonl"),
      checksums=_final_checksums(workdir),
  )


@pytest.fixture(scope="module")
def resumed_in_bucket(reference, gcs_server):
  """The tiny config trained into a bucket, stopped after step 4 as SIGTERM stops it, then resumed:
  (workdir, the two runs' stderr)."""
  workdir = f"{gcs_server.create_bucket()}/run"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(preemption.Preemption, "stop_after", lambda self, call: call == 3)  # step 4
    stopped = cli(cli_args(workdir))
  assert stopped.returncode == 0, stopped.stderr[-3000:]
  resumed = cli(cli_args(workdir))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  return workdir, stopped.stderr, resumed.stderr


def test_a_bucket_run_stopped_and_resumed_is_bit_exact(reference, resumed_in_bucket, gcs_server):
  workdir, stopped, resumed = resumed_in_bucket
  assert "saved a checkpoint at step 4" in stopped
  assert f"Resuming from the checkpoint at step 4 in {workdir}/checkpoints" in resumed
  _assert_same_run(reference, workdir, gcs_server)
  names = gcs_server.objects(workdir, "run/")
  for name in ("config.json", "spm.model", "metrics.jsonl", "eval_metrics.jsonl", "lease.json"):
    assert f"run/{name}" in names, names
  assert json.loads(gcs_server.read(f"{workdir}/lease.json"))["released"] is True
  assert sorted({n.split("/")[2] for n in names if n.startswith("run/checkpoints/")}) == [
      "3",
      "4",
      "6",
  ]
  assert any(n.startswith("run/checkpoints/6/state/ocdbt") for n in names)  # tensorstore's arrays


def test_a_checkpoint_saved_into_a_bucket_restores_exactly_and_lives_there(bucket, gcs_server):
  state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.int32(7)}
  checkpointer = checkpointing.Checkpointer(f"{bucket}/run", keep=2)
  checkpointer.save(3, state, {"note": "x"})
  checkpointer.wait()
  names = gcs_server.objects(bucket, "run/checkpoints/3/")
  assert any(n.startswith("run/checkpoints/3/state/ocdbt") for n in names), names  # tensorstore's
  assert "run/checkpoints/3/commit_success.txt" in names and checkpointer.all_steps() == [3]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored = checkpointer.restore(3, abstract)
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert int(restored["step"]) == 7 and checkpointer.read_meta(3)["note"] == "x"
  checkpointer.close()


@pytest.fixture
def proxy(gcs_server):
  proxy = GcsProxy(gcs_server)
  yield proxy
  proxy.stop()


def _start_cli(args, env, log) -> subprocess.Popen:
  """The CLI in a process of its own, its output going to the file `log` (a pipe that nobody reads
  while the test waits would fill and stop it)."""
  with open(log, "w") as output:
    return subprocess.Popen(
        args, cwd=REPO, env=dict(os.environ, **env), stdout=output, stderr=subprocess.STDOUT
    )


@pytest.mark.fault
@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_checkpoint_write_resumes_from_the_newest_intact_step(
    reference, gcs_server, bucket, proxy, tmp_path
):
  workdir = f"{bucket}/run"
  # The CLI's clients reach the bucket through the proxy, which keeps waiting the first write of
  # step 6 made once the step has an object in the bucket: the process is killed half-way.
  in_flight = proxy.hold(
      lambda method, _, name: method == "POST"
      and name.startswith("run/checkpoints/6/")
      and gcs_server.objects(bucket, "run/checkpoints/6/")
  )
  log = tmp_path / "killed.log"
  process = _start_cli(cli_args(workdir), proxy.env, log)
  try:
    assert in_flight.reached.wait(300), log.read_text()[-3000:]
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    in_flight.drop()
  step_6 = gcs_server.objects(bucket, "run/checkpoints/6/")
  assert step_6 and "run/checkpoints/6/commit_success.txt" not in step_6, step_6  # half-written
  assert "run/checkpoints/3/commit_success.txt" in gcs_server.objects(bucket, "run/checkpoints/3/")

  resumed = cli(cli_args(workdir))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resuming from the checkpoint at step 3 in {workdir}/checkpoints" in resumed.stderr
  assert "ended without releasing it" in resumed.stderr  # the killed run's lease, taken over
  _assert_same_run(reference, workdir, gcs_server)


@pytest.mark.fault
def test_a_damaged_step_in_a_bucket_is_set_aside_whole_and_trained_again(
    reference, gcs_server, bucket
):
  workdir = f"{bucket}/run"
  assert cli(cli_args(workdir)).returncode == 0
  saved = gcs_server.objects(bucket, "run/checkpoints/6/")
  arrays = [name for name in saved if "/state/ocdbt.process_0/d/" in name]
  damaged = max(arrays, key=lambda name: len(gcs_server.read(f"{bucket}/{name}")))
  content = gcs_server.read(f"{bucket}/{damaged}")
  middle = len(content) // 2
  flipped = content[:middle] + bytes(b ^ 0xFF for b in content[middle : middle + 64])
  gcs_server.write(f"{bucket}/{damaged}", flipped + content[middle + 64 :])

  resumed = cli(cli_args(workdir))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "The checkpoint at step 6 in" in resumed.stderr and "is damaged" in resumed.stderr
  assert f"Moved the damaged checkpoint at step 6 to {workdir}/checkpoints/6.damaged" in (
      resumed.stderr
  )
  assert f"Resuming from the checkpoint at step 3 in {workdir}/checkpoints" in resumed.stderr
  _assert_same_run(reference, workdir, gcs_server)  # step 6 trained and saved again
  # Every object of the damaged step kept under the new name, the damaged one as it was.
  kept = gcs_server.objects(bucket, "run/checkpoints/6.damaged/")
  assert kept == [name.replace("/6/", "/6.damaged/") for name in saved]
  assert gcs_server.read(f"{bucket}/{damaged.replace('/6/', '/6.damaged/')}") != content


@pytest.mark.fault
def test_a_second_run_is_refused_and_a_take_over_fences_the_first_off(
    gcs_server, bucket, proxy, tmp_path
):
  workdir = f"{bucket}/run"
  # The first run's reads of the lease wait, once it wrote config.json (it is then training,
  # before its first checkpoint), until the other runs are done.
  started = lambda: ("POST", bucket[5:], "run/config.json") in proxy.seen
  paused = proxy.hold(
      lambda method, _, name: method == "GET" and name == "run/lease.json" and started()
  )
  log = tmp_path / "first.log"
  first = _start_cli(cli_args(workdir), proxy.env, log)
  try:
    assert paused.reached.wait(300), log.read_text()[-3000:]
    holder = json.loads(gcs_server.read(f"{workdir}/lease.json"))
    assert holder["pid"] == first.pid and not holder["released"]
    before = gcs_server.generations(bucket)

    second = cli(cli_args(workdir))
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert f"electra-jax: error: The workdir {workdir} is in use by run {holder['run_id']}" in (
        second.stderr
    )
    assert gcs_server.generations(bucket) == before  # nothing written

    third = cli(cli_args(workdir) + ["--take_over_workdir"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert "--take_over_workdir: taking" in third.stderr
    after_third = gcs_server.generations(bucket)
    assert {"run/checkpoints/3/commit_success.txt", "run/checkpoints/6/commit_success.txt"} <= set(
        after_third
    )
  finally:
    paused.release()
    first.wait(timeout=300)
  stderr = log.read_text()
  assert first.returncode == 1
  assert f"Another run took over the workdir {workdir}" in stderr, stderr[-3000:]
  assert "stopped without saving" in stderr
  # The first run wrote nothing more: no checkpoint, no log, no lease over the third run's.
  assert gcs_server.generations(bucket) == after_third
  assert len(_jsonl(gcs_server, f"{workdir}/metrics.jsonl")) == 6


@pytest.mark.slow
def test_two_processes_save_one_checkpoint_into_a_bucket_and_a_run_resumes_from_it(
    gcs_server, bucket
):
  from test_distributed import _start_two  # noqa: PLC0415

  workdir = f"{bucket}/run"
  # One device each, the parameters sharded over both: each process writes its own shards.
  overrides = {"mesh.fsdp": 2, "train.steps": 3, "checkpoint.every_steps": 3, "eval.every_steps": 0}
  processes = _start_two(lambda i: cli_args(workdir, **overrides), devices=1)
  try:
    outputs = [process.communicate(timeout=300) for process in processes]
  finally:
    for process in processes:  # a hung process (a failed check) must not outlive the test
      if process.poll() is None:
        process.kill()
  for process, (_, stderr) in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  step_3 = gcs_server.objects(bucket, "run/checkpoints/3/")
  for i in range(2):
    assert any(
        n.startswith(f"run/checkpoints/3/state/ocdbt.process_{i}/d/") for n in step_3
    ), step_3
  assert "run/checkpoints/3/commit_success.txt" in step_3
  assert [m["step"] for m in _jsonl(gcs_server, f"{workdir}/metrics.jsonl")] == [1, 2, 3]

  # One process of one device reads both processes' shards back: every array as saved (a restore
  # checks them against the checksums the two processes recorded) and trains on.
  resumed = cli(cli_args(workdir, **{"train.steps": 4}))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resuming from the checkpoint at step 3 in {workdir}/checkpoints" in resumed.stderr
  assert [m["step"] for m in _jsonl(gcs_server, f"{workdir}/metrics.jsonl")] == [1, 2, 3, 4]
  assert "run/checkpoints/4/commit_success.txt" in gcs_server.objects(bucket, "run/checkpoints/4/")


def _export(workdir, out):
  args = cli_args(workdir)[:3] + ["--mode=export_hf", f"--workdir={workdir}", f"--out={out}"]
  result = cli(args)
  assert result.returncode == 0, result.stderr[-3000:]
  return {
      path.relative_to(out): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()
  }


def test_export_from_a_bucket_workdir_is_the_export_of_the_same_run_kept_locally(
    reference, resumed_in_bucket, tmp_path
):
  from_bucket = _export(resumed_in_bucket[0], tmp_path / "from_bucket")
  assert "discriminator/model.safetensors" in {str(name) for name in from_bucket}
  assert from_bucket == _export(reference["workdir"], tmp_path / "from_disk")  # byte for byte


@pytest.mark.fault
def test_a_bucket_that_does_not_exist_is_refused_in_one_line_before_anything(gcs_server):
  workdir = "gs://no-such-bucket-for-electra/run"
  result = cli(cli_args(workdir))
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert error.startswith(
      f"electra-jax: error: --workdir={workdir}: the bucket gs://no-such-bucket-for-electra does "
      "not exist"
  ), error
  assert "gcloud storage buckets create gs://no-such-bucket-for-electra" in error
  assert "loaded prepared train data" not in result.stderr  # before the data, let alone a compile
  with pytest.raises(urllib.error.HTTPError, match="404"):  # and not made by the run
    urllib.request.urlopen(f"{gcs_server.url}/storage/v1/b/no-such-bucket-for-electra")


@pytest.mark.fault
def test_a_bucket_that_refuses_writes_is_refused_in_one_line_with_nothing_written(
    gcs_server, bucket, proxy, monkeypatch
):
  proxy.refuse_writes = True
  for name, value in proxy.env.items():
    monkeypatch.setenv(name, value)
  result = cli(cli_args(f"{bucket}/run"))
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert error.startswith(
      f"electra-jax: error: --workdir={bucket}/run: {bucket} refuses this account (403 Forbidden)"
  ), error
  assert f"roles/storage.objectUser on {bucket}" in error
  assert "loaded prepared train data" not in result.stderr
  assert any(method == "POST" for method, _, _ in proxy.seen)  # it was asked, and said no
  assert gcs_server.objects(bucket) == []


@pytest.mark.fault
def test_prepare_data_into_a_bucket_that_refuses_writes_is_refused_before_any_work(
    gcs_server, bucket, proxy, monkeypatch, tmp_path
):
  # The workdir's check guards prepared data too: before the corpus is read or a tokenizer trained.
  proxy.refuse_writes = True
  for name, value in proxy.env.items():
    monkeypatch.setenv(name, value)
  prepared = f"{bucket}/prepared"
  args = cli_args(tmp_path / "unused", **{"data.prepared_dir": prepared})
  result = cli(args + ["--mode=prepare_data", "--workers=0"])
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert error.startswith(
      f"electra-jax: error: data.prepared_dir={prepared}: {bucket} refuses this account (403"
  ), error
  assert f"roles/storage.objectUser on {bucket}" in error
  assert gcs_server.objects(bucket) == []


@pytest.mark.fault
def test_a_bucket_without_credentials_is_refused_in_one_line(gcs_server, tmp_path, monkeypatch):
  # Google's own endpoint in place of the local API: no credentials here (and no request sent).
  monkeypatch.delenv("STORAGE_EMULATOR_HOST")
  monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # gcloud's folder, without a login
  result = cli(cli_args("gs://some-bucket/run"))
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert error.startswith(
      "electra-jax: error: --workdir=gs://some-bucket/run: no usable Google Cloud credentials"
  ), error
  assert "gcloud auth application-default login" in error
