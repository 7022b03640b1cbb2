"""The command lines for one Cloud TPU VM slice: create and delete it, install electra-jax on its
workers, prepare a corpus once on one worker, start the training run on every worker, and the
fit check that compiles the run for the slice on this machine. Only the standard library."""

import dataclasses
import os
import re
import shlex
from typing import Optional

import remote_job

# The TPU software versions Google recommends for JAX, by accelerator generation.
_RUNTIME_VERSIONS = (
    ("v6e", "v2-alpha-tpuv6e"),
    ("v5p", "v2-alpha-tpuv5"),
    ("v5litepod", "v2-alpha-tpuv5-lite"),
    ("v5e", "v2-alpha-tpuv5-lite"),
)
_DEFAULT_RUNTIME = "tpu-ubuntu2204-base"  # v4 and older


def default_runtime_version(accelerator_type: str) -> str:
  for prefix, version in _RUNTIME_VERSIONS:
    if accelerator_type.startswith(prefix):
      return version
  return _DEFAULT_RUNTIME


def is_single_host(accelerator_type: Optional[str]) -> bool:
  """Whether gcloud's `accelerator_type` is a slice of one host: 8 cores or chips at most (v4-8,
  v5p-8, v5litepod-8, v6e-4). An unknown or missing type counts as several hosts."""
  match = re.fullmatch(r"v\d+[a-z]*-(\d+)", accelerator_type or "")
  return bool(match) and int(match.group(1)) <= 8


def check_shared(flag: str, value: str, accelerator_type: Optional[str]) -> None:
  """Every worker of a slice reads the same workdir and shards: a path on each worker's own disk
  is refused unless the slice has one host."""
  if value.startswith("gs://") or is_single_host(accelerator_type):
    return
  hosts = (
      f"--accelerator-type={accelerator_type} has several hosts"
      if accelerator_type
      else "the slice may have several hosts (no --accelerator-type says it has one)"
  )
  raise ValueError(
      f"{flag}={value} is a path on each worker's own disk, but {hosts}, and every worker must "
      f"read the same files: give a bucket path, e.g. {flag}=gs://BUCKET/NAME"
      + (
          "."
          if accelerator_type
          else " (a one-host slice may keep it: add its --accelerator-type)."
      )
  )


def compile_topology(accelerator_type: str) -> str:
  """The slice as --mode=compile's --topology names it (gcloud's v5e types are v5litepod-N)."""
  return re.sub(r"^v5litepod-", "v5e-", accelerator_type)


def fit_argv(accelerator_type: str, config: str, overrides, topology: Optional[str] = None):
  """The fit check, run here: the train step compiled for every chip of the slice, its memory
  per chip against the chip's HBM (pip install 'electra-jax[tpu-compile]')."""
  return [
      "electra-jax",
      "--mode=compile",
      f"--topology={topology or compile_topology(accelerator_type)}",
      f"--config={config}",
      *overrides,
  ]


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

  def describe(self) -> list[list[str]]:
    """The slice's state, and its queued resource's first when it has one."""
    return ([self.describe_queued()] if self.queued else []) + [self.describe_node()]

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
  # gcs (gcsfs, google-cloud-storage): the workdir and the shards of a slice live in a bucket.
  extras: tuple[str, ...] = ("gcs",)

  def commands(self, tpu: Slice) -> list[list[str]]:
    remote_job.check_install_source(self.repo_url, self.local)
    remote_dir, staging = shlex.quote(self.remote_dir), shlex.quote(self.remote_dir + ".new")
    # pip needs a path, not a bare name, to install a directory.
    package_dir = self.remote_dir if os.path.isabs(self.remote_dir) else f"./{self.remote_dir}"
    package = f"{package_dir}[{','.join(dict.fromkeys(self.extras))}]"
    pip = shlex.join([self.python, "-m", "pip", "install", "--upgrade", self.jax_package, package])
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


def _recipe(remote_dir: str, config: str) -> str:
  """A relative --config names a recipe in the checkout install left on the worker."""
  return config if os.path.isabs(config) else f"{remote_dir}/{config}"


@dataclasses.dataclass(frozen=True)
class Run:
  """The one training command every worker runs; JAX joins the slice's workers by itself. With
  `prepared_dir` it trains on the shards `Prepare` wrote there."""

  workdir: str
  config: str = "configs/electra_small.py"
  overrides: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  remote_dir: str = "electra-jax"
  python: str = "python3"
  prepared_dir: Optional[str] = None

  def argv(self) -> list[str]:
    shards = (
        ["--config.data.source=prepared", f"--config.data.prepared_dir={self.prepared_dir}"]
        if self.prepared_dir
        else []
    )
    return remote_job.train_argv(
        self.python,
        _recipe(self.remote_dir, self.config),
        self.workdir,
        [*self.overrides, *shards],
    )

  def start(self, tpu: Slice) -> list[list[str]]:
    # Every worker joins one JAX job: TPU VMs describe the slice only through their metadata
    # server, which jax.distributed.initialize() reads when electra-jax is told to call it.
    env = {"ELECTRA_JAX_DISTRIBUTED": "auto", **dict(self.env)}
    return [tpu.ssh(remote_job.start_script(self.argv(), env))]


@dataclasses.dataclass(frozen=True)
class Prepare:
  """--mode=prepare_data once, on one worker, detached: the corpus the overrides describe (on
  that VM, or first copied there from `copy_corpus`, a bucket folder, into `corpus_dir`)
  tokenized and packed into `prepared_dir`, a bucket every worker of the slice reads, by
  `workers` processes (None: one per core of the VM). Re-running it resumes."""

  prepared_dir: str
  config: str = "configs/electra_small.py"
  overrides: tuple[str, ...] = ()
  env: tuple[tuple[str, str], ...] = ()
  remote_dir: str = "electra-jax"
  python: str = "python3"
  worker: str = "0"
  workers: Optional[int] = None
  copy_corpus: Optional[str] = None
  corpus_dir: str = "corpus"

  def command(self) -> str:
    argv = [
        self.python,
        "-m",
        "electra_jax.main",
        "--mode=prepare_data",
        f"--config={_recipe(self.remote_dir, self.config)}",
        *self.overrides,
        f"--config.data.prepared_dir={self.prepared_dir}",
    ]
    # nproc on the VM: the cores this job may use there.
    workers = '--workers="$(nproc)"' if self.workers is None else f"--workers={int(self.workers)}"
    # One process on the VM's CPU: --mode=prepare_data joins no JAX job and takes no TPU.
    command = f"{remote_job.env_command(argv, dict(self.env))} {workers}"
    if self.copy_corpus:
      # rsync copies only what the VM lacks: a re-run after a preemption resumes the copy too.
      copy = ["gcloud", "storage", "rsync", "--recursive", self.copy_corpus, self.corpus_dir]
      command = f"mkdir -p {shlex.quote(self.corpus_dir)} && {shlex.join(copy)} && {command}"
    return command

  def start(self, tpu: Slice) -> list[list[str]]:
    script = remote_job.start_job_script(self.command(), remote_job.PREPARE_JOB)
    return [tpu.ssh(script, worker=self.worker)]
