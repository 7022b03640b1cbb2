"""Shell snippets that start, inspect and stop a detached electra-jax job on a host (a TPU VM
worker, a GPU machine), shared by tpu_vm.py and gpu.py, plus the command-line pieces the
launchers need (overrides, --env, --config checks, packing a local checkout).
A job leaves three files in the directory the snippets run in (the login directory over ssh):
its log, the pid of its process group and, once it ends by itself, its exit status. Each kind
of job (a training run, a data preparation) has its own files, so one of each can run."""

import ast
import dataclasses
import difflib
import os
import re
import shlex
import subprocess
import sys
from typing import Callable, Optional, Sequence

# Printed by status_script, one line per host; parse_status reads them back out of whatever
# else ssh prints around them (banners, gcloud's worker prefixes).
STATUS_MARK = "ELECTRA_JAX_STATUS"
_STATUS_LINE = re.compile(
    STATUS_MARK
    + r" host=(?P<host>\S+) run=(?P<run>\S+) done=(?P<done>[01]) installed=(?P<installed>[01])"
)
# Exits non-zero unless the electra-jax distribution is installed (much faster than pip show).
_INSTALLED_CHECK = "import importlib.metadata as m; m.version('electra-jax')"


@dataclasses.dataclass(frozen=True)
class JobFiles:
  """The files of one kind of job, and what its log says once the job's work is all done (grep
  patterns: a job that exits 0 short of that stopped at a SIGTERM)."""

  log: str = "electra-jax.log"
  pid: str = "electra-jax.pid"
  exit: str = "electra-jax.exit"
  stopped: str = "electra-jax.stopped"  # written by `stop`: a supervisor leaves the run stopped
  # What train.py logs on process 0 when train.steps is reached (now, or by an earlier run).
  done: tuple[str, ...] = ("Done: step", "Nothing to do: the checkpoint")


TRAIN_JOB = JobFiles()
# --mode=prepare_data, which prints this line when every shard is written and checked.
PREPARE_JOB = JobFiles(
    "electra-jax-prepare.log",
    "electra-jax-prepare.pid",
    "electra-jax-prepare.exit",
    "electra-jax-prepare.stopped",
    done=("Prepared [0-9][0-9]* shards in ",),
)


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
  host: str
  run: str  # running | exited:<code> | died (killed, rebooted) | stopped (by `stop`) | none (never started here)
  done: bool  # the log says train.steps was reached
  installed: bool

  @property
  def running(self) -> bool:
    return self.run == "running"

  @property
  def crashed(self) -> bool:
    """Killed, or exited non-zero. A run that exited 0 short of train.steps stopped at a
    SIGTERM (a maintenance event, a preemption notice) and saved."""
    return self.run == "died" or (self.run.startswith("exited:") and self.run != "exited:0")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(launcher arguments, config overrides): the overrides are everything after a `--`."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  cut = argv.index("--")
  return argv[:cut], argv[cut + 1 :]


BASE_RECIPE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.py"
)


def recipe_keys(base_file: str = BASE_RECIPE) -> set[str]:
  """Every GROUP.KEY that configs/base.py assigns, read from its source (the launchers need no
  ml_collections): `config.model = model = ConfigDict()` makes `model` stand for "model"."""
  with open(base_file) as f:
    tree = ast.parse(f.read())
  aliases, keys = {"config": ""}, set()

  def dotted(node) -> Optional[str]:
    if isinstance(node, ast.Name):
      return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
      parent = dotted(node.value)
      return None if parent is None else (f"{parent}.{node.attr}" if parent else node.attr)
    return None

  for node in ast.walk(tree):
    if isinstance(node, ast.Assign):
      paths = [dotted(target) for target in node.targets]
      path = next((p for p in paths if p), None)
      if path is None:
        continue
      keys.add(path)
      for target in node.targets:
        if isinstance(target, ast.Name):
          aliases[target.id] = path
  return keys


