"""Joining a multi-process JAX job before anything touches the devices: by explicit settings (flags,
ELECTRA_JAX_*), or JAX's own detection on SLURM and multi-host TPU slices."""

import os
import urllib.request

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from electra_jax import xla_flags
from electra_jax.errors import ConfigError


def _multi_host_environment() -> str | None:
  """The scheduler JAX reads its coordinator from, when this is one of several processes
  (launch/tpu_vm.py sets ELECTRA_JAX_DISTRIBUTED=auto; GKE sets TPU_WORKER_HOSTNAMES); else None."""
  if os.environ.get("ELECTRA_JAX_DISTRIBUTED", "").lower() == "auto":
    return "ELECTRA_JAX_DISTRIBUTED=auto (JAX's own cluster detection)"
  # A task of an srun step (SLURM_NTASKS alone is also set in an salloc shell, where no peers join).
  slurm_step = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and set(slurm_step) <= set(os.environ):
    return "SLURM"
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
    return "a multi-host TPU slice on GKE"
  # A TPU VM slice's workers: only the metadata server's worker-network-endpoints (as JAX reads).
  if not xla_flags.tpu_chips_present():
    return None
  host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
  request = urllib.request.Request(
      f"http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
      headers={"Metadata-Flavor": "Google"},
  )
  try:
    with urllib.request.urlopen(request, timeout=10) as response:
      workers = [worker for worker in response.read().decode().split(",") if worker.strip()]
  except (OSError, ValueError):  # no answer: one host
    return None
  return "a multi-host Cloud TPU VM slice (its metadata server)" if len(workers) > 1 else None


def _from_env(value, name: str):
  """`value`, or else the whole number in $name (None when that is unset too)."""
  if value is not None or not os.environ.get(name):
    return value
  try:
    return int(os.environ[name])
  except ValueError:
    raise ConfigError(f"{name}={os.environ[name]!r} is not a whole number.") from None


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> None:
  """Call once, before anything touches the devices: the arguments, else the ELECTRA_JAX_*
  variables, else the scheduler _multi_host_environment finds."""
  coordinator_address = coordinator_address or os.environ.get("ELECTRA_JAX_COORDINATOR_ADDRESS")
  num_processes = _from_env(num_processes, "ELECTRA_JAX_NUM_PROCESSES")
  process_id = _from_env(process_id, "ELECTRA_JAX_PROCESS_ID")
  explicit = (coordinator_address, num_processes, process_id)
  if any(value is not None for value in explicit):
    if any(value is None for value in explicit):
      raise ConfigError(
          f"A multi-process run needs all of coordinator_address={coordinator_address!r}, "
          f"num_processes={num_processes!r} and process_id={process_id!r} (flags or ELECTRA_JAX_*)."
      )
    if not 0 <= process_id < num_processes:
      raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes}).")
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
      raise ConfigError(
          f"coordinator_address={coordinator_address!r} must be HOST:PORT (process 0's address, a "
          "free port every process reaches), e.g. 10.0.0.2:1234."
      )
    # The CPU backend's cross-process collectives (local runs, tests); GPU and TPU ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif (scheduler := _multi_host_environment()) is not None:
    logging.info("Joining the multi-process job described by %s.", scheduler)
    jax.distributed.initialize()
  else:
    return
  counts = (jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  logging.info("Process %d of %d, %d local and %d global devices.", *counts)


def from_process_0(value: int) -> int:
  """`value` as process 0 has it, on every process (one process: `value`)."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
