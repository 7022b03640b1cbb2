"""launch/tpu_vm.py and tpu_commands.py: the gcloud commands each subcommand prints in --dry-run
(flags, quoting through every shell level), what it refuses before any gcloud call, and the pod
walkthrough's jobs run on this machine: the preparation once on one worker, on every core, with
the real CLI too, and the training on every worker from the same bucket paths."""

import json
import os
import random
import shlex
import subprocess
import sys

import pytest

from conftest import REPO
from launch_helpers import (
    _dry_run,
    _refused,
    _commands,
    _refusal,
    _checkout,
    _option,
    _fake_python,
    _bash,
    _recorder,
    _wait_for,
    tpu_commands,
    remote_job,
)


# ---------------------------------------------------------------------------------------
# tpu_vm.py: the commands
# ---------------------------------------------------------------------------------------
def test_create_on_demand_spot_and_queued():
  (on_demand,) = _dry_run(
      "tpu_vm.py",
      "create",
      "--name=pod",
      "--zone=us-central2-b",
      "--accelerator-type=v4-32",
      "--dry-run",
  )
  assert on_demand == [
      "gcloud",
      "compute",
      "tpus",
      "tpu-vm",
      "create",
      "pod",
      "--zone=us-central2-b",
      "--accelerator-type=v4-32",
      "--version=tpu-ubuntu2204-base",
  ]
  (spot,) = _dry_run(
      "tpu_vm.py",
      "create",
      "--name=pod",
      "--zone=us-west4-a",
      "--project=proj",
      "--accelerator-type=v5litepod-16",
      "--spot",
      "--dry-run",
  )
  assert spot[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod"]
  assert {"--spot", "--project=proj", "--version=v2-alpha-tpuv5-lite", "--zone=us-west4-a"} <= set(
      spot
  )
  (queued,) = _dry_run(
      "tpu_vm.py",
      "create",
      "--name=pod",
      "--zone=us-east5-a",
      "--accelerator-type=v6e-16",
      "--queued",
      "--queued-id=pod-qr",
      "--spot",
      "--valid-until-duration=6h",
      "--dry-run",
  )
  assert queued[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "pod-qr"]
  assert {
      "--node-id=pod",
      "--runtime-version=v2-alpha-tpuv6e",
      "--accelerator-type=v6e-16",
      "--spot",
      "--valid-until-duration=6h",
      "--zone=us-east5-a",
  } <= set(queued)
  assert not any(
      a.startswith("--version=") for a in queued
  )  # queued-resources calls it --runtime-version


def test_delete_follow_and_status_commands():
  (node,) = _dry_run("tpu_vm.py", "delete", "--name=pod", "--zone=z", "--dry-run")
  assert node == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "pod", "--zone=z", "--quiet"]
  (queued,) = _dry_run("tpu_vm.py", "delete", "--name=pod", "--zone=z", "--queued", "--dry-run")
  assert queued[3:6] == ["queued-resources", "delete", "pod"] and "--force" in queued
  (follow,) = _dry_run("tpu_vm.py", "follow", "--name=pod", "--zone=z", "--dry-run")
  assert _option(follow, "worker") == "0" and "electra-jax.log" in _option(follow, "command")
  describe_queued, describe_node, workers = _dry_run(
      "tpu_vm.py", "status", "--name=pod", "--zone=z", "--queued", "--dry-run"
  )
  assert describe_queued[3:5] == ["queued-resources", "describe"]
  assert describe_node[3:5] == ["tpu-vm", "describe"] and _option(workers, "worker") == "all"