def check_overrides(overrides: Sequence[str], base_file: str = BASE_RECIPE) -> Optional[str]:
  """An error message for anything after `--` that is not a --config.KEY=VALUE override of a
  key configs/base.py has (a misspelling would otherwise fail only on the workers, after the
  slice is made and installed)."""
  keys = recipe_keys(base_file) if os.path.isfile(base_file) else None
  for override in overrides:
    if not re.fullmatch(r"--config\.[A-Za-z_][\w.]*=.*", override, flags=re.DOTALL):
      return (
          f"{override!r} is not a config override; after `--` give only --config.GROUP.KEY=VALUE "
          "arguments (e.g. --config.train.batch_size=256)."
      )
    key = override[len("--config.") :].split("=", 1)[0]
    if keys is not None and key not in keys:
      close = difflib.get_close_matches(key, sorted(k for k in keys if "." in k), n=1)
      return (
          f"--config.{key}: the config has no key {key!r}.{f' Did you mean {close[0]!r}?' if close else ''} "
          f"{os.path.relpath(base_file)} lists every key."
      )
  return None


def override_value(overrides: Sequence[str], key: str) -> Optional[str]:
  """The value the last `--config.KEY=VALUE` of `overrides` gives KEY (as ml_collections takes
  it: the last one wins); None when none does."""
  values = [o.split("=", 1)[1] for o in overrides if o.startswith(f"--config.{key}=")]
  return values[-1] if values else None


def missing_config(config: str, root: str, where: str) -> Optional[str]:
  """An error message when `config`, a recipe on this machine, names no file; None when it
  does, or when it is remote (gs://...). A relative path is taken from the directory `root`,
  which `where` describes for the message."""
  if "://" in config:
    return None
  # ml_collections passes anything after the first ":" to the recipe's get_config.
  path = os.path.join(root, config.split(":", 1)[0])
  if os.path.isfile(path):
    return None
  return (
      f"--config={config}: there is no file {os.path.abspath(path)}"
      f"{'' if os.path.isabs(config) else f' ({where})'}. Check the recipe's name (they are in configs/), "
      "or give its full path."
  )


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
  env = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
      raise ValueError(
          f"--env {pair!r} is not NAME=VALUE (e.g. --env XLA_FLAGS=--xla_dump_to=/tmp/dump)."
      )
    env[key] = value
  return env


def train_argv(python: str, config: str, workdir: str, overrides: Sequence[str]) -> list[str]:
  """The training command every process runs; it resumes from `workdir` by itself."""
  return [
      python,
      "-m",
      "electra_jax.main",
      f"--config={config}",
      f"--workdir={workdir}",
      *overrides,
  ]


# What install --local leaves out of a directory that is not a git checkout. A git checkout
# ships exactly the files git sees instead (pack_local).
FALLBACK_EXCLUDES = (".git", "workdirs", "__pycache__", "*.egg-info")


def check_install_source(repo_url: Optional[str], local: Optional[str]) -> None:
  """install takes exactly one of --repo-url and --local, and --local must be a directory."""
  if bool(repo_url) == bool(local):
    raise ValueError(
        "install needs exactly one of --repo-url=URL (with --branch) or --local=CHECKOUT."
    )
  if local and not os.path.isdir(local):
    raise ValueError(
        f"--local={local} is not a directory here; give the electra-jax checkout to install "
        "(e.g. --local=.)."
    )


