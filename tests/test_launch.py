"""launch/: the gcloud, ssh, sbatch commands the scripts print in --dry-run (flags, quoting of
overrides through every shell level), the detached-run shell snippets run for real on this
machine, the preemption supervisor against a scripted sequence of slice states, and the Colab
notebook's code cells executed on CPU with a shrunken demo config."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

from conftest import REPO, TINY_OVERRIDES

LAUNCH = os.path.join(REPO, "launch")


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"launch_{name}", os.path.join(LAUNCH, f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


tpu_vm, gpu, slurm, remote_job, make_colab = (
    _load(name) for name in ("tpu_vm", "gpu", "slurm", "remote_job", "make_colab")
)

# Overrides that break naive quoting: a space, a glob, a dollar sign, both quote characters.
TRICKY_OVERRIDES = [
    "--config.train.batch_size=256",
    "--config.data.files=/data/my corpus/*.txt,$HOME/b.txt",
    """--config.data.text_field=it's "text\"""",
]


def _dry_run(script, *args, notes=None):
  """The commands a dry run prints, each split into its argv; its `# ...` notes go to `notes`."""
  # From the checkout, as the README runs them: a relative --config is looked for here.
  done = subprocess.run(
      [sys.executable, os.path.join(LAUNCH, script), *args],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=REPO,
  )
  assert done.returncode == 0, done.stderr
  if notes is not None:
    notes.extend(line for line in done.stdout.splitlines() if line.startswith("#"))
  return [
      shlex.split(line) for line in done.stdout.splitlines() if line and not line.startswith("#")
  ]


def _refused(script, *args, cwd=REPO):
  """stderr of a launcher that refused its arguments before printing or running anything."""
  done = subprocess.run(
      [sys.executable, os.path.join(LAUNCH, script), *args],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=cwd,
  )
  assert done.returncode == 2 and not done.stdout, done
  return done.stderr


def _checkout(directory, git=True):
  """A small electra-jax-like checkout with the local junk install --local must leave behind:
  a virtualenv, sweeps, prepared data (all ignored), a workdir, bytecode. In git: one file
  committed to the index, one untracked but not ignored (uncommitted work, which must travel)."""
  files = {
      ".gitignore": "__pycache__/\n.venv/\n/sweeps/\n/.bench_data/\n/workdirs/\n",
      "setup.py": "# setup\n",
      "configs/demo.py": "# recipe\n",
      "electra_jax/new_module.py": "# new\n",
      ".venv/bin/python": "",
      "sweeps/objectives/0/checkpoint": "",
      ".bench_data/s128/shard": "",
      "workdirs/demo/metrics.jsonl": "",
      "electra_jax/__pycache__/x.pyc": "",
  }
  for name, text in files.items():
    os.makedirs(os.path.join(directory, os.path.dirname(name)), exist_ok=True)
    with open(os.path.join(directory, name), "w") as f:
      f.write(text)
  if git:
    for command in (["init", "-q"], ["add", ".gitignore", "setup.py", "configs/demo.py"]):
      subprocess.run(["git", "-C", str(directory), *command], check=True, capture_output=True)
  return directory


def _fake_ssh(directory, remote_home):
  """A stand-in `ssh HOST COMMAND` that runs COMMAND with bash in `remote_home`."""
  path = os.path.join(directory, "ssh")
  with open(path, "w") as f:
    f.write(f'#!/usr/bin/env bash\ncd {shlex.quote(str(remote_home))} && exec bash -c "$2"\n')
  os.chmod(path, 0o755)
  return dict(os.environ, PATH=f"{directory}{os.pathsep}{os.environ['PATH']}")


def _tree(directory):
  return sorted(
      os.path.relpath(os.path.join(root, name), directory)
      for root, _, names in os.walk(directory)
      for name in names
  )


def _option(argv, name):
  values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
  assert len(values) == 1, (name, argv)
  return values[0]


def _fake_python(directory, body="echo started"):
  """An executable standing in for python3: records its argv as JSON, then runs `body`."""
  path = os.path.join(directory, "fake-python")
  with open(path, "w") as f:
    f.write(
        "#!/usr/bin/env bash\n"
        f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\""
        f" > argv.json\n{body}\n"
    )
  os.chmod(path, 0o755)
  return path