def test_install_from_git_and_from_a_local_checkout(tmp_path):
  (ssh,) = _dry_run(
      "tpu_vm.py",
      "install",
      "--name=pod",
      "--zone=z",
      "--dry-run",
      "--repo-url=https://github.com/someone/electra-jax",
      "--branch=dev",
  )
  assert ssh[3:6] == ["tpu-vm", "ssh", "pod"] and _option(ssh, "worker") == "all"
  remote = _option(ssh, "command")
  assert "git clone --depth=1 --branch=dev https://github.com/someone/electra-jax" in remote
  assert "pip install --upgrade 'jax[tpu]' './electra-jax[gcs]'" in remote
  # A corpus read through an optional library (a Hugging Face dataset) needs its extra too.
  (hf,) = _commands("install", "--name=pod", "--zone=z", "--repo-url=u", "--extra=hf_datasets")
  assert "'./electra-jax[gcs,hf_datasets]'" in _option(hf, "command")

  # A git checkout ships what git lists: the tracked and the untracked-not-ignored files.
  checkout = _checkout(tmp_path / "checkout")
  name = f"pod-{os.getpid()}"  # the tarball goes to /tmp/electra-jax-src-NAME.tar.gz
  notes = []
  pack, scp, unpack = _dry_run(
      "tpu_vm.py",
      "install",
      f"--name={name}",
      "--zone=z",
      "--dry-run",
      f"--local={checkout}",
      notes=notes,
  )
  assert notes == [
      f"# {checkout} is a git checkout: shipping the files git lists (tracked, and untracked but "
      "not ignored)."
  ]
  assert pack[:2] == ["bash", "-c"]
  assert f"git -C {checkout} ls-files -z --cached --others --exclude-standard | tar" in pack[2]
  tarball = f"/tmp/electra-jax-src-{name}.tar.gz"
  assert scp[3:5] == ["tpu-vm", "scp"] and scp[5] == tarball and _option(scp, "worker") == "all"
  assert scp[6] == f"{name}:{os.path.basename(tarball)}"
  assert f"tar -xzf {os.path.basename(tarball)}" in _option(unpack, "command")
  # What the pack command puts in the tarball, run for real: none of the ignored junk.
  try:
    subprocess.run(pack, check=True, capture_output=True, timeout=60)
    members = subprocess.run(
        ["tar", "-tzf", tarball], check=True, capture_output=True, text=True
    ).stdout.split()
  finally:
    if os.path.exists(tarball):
      os.remove(tarball)
  assert sorted(members) == [
      ".gitignore",
      "configs/demo.py",
      "electra_jax/new_module.py",
      "setup.py",
  ]

  # Not a git checkout: everything but the old exclude list, and the dry run says so.
  plain = _checkout(tmp_path / "plain", git=False)
  notes = []
  pack, _, _ = _dry_run(
      "tpu_vm.py", "install", "--name=pod", "--zone=z", "--dry-run", f"--local={plain}", notes=notes
  )
  assert len(notes) == 1 and f"{plain} is not a git checkout" in notes[0]
  assert shlex.split(pack[2].split("; ", 1)[1]) == [
      "tar",
      "-czf",
      "/tmp/electra-jax-src-pod.tar.gz",
      "--exclude=.git",
      "--exclude=workdirs",
      "--exclude=__pycache__",
      "--exclude=*.egg-info",
      "-C",
      str(plain),
      ".",
  ]
  assert "is not a directory" in _refused(
      "tpu_vm.py",
      "install",
      "--name=pod",
      "--zone=z",
      "--dry-run",
      f"--local={tmp_path / 'nowhere'}",
  )


@pytest.mark.fault
def test_bad_flags_are_refused_before_anything_runs():
  def refused(*args):
    return _refused("tpu_vm.py", *args)

  assert "--config.GROUP.KEY=VALUE" in refused(
      "run", "--name=p", "--zone=z", "--workdir=gs://b/r", "--dry-run", "--", "--train.steps=5"
  )
  assert "needs --workdir" in refused("run", "--name=p", "--zone=z", "--dry-run")
  # A misspelled key is caught here, not on the workers after the slice is made.
  assert "the config has no key 'train.batch_sze'. Did you mean 'train.batch_size'?" in refused(
      "run",
      "--name=p",
      "--zone=z",
      "--workdir=gs://b/r",
      "--dry-run",
      "--",
      "--config.train.batch_sze=1024",
  )
  for launcher, args in (
      ("gpu.py", ["run", "--workdir=/tmp/r"]),
      ("slurm.py", ["--workdir=/tmp/r"]),
  ):
    assert "no key 'model.hiden_size'" in _refused(
        launcher, *args, "--dry-run", "--", "--config.model.hiden_size=64"
    )
  assert "only applies to --queued" in refused(
      "create",
      "--name=p",
      "--zone=z",
      "--accelerator-type=v4-8",
      "--valid-until-duration=1h",
      "--dry-run",
  )
  assert "exactly one of" in refused("install", "--name=p", "--zone=z", "--dry-run")
  assert "--accelerator-type" in refused("create", "--name=p", "--zone=z", "--dry-run")
  assert "--queued-id=qr names a queued resource: add --queued" in refused(
      "delete", "--name=p", "--zone=z", "--queued-id=qr", "--dry-run"
  )
  assert "must not be empty" in refused("delete", "--name=p", "--zone=", "--dry-run")
  assert "--poll-seconds=-1.0 must be >= 1" in refused(
      "restart",
      "--name=p",
      "--zone=z",
      "--workdir=gs://b/r",
      "--repo-url=u",
      "--poll-seconds=-1",
      "--dry-run",
  )
  assert "--grace-seconds=-5 must be >= 0" in refused(
      "stop", "--name=p", "--zone=z", "--grace-seconds=-5", "--dry-run"
  )


# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# The pod walkthrough: fit here, prepare once into a bucket, train every worker from it
# ---------------------------------------------------------------------------------------
T = ("--name=pod", "--zone=us-west4-a")
CORPUS_OVERRIDES = [
    "--config.data.source=text",
    "--config.data.files=my corpus/**/*.txt,$HOME/it's.txt",
]


def test_fit_compiles_the_run_for_the_slice_here():
  (fit,) = _dry_run(
      "tpu_vm.py",
      "fit",
      "--accelerator-type=v5litepod-16",
      "--config=configs/electra_base.py",
      "--dry-run",
      "--",
      "--config.train.batch_size=256",
      "--config.mesh.fsdp=4",
  )
  assert fit == [
      "electra-jax",
      "--mode=compile",
      "--topology=v5e-16",  # gcloud's v5litepod-16
      "--config=configs/electra_base.py",
      "--config.train.batch_size=256",
      "--config.mesh.fsdp=4",
  ]
  (v4,) = _dry_run("tpu_vm.py", "fit", "--accelerator-type=v4-32", "--dry-run")
  assert _option(v4, "topology") == "v4-32" and _option(v4, "config") == "configs/electra_small.py"
  assert "fit needs --accelerator-type" in _refused("tpu_vm.py", "fit", "--dry-run")
  assert "there is no file" in _refused(
      "tpu_vm.py", "fit", "--accelerator-type=v4-32", "--config=configs/electra_bse.py", "--dry-run"
  )


def test_prepare_runs_once_on_one_worker_on_every_core(tmp_path):
  python = _recorder(str(tmp_path), "python")
  _recorder(str(tmp_path), "gcloud")  # the gcloud the worker finds first
  (ssh,) = _dry_run(
      "tpu_vm.py",
      "prepare",
      *T,
      "--copy-corpus=gs://b/raw text",
      "--corpus-dir=my corpus",
      "--prepared-dir=gs://b/prepared 1",
      "--config=configs/electra_base.py",
      f"--python={python}",
      "--dry-run",
      "--",
      *CORPUS_OVERRIDES,
  )
  assert ssh[3:6] == ["tpu-vm", "ssh", "pod"] and _option(ssh, "worker") == "0"
  # The worker's login shell, here, with the fake gcloud first on its PATH.
  home = tmp_path / "home"
  home.mkdir()
  env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  assert "started" in _bash(_option(ssh, "command"), home, env)
  assert _wait_for(lambda: (home / "electra-jax-prepare.exit").exists())
  assert (home / "electra-jax-prepare.exit").read_text().strip() == "0"
  assert not (home / "electra-jax.pid").exists()  # the run's files are the run's
  assert (home / "my corpus").is_dir()
  copy = json.loads((home / "gcloud.json").read_text())["argv"]
  assert copy == ["storage", "rsync", "--recursive", "gs://b/raw text", "my corpus"]
  prepared = json.loads((home / "python.json").read_text())
  cores = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
  assert prepared["argv"] == [
      "-m",
      "electra_jax.main",
      "--mode=prepare_data",
      "--config=electra-jax/configs/electra_base.py",
      *CORPUS_OVERRIDES,
      "--config.data.prepared_dir=gs://b/prepared 1",
      f"--workers={cores}",
  ]
  # A plain command: --mode=prepare_data itself joins no JAX job and takes no TPU a run may hold
  # (tests/test_distributed.py), so the job gets none of the slice's multi-process settings.
  assert not {"ELECTRA_JAX_DISTRIBUTED", "ELECTRA_JAX_NUM_PROCESSES"} & set(prepared["env"])

  # Another worker, a set number of processes, and a corpus already on the VM: no copy.
  (elsewhere,) = _dry_run(
      "tpu_vm.py",
      "prepare",
      *T,
      "--prepared-dir=gs://b/p",
      "--worker=3",
      "--workers=6",
      "--dry-run",
  )
  assert _option(elsewhere, "worker") == "3"
  assert "--workers=6;" in _option(elsewhere, "command")
  assert "gcloud storage" not in _option(elsewhere, "command")


