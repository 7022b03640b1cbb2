"""How much device memory a training step needs, and the largest batch that fits.

XLA reports, for a compiled step, the bytes of its arguments, outputs (the donated state aliases
its input) and temporaries, per device. The temporaries grow linearly with the batch (the
activations), so two compiles give bytes(batch) = fixed + per_example * batch, and a third
checks the prediction. `train.batch_size = -1` asks `train.prepare` for the largest multiple of
the batch shards that fits in `train.memory_fraction` of a device's memory.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from absl import logging

from electra_jax.config_lib import ConfigError


@dataclasses.dataclass(frozen=True)
class StepMemory:
  batch_size: int
  bytes_per_device: int  # arguments + outputs - donated (aliased) + temporaries


def compiled_bytes(compiled) -> int:
  """Peak bytes one device holds for a compiled computation, as XLA's buffer assignment says."""
  m = compiled.memory_analysis()
  if m is None:
    raise ConfigError("This backend reports no memory analysis for compiled steps; set train.batch_size.")
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def device_memory_bytes(device: jax.Device | None = None) -> int:
  """Memory of one device: the allocator's limit on GPU/TPU; on CPU the host's available
  memory shared by its local devices."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    with open("/proc/meminfo") as f:
      available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration):
    available_kb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
  return available_kb * 1024 // max(1, jax.local_device_count())


def step_memory(config, setup, mesh, batch_size: int) -> StepMemory:
  """Compiles the train step for `batch_size` (global) and returns its per-device bytes."""
  from electra_jax import partitioning, train  # noqa: PLC0415 (train imports this module)

  sized = config.copy_and_resolve_references()
  sized.train.batch_size = batch_size
  with partitioning.activate(mesh):
    compiled = train.compile_train_step(setup, sized, mesh)
  return StepMemory(batch_size, compiled_bytes(compiled))


def largest_batch(config, setup, mesh, limit_bytes: int, quantum: int) -> tuple[int, list[StepMemory]]:
  """The largest multiple of `quantum` whose step fits in `limit_bytes` per device, with the
  measurements taken on the way. Raises ConfigError when not even `quantum` fits."""
  small, large = step_memory(config, setup, mesh, quantum), step_memory(config, setup, mesh, 4 * quantum)
  measured = [small, large]
  if small.bytes_per_device > limit_bytes:
    raise ConfigError(
        f"Even a batch of {quantum} needs {small.bytes_per_device / 2**30:.2f} GiB per device, more than "
        f"the {limit_bytes / 2**30:.2f} GiB allowed: use a smaller model or max_seq_len, bfloat16, "
        "or more devices."
    )
  per_example = max(1.0, (large.bytes_per_device - small.bytes_per_device) / (3 * quantum))
  fixed = small.bytes_per_device - per_example * quantum
  candidate = max(quantum, int((limit_bytes - fixed) / per_example) // quantum * quantum)
  # The fit is linear, XLA's buffer layout not quite: walk from the prediction to the last
  # multiple of `quantum` that fits (usually one or two more compiles).
  check = step_memory(config, setup, mesh, candidate)
  measured.append(check)
  while check.bytes_per_device > limit_bytes and candidate > quantum:
    candidate = max(quantum, int(candidate * 0.95) // quantum * quantum if candidate > 20 * quantum
                    else candidate - quantum)
    check = step_memory(config, setup, mesh, candidate)
    measured.append(check)
  for _ in range(8):  # then upwards while the next one still fits
    above = step_memory(config, setup, mesh, candidate + quantum)
    measured.append(above)
    if above.bytes_per_device > limit_bytes:
      break
    candidate, check = candidate + quantum, above
  logging.info(
      "Memory per device: %.1f MiB fixed + %.3f MiB per example; largest batch %d (%.2f of %.2f GiB).",
      fixed / 2**20, per_example / 2**20, candidate, check.bytes_per_device / 2**30, limit_bytes / 2**30,
  )
  return candidate, measured
