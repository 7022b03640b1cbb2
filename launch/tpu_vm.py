"""Check that a run fits a Cloud TPU VM slice, create the slice, install electra-jax on every
worker, prepare a corpus once into a bucket, start one run on all workers, follow it, and keep
it going through preemptions. Only the standard library and gcloud.

  python launch/tpu_vm.py fit     --accelerator-type=v5litepod-16 --config=configs/electra_base.py
  python launch/tpu_vm.py create  --name=NAME --zone=ZONE --accelerator-type=v4-32 [--spot | --queued]
  python launch/tpu_vm.py install --name=NAME --zone=ZONE --repo-url=https://github.com/OWNER/electra-jax
  python launch/tpu_vm.py prepare --name=NAME --zone=ZONE --prepared-dir=gs://BUCKET/prepared \\
      [--copy-corpus=gs://BUCKET/raw] -- --config.data.source=text --config.data.files='corpus/*.txt'
  python launch/tpu_vm.py run     --name=NAME --zone=ZONE --workdir=gs://BUCKET/run \\
      --prepared-dir=gs://BUCKET/prepared -- --config.train.steps=1000
  python launch/tpu_vm.py follow | status | stop  --name=NAME --zone=ZONE [--job=prepare]
  python launch/tpu_vm.py delete  --name=NAME --zone=ZONE
  python launch/tpu_vm.py restart (all of create's, install's and run's flags)

Every subcommand takes --dry-run: it prints the exact commands, one per line, and runs nothing.
Each worker keeps a job's log, pid and exit status in its home directory (remote_job.py).
"""

import argparse
import os
import re
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Sibling files, found wherever the script is run from.
import remote_job  # noqa: E402
import tpu_commands  # noqa: E402
import tpu_supervisor  # noqa: E402