def test_the_preparation_is_followed_checked_and_stopped_apart_from_the_run(tmp_path):
  # A run and a preparation on one worker (here): each command acts on its own job only.
  slow = "trap 'exit 0' TERM\nfor i in $(seq 300); do sleep 0.1; done"
  run_python = _recorder(str(tmp_path), "run-python", slow)
  prepare_python = _recorder(str(tmp_path), "prepare-python", slow)

  def command(*args):
    *_, ssh = _commands(*args, *T)  # status describes the slice first
    return ssh

  def status(job):
    argv = command("status", f"--job={job}", f"--python={sys.executable}")
    (worker,) = remote_job.parse_status(_bash(_option(argv, "command"), tmp_path))
    return _option(argv, "worker"), worker.run

  _bash(
      _option(command("run", "--workdir=gs://b/r", f"--python={run_python}"), "command"), tmp_path
  )
  start = command("prepare", "--prepared-dir=gs://b/p", f"--python={prepare_python}")
  _bash(_option(start, "command"), tmp_path)
  assert _wait_for(lambda: (tmp_path / "prepare-python.json").exists())
  assert _wait_for(lambda: (tmp_path / "run-python.json").exists())
  assert status("prepare") == ("0", "running") and status("train") == ("all", "running")
  assert "still going" in _bash(_option(start, "command"), tmp_path)  # once, not twice
  follow = command("follow", "--job=prepare")
  assert _option(follow, "worker") == "0"
  assert _option(follow, "command").endswith("electra-jax-prepare.log")
  stop = command("stop", "--job=prepare", "--grace-seconds=20")
  assert _option(stop, "worker") == "0"
  assert "stopped" in _bash(_option(stop, "command"), tmp_path)
  assert status("prepare") == ("0", "stopped") and status("train") == ("all", "running")
  assert "stopped" in _bash(_option(command("stop", "--grace-seconds=20"), "command"), tmp_path)
  assert status("train") == ("all", "stopped")
  assert "acts on all of them" in _refusal("stop", *T, "--worker=1")


def test_every_worker_trains_on_the_same_prepared_dir_and_workdir(tmp_path):
  fake = _fake_python(str(tmp_path))
  (ssh,) = _dry_run(
      "tpu_vm.py",
      "run",
      *T,
      "--accelerator-type=v5litepod-16",
      "--prepared-dir=gs://b/prepared 1",
      "--workdir=gs://b/run 1",
      f"--python={fake}",
      "--dry-run",
      "--",
      "--config.train.batch_size=256",
  )
  assert _option(ssh, "worker") == "all"  # one command, the same on every worker
  _bash(_option(ssh, "command"), tmp_path)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  assert json.loads((tmp_path / "argv.json").read_text()) == [
      "-m",
      "electra_jax.main",
      "--config=electra-jax/configs/electra_small.py",
      "--workdir=gs://b/run 1",
      "--config.train.batch_size=256",
      "--config.data.source=prepared",
      "--config.data.prepared_dir=gs://b/prepared 1",
  ]
  # restart starts that same command after every preemption.
  lines = _dry_run(
      "tpu_vm.py",
      "restart",
      *T,
      "--accelerator-type=v5litepod-16",
      "--repo-url=https://github.com/someone/electra-jax",
      "--prepared-dir=gs://b/prepared 1",
      "--workdir=gs://b/run 1",
      f"--python={fake}",
      "--dry-run",
      "--",
      "--config.train.batch_size=256",
  )
  starts = {_option(argv, "command") for argv in lines if "setsid nohup" in " ".join(argv)}
  assert starts == {_option(ssh, "command")}


