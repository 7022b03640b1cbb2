"""Create a Cloud TPU VM slice, install electra-jax on every worker, start one run on all of them,
follow it, and keep it going through preemptions. Only the standard library and gcloud.

  python launch/tpu_vm.py create  --name=NAME --zone=ZONE --accelerator-type=v4-32 [--spot | --queued]
  python launch/tpu_vm.py install --name=NAME --zone=ZONE --repo-url=https://github.com/OWNER/electra-jax
  python launch/tpu_vm.py run     --name=NAME --zone=ZONE --workdir=gs://BUCKET/run -- --config.train.steps=1000
  python launch/tpu_vm.py follow | status | stop | delete  --name=NAME --zone=ZONE
  python launch/tpu_vm.py restart (all of create's, install's and run's flags)

Every subcommand takes --dry-run: it prints the exact commands, one per line, and runs nothing.
Each worker keeps its run's log, pid and exit status in its home directory (remote_job.py).
"""

import argparse
import dataclasses
import os
import shlex
import sys
import time
from typing import Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remote_job  # noqa: E402  (a sibling file, found wherever the script is run from)

# The TPU software versions Google recommends for JAX, by accelerator generation.
_RUNTIME_VERSIONS = (
    ("v6e", "v2-alpha-tpuv6e"),
    ("v5p", "v2-alpha-tpuv5"),
    ("v5litepod", "v2-alpha-tpuv5-lite"),
    ("v5e", "v2-alpha-tpuv5-lite"),
)
_DEFAULT_RUNTIME = "tpu-ubuntu2204-base"  # v4 and older

# Node states (`gcloud compute tpus tpu-vm describe`) and queued-resource states.
NODE_GONE = {"PREEMPTED", "TERMINATED", "MISSING"}
NODE_STOPPED = {"STOPPED", "STOPPING"}
QUEUED_GONE = {"SUSPENDING", "SUSPENDED", "MISSING"}
QUEUED_FAILED = "FAILED"  # refused, or --valid-until-duration ran out: not retried


def default_runtime_version(accelerator_type: str) -> str:
  for prefix, version in _RUNTIME_VERSIONS:
    if accelerator_type.startswith(prefix):
      return version
  return _DEFAULT_RUNTIME


@dataclasses.dataclass(frozen=True)
class Slice:
  """One TPU VM slice (a node of one or more workers), optionally owned by a queued resource."""

  name: str
  zone: str
  project: Optional[str] = None
  accelerator_type: Optional[str] = None
  version: Optional[str] = None
  spot: bool = False
  queued: bool = False
  queued_id: Optional[str] = None
  valid_until_duration: Optional[str] = None

  @property
  def queued_resource(self) -> str:
    return self.queued_id or self.name

  def _scope(self) -> list[str]:
    return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])

  def _tpus(self, *words: str) -> list[str]:
    return ["gcloud", "compute", "tpus", *words]

  def create(self) -> list[list[str]]:
    if not self.accelerator_type:
      raise ValueError("create needs --accelerator-type (e.g. v4-32, v5litepod-16).")
    version = self.version or default_runtime_version(self.accelerator_type)
    if self.queued:
      argv = self._tpus(
          "queued-resources",
          "create",
          self.queued_resource,
          f"--node-id={self.name}",
          *self._scope(),
          f"--accelerator-type={self.accelerator_type}",
          f"--runtime-version={version}",
      )
      if self.valid_until_duration:
        argv.append(f"--valid-until-duration={self.valid_until_duration}")
    else:
      argv = self._tpus(
          "tpu-vm",
          "create",
          self.name,
          *self._scope(),
          f"--accelerator-type={self.accelerator_type}",
          f"--version={version}",
      )
    return [argv + (["--spot"] if self.spot else [])]

  def delete(self) -> list[list[str]]:
    if self.queued:  # --force also deletes the node the queued resource holds
      return [
          self._tpus(
              "queued-resources",
              "delete",
              self.queued_resource,
              *self._scope(),
              "--force",
              "--quiet",
          )
      ]
    return [self._tpus("tpu-vm", "delete", self.name, *self._scope(), "--quiet")]

  def describe_node(self) -> list[str]:
    return self._tpus("tpu-vm", "describe", self.name, *self._scope(), "--format=value(state)")

  def describe_queued(self) -> list[str]:
    return self._tpus(
        "queued-resources",
        "describe",
        self.queued_resource,
        *self._scope(),
        "--format=value(state.state)",
    )

  def ssh(self, command: str, worker: str = "all") -> list[str]:
    return self._tpus(
        "tpu-vm", "ssh", self.name, *self._scope(), f"--worker={worker}", f"--command={command}"
    )

  def scp(self, source: str, destination: str, worker: str = "all") -> list[str]:
    return self._tpus(
        "tpu-vm", "scp", source, f"{self.name}:{destination}", *self._scope(), f"--worker={worker}"
    )


