"""The device memory a compiled train step needs (XLA's per-device figures), the largest batch that
fits (`train.batch_size = -1`), and XLA's out of memory as one line naming the batch."""

import contextlib
import dataclasses
import math
import os
import time

import jax
from absl import logging

from electra_jax.errors import ConfigError

# A batch fits only if its step does no more work per example than the first two measured (XLA's
# TPU compiler rematerializes activations to squeeze a larger batch into HBM).
RECOMPUTE_TOLERANCE = 0.02
# The status code of XLA's out of memory (absl's RESOURCE_EXHAUSTED), at compile or run time.
RESOURCE_EXHAUSTED = 8


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out of memory (a device's, or the host's on CPU), by its status code
  (jaxlib 0.6, Python 3.10's, has no `error_code`: the message starts with it)."""
  if not isinstance(error, jax.errors.JaxRuntimeError):
    return False
  if hasattr(error, "error_code"):
    return error.error_code == RESOURCE_EXHAUSTED
  return str(error).startswith("RESOURCE_EXHAUSTED:")


@contextlib.contextmanager
def out_of_memory_named(what: str, fix: str):
  """XLA's out of memory in the block as a one-line ConfigError: `what` ran out, do `fix`."""
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    if not is_out_of_memory(error):
      raise
    device = jax.devices()[0].platform.upper()
    raise ConfigError(f"The {device} device ran out of memory {what}: {fix}.") from None


@dataclasses.dataclass(frozen=True)
class StepMemory:
  batch_size: int
  bytes_per_device: int | None  # the sum of `parts`; None: the compiler refused it as too large
  flops: float | None = None  # XLA's cost analysis per device, which counts what it recomputes
  parts: dict[str, int] = dataclasses.field(default_factory=dict)  # memory_parts of the step


def memory_parts(compiled) -> dict[str, int]:
  """Bytes one device holds for a compiled computation by kind, as XLA's buffer assignment says;
  the donated inputs that outputs reuse count negative."""
  if (m := compiled.memory_analysis()) is None:
    raise ConfigError("This backend reports no memory analysis of a step: set train.batch_size.")
  return {
      "arguments": int(m.argument_size_in_bytes),
      "outputs": int(m.output_size_in_bytes),
      "donated": -int(m.alias_size_in_bytes),
      "temporaries": int(m.temp_size_in_bytes),
      "generated code": int(m.generated_code_size_in_bytes),
  }


def compiled_flops(compiled) -> float | None:
  """FLOPs of a compiled computation per device from XLA's cost analysis, None if not reported."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (not every backend has one)
    return None
  flops = cost.get("flops") if isinstance(cost, dict) else None
  return float(flops) if flops else None


def device_memory_bytes(device: jax.Device | None = None) -> int:
  """Memory of one device: the allocator's limit on GPU/TPU; on CPU its share of the host's."""
  stats = (device or jax.local_devices()[0]).memory_stats()  # None on CPU
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    with open("/proc/meminfo") as f:
      available_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration):
    available_kb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
  return available_kb * 1024 // max(1, jax.local_device_count())


def floor_bytes(setup, micro_batch: int, seq_len: int, batch_shards: int) -> int:
  """A floor under a train step's bytes per device, known before compiling: the state's shards and
  each discriminator layer's input, which the backward pass keeps even with model.remat='full'."""
  state = sum(
      math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
      for leaf in jax.tree.leaves(setup.abstract_state)
  )
  tower, rows = setup.model.discriminator_config, -(-micro_batch // batch_shards)
  return state + tower.num_layers * rows * seq_len * tower.hidden_size * setup.model.dtype.itemsize


def step_memory(compile_step, batch_size: int) -> StepMemory:
  """The per-device bytes of the step `compile_step(batch_size=...)` compiles (a global batch)."""
  start = time.perf_counter()
  try:
    compiled = compile_step(batch_size=batch_size)
  except jax.errors.JaxRuntimeError as e:
    if not is_out_of_memory(e):
      raise
    why = str(e).splitlines()[0][:200]
    logging.info(f"Batch {batch_size}: refused by the compiler as over memory ({why}).")
    return StepMemory(batch_size, None)
  parts, flops = memory_parts(compiled), compiled_flops(compiled)
  size = sum(parts.values())
  cost = "no cost analysis" if flops is None else f"{flops / 1e9:,.1f} GFLOPs"
  seconds = time.perf_counter() - start
  logging.info(f"Batch {batch_size}: {size / 2**30:.2f} GiB per device, {cost} ({seconds:.0f} s).")
  return StepMemory(batch_size, size, flops, parts)


def linear_fit(small: StepMemory, large: StepMemory, of: str = "bytes_per_device"):
  """(fixed, per_example >= 1) of `of` = fixed + per_example * batch through two measurements."""
  low, high = getattr(small, of), getattr(large, of)
  per_example = max(1.0, (high - low) / (large.batch_size - small.batch_size))
  return low - per_example * small.batch_size, per_example


def fit_of(measured: list[StepMemory]) -> tuple[float, float] | None:
  """The linear fit through the two smallest measured batches that compiled (None: fewer)."""
  sized = sorted(
      (m for m in measured if m.bytes_per_device is not None), key=lambda m: m.batch_size
  )
  return linear_fit(sized[0], sized[1]) if len(sized) >= 2 else None


def largest_batch(compile_step, limit_bytes: int, quantum: int) -> tuple[int, list[StepMemory]]:
  """(the largest multiple of `quantum` whose step fits in `limit_bytes` a device, the
  measurements): guesses along the line through the largest fits, then bisection. Fitting only by
  recomputing is not fitting; ConfigError when not even `quantum` fits."""
  measured, fitting = [], []  # every measurement; those that fit

  def fits(batch: int) -> bool:
    m = step_memory(compile_step, batch)
    measured.append(m)
    if m.bytes_per_device is None or m.bytes_per_device > limit_bytes:
      return False
    if len(measured) > 2 and None not in (measured[0].flops, measured[1].flops, m.flops):
      # How far m's FLOPs exceed the line through the first two compiles', as a fraction of it.
      fixed, per_example = linear_fit(*measured[:2], of="flops")
      predicted = fixed + per_example * m.batch_size
      if predicted > 0 and (more := m.flops / predicted - 1) > RECOMPUTE_TOLERANCE:
        logging.info(
            f"Batch {batch}: XLA recomputes {more:.0%} more of the step than the first two "
            "compiles' line predicts, to fit it in memory: taken as not fitting."
        )
        return False
    fitting.append(m)
    return True

  if not fits(quantum):
    needs = measured[0].bytes_per_device
    needs = "more than a device's memory" if needs is None else f"{needs / 2**30:.2f} GiB a device"
    raise ConfigError(
        f"Even a batch of {quantum} needs {needs}, more than the {limit_bytes / 2**30:.2f} GiB "
        "allowed: use a smaller model or max_seq_len, bfloat16, or more devices."
    )
  # The largest batch known to fit, the smallest known not to.
  low, high = (4 * quantum, None) if fits(4 * quantum) else (quantum, 4 * quantum)
  while high is None or high - low > quantum:
    if high is None:
      # XLA's layout is not even monotonic in the batch: the slope is at least a quarter of the
      # chord from the smallest batch, and the guess at most 8 x low.
      _, chord = linear_fit(fitting[0], fitting[-1])
      per_example = max(linear_fit(fitting[-2], fitting[-1])[1], chord / 4)
      last = fitting[-1]
      guess = int((limit_bytes - last.bytes_per_device) / per_example + last.batch_size)
      candidate = max(low + quantum, min(guess // quantum * quantum, 8 * low))
    else:
      candidate = min(max(low + quantum, (low + high) // 2 // quantum * quantum), high - quantum)
    low, high = (candidate, high) if fits(candidate) else (low, candidate)
  if fit := fit_of(measured):
    logging.info("Memory per device: %.1f MiB + %.3f MiB per example.", *(f / 2**20 for f in fit))
  logging.info(
      "Largest batch %d (limit %.2f GiB, %d compiles).", low, limit_bytes / 2**30, len(measured)
  )
  return low, measured