_JOBS = {"train": remote_job.TRAIN_JOB, "prepare": remote_job.PREPARE_JOB}
_TAKE_OVERRIDES = ("fit", "prepare", "run", "restart")


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

  slice_type = argparse.ArgumentParser(add_help=False)
  slice_type.add_argument(
      "--accelerator-type",
      help="e.g. v4-32, v5litepod-16, v5p-64, v6e-16 (run: lets a one-host slice keep local paths)",
  )

  create = argparse.ArgumentParser(add_help=False)
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
  install.add_argument(
      "--extra",
      action="append",
      default=[],
      help="an extra of electra-jax beside gcs, e.g. hf_datasets (repeatable)",
  )

  recipe = argparse.ArgumentParser(add_help=False)
  recipe.add_argument(
      "--config", default="configs/electra_small.py", help="recipe, relative to the checkout"
  )
  recipe.add_argument(
      "--env", action="append", default=[], metavar="NAME=VALUE", help="environment of the job"
  )

  run = argparse.ArgumentParser(add_help=False)
  run.add_argument("--workdir", help="where checkpoints and metrics go, typically gs://BUCKET/RUN")
  run.add_argument(
      "--prepared-dir", help="train on the shards `prepare` wrote there (gs://BUCKET/...)"
  )

  job = argparse.ArgumentParser(add_help=False)
  job.add_argument(
      "--job", choices=sorted(_JOBS), default="train", help="the training run, or `prepare`"
  )
  job.add_argument(
      "--worker", help="the worker to act on (default: 0; status and stop of the run: all)"
  )

  parser = argparse.ArgumentParser(
      prog="tpu_vm.py",
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Config overrides follow a `--`: ... run --workdir=gs://b/r -- --config.train.steps=1000",
  )
  sub = parser.add_subparsers(dest="command", required=True)
  fit = sub.add_parser(
      "fit",
      parents=[slice_type, recipe],
      help="compile the run for the slice here: memory per chip, and whether it fits",
  )
  fit.add_argument(
      "--topology", help="--mode=compile's name for the slice (default: from the type)"
  )
  fit.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
  sub.add_parser("create", parents=[common, slice_type, create], help="create the slice")
  sub.add_parser(
      "install", parents=[common, software, install], help="install electra-jax on every worker"
  )
  prepare = sub.add_parser(
      "prepare",
      parents=[common, software, recipe],
      help="tokenize and pack the corpus into a bucket, once, on one worker, detached",
  )
  prepare.add_argument("--prepared-dir", required=True, help="where the shards go: gs://BUCKET/...")
  prepare.add_argument(
      "--copy-corpus", help="a bucket folder copied to the VM first (gcloud storage rsync)"
  )
  prepare.add_argument(
      "--corpus-dir", default="corpus", help="where --copy-corpus goes on the VM (from $HOME)"
  )
  prepare.add_argument("--worker", default="0", help="the worker that prepares")
  prepare.add_argument("--workers", type=int, help="processes (default: one per core of the VM)")
  sub.add_parser(
      "run",
      parents=[common, software, slice_type, recipe, run],
      help="start the run on every worker, detached",
  )
  follow = sub.add_parser("follow", parents=[common, job], help="tail a worker's log")
  follow.add_argument("--lines", type=int, default=200)
  sub.add_parser(
      "status", parents=[common, software, job], help="slice state and each worker's job"
  )
  stop = sub.add_parser(
      "stop", parents=[common, job], help="stop the job (the run saves a checkpoint first)"
  )
  stop.add_argument("--grace-seconds", type=int, default=120)
  sub.add_parser("delete", parents=[common], help="delete the slice (or its queued resource)")
  restart = sub.add_parser(
      "restart",
      parents=[common, slice_type, create, software, install, recipe, run],
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


def _check(args, overrides: Sequence[str]) -> None:
  """Refuses, by a ValueError naming the value and the fix, what would fail only on the
  workers; nothing has run yet."""
  command = args.command
  if overrides and command not in _TAKE_OVERRIDES:
    raise ValueError(
        f"config overrides after `--` only go with {', '.join(_TAKE_OVERRIDES)}, not {command}."
    )
  if (problem := remote_job.check_overrides(overrides)) is not None:
    raise ValueError(problem)
  if command != "fit":
    if not args.zone.strip() or not args.name.strip():
      raise ValueError(f"--zone={args.zone!r} and --name={args.name!r} must not be empty.")
    if args.queued_id and not args.queued:
      raise ValueError(
          f"--queued-id={args.queued_id} names a queued resource: add --queued (without it the "
          "commands act on a plain TPU VM node)."
      )
  if getattr(args, "valid_until_duration", None) and not args.queued:
    raise ValueError("--valid-until-duration only applies to --queued slices.")
  for flag, value, least in (
      ("--poll-seconds", getattr(args, "poll_seconds", 1), 1),
      ("--grace-seconds", getattr(args, "grace_seconds", 0), 0),
      ("--max-restarts", getattr(args, "max_restarts", 0), 0),
      ("--lines", getattr(args, "lines", 1), 1),
      ("--workers", getattr(args, "workers", None) or 0, 0),
  ):
    if value < least:
      raise ValueError(f"{flag}={value} must be >= {least}.")
  remote_job.parse_env(getattr(args, "env", []))
  for extra in getattr(args, "extra", []):
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", extra):
      raise ValueError(f"--extra={extra!r}: give the name of one extra, e.g. --extra=hf_datasets.")
  job, worker = getattr(args, "job", None), getattr(args, "worker", None)
  if worker is not None and job == "train" and command != "follow":
    raise ValueError(
        f"--worker={worker}: the run spans every worker, and {command} acts on all of them "
        "(--worker picks the worker of --job=prepare)."
    )
  if worker is not None and "prepare" in (command, job) and not re.fullmatch(r"\d+", worker):
    raise ValueError(f"--worker={worker}: the preparation runs on one worker; give its number.")

  if command == "fit":
    if not args.accelerator_type and not args.topology:
      raise ValueError("fit needs --accelerator-type (e.g. v5litepod-16), the slice to fit.")
    where = "relative to the current directory, where fit compiles"
    if (problem := remote_job.missing_config(args.config, ".", where)) is not None:
      raise ValueError(problem)
  if command == "prepare":
    _check_prepare(args, overrides)
  if command in ("run", "restart"):
    _check_training(args, overrides)


def _check_prepare(args, overrides: Sequence[str]) -> None:
  """The preparation writes to a bucket, from a corpus."""
  if not args.prepared_dir.startswith("gs://"):
    raise ValueError(
        f"--prepared-dir={args.prepared_dir}: prepare writes the shards once for every worker "
        "of the slice to read, so they go to a bucket: give --prepared-dir=gs://BUCKET/NAME."
    )
  if args.copy_corpus is not None and not args.copy_corpus.startswith("gs://"):
    raise ValueError(
        f"--copy-corpus={args.copy_corpus}: give the bucket folder that holds the corpus, "
        "gs://BUCKET/PATH (a corpus already on the VM needs no copy: name it in data.files)."
    )
  if remote_job.override_value(overrides, "data.prepared_dir") is not None:
    raise ValueError("--config.data.prepared_dir: prepare takes it as --prepared-dir=gs://...")
  if remote_job.override_value(overrides, "data.source") == "prepared":
    raise ValueError(
        "--config.data.source=prepared names shards already prepared; prepare reads a corpus "
        "(text, jsonl, tfds, hf_datasets or builtin)."
    )


def _check_training(args, overrides: Sequence[str]) -> None:
  """Every worker of the slice reads the same workdir and shards."""
  if not args.workdir:
    raise ValueError(f"{args.command} needs --workdir (e.g. gs://BUCKET/electra-small-1).")
  tpu_commands.check_shared("--workdir", args.workdir, args.accelerator_type)
  if args.prepared_dir:
    for key in ("data.source", "data.prepared_dir"):
      if remote_job.override_value(overrides, key) is not None:
        raise ValueError(
            f"--config.{key}: --prepared-dir={args.prepared_dir} sets data.source and "
            "data.prepared_dir; drop the override."
        )
    tpu_commands.check_shared("--prepared-dir", args.prepared_dir, args.accelerator_type)
  elif (prepared := remote_job.override_value(overrides, "data.prepared_dir")) is not None:
    tpu_commands.check_shared("--config.data.prepared_dir", prepared, args.accelerator_type)


def main(argv: Optional[Sequence[str]] = None, execute: Optional[remote_job.Execute] = None) -> int:
  own_args, overrides = remote_job.split_overrides(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(own_args)
  try:
    _check(args, overrides)
  except ValueError as error:
    parser.error(str(error))
  execute = execute or remote_job.make_executor(args.dry_run)
  command = args.command
  if command == "fit":
    return remote_job.run_all(
        execute,
        [tpu_commands.fit_argv(args.accelerator_type, args.config, overrides, args.topology)],
    )

  tpu = tpu_commands.Slice(
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
  recipe = dict(
      config=getattr(args, "config", ""),
      overrides=tuple(overrides),
      env=tuple(remote_job.parse_env(getattr(args, "env", [])).items()),
  )
  install = tpu_commands.Install(
      getattr(args, "repo_url", None),
      getattr(args, "branch", "main"),
      getattr(args, "local", None),
      jax_package=getattr(args, "jax_package", "jax[tpu]"),
      extras=("gcs", *getattr(args, "extra", [])),
      **software,
  )
  job = _JOBS[getattr(args, "job", "train")]
  # One worker for the preparation; the run's status and stop act on every worker.
  worker = getattr(args, "worker", None) or ("all" if job is remote_job.TRAIN_JOB else "0")

  try:
    if command == "create":
      return remote_job.run_all(execute, tpu.create())
    if command == "install":
      commands = install.commands(tpu)
      if install.local:
        remote_job.note(remote_job.local_contents(install.local), args.dry_run)
      return remote_job.run_all(execute, commands)
    if command == "prepare":
      prepare = tpu_commands.Prepare(
          args.prepared_dir,
          worker=args.worker,
          workers=args.workers,
          copy_corpus=args.copy_corpus,
          corpus_dir=args.corpus_dir,
          **recipe,
          **software,
      )
      return remote_job.run_all(execute, prepare.start(tpu))
    if command == "follow":
      script = remote_job.follow_script(args.lines, job)
      return remote_job.run_all(execute, [tpu.ssh(script, worker=args.worker or "0")])
    if command == "status":
      script = remote_job.status_script(args.python, job)
      return remote_job.run_all(execute, tpu.describe() + [tpu.ssh(script, worker=worker)])
    if command == "stop":
      script = remote_job.stop_script(args.grace_seconds, job)
      return remote_job.run_all(execute, [tpu.ssh(script, worker=worker)])
    if command == "delete":
      return remote_job.run_all(execute, tpu.delete())

    run = tpu_commands.Run(args.workdir, prepared_dir=args.prepared_dir, **recipe, **software)
    if command == "run":
      return remote_job.run_all(execute, run.start(tpu))
    # restart: refuse flags that would only fail after a preemption, before anything runs.
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
      tpu_supervisor.supervise_dry_run(tpu, install, run, execute)
      return 0
    return tpu_supervisor.supervise(
        tpu, install, run, execute, args.poll_seconds, args.max_restarts
    )
  except ValueError as error:
    parser.error(str(error))


if __name__ == "__main__":
  sys.exit(main())
