"""How much device memory a training step needs, and the largest batch that fits.

XLA reports, for a compiled step, the bytes of its arguments, outputs (the donated state aliases
its input) and temporaries, per device. The temporaries grow linearly with the batch (the
activations), so two compiles give bytes(batch) = fixed + per_example * batch, whose prediction
`largest_batch` then checks by bracketing and bisection. `train.batch_size = -1` asks
`train.prepare` for the largest multiple of the batch shards that fits in
`train.memory_fraction` of a device's memory.
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


def linear_fit(small: StepMemory, large: StepMemory) -> tuple[float, float]:
  """(fixed, per_example) bytes of bytes(batch) = fixed + per_example * batch through two
  measurements; per_example at least one byte (a step's memory never shrinks with the batch)."""
  per_example = max(1.0, (large.bytes_per_device - small.bytes_per_device) / (large.batch_size - small.batch_size))
  return small.bytes_per_device - per_example * small.batch_size, per_example


def largest_batch(config, setup, mesh, limit_bytes: int, quantum: int) -> tuple[int, list[StepMemory]]:
  """The largest multiple of `quantum` whose step fits in `limit_bytes` per device, with the
  measurements taken on the way. Raises ConfigError when not even `quantum` fits.

  Two compiles give a linear fit, whose prediction is the first guess; XLA's buffer layout is
  not quite linear, so the answer is then bracketed (galloping up while guesses fit) and
  bisected down to one quantum: a handful of compiles."""
  measured: list[StepMemory] = []

  def fits(batch: int) -> bool:
    measured.append(step_memory(config, setup, mesh, batch))
    return measured[-1].bytes_per_device <= limit_bytes

  if not fits(quantum):
    raise ConfigError(
        f"Even a batch of {quantum} needs {measured[0].bytes_per_device / 2**30:.2f} GiB per device, "
        f"more than the {limit_bytes / 2**30:.2f} GiB allowed: use a smaller model or max_seq_len, "
        "bfloat16, or more devices."
    )
  low, high = quantum, None  # the largest known to fit, the smallest known not to
  if fits(4 * quantum):
    low = 4 * quantum
  else:
    high = 4 * quantum
  fixed, per_example = linear_fit(measured[0], measured[1])
  guess = int((limit_bytes - fixed) / per_example) // quantum * quantum
  step = max(quantum, guess // 20 // quantum * quantum)
  while high is None or high - low > quantum:
    if high is None:
      candidate = max(guess, low + quantum)
    else:
      candidate = max(low + quantum, (low + high) // 2 // quantum * quantum)
      candidate = min(candidate, high - quantum)
    if fits(candidate):
      low = candidate
      guess, step = candidate + step, 2 * step  # gallop up until a guess does not fit
    else:
      high = candidate
  logging.info(
      "Memory per device: %.1f MiB fixed + %.3f MiB per example; largest batch %d (limit %.2f GiB, "
      "%d compiles).", fixed / 2**20, per_example / 2**20, low, limit_bytes / 2**30, len(measured),
  )
  return low, measured
