"""Run electra-jax on one multi-GPU host, this one or another over ssh: one process drives every
GPU it sees (no coordinator needed), detached so that it survives the terminal or ssh session.

  python launch/gpu.py install [--host=USER@HOST] (--repo-url=URL [--branch=B] | --local=CHECKOUT)
  python launch/gpu.py run     [--host=USER@HOST] --workdir=DIR [--gpus=0,1,2,3] -- --config.train.batch_size=256
  python launch/gpu.py follow | status | stop  [--host=USER@HOST]

Every subcommand takes --dry-run (print the commands, run nothing). Re-running `run` after a
crash or a reboot resumes from the workdir's latest checkpoint. Several hosts: use slurm.py, or
start the same run on each host with --coordinator_address/--num_processes/--process_id.
"""

import argparse
import os
import re
import shlex
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remote_job  # noqa: E402


def on_host(host: Optional[str], script: str, job_dir: str) -> list[str]:
  """argv running `script` in the job directory: over ssh in the login directory, or here."""
  if host:
    return ["ssh", host, script]
  return ["bash", "-c", f"mkdir -p {shlex.quote(job_dir)} && cd {shlex.quote(job_dir)} && {script}"]


def install_commands(args) -> list[list[str]]:
  remote_job.check_install_source(args.repo_url, args.local)
  pip = [args.python, "-m", "pip", "install", "--upgrade", args.jax_package]
  if not args.host:  # this machine: install the checkout where it is
    checkout = os.path.abspath(args.local) if args.local else os.path.abspath(args.remote_dir)
    if args.local:
      return [pip + [checkout]]
    # Cloned beside the old checkout, which is replaced only once the clone succeeded (so a
    # second install updates it rather than failing on an existing directory).
    staging = checkout + ".new"
    clone = shlex.join(
        ["git", "clone", "--depth=1", f"--branch={args.branch}", args.repo_url, staging]
    )
    replace = (
        f"set -e; rm -rf {shlex.quote(staging)}; {clone}; rm -rf {shlex.quote(checkout)}; "
        f"mv {shlex.quote(staging)} {shlex.quote(checkout)}"
    )
    return [["bash", "-c", replace], pip + [checkout]]
  remote_dir = shlex.quote(args.remote_dir)
  package_dir = args.remote_dir if os.path.isabs(args.remote_dir) else f"./{args.remote_dir}"
  remote_pip = shlex.join(pip + [package_dir])
  staging = shlex.quote(args.remote_dir + ".new")
  if args.local:
    # A tarball streamed over ssh into a fresh directory, as a clone would be: exactly the files
    # pack_local picks (of a git checkout, those git lists), nothing left from an older copy.
    unpack = (
        f"set -e; rm -rf {staging}; mkdir -p {staging}; tar -xzf - -C {staging}; "
        f"rm -rf {remote_dir}; mv {staging} {remote_dir}"
    )
    copy = f"set -o pipefail; {remote_job.pack_local(args.local, '-')} | {shlex.join(['ssh', args.host, unpack])}"
    return [["bash", "-c", copy], ["ssh", args.host, remote_pip]]
  clone = shlex.join(
      [
          "git",
          "clone",
          "--depth=1",
          f"--branch={args.branch}",
          args.repo_url,
          args.remote_dir + ".new",
      ]
  )
  return [
      [
          "ssh",
          args.host,
          f"set -e; rm -rf {staging}; {clone}; rm -rf {remote_dir}; mv {staging} {remote_dir}; {remote_pip}",
      ]
  ]


def run_command(args, overrides: Sequence[str]) -> list[str]:
  if args.host:  # a relative recipe path names one in the checkout on that host
    config = args.config if os.path.isabs(args.config) else f"{args.remote_dir}/{args.config}"
    workdir = args.workdir
  else:  # the job directory may differ from the current one: make local paths absolute
    config = args.config
    in_checkout = os.path.join(args.remote_dir, config)
    if not os.path.isabs(config) and not os.path.exists(config) and os.path.exists(in_checkout):
      config = in_checkout  # a recipe of the checkout `install --repo-url` made here
    # Refused here: the detached job would only say so in its log.
    where = f"looked for in the current directory, then in --remote-dir={args.remote_dir}"
    if (problem := remote_job.missing_config(config, ".", where)) is not None:
      raise ValueError(problem)
    config = config if "://" in config else os.path.abspath(config)
    workdir = args.workdir if "://" in args.workdir else os.path.abspath(args.workdir)
  env = remote_job.parse_env(args.env)
  if args.gpus:
    env["CUDA_VISIBLE_DEVICES"] = args.gpus
  argv = remote_job.train_argv(args.python, config, workdir, overrides)
  return on_host(args.host, remote_job.start_script(argv, env), args.job_dir)


def _parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--host", help="ssh destination (USER@HOST); default: this machine")
  common.add_argument(
      "--job-dir", default=".", help="local runs: where the log, pid and exit files go"
  )
  common.add_argument("--python", default="python3")
  common.add_argument(
      "--remote-dir", default="electra-jax", help="the checkout (on --host: in its $HOME)"
  )
  common.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")

  parser = argparse.ArgumentParser(
      prog="gpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = parser.add_subparsers(dest="command", required=True)
  install = sub.add_parser("install", parents=[common], help="install electra-jax with CUDA JAX")
  install.add_argument("--repo-url")
  install.add_argument("--branch", default="main")
  install.add_argument(
      "--local", help="a local checkout (copied to --host: of a git checkout, the files git lists)"
  )
  install.add_argument("--jax-package", default="jax[cuda12]")
  run = sub.add_parser("run", parents=[common], help="start the run, detached")
  run.add_argument("--workdir", required=True)
  run.add_argument("--config", default="configs/electra_small.py")
  run.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3 (default: all)")
  run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
  follow = sub.add_parser("follow", parents=[common], help="tail the log")
  follow.add_argument("--lines", type=int, default=200)
  sub.add_parser("status", parents=[common], help="is the run alive, how did it end")
  stop = sub.add_parser("stop", parents=[common], help="stop the run (it saves a checkpoint first)")
  stop.add_argument("--grace-seconds", type=int, default=120)
  return parser


def main(argv: Optional[Sequence[str]] = None, execute: Optional[remote_job.Execute] = None) -> int:
  own_args, overrides = remote_job.split_overrides(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(own_args)
  if overrides and args.command != "run":
    parser.error(f"config overrides after `--` only go with run, not {args.command}.")
  if (problem := remote_job.check_overrides(overrides)) is not None:
    parser.error(problem)
  gpus = getattr(args, "gpus", None)
  if gpus is not None and not re.fullmatch(r"[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*", gpus):
    parser.error(
        f"--gpus={gpus!r}: give GPU indices (or UUIDs) separated by commas and no spaces, "
        "e.g. --gpus=0,1,2,3; leave it out to use every GPU."
    )
  execute = execute or remote_job.make_executor(args.dry_run)
  try:
    if args.command == "install":
      commands = install_commands(args)
      if args.local and args.host:
        remote_job.note(remote_job.local_contents(args.local), args.dry_run)
    elif args.command == "run":
      commands = [run_command(args, overrides)]
    elif args.command == "follow":
      commands = [on_host(args.host, remote_job.follow_script(args.lines), args.job_dir)]
    elif args.command == "status":
      commands = [on_host(args.host, remote_job.status_script(args.python), args.job_dir)]
    else:
      commands = [on_host(args.host, remote_job.stop_script(args.grace_seconds), args.job_dir)]
  except ValueError as error:
    parser.error(str(error))
  return remote_job.run_all(execute, commands)


if __name__ == "__main__":
  sys.exit(main())
