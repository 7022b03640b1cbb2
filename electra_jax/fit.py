"""The fit check (`--mode=compile`): the train step compiled for TPUs or GPUs this machine lacks,
its memory and FLOPs per chip (XLA's) against HBM and flops.py, and the largest batch."""

import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import math
import os

from jax.experimental import topologies

from electra_jax import config_lib, flops, memory, partitioning, train_state
from electra_jax.errors import ConfigError

INSTALL = {
    "tpu": "pip install 'electra-jax[tpu-compile]'",
    "cuda": "pip install 'electra-jax[gpu-compile]'",
}
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str  # jax's device_kind
  hbm: int  # bytes of HBM per chip
  bandwidth: float  # HBM bytes/s per chip (datasheets; flops.py has the peak FLOP/s)
  cores: int = 1  # TensorCores per chip, which the slice names of v4 and v5p count
  gpu: dict | None = None  # what XLA's GPU compiler is told of the GPU (_GPU_DESCRIPTION)


# NVIDIA's datasheets: SMs, shared memory per SM and per block (opt-in), L2, clock, FP32 lanes.
_HOPPER = dict(
    sms=132, smem=233472, optin=232448, l2=52428800, ghz=1.98, fpus=128, major=9, minor=0
)
_AMPERE = dict(sms=108, smem=167936, optin=166912, l2=41943040, ghz=1.41, fpus=64, major=8, minor=0)
CHIPS = {
    # Google Cloud TPU docs, "System architecture" (cloud.google.com/tpu/docs/v4): 32 GiB HBM2.
    "v4": Chip("TPU v4", 32 * GiB, 1200e9, cores=2),
    # cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 (XLA refuses a step over 15.75 GiB of it).
    "v5e": Chip("TPU v5 lite", 16 * GiB, 819e9),
    # cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e.
    "v5p": Chip("TPU v5", 95 * GiB, 2765e9, cores=2),
    # cloud.google.com/tpu/docs/v6e (Trillium): 32 GiB HBM.
    "v6e": Chip("TPU v6 lite", 32 * GiB, 1640e9),
    # nvidia-smi's memory.total on the H100 SXM and the H200 of benchmarks/RESULTS.md.
    "h100": Chip("NVIDIA H100 80GB HBM3", 85_520_809_984, 3.35e12, gpu=_HOPPER),
    "h200": Chip("NVIDIA H200", 150_754_820_096, 4.8e12, gpu=_HOPPER),
    # NVIDIA's A100 datasheet (SXM4, 80 GB HBM2e), which nvidia-smi counts as 81,920 MiB.
    "a100": Chip("NVIDIA A100-SXM4-80GB", 81_920 * 2**20, 2.039e12, gpu=_AMPERE),
}
# The slice shapes Cloud TPU offers. v5e and v6e are 2-D and their names count chips; v4 and v5p
# are 3-D and their names count TensorCores, two a chip (v4-32 is 2x2x4 = 16 chips).
_SHAPES = {
    2: "1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16".split(),
    3: "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 8x8x8 8x8x16 8x16x16".split(),
}
_TPU_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
_GPUS_PER_HOST = 8

# What XLA's GPU compiler is told of a GPU it compiles for without one (a Chip's `gpu`).
_GPU_DESCRIPTION = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem} threads_per_core_limit: 2048 core_count: {sms}
  fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth:.0f} l2_cache_size: {l2}
  clock_rate_ghz: {ghz} device_memory_size: {hbm} shared_memory_per_block_optin: {optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 }}
dnn_version_info {{ major: 9 minor: 8 }}
platform_name: "CUDA"
device_description_str: "{kind}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU slice or a group of GPUs, by the name a user gives it (`v4-32`, `v5e-16`, `h100-8`)."""

  name: str
  family: str  # a key of CHIPS
  chips: int
  hosts: int
  shape: str  # TPU: the slice's chip grid, e.g. "2x2x4"; GPU: ""

  @property
  def chip(self) -> Chip:
    return CHIPS[self.family]

  @property
  def platform(self) -> str:
    return "cuda" if self.chip.gpu else "tpu"

  def __str__(self) -> str:
    hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
    counted = " (its name counts TensorCores, two a chip)" if self.chip.cores > 1 else ""
    unit = "GPU" if self.platform == "cuda" else "chip"
    return (
        f"{self.name}: {self.chips} {unit}{'s' if self.chips > 1 else ''} on {hosts}{counted}, "
        f"{self.chip.kind} with {self.chip.hbm / GiB:.1f} GiB of HBM each"
    )


