"""Write (and optionally submit) an sbatch script for a multi-node GPU run of electra-jax.

  python launch/slurm.py --nodes=4 --gpus-per-node=8 --workdir=/shared/runs/small \\
      [--partition=P --account=A --time=24:00:00 --chain=3] [--submit | --dry-run] \\
      -- --config.train.batch_size=1024

One task per GPU: JAX's SLURM detection (which electra-jax's distributed.initialize relies
on) gives each task the GPU numbered SLURM_LOCALID, so every task must see all of its node's
GPUs (--gpus-per-node, no per-task binding). The tasks find each other from SLURM's variables.
Before the time limit, SLURM sends SIGTERM (--signal): the run saves a checkpoint and exits;
--chain=K queues K more jobs, each starting after the previous one ends, each resuming from the
workdir. --dry-run prints the script and the submit commands and writes nothing.
"""

import argparse
import os
import shlex
import subprocess
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remote_job  # noqa: E402

# The checkout this script belongs to (launch/..).
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sbatch_script(args, overrides: Sequence[str]) -> str:
  directives = [
      f"--job-name={args.job_name}",
      f"--nodes={args.nodes}",
      f"--ntasks-per-node={args.gpus_per_node}",
      f"--gpus-per-node={args.gpus_per_node}",
      f"--cpus-per-task={args.cpus_per_task}",
      f"--time={args.time}",
      f"--output={os.path.join(args.log_dir, '%x-%j.out')}",
      "--open-mode=append",
      # SIGTERM to every task this long before the time limit: the run checkpoints and exits 0.
      f"--signal=TERM@{args.signal_seconds}",
      "--requeue",  # a preempted job goes back to the queue and resumes from the workdir
  ]
  directives += [f"--partition={args.partition}"] * bool(args.partition)
  directives += [f"--account={args.account}"] * bool(args.account)
  directives += list(args.sbatch_arg)
  for directive in directives:  # sbatch splits #SBATCH lines at whitespace; a newline would end one
    _, equals, value = directive.partition("=")
    if (equals and not value) or any(c.isspace() or not c.isprintable() for c in directive):
      raise ValueError(
          f"#SBATCH {directive!r}: each directive's value must be non-empty and have no spaces "
          "or control characters: sbatch reads #SBATCH lines word by word."
      )
  workdir = args.workdir if "://" in args.workdir else os.path.abspath(args.workdir)
  config = args.config if "://" in args.config else os.path.abspath(args.config)
  train = remote_job.train_argv(args.python, config, workdir, overrides)
  env = remote_job.parse_env(args.env)
  lines = (
      ["#!/bin/bash"]
      + [f"#SBATCH {d}" for d in directives]
      + [
          "# Written by launch/slurm.py. Submitting it again resumes from the workdir.",
          "set -eo pipefail",
      ]
  )
  lines += list(args.setup)  # e.g. `source ~/venvs/electra/bin/activate`, `module load cuda`
  lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
  lines += [
      'echo "job $SLURM_JOB_ID: $SLURM_NNODES nodes x $SLURM_NTASKS_PER_NODE tasks on $SLURM_JOB_NODELIST"',
      # --kill-on-bad-exit: one failed task ends the step rather than leaving the others
      # waiting in a collective until the time limit. --cpus-per-task again: Slurm 22.05-23.02's
      # srun does not take it from the allocation, and the data loader would get one core.
      f"srun --kill-on-bad-exit=1 --cpus-per-task={args.cpus_per_task} " + shlex.join(train),
  ]
  return "\n".join(lines) + "\n"


def submit_commands(script_path: str, chain: int) -> list[str]:
  """Shell lines: the first submission, then `chain` more, each after the previous one ends."""
  lines = [f"jobid=$(sbatch --parsable {shlex.quote(script_path)})"]
  lines += [
      f"jobid=$(sbatch --parsable --dependency=afterany:$jobid {shlex.quote(script_path)})"
  ] * chain
  return lines


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="slurm.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--workdir", required=True, help="on a filesystem every node sees (or gs://)")
  parser.add_argument("--config", default="configs/electra_small.py")
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--gpus-per-node", type=int, default=8)
  parser.add_argument("--cpus-per-task", type=int, default=8)
  parser.add_argument("--time", default="24:00:00")
  parser.add_argument("--partition")
  parser.add_argument("--account")
  parser.add_argument("--job-name", default="electra-jax")
  parser.add_argument("--log-dir", default="slurm-logs")
  parser.add_argument(
      "--signal-seconds", type=int, default=300, help="SIGTERM this long before the limit"
  )
  parser.add_argument("--python", default="python3")
  parser.add_argument("--setup", action="append", default=[], help="a shell line run before srun")
  parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
  parser.add_argument("--sbatch-arg", action="append", default=[], help="another #SBATCH directive")
  parser.add_argument("--script", default="electra-jax.sbatch", help="where to write the script")
  parser.add_argument("--chain", type=int, default=0, help="queue this many follow-up jobs")
  parser.add_argument("--submit", action="store_true", help="submit it with sbatch")
  parser.add_argument("--dry-run", action="store_true", help="print the script and submit commands")
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  own_args, overrides = remote_job.split_overrides(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(own_args)
  if (problem := remote_job.check_overrides(overrides)) is not None:
    parser.error(problem)
  if not args.log_dir:
    parser.error("--log-dir='' must name a directory for the jobs' logs.")
  # The job writes its log there from the directory it is submitted from: make it absolute now.
  args.log_dir = os.path.abspath(args.log_dir)
  if args.nodes < 1 or args.gpus_per_node < 1 or args.chain < 0:
    parser.error(
        f"--nodes={args.nodes} and --gpus-per-node={args.gpus_per_node} must be >= 1, "
        f"--chain={args.chain} >= 0."
    )
  # The script names the recipe by its absolute path from here; refuse one that is not there
  # now rather than let every task of a queued job fail on it later.
  where = f"taken from the current directory, {os.getcwd()}"
  if (problem := remote_job.missing_config(args.config, ".", where)) is not None:
    own = os.path.join(_CHECKOUT, args.config)
    if not os.path.isabs(args.config) and os.path.isfile(own):  # run from outside the checkout
      problem += (
          f" slurm.py's checkout has {own}: run slurm.py from {_CHECKOUT}, or pass --config={own}."
      )
    parser.error(problem)
  try:
    script = sbatch_script(args, overrides)
  except ValueError as error:
    parser.error(str(error))
  submit = submit_commands(args.script, args.chain)
  if args.dry_run:
    print(f"# {args.script}")
    print(script, end="")
    print("# submit with:")
    print("\n".join(submit))
    return 0
  tmp = f"{args.script}.tmp"
  with open(tmp, "w") as f:
    f.write(script)
  os.replace(tmp, args.script)
  os.makedirs(args.log_dir, exist_ok=True)
  print(f"Wrote {args.script}.")
  if not args.submit:
    print("Submit it with:\n" + "\n".join(submit))
    return 0
  return subprocess.run(
      ["bash", "-c", "set -e; " + "; ".join(submit) + '; echo "last job: $jobid"']
  ).returncode


if __name__ == "__main__":
  sys.exit(main())