@dataclasses.dataclass(frozen=True)
class Install:
  """electra-jax from a git URL (cloned on each worker) or a local checkout (copied as a
  tarball: of a git checkout, the files git lists). The checkout stays on the worker: the
  recipes in configs/ are read from it."""

  repo_url: Optional[str] = None
  branch: str = "main"
  local: Optional[str] = None
  remote_dir: str = "electra-jax"
  python: str = "python3"
  jax_package: str = "jax[tpu]"

  def commands(self, tpu: Slice) -> list[list[str]]:
    remote_job.check_install_source(self.repo_url, self.local)
    remote_dir, staging = shlex.quote(self.remote_dir), shlex.quote(self.remote_dir + ".new")
    # pip needs a path, not a bare name, to install a directory.
    package_dir = self.remote_dir if os.path.isabs(self.remote_dir) else f"./{self.remote_dir}"
    # The gcs extra (gcsfs, google-cloud-storage): workdirs on a slice live in a gs:// bucket.
    pip = shlex.join(
        [self.python, "-m", "pip", "install", "--upgrade", self.jax_package, f"{package_dir}[gcs]"]
    )
    if self.repo_url:
      fetch = shlex.join(
          [
              "git",
              "clone",
              "--depth=1",
              f"--branch={self.branch}",
              self.repo_url,
              self.remote_dir + ".new",
          ]
      )
      script = f"set -e; rm -rf {staging}; {fetch}; rm -rf {remote_dir}; mv {staging} {remote_dir}; {pip}"
      return [tpu.ssh(script)]
    tarball = f"electra-jax-src-{tpu.name}.tar.gz"
    local_tarball = os.path.join("/tmp", tarball)
    pack = ["bash", "-c", "set -o pipefail; " + remote_job.pack_local(self.local, local_tarball)]
    unpack = (
        f"set -e; rm -rf {staging}; mkdir -p {staging}; tar -xzf {shlex.quote(tarball)} -C {staging}; "
        f"rm -rf {remote_dir}; mv {staging} {remote_dir}; {pip}"
    )
    return [pack, tpu.scp(local_tarball, tarball), tpu.ssh(unpack)]


@dataclasses.dataclass(frozen=True)
class Run:
  """The one training command every worker runs; JAX joins the slice's workers by itself."""

  workdir: str
  config: str = "configs/electra_small.py"
  overrides: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  remote_dir: str = "electra-jax"
  python: str = "python3"

  def argv(self) -> list[str]:
    # A relative --config names a recipe in the installed checkout.
    config = self.config if os.path.isabs(self.config) else f"{self.remote_dir}/{self.config}"
    return remote_job.train_argv(self.python, config, self.workdir, self.overrides)

  def start(self, tpu: Slice) -> list[list[str]]:
    # Every worker joins one JAX job: TPU VMs describe the slice only through their metadata
    # server, which jax.distributed.initialize() reads when electra-jax is told to call it.
    env = {"ELECTRA_JAX_DISTRIBUTED": "auto", **dict(self.env)}
    return [tpu.ssh(remote_job.start_script(self.argv(), env))]


# ---------------------------------------------------------------------------------------
# Supervision: poll, and bring the run back after a preemption or a crash
# ---------------------------------------------------------------------------------------
def slice_state(tpu: Slice, execute: remote_job.Execute) -> str:
  """The node's state (READY, CREATING, PREEMPTED...), MISSING when it does not exist, the
  queued resource's state while it holds no active node, UNKNOWN when gcloud failed otherwise."""

  def ask(argv):
    result = execute(argv, capture=True)
    if result.returncode:
      text = (result.output + result.error).lower()
      return "MISSING" if ("not_found" in text or "not found" in text) else "UNKNOWN"
    # The state is gcloud's stdout; its notices ("Updates are available ...") are on stderr.
    return result.output.strip().splitlines()[-1].strip() if result.output.strip() else "UNKNOWN"

  if tpu.queued:
    queued_state = ask(tpu.describe_queued())
    if queued_state != "ACTIVE":
      return queued_state
  return ask(tpu.describe_node())


