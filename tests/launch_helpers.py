"""What the launch tests share: the launch/ scripts loaded as modules, their dry runs and
refusals run as a user runs them, and stand-ins (ssh, python, gcloud) that record what reaches
them."""

import contextlib
import importlib.util
import io
import os
import shlex
import subprocess
import sys
import time

import pytest
from conftest import REPO

LAUNCH = os.path.join(REPO, "launch")


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"launch_{name}", os.path.join(LAUNCH, f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


tpu_vm, tpu_commands, tpu_supervisor, remote_job, make_colab = (
    _load(name) for name in ("tpu_vm", "tpu_commands", "tpu_supervisor", "remote_job", "make_colab")
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


def _commands(*args):
  """The commands `tpu_vm.py ARGS` runs, recorded in this process instead of run."""
  recorded = []

  def record(argv, capture=False):
    recorded.append(list(argv))
    return remote_job.Result(0, "")

  assert tpu_vm.main(list(args), execute=record) == 0
  return recorded


def _refusal(*args):
  """What `tpu_vm.py ARGS` says on refusing them, in this process; it must have run nothing."""
  recorded, stderr, stdout = [], io.StringIO(), io.StringIO()
  with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
    with pytest.raises(SystemExit) as exit_info:
      tpu_vm.main(list(args), execute=lambda *call, **_: recorded.append(call))
  assert exit_info.value.code == 2 and recorded == [] and not stdout.getvalue()
  return stderr.getvalue()


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


def _bash(script, cwd, env=None):
  return subprocess.run(
      ["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60, env=env
  ).stdout


def _recorder(directory, name, body=""):
  """An executable `name` in `directory` that writes its argv and the ELECTRA_JAX_* and JAX_*
  variables it got to NAME.json where it runs, then runs `body`."""
  record = (
      "import json, os, sys; json.dump({'argv': sys.argv[1:], 'env': {k: v for k, v in "
      "os.environ.items() if k.startswith(('ELECTRA_JAX_', 'JAX_'))}}, "
      f"open({name + '.json'!r}, 'w'))"
  )
  path = os.path.join(directory, name)
  with open(path, "w") as f:
    f.write(
        f'#!/usr/bin/env bash\n{shlex.quote(sys.executable)} -c {shlex.quote(record)} "$@"\n{body}\n'
    )
  os.chmod(path, 0o755)
  return path


def _wait_for(predicate, timeout=20.0):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    time.sleep(0.1)
  return False