def _bash(script, cwd):
  return subprocess.run(
      ["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60
  ).stdout


def _wait_for(predicate, timeout=20.0):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    time.sleep(0.1)
  return False


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


def test_gpu_install_copies_the_git_files_of_a_local_checkout_to_a_host(tmp_path):
  checkout = _checkout(tmp_path / "checkout")
  remote_home = tmp_path / "home"
  (remote_home / "electra-jax").mkdir(parents=True)
  (remote_home / "electra-jax" / "stale.py").write_text("# from an older copy\n")
  notes = []
  copy, pip = _dry_run(
      "gpu.py", "install", "--host=me@gpu-box", f"--local={checkout}", "--dry-run", notes=notes
  )
  assert len(notes) == 1 and "is a git checkout" in notes[0]
  assert copy[:2] == ["bash", "-c"] and "ssh me@gpu-box" in copy[2]
  assert pip == [
      "ssh",
      "me@gpu-box",
      "python3 -m pip install --upgrade 'jax[cuda12]' ./electra-jax",
  ]
  # The copy, run for real through an ssh that lands in remote_home: the host gets exactly the
  # files git lists, and nothing of the copy it had before.
  subprocess.run(
      copy, check=True, capture_output=True, timeout=60, env=_fake_ssh(tmp_path, remote_home)
  )
  assert _tree(remote_home) == [
      "electra-jax/.gitignore",
      "electra-jax/configs/demo.py",
      "electra-jax/electra_jax/new_module.py",
      "electra-jax/setup.py",
  ]


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
# The detached run: quoting through every shell, start / status / stop for real
# ---------------------------------------------------------------------------------------
def test_run_command_reaches_python_with_overrides_intact(tmp_path):
  fake = _fake_python(str(tmp_path))
  (ssh,) = _dry_run(
      "tpu_vm.py",
      "run",
      "--name=pod",
      "--zone=z",
      "--workdir=gs://bucket/run 1",
      f"--python={fake}",
      "--env=XLA_FLAGS=--xla_a=1 --xla_b",
      "--dry-run",
      "--",
      *TRICKY_OVERRIDES,
  )
  assert _option(ssh, "worker") == "all"
  assert "ELECTRA_JAX_DISTRIBUTED=auto" in _option(ssh, "command")  # every worker joins one job
  # What the worker's login shell receives, run here in place of the worker.
  _bash(_option(ssh, "command"), cwd=tmp_path)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  argv = json.loads((tmp_path / "argv.json").read_text())
  assert argv == [
      "-m",
      "electra_jax.main",
      "--config=electra-jax/configs/electra_small.py",
      "--workdir=gs://bucket/run 1",
      *TRICKY_OVERRIDES,
  ]
  assert "started" in (tmp_path / "electra-jax.log").read_text()


def test_start_status_stop_lifecycle(tmp_path):
  # Stands in for train.py: saves and exits 0 on SIGTERM, logs "Done" when it finishes.
  body = (
      "trap 'echo saving; echo saved; exit 0' TERM\n"
      "for i in $(seq 300); do sleep 0.1; done\necho 'Done: step 300, checkpoints in x'"
  )
  fake = _fake_python(str(tmp_path), body)
  start = remote_job.start_script([fake, "-m", "electra_jax.main"], {})
  status = remote_job.status_script(sys.executable)

  def state():
    (worker,) = remote_job.parse_status(_bash(status, tmp_path))
    return worker

  assert state().run == "none"
  assert "started" in _bash(start, tmp_path)
  assert _wait_for(lambda: (tmp_path / "argv.json").exists())
  running = state()
  assert running.running and running.installed  # electra-jax is installed for this Python
  assert "still going" in _bash(start, tmp_path)  # never two runs on one worker
  assert "stopped" in _bash(remote_job.stop_script(grace_seconds=20), tmp_path)
  stopped = state()
  assert stopped.run == "stopped" and not stopped.done  # saved and left by `stop`, not finished
  assert "saved" in (tmp_path / "electra-jax.log").read_text()

  finishing = _fake_python(str(tmp_path), "echo 'Done: step 6, checkpoints in x'")
  _bash(remote_job.start_script([finishing], {}), tmp_path)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  finished = state()
  assert finished.run == "exited:0" and finished.done
  assert len(list(tmp_path.glob("electra-jax.log.*"))) == 1  # the first run's log is kept


# ---------------------------------------------------------------------------------------
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
  tpu = tpu_vm.Slice("pod", "us-central2-b", accelerator_type="v4-16", spot=True, queued=queued)
  install = tpu_vm.Install(repo_url="https://github.com/someone/electra-jax")
  run = tpu_vm.Run("gs://bucket/run", overrides=("--config.train.steps=100",))
  sleeps = []
  code = tpu_vm.supervise(
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


def test_restart_stops_on_a_failed_queued_resource_and_on_creates_that_keep_failing():
  # FAILED: the request was refused or its --valid-until-duration ran out; queuing it again
  # would wait forever. A create that keeps failing (wrong zone or type, no quota) is retried
  # a bounded number of times, not every poll until someone notices.
  failed = FakeGcloud([], queued_states=["FAILED"])
  assert _supervise(failed, queued=True)[0] == 1 and failed.kinds() == []
  refused = FakeGcloud([("MISSING", [])] * 10, create_fails=True)
  code, sleeps = _supervise(refused, max_restarts=2)
  assert code == 1 and refused.kinds() == ["tpu-vm create"] * 3 and len(sleeps) == 2


def test_slice_state_ignores_gcloud_notices_on_stderr(tmp_path):
  # gcloud prints "Updates are available ..." to stderr; it must not be read as the state.
  gcloud = tmp_path / "gcloud"
  gcloud.write_text("#!/bin/sh\necho READY\necho 'To update: $ gcloud components update' >&2\n")
  gcloud.chmod(0o755)
  execute = remote_job.make_executor(dry_run=False)
  tpu = tpu_vm.Slice("pod", "us-central2-b", accelerator_type="v4-16")
  real = lambda argv, capture=False: execute([str(gcloud)] + list(argv[1:]), capture)  # noqa: E731
  assert tpu_vm.slice_state(tpu, real) == "READY"


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
  assert tpu_vm.decide("READY", workers("exited:0", "exited:0"), queued=False) == "run"
  assert tpu_vm.decide("READY", workers("exited:143", "running"), queued=False) == "stop_and_run"
  assert tpu_vm.decide("READY", None, queued=False) == "wait"  # ssh not answering yet
  assert tpu_vm.decide("REPAIRING", None, queued=False) == "wait"
  assert tpu_vm.decide("SUSPENDED", None, queued=True) == "recreate"  # spot capacity taken back
  assert tpu_vm.decide("FAILED", None, queued=True) == "failed"  # not queued again forever
  # `stop` marks the workers: a supervising `restart` leaves the run stopped.
  assert tpu_vm.decide("READY", workers("stopped", "stopped"), queued=False) == "stopped_run"
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


# ---------------------------------------------------------------------------------------
# gpu.py and slurm.py
# ---------------------------------------------------------------------------------------
def test_gpu_host_run_over_ssh_and_here(tmp_path):
  (ssh,) = _dry_run(
      "gpu.py",
      "run",
      "--host=me@gpu-box",
      "--workdir=gs://b/r",
      "--gpus=0,1,2,3",
      "--dry-run",
      "--",
      "--config.train.steps=50",
  )
  assert ssh[:2] == ["ssh", "me@gpu-box"]
  assert (
      "env CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m electra_jax.main "
      "--config=electra-jax/configs/electra_small.py --workdir=gs://b/r --config.train.steps=50"
  ) in ssh[2]

  fake = _fake_python(str(tmp_path))
  (local,) = _dry_run(
      "gpu.py",
      "run",
      f"--job-dir={tmp_path}",
      "--workdir=relative/wd",
      f"--python={fake}",
      "--config=configs/demo.py",
      "--dry-run",
      "--",
      *TRICKY_OVERRIDES,
  )
  assert local[:2] == ["bash", "-c"]
  subprocess.run(local, cwd=REPO, timeout=60, check=True, capture_output=True)
  assert _wait_for(lambda: (tmp_path / "electra-jax.exit").exists())
  argv = json.loads((tmp_path / "argv.json").read_text())
  # Paths made absolute: the job runs in --job-dir, not where the command was typed.
  assert argv == [
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/demo.py",
      f"--workdir={os.path.join(REPO, 'relative/wd')}",
      *TRICKY_OVERRIDES,
  ]


def test_gpu_local_install_from_git_twice_then_run_its_recipe(tmp_path):
  # Without --host, `install --repo-url` clones into --remote-dir here; a second install
  # replaces that checkout, and `run` finds a relative --config in it.
  origin = tmp_path / "origin"
  (origin / "configs").mkdir(parents=True)
  (origin / "configs" / "demo.py").write_text("# recipe\n")
  git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(origin)]
  for command in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "first"]):
    subprocess.run(git + command, check=True, capture_output=True)
  fake = _fake_python(str(tmp_path))
  work = tmp_path / "work"
  work.mkdir()
  install = [
      sys.executable,
      os.path.join(LAUNCH, "gpu.py"),
      "install",
      f"--repo-url=file://{origin}",
      "--branch=main",
      f"--python={fake}",
  ]
  for _ in range(2):
    done = subprocess.run(install, cwd=work, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
  assert (work / "electra-jax" / "configs" / "demo.py").exists() and not (
      work / "electra-jax.new"
  ).exists()
  assert json.loads((work / "argv.json").read_text())[-1] == str(
      work / "electra-jax"
  )  # pip's target
  run = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "gpu.py"),
          "run",
          "--workdir=wd",
          "--config=configs/demo.py",
          "--dry-run",
      ],
      cwd=work,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert f"--config={work}/electra-jax/configs/demo.py" in run.stdout, run.stdout