def is_git_checkout(directory: str) -> bool:
  """Whether `directory` is the top of a git work tree. Somewhere inside a bigger repository
  (a home directory kept in git) that repository's ignore rules would pick what is shipped."""
  try:
    done = subprocess.run(
        ["git", "-C", directory, "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
  except OSError:  # no git on this machine
    return False
  top = done.stdout.strip()
  return done.returncode == 0 and bool(top) and os.path.realpath(top) == os.path.realpath(directory)


def pack_local(directory: str, tarball: str) -> str:
  """A shell pipeline writing a gzipped tarball of the local checkout `directory` to `tarball`
  ("-": stdout); run it under `set -o pipefail`. local_contents says what it holds."""
  directory = os.path.abspath(directory)
  if is_git_checkout(directory):
    # Tracked files plus untracked ones git does not ignore: uncommitted work travels, while a
    # virtualenv, sweeps, prepared data or anything else .gitignore names stays here.
    # --no-recursion: a listed directory (a submodule) does not bring all of its contents.
    listing = [
        "git",
        "-C",
        directory,
        "ls-files",
        "-z",
        "--cached",
        "--others",
        "--exclude-standard",
    ]
    tar = ["tar", "-czf", tarball, "-C", directory, "--null", "--no-recursion", "-T", "-"]
    return f"{shlex.join(listing)} | {shlex.join(tar)}"
  return shlex.join(
      [
          "tar",
          "-czf",
          tarball,
          *(f"--exclude={pattern}" for pattern in FALLBACK_EXCLUDES),
          "-C",
          directory,
          ".",
      ]
  )


def local_contents(directory: str) -> str:
  """What pack_local ships from `directory`, in a line for the user."""
  directory = os.path.abspath(directory)
  if is_git_checkout(directory):
    return f"{directory} is a git checkout: shipping the files git lists (tracked, and untracked but not ignored)."
  return (
      f"{directory} is not a git checkout: shipping all of it but {', '.join(FALLBACK_EXCLUDES)} "
      "(a virtualenv or data inside it goes too)."
  )


def note(line: str, dry_run: bool) -> None:
  """A remark beside the commands: a comment line among a dry run's, on stderr otherwise."""
  print(f"# {line}", file=sys.stdout if dry_run else sys.stderr, flush=True)


def env_command(argv: Sequence[str], env: dict[str, str]) -> str:
  """`argv` as one shell command, run with `env` added to the environment."""
  return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv] if env else list(argv))


def start_script(argv: Sequence[str], env: dict[str, str], files: JobFiles = TRAIN_JOB) -> str:
  """Starts `argv` detached (start_job_script)."""
  return start_job_script(env_command(argv, env), files)


def start_job_script(command: str, files: JobFiles = TRAIN_JOB) -> str:
  """Starts the shell `command` detached (setsid + nohup, stdin from /dev/null), so that ssh can
  hang up, unless a job of its kind started here is still alive. The previous log is kept with a
  time suffix.

  The job is `bash -c` around the command: bash records its pid (its process group, which
  stop_script signals) and the command's exit status. Its SIGTERM trap is a no-op so that it
  outlives the Python process (which saves a checkpoint on SIGTERM) to write that status; a
  trapped signal, unlike an ignored one, is back to its default in the child.
  """
  log, pid, exit_file, stopped = (
      shlex.quote(name) for name in (files.log, files.pid, files.exit, files.stopped)
  )
  job = f"trap : TERM; echo $$ > {pid}; {command}; echo $? > {exit_file}"
  return (
      f'if kill -0 "$(cat {pid} 2>/dev/null)" 2>/dev/null; then '
      f'echo "$(hostname): the job started here with {files.log} is still going (pid $(cat {pid})); '
      'not starting another."; '
      f"else rm -f {exit_file} {pid} {stopped}; "
      f'if [ -f {log} ]; then mv {log} {log}."$(date +%Y%m%d-%H%M%S)"; fi; '
      f"setsid nohup bash -c {shlex.quote(job)} > {log} 2>&1 < /dev/null & "
      f'echo "$(hostname): started, log in $PWD/"{log}; fi'
  )