def decide(state: str, workers: Optional[list[remote_job.WorkerStatus]], queued: bool) -> str:
  """What the supervisor does next, from the slice's state and each worker's run:
  recreate | wait | stopped | stopped_run | failed | install_and_run | run | stop_and_run | finished.
  """
  if queued and state == QUEUED_FAILED:
    return "failed"
  if state in (QUEUED_GONE if queued else set()) | NODE_GONE:
    return "recreate"
  if state in NODE_STOPPED:
    return "stopped"  # someone stopped it on purpose; do not override that
  if state != "READY" or not workers:
    return "wait"  # creating, queued, repairing, or ssh not answering yet
  if any(w.run == "stopped" for w in workers) and not any(w.running for w in workers):
    return "stopped_run"  # someone ran `stop`: leave it so
  if not all(w.installed for w in workers):
    return "install_and_run"
  if all(w.running for w in workers):
    return "wait"
  if not any(w.running for w in workers):
    # train.py logs "Done" on process 0 only; the others just exit 0.
    return "finished" if any(w.done for w in workers) else "run"
  return "stop_and_run"  # a dead peer: the others are stuck in collectives


def supervise(
    tpu: Slice,
    install: Install,
    run: Run,
    execute: remote_job.Execute,
    poll_seconds: float = 120.0,
    max_restarts: int = 20,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
  """Keeps `run` going on `tpu` until it reaches train.steps: recreates the slice after a
  preemption, installs, starts the same command (which resumes from the workdir), and
  restarts the run when a worker died. Returns 0 when done, 1 when it gives up: after
  `max_restarts` restarts of runs that ended on a live slice (a crash at startup, a bad
  override) or failed installs, after `max_restarts` failed creates in a row (a wrong zone or
  type, no quota; a stockout that lasts), or when a queued resource FAILED. Preemptions do not
  count: a spot run may see many."""
  failures = failed_creates = 0
  watched = False  # a run this supervisor started or saw running
  while True:
    state = slice_state(tpu, execute)
    workers = None
    if state == "READY":
      workers = remote_job.parse_status(
          execute(tpu.ssh(remote_job.status_script(run.python)), capture=True).output
      )
    action = decide(state, workers, tpu.queued)
    if action == "stopped_run" and not watched:
      action = "run"  # stopped before this restart began: restarting it is what was asked
    watched = watched or any(w.running for w in workers or [])
    summary = ", ".join(f"{w.host}={w.run}" for w in workers or [])
    log(
        f"[{time.strftime('%H:%M:%S')}] slice {tpu.name}: {state}{' | ' + summary if summary else ''} -> {action}"
    )

    if action == "finished":
      log("The run reached train.steps.")
      return 0
    if action == "failed":
      log(
          f"The queued resource {tpu.name} FAILED (refused, or --valid-until-duration ran out): "
          f"`gcloud compute tpus queued-resources describe {tpu.name} --zone={tpu.zone}` says why. "
          "Delete it, then create it or run restart again."
      )
      return 1
    if action == "stopped_run":
      log(
          f"The run on {tpu.name} was stopped with `stop` (it saved a checkpoint): leaving it stopped. "
          "`run` or `restart` starts it again from its workdir."
      )
      return 0
    if action == "stopped":
      log(
          f"{tpu.name} is {state}: someone stopped it. Start it (gcloud compute tpus tpu-vm start) or "
          "delete it, then run restart again."
      )
      return 1
    if action == "recreate":
      if state != "MISSING":
        remote_job.run_all(execute, tpu.delete())
      if remote_job.run_all(execute, tpu.create()) == 0:
        failed_creates = 0
      else:  # capacity may be short: retried at the next poll, a bounded number of times
        failed_creates += 1
        if failed_creates > max_restarts:
          log(
              f"Gave up after {failed_creates} failed creates in a row; the gcloud errors above say why."
          )
          return 1
    elif action in ("install_and_run", "run", "stop_and_run"):
      if action != "install_and_run" and any(w.crashed for w in workers):  # on a slice still there
        failures += 1
        if failures > max_restarts:
          log(
              f"Gave up after {max_restarts} restarts; read the worker logs (follow) for the cause."
          )
          return 1
      if any(w.running for w in workers):
        # A dead peer (stop_and_run), or a reimaged worker that lost electra-jax while the
        # others still run (the install would replace the checkout under them): the live ones
        # would wait on it forever. Stop them first.
        execute(tpu.ssh(remote_job.stop_script()))
      if action != "install_and_run" or remote_job.run_all(execute, install.commands(tpu)) == 0:
        remote_job.run_all(execute, run.start(tpu))
        watched = True
      else:
        failures += 1
    sleep(poll_seconds)


def supervise_dry_run(tpu: Slice, install: Install, run: Run, execute: remote_job.Execute) -> None:
  print("# restart polls every --poll-seconds with:")
  if tpu.queued:
    execute(tpu.describe_queued())
  execute(tpu.describe_node())
  execute(tpu.ssh(remote_job.status_script(run.python)))
  print("# when the slice is preempted (or missing), it recreates it, installs and starts the run:")
  for argv in tpu.delete() + tpu.create() + install.commands(tpu) + run.start(tpu):
    execute(argv)
  print(
      "# when a worker's run died while others still run, it stops them and starts the run again:"
  )
  execute(tpu.ssh(remote_job.stop_script()))
  for argv in run.start(tpu):
    execute(argv)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--name", required=True, help="the TPU VM (node) name")
  common.add_argument("--zone", required=True, help="e.g. us-central2-b (v4), us-west4-a (v5e)")
  common.add_argument("--project", help="Google Cloud project (default: gcloud's configured one)")
  common.add_argument(
      "--queued", action="store_true", help="the slice comes from a queued resource"
  )
  common.add_argument("--queued-id", help="the queued resource's id (default: --name)")
  common.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")

  create = argparse.ArgumentParser(add_help=False)
  create.add_argument("--accelerator-type", help="e.g. v4-32, v5litepod-16, v5p-64, v6e-16")
  create.add_argument(
      "--version", help="TPU software version (default: Google's JAX choice for the type)"
  )
  create.add_argument("--spot", action="store_true", help="Spot capacity: cheaper, preemptible")
  create.add_argument(
      "--valid-until-duration", help="queued: give up waiting after this long, e.g. 6h"
  )

  software = argparse.ArgumentParser(add_help=False)
  software.add_argument(
      "--remote-dir", default="electra-jax", help="the checkout on each worker (in $HOME)"
  )
  software.add_argument("--python", default="python3", help="the workers' Python")

  install = argparse.ArgumentParser(add_help=False)
  install.add_argument("--repo-url", help="git URL to clone on every worker")
  install.add_argument("--branch", default="main")
  install.add_argument("--local", help="a local checkout to copy to every worker instead")
  install.add_argument("--jax-package", default="jax[tpu]", help="pip requirement for JAX")

  run = argparse.ArgumentParser(add_help=False)
  run.add_argument("--workdir", help="where checkpoints and metrics go, typically gs://BUCKET/RUN")
  run.add_argument(
      "--config", default="configs/electra_small.py", help="recipe, relative to the checkout"
  )
  run.add_argument(
      "--env", action="append", default=[], metavar="NAME=VALUE", help="environment of the run"
  )

  parser = argparse.ArgumentParser(
      prog="tpu_vm.py",
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Config overrides follow a `--`: ... run --workdir=gs://b/r -- --config.train.steps=1000",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("create", parents=[common, create], help="create the slice")
  sub.add_parser(
      "install", parents=[common, software, install], help="install electra-jax on every worker"
  )
  sub.add_parser(
      "run", parents=[common, software, run], help="start the run on every worker, detached"
  )
  follow = sub.add_parser("follow", parents=[common], help="tail a worker's log")
  follow.add_argument("--worker", default="0")
  follow.add_argument("--lines", type=int, default=200)
  sub.add_parser("status", parents=[common, software], help="slice state and each worker's run")
  stop = sub.add_parser(
      "stop", parents=[common], help="stop the run on every worker (it saves first)"
  )
  stop.add_argument("--grace-seconds", type=int, default=120)
  sub.add_parser("delete", parents=[common], help="delete the slice (or its queued resource)")
  restart = sub.add_parser(
      "restart",
      parents=[common, create, software, install, run],
      help="supervise: recreate, reinstall and resume until train.steps",
  )
  restart.add_argument("--poll-seconds", type=float, default=120.0)
  restart.add_argument(
      "--max-restarts",
      type=int,
      default=20,
      help="give up after this many restarts of a crashed run (preemptions do not count)",
  )
  return parser


def main(argv: Optional[Sequence[str]] = None, execute: Optional[remote_job.Execute] = None) -> int:
  own_args, overrides = remote_job.split_overrides(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(own_args)
  if overrides and args.command not in ("run", "restart"):
    parser.error(f"config overrides after `--` only go with run and restart, not {args.command}.")
  if (problem := remote_job.check_overrides(overrides)) is not None:
    parser.error(problem)
  if getattr(args, "valid_until_duration", None) and not args.queued:
    parser.error("--valid-until-duration only applies to --queued slices.")
  if args.queued_id and not args.queued:
    parser.error(
        f"--queued-id={args.queued_id} names a queued resource: add --queued (without it the "
        "commands act on a plain TPU VM node)."
    )
  if not args.zone.strip() or not args.name.strip():
    parser.error(f"--zone={args.zone!r} and --name={args.name!r} must not be empty.")
  for flag, value, least in (
      ("--poll-seconds", getattr(args, "poll_seconds", 1), 1),
      ("--grace-seconds", getattr(args, "grace_seconds", 0), 0),
      ("--max-restarts", getattr(args, "max_restarts", 0), 0),
      ("--lines", getattr(args, "lines", 1), 1),
  ):
    if value < least:
      parser.error(f"{flag}={value} must be >= {least}.")
  if args.command in ("run", "restart") and not args.workdir:
    parser.error(f"{args.command} needs --workdir (e.g. gs://BUCKET/electra-small-1).")
  try:
    env = tuple(remote_job.parse_env(getattr(args, "env", [])).items())
  except ValueError as error:
    parser.error(str(error))
  execute = execute or remote_job.make_executor(args.dry_run)

  tpu = Slice(
      args.name,
      args.zone,
      args.project,
      getattr(args, "accelerator_type", None),
      getattr(args, "version", None),
      getattr(args, "spot", False),
      args.queued,
      args.queued_id,
      getattr(args, "valid_until_duration", None),
  )
  software = dict(
      remote_dir=getattr(args, "remote_dir", "electra-jax"),
      python=getattr(args, "python", "python3"),
  )
  install = Install(
      getattr(args, "repo_url", None),
      getattr(args, "branch", "main"),
      getattr(args, "local", None),
      jax_package=getattr(args, "jax_package", "jax[tpu]"),
      **software,
  )
  run = Run(
      getattr(args, "workdir", None) or "",
      getattr(args, "config", ""),
      tuple(overrides),
      env,
      **software,
  )

  try:
    if args.command == "create":
      return remote_job.run_all(execute, tpu.create())
    if args.command == "install":
      commands = install.commands(tpu)
      if install.local:
        remote_job.note(remote_job.local_contents(install.local), args.dry_run)
      return remote_job.run_all(execute, commands)
    if args.command == "run":
      return remote_job.run_all(execute, run.start(tpu))
    if args.command == "follow":
      return remote_job.run_all(
          execute, [tpu.ssh(remote_job.follow_script(args.lines), worker=args.worker)]
      )
    if args.command == "status":
      commands = ([tpu.describe_queued()] if tpu.queued else []) + [tpu.describe_node()]
      return remote_job.run_all(execute, commands + [tpu.ssh(remote_job.status_script(run.python))])
    if args.command == "stop":
      return remote_job.run_all(execute, [tpu.ssh(remote_job.stop_script(args.grace_seconds))])
    if args.command == "delete":
      return remote_job.run_all(execute, tpu.delete())
    if args.command == "restart":
      # Refuse flags that would only fail after a preemption, before anything runs.
      install.commands(tpu)
      tpu.create()
      # The workers read a relative recipe from their copy of --local, so a typo can be caught
      # here rather than by a crash on every worker. (The checkout that `run` or --repo-url
      # uses is not on this machine: those are not checked.)
      if install.local and not os.path.isabs(run.config):
        where = f"relative to --local={install.local}, the checkout the workers get"
        if (problem := remote_job.missing_config(run.config, install.local, where)) is not None:
          parser.error(problem)
      if install.local:
        remote_job.note(remote_job.local_contents(install.local), args.dry_run)
      if args.dry_run:
        supervise_dry_run(tpu, install, run, execute)
        return 0
      return supervise(tpu, install, run, execute, args.poll_seconds, args.max_restarts)
  except ValueError as error:
    parser.error(str(error))
  raise AssertionError(args.command)


if __name__ == "__main__":
  sys.exit(main())