@pytest.mark.fault
def test_paths_the_other_workers_cannot_see_are_refused_before_any_gcloud_call():
  assert "--workdir=/data/run is a path on each worker's own disk" in _refusal(
      "run", *T, "--workdir=/data/run"
  )
  assert "--prepared-dir=/data/p is a path on each worker's own disk, but " in _refusal(
      "run", *T, "--accelerator-type=v5litepod-16", "--workdir=gs://b/r", "--prepared-dir=/data/p"
  )
  assert "--config.data.prepared_dir=/data/p is a path" in _refusal(
      "run", *T, "--workdir=gs://b/r", "--", "--config.data.prepared_dir=/data/p"
  )
  assert "gs://BUCKET" in _refusal(
      "restart", *T, "--accelerator-type=v4-32", "--repo-url=u", "--workdir=workdirs/base"
  )
  assert "--prepared-dir=/data/p: prepare writes the shards once" in _refusal(
      "prepare", *T, "--prepared-dir=/data/p"
  )
  assert "--copy-corpus=/data/raw: give the bucket folder" in _refusal(
      "prepare", *T, "--prepared-dir=gs://b/p", "--copy-corpus=/data/raw"
  )
  assert "--config.data.source: --prepared-dir=gs://b/p sets data.source" in _refusal(
      "run", *T, "--workdir=gs://b/r", "--prepared-dir=gs://b/p", "--", "--config.data.source=text"
  )
  assert "the preparation runs on one worker" in _refusal(
      "prepare", *T, "--prepared-dir=gs://b/p", "--worker=all"
  )
  # A one-host slice may keep a local workdir.
  (single,) = _commands("run", *T, "--accelerator-type=v4-8", "--workdir=/data/run")
  assert "--workdir=/data/run" in _option(single, "command")


def test_the_prepare_command_runs_the_real_cli(tmp_path):
  # What prepare starts on the worker, with a local directory in place of the bucket: the
  # flags and the overrides are ones electra-jax takes, and it joins no multi-process job.
  corpus = tmp_path / "my corpus"
  corpus.mkdir()
  words = "the quick brown fox jumps over a lazy dog while seven wizards hex a jovial box".split()
  rng = random.Random(0)
  documents = [
      "\n".join(" ".join(rng.choices(words, k=12)).capitalize() + "." for _ in range(5))
      for _ in range(200)
  ]
  (corpus / "a.txt").write_text("\n\n".join(documents) + "\n")
  prepare = tpu_commands.Prepare(
      str(tmp_path / "prepared"),
      config="configs/demo.py",
      overrides=(
          "--config.data.source=text",
          "--config.data.files=my corpus/*.txt",
          "--config.data.spm_vocab_size=64",
          "--config.data.max_seq_len=32",
      ),
      remote_dir=REPO,
      python=sys.executable,
      workers=0,  # in this process: --workers="$(nproc)" is the fake-Python test's
  )
  assert "started" in _bash(
      remote_job.start_job_script(prepare.command(), remote_job.PREPARE_JOB), tmp_path
  )
  assert _wait_for(lambda: (tmp_path / "electra-jax-prepare.exit").exists(), timeout=120)
  log = (tmp_path / "electra-jax-prepare.log").read_text()
  assert (tmp_path / "electra-jax-prepare.exit").read_text().strip() == "0", log[-2000:]
  assert "Process 0 of" not in log
  manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
  assert manifest["complete"] and manifest["max_seq_len"] == 32
  # What status reads in that log: the preparation finished (not merely exited).
  (worker,) = remote_job.parse_status(
      _bash(remote_job.status_script(sys.executable, remote_job.PREPARE_JOB), tmp_path)
  )
  assert worker.run == "exited:0" and worker.done


# ---------------------------------------------------------------------------------------