def test_slurm_script_runs_one_task_per_gpu(tmp_path):
  out = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--nodes=4",
          "--gpus-per-node=8",
          "--partition=gpu",
          "--workdir=/shared/run",
          "--chain=2",
          f"--script={tmp_path}/job.sbatch",
          "--dry-run",
          "--",
          *TRICKY_OVERRIDES,
      ],
      capture_output=True,
      text=True,
      timeout=60,
      check=True,
      cwd=REPO,
  ).stdout
  script, submit = out.split("# submit with:\n")
  script = script.split("\n", 1)[1]  # after the "# <path>" header
  assert not os.path.exists(tmp_path / "job.sbatch")  # a dry run writes nothing
  directives = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
  assert {
      "--nodes=4",
      "--ntasks-per-node=8",
      "--gpus-per-node=8",
      "--partition=gpu",
      "--requeue",
  } <= set(directives)
  assert any(d.startswith("--signal=TERM@") for d in directives)
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
  srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
  assert (
      "--cpus-per-task=8" in srun[: srun.index("-m")]
  )  # srun of Slurm 22.05-23.02 would give 1 core
  assert srun[srun.index("-m") - 1 :] == [
      "python3",
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/electra_small.py",
      "--workdir=/shared/run",
      *TRICKY_OVERRIDES,
  ]
  submits = submit.splitlines()
  assert len(submits) == 3 and all("--dependency=afterany:$jobid" in line for line in submits[1:])
  assert f"--output={REPO}/slurm-logs/%x-%j.out" in directives  # not relative to where sbatch runs
  assert "must be non-empty and have no spaces" in _refused(
      "slurm.py", "--workdir=/r", "--job-name=my run", "--dry-run"
  )
  # A newline in any directive would end the #SBATCH block and run the rest as shell lines.
  for option in (
      "--time=1:00:00\nrm -rf ~",
      "--partition=gpu\ntouch /tmp/x",
      "--sbatch-arg=--qos=a\nid",
      "--job-name=",
  ):
    refused = _refused("slurm.py", "--workdir=/r", option, "--dry-run")
    assert "must be non-empty and have no spaces or control characters" in refused, (
        option,
        refused,
    )
  assert "--gpus='0, 1': give GPU indices" in _refused(
      "gpu.py", "run", "--workdir=/r", "--gpus=0, 1", "--dry-run"
  )
  assert "--gpus=''" in _refused("gpu.py", "run", "--workdir=/r", "--gpus=", "--dry-run")

  written = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--workdir=/shared/run",
          f"--script={tmp_path}/job.sbatch",
          f"--log-dir={tmp_path}/logs",
      ],
      capture_output=True,
      text=True,
      timeout=60,
      check=True,
      cwd=REPO,
  )
  assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH")
  assert "sbatch --parsable" in written.stdout