def status_script(python: str, files: JobFiles = TRAIN_JOB) -> str:
  """Prints one STATUS_MARK line: is the job alive, how did it end, did its log say its work is
  done (`files.done`), is electra-jax installed for `python`."""
  log, pid, exit_file, stopped = (
      shlex.quote(name) for name in (files.log, files.pid, files.exit, files.stopped)
  )
  done_test = " ".join(f"-e {shlex.quote(p)}" for p in files.done)
  return (
      # The exit file is the job's last act (start_script removes an old one), so it wins.
      f'if [ -f {exit_file} ]; then run="exited:$(cat {exit_file})"; '
      f'elif kill -0 "$(cat {pid} 2>/dev/null)" 2>/dev/null; then run=running; '
      f"elif [ -f {pid} ]; then run=died; else run=none; fi; "
      # Ended by `stop` (its mark, until the next start): not a run to restart.
      f'if [ -f {stopped} ] && [ "$run" != running ]; then run=stopped; fi; '
      f"if grep -q {done_test} {log} 2>/dev/null; then done=1; else done=0; fi; "
      f"if {shlex.quote(python)} -c {shlex.quote(_INSTALLED_CHECK)} > /dev/null 2>&1; then installed=1; else installed=0; fi; "
      f'echo "{STATUS_MARK} host=$(hostname) run=$run done=$done installed=$installed"'
  )


def stop_script(grace_seconds: int = 120, files: JobFiles = TRAIN_JOB) -> str:
  """SIGTERM to the run's process group (the run saves a checkpoint and exits), then SIGKILL
  whatever is left after `grace_seconds` (a process stuck in a collective with a dead peer)."""
  pid, stopped = shlex.quote(files.pid), shlex.quote(files.stopped)
  return (
      # The mark first: a `restart` supervising this run sees it and leaves the run stopped.
      f"touch {stopped}; "
      f'p="$(cat {pid} 2>/dev/null)"; '
      f'if [ -n "$p" ] && kill -0 -- "-$p" 2>/dev/null; then '
      f'kill -TERM -- "-$p"; '
      f'for i in $(seq {int(grace_seconds)}); do kill -0 -- "-$p" 2>/dev/null || break; sleep 1; done; '
      f'kill -KILL -- "-$p" 2>/dev/null; echo "$(hostname): stopped"; '
      f'else echo "$(hostname): nothing running"; fi'
  )


def follow_script(lines: int = 200, files: JobFiles = TRAIN_JOB) -> str:
  return f"tail -n {int(lines)} -F {shlex.quote(files.log)}"


def parse_status(output: str) -> list[WorkerStatus]:
  return [
      WorkerStatus(m["host"], m["run"], m["done"] == "1", m["installed"] == "1")
      for m in _STATUS_LINE.finditer(output)
  ]


@dataclasses.dataclass(frozen=True)
class Result:
  returncode: int
  output: str  # stdout, when captured
  error: str = ""  # stderr, when captured (gcloud's notices go there, never into `output`)


Execute = Callable[..., Result]


def make_executor(dry_run: bool, out=None) -> Execute:
  """execute(argv, capture=False) -> Result. A dry run prints each command, shell-quoted, one
  per line, and runs nothing; a real run echoes it to stderr with a `+ ` prefix, then runs it."""

  def execute(argv: Sequence[str], capture: bool = False) -> Result:
    line = shlex.join(argv)
    if dry_run:
      print(line, file=out or sys.stdout)
      return Result(0, "")
    print(f"+ {line}", file=sys.stderr, flush=True)
    if capture:
      done = subprocess.run(list(argv), capture_output=True, text=True)
      return Result(done.returncode, done.stdout, done.stderr)
    return Result(subprocess.run(list(argv)).returncode, "")

  return execute


def run_all(execute: Execute, commands: Sequence[Sequence[str]]) -> int:
  """Runs the commands in order, stopping at the first failure; returns its exit status."""
  for argv in commands:
    result = execute(argv)
    if result.returncode:
      print(
          f"Command failed with exit status {result.returncode}: {shlex.join(argv)}",
          file=sys.stderr,
      )
      return result.returncode
  return 0