def _tpu_targets() -> dict[str, Target]:
  known = {}
  for family, dims in _TPU_DIMS.items():
    one_vm = 8 if dims == 2 else 4  # a 2-D slice of up to 8 chips is one VM; larger ones, 4 a VM
    for shape in _SHAPES[dims]:
      chips = math.prod(int(d) for d in shape.split("x"))
      name = f"{family}-{chips * CHIPS[family].cores}"
      known[name] = Target(name, family, chips, chips // 4 if chips > one_vm else 1, shape)
  return known


TPU_TARGETS = _tpu_targets()


def lookup(name: str) -> Target:
  """The target `name` describes; ConfigError listing the known ones if it is none of them."""
  family, _, count = name.strip().lower().partition("-")
  family = "v5e" if family == "v5litepod" else family  # gcloud's name for a v5e slice
  if f"{family}-{count}" in TPU_TARGETS:
    return dataclasses.replace(TPU_TARGETS[f"{family}-{count}"], name=name)
  if family in CHIPS and CHIPS[family].gpu and (count == "" or count.isdigit()):
    gpus = int(count or 1)
    if gpus in (1, 2, 4) or (gpus > 0 and gpus % _GPUS_PER_HOST == 0):
      return Target(name, family, gpus, max(1, gpus // _GPUS_PER_HOST), "")
  tpus = "; ".join(
      ", ".join(names) for _, names in itertools.groupby(TPU_TARGETS, lambda n: n.split("-")[0])
  )
  gpus = ", ".join(name for name, chip in CHIPS.items() if chip.gpu)
  raise ConfigError(
      f"--topology={name!r} is not a TPU slice or GPU this check knows. TPU slices: {tpus} (v4 and "
      f"v5p names count TensorCores, two a chip; v5litepod-N is v5e-N); GPUs: {gpus}, or NAME-N "
      f"for N of them (1, 2, 4 or a multiple of {_GPUS_PER_HOST}), e.g. h100-8."
  )


def check_mesh(mesh_config, target: Target) -> tuple[int, int, int]:
  """The mesh's (data, fsdp, tensor) on `target`'s chips, by the same check training makes."""
  try:
    return partitioning.resolve_mesh_shape(mesh_config, target.chips)
  except ConfigError as e:
    raise ConfigError(f"The mesh does not fit --topology={target}. {e}") from None


def devices(target: Target) -> list:
  """Compile-only devices for every chip of `target`, over its hosts; ConfigError, before anything
  compiles, naming the extra to install when the plugin is missing."""
  if target.platform == "tpu":
    installed = os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu")
    # This process only compiles: it opens no TPU, so another process holding this host's chips
    # (libtpu's lock file) is no reason to stop, and libtpu need not look for a TPU VM's hosts.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    dims = [int(d) for d in target.shape.split("x")]
    torus = len(dims) == 3 and min(dims) >= 4  # full 3-D slices from 4x4x4 up; 2-D sides of 16
    kwargs = dict(
        chips_per_host_bounds=tuple((dims + [1])[:3]) if target.hosts == 1 else (2, 2, 1),
        wrap=tuple(([torus or d == 16 for d in dims] + [False])[:3]),
    )
    if target.chip.cores > 1:
      kwargs["chip_config_name"] = "megacore"  # one JAX device per chip, its two cores as one
    name = f"{target.family}:{target.shape}"
  else:
    installed = False
    with contextlib.suppress(ModuleNotFoundError):  # no jax_plugins package: no plugin at all
      installed = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    gpu = _GPU_DESCRIPTION.format(**target.chip.gpu, **dataclasses.asdict(target.chip))
    kwargs = dict(target_config=gpu, topology=f"1x{target.hosts}x{target.chips // target.hosts}")
    name = "fit"
  if not installed:
    what = "libtpu" if target.platform == "tpu" else "the CUDA plugin of jax"
    raise ConfigError(
        f"--topology={target.name} compiles with {what}, which is not installed. No accelerator is "
        f"needed: {INSTALL[target.platform]}"
    )
  try:
    found = list(topologies.get_topology_desc(name, target.platform, **kwargs).devices)
    wrong = len(found) != target.chips and f"describes {len(found)} devices, not {target.chips}"
  except Exception as e:  # noqa: BLE001 (a plugin too old or too new for this jax)
    wrong = f"could not describe it ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
  if wrong:  # a plugin that counts cores where we count chips, or not the one jax expects
    raise ConfigError(
        f"--topology={target.name}: the plugin installed {wrong}. Install the one this jax was "
        f"built with: {INSTALL[target.platform]}"
    )
  return found


@dataclasses.dataclass(frozen=True)
class Fit:
  """What the fit check found for one config on one target."""

  target: Target
  mesh: dict[str, int]
  step: memory.StepMemory  # the config's own batch
  limit: int  # bytes per chip a step may hold: train.memory_fraction of HBM
  model_flops: float  # flops.py's count for one step of the config's batch, all chips together
  loops: bool  # the step scans (layers or micro-batches): XLA counts a loop's FLOPs once
  largest: tuple[int, list[memory.StepMemory]] | None = None  # memory.largest_batch's answer

  @property
  def fits(self) -> bool:
    return self.step.bytes_per_device is not None and self.step.bytes_per_device <= self.limit


def check(config, target: Target, max_batch: bool = False) -> Fit:
  """Compiles `config`'s train step for `target` (with `max_batch` or train.batch_size=-1, also
  searches the largest batch that fits); every refusal comes before a compile."""
  config_lib.validate(config)
  check_mesh(config.mesh, target)
  mesh = partitioning.make_mesh(config.mesh, devices=devices(target))
  partitioning.check_shards(mesh, config.train, target.hosts)
  # The tokenizer's special ids shape the masking, not the program; the vocabulary is the recipe's.
  special = dict(pad=0, cls=2, sep=3, mask=4, vocab_size=config.model.vocab_size)
  setup = train_state.build_setup(config, mesh, special)
  compile_step = functools.partial(train_state.compile_train_step, setup, config, mesh)
  limit = int(config.train.memory_fraction * target.chip.hbm)
  largest = None
  if max_batch or config.train.batch_size == -1:
    quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
    largest = memory.largest_batch(compile_step, limit, quantum)
  batch = config.train.batch_size if config.train.batch_size != -1 else largest[0]
  step = next((m for m in (largest or (None, []))[1] if m.batch_size == batch), None)
  step = step or memory.step_memory(compile_step, batch)
  seq = config.data.max_seq_len
  model_flops = flops.objective_flops_per_token(setup.model, setup.objective, seq) * batch * seq
  loops = bool(config.model.scan_layers) or config.train.grad_accum_steps > 1
  return Fit(target, dict(mesh.shape), step, limit, model_flops, loops, largest)


def _size(n: int) -> str:
  return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def _flops(n: float) -> str:
  return f"{n / 1e9:,.1f} G" if n >= 1e9 else f"{n / 1e6:,.1f} M"


def describe(fit: Fit, config) -> str:
  """The fit check's report, as `--mode=compile` prints it."""
  t, step = fit.target, fit.step
  mesh = " x ".join(f"{axis} {size}" for axis, size in fit.mesh.items())
  lines = [
      f"Compiled for {t}; nothing ran.",
      f"Step: batch {step.batch_size} x seq {config.data.max_seq_len}, {config.train.dtype}, "
      f"attention {config.model.attention_impl}, mesh {mesh}.",
  ]
  held = step.bytes_per_device
  if held is None:
    lines.append("Does not fit: XLA's compiler refused the step as more than a chip's HBM.")
  else:
    share = fit.model_flops / t.chips
    looped = "; a loop's body counted once" if fit.loops else ""
    lines += [
        "Memory per chip (XLA's memory analysis):",
        *(f"  {name:<15}{_size(size):>12}" for name, size in step.parts.items()),
        f"  {'total':<15}{_size(held):>12} of {_size(t.chip.hbm)} HBM ({held / t.chip.hbm:.0%})",
        f"{'Fits' if fit.fits else 'Does not fit'}: {_size(held)} per chip is "
        f"{'within' if fit.fits else 'over'} train.memory_fraction="
        f"{config.train.memory_fraction:g} of HBM, {_size(fit.limit)}.",
        f"FLOPs per chip: XLA gives no cost analysis here; flops.py's share {_flops(share)}."
        if step.flops is None
        else f"FLOPs per chip (XLA's cost analysis{looped}): {_flops(step.flops)} against "
        f"electra_jax/flops.py's share {_flops(share)} ({step.flops / share - 1:+.1%}).",
    ]
  if fit.largest is not None:
    batch, measured = fit.largest
    shards = fit.mesh["data"] * fit.mesh["fsdp"]
    by_batch = {m.batch_size: m for m in measured}
    above = min(b for b in by_batch if b > batch)
    held = by_batch[above].bytes_per_device
    why = "refused by the compiler" if held is None else _size(held)
    if held is not None and held <= fit.limit:
      why += ", fitted only by recomputing"
    lines.append(
        f"Largest batch that fits: {batch} ({batch // shards} per batch shard of {shards}), "
        f"{_size(by_batch[batch].bytes_per_device)} per chip; {above} does not ({why}). "
        f"{len(measured)} compiles."
    )
  return "\n".join(lines)