def test_a_recipe_that_is_not_there_is_refused_before_anything_is_written(tmp_path):
  # A typo: slurm.py would write a script whose every task fails once the job leaves the queue.
  script, logs = tmp_path / "job.sbatch", tmp_path / "logs"
  typo = _refused(
      "slurm.py",
      "--workdir=/shared/run",
      "--config=configs/electra_smal.py",
      f"--script={script}",
      f"--log-dir={logs}",
  )
  assert (
      f"--config=configs/electra_smal.py: there is no file {REPO}/configs/electra_smal.py" in typo
  )
  assert not script.exists() and not logs.exists()
  # From outside the checkout the default recipe is not under the current directory: the
  # error points at slurm.py's own checkout. A full path works from anywhere.
  outside = _refused(
      "slurm.py", "--workdir=/shared/run", f"--script={script}", "--dry-run", cwd=tmp_path
  )
  assert f"there is no file {tmp_path}/configs/electra_small.py" in outside
  assert f"--config={REPO}/configs/electra_small.py" in outside
  done = subprocess.run(
      [
          sys.executable,
          os.path.join(LAUNCH, "slurm.py"),
          "--workdir=/shared/run",
          f"--config={REPO}/configs/electra_small.py",
          "--dry-run",
      ],
      capture_output=True,
      text=True,
      timeout=60,
      cwd=tmp_path,
      check=True,
  )
  assert f"--config={REPO}/configs/electra_small.py" in done.stdout
  # gpu.py on this machine, and tpu_vm.py restart, which installs --local on the workers.
  assert "there is no file" in _refused(
      "gpu.py", "run", "--workdir=wd", "--config=configs/electra_smal.py", "--dry-run"
  )
  assert "relative to --local" in _refused(
      "tpu_vm.py",
      "restart",
      "--name=p",
      "--zone=z",
      "--accelerator-type=v4-8",
      f"--local={REPO}",
      "--workdir=gs://b/r",
      "--config=configs/electra_smal.py",
      "--dry-run",
  )


def test_electra_jax_joins_the_job_slurm_py_describes(monkeypatch):
  from electra_jax import distributed
  # What srun sets in each task of the script's step (--nodes=4 x --ntasks-per-node=8).
  for name, value in {
      "SLURM_NTASKS": "32",
      "SLURM_JOB_ID": "7",
      "SLURM_STEP_NODELIST": "gpu[01-04]",
      "SLURM_PROCID": "9",
      "SLURM_LOCALID": "1",
  }.items():
    monkeypatch.setenv(name, value)
  assert distributed._multi_host_environment() == "SLURM"


# ---------------------------------------------------------------------------------------
# The Colab notebook
# ---------------------------------------------------------------------------------------
def _notebook():
  with open(os.path.join(LAUNCH, "colab_tpu.ipynb"), encoding="utf-8") as f:
    return json.load(f)


def test_notebook_is_current_and_well_formed():
  with open(os.path.join(LAUNCH, "colab_tpu.ipynb"), encoding="utf-8") as f:
    assert f.read() == make_colab.render(), "run `python launch/make_colab.py`"
  notebook = _notebook()
  assert (notebook["nbformat"], notebook["nbformat_minor"]) == (4, 5)
  code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
  assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)
  install = "".join(code[0]["source"])
  assert install.startswith(make_colab.COLAB_ONLY) and 'REPO_URL = "https://github.com/' in install
  assert len({cell["id"] for cell in notebook["cells"]}) == len(notebook["cells"])


def test_notebook_pretrains_and_evaluates_on_cpu(tmp_path):
  cells = [
      "".join(cell["source"])
      for cell in _notebook()["cells"]
      if cell["cell_type"] == "code" and not cell["source"][0].startswith(make_colab.COLAB_ONLY)
  ]
  runner = (
      "import json, sys\nnamespace = {}\n"
      "for index, source in enumerate(json.load(sys.stdin)):\n"
      "  exec(compile(source, f'cell {index}', 'exec'), namespace)\n"
  )
  # No evaluation during training: the notebook's last cell evaluates the checkpoint.
  overrides = dict(
      TINY_OVERRIDES,
      **{
          "train.steps": 4,
          "train.log_every": 2,
          "checkpoint.every_steps": 4,
          "eval.every_steps": 0,
      },
  )
  env = dict(
      os.environ,
      ELECTRA_JAX_NOTEBOOK_WORKDIR=str(tmp_path / "wd"),
      ELECTRA_JAX_NOTEBOOK_PLOT="0",
      ELECTRA_JAX_NOTEBOOK_OVERRIDES=json.dumps(overrides),
  )
  done = subprocess.run(
      [sys.executable, "-c", runner],
      input=json.dumps(cells),
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "device(s)" in out and f"hidden 32, {TINY_OVERRIDES['model.num_layers']} layers" in out
  # The live view printed each logged step as the run wrote it.
  assert [line.split("|")[0].split() for line in out.splitlines() if line.startswith("step ")] == [
      ["step", "2"],
      ["step", "4"],
  ]
  rows = [json.loads(line) for line in (tmp_path / "wd" / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == [2, 4]
  assert (tmp_path / "wd" / "checkpoints" / "4").is_dir()
  held_out = json.loads((tmp_path / "wd" / "eval_step_4.json").read_text())
  assert "held-out metrics of the checkpoint at step 4" in out
  assert 0.0 <= held_out["disc_auc"] <= 1.0 and held_out["loss"] > 0
  assert f"{held_out['disc_auc']:.4f}" in out
