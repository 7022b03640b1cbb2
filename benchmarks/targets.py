"""Accelerators to compile for on a machine that has none (jax's deviceless ahead-of-time
compilation): GPUs through a described target and the CUDA plugin, TPU slices through a
topology and libtpu. Used by compile_audit.py and max_batch.py.

  pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"   # GPU targets
  pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"      # TPU targets

Neither needs the accelerator itself; keep each in a virtual environment of its own
(`python -m venv --system-site-packages`) if the test suite shares this Python, so its jax
does not try to start them.
"""

from __future__ import annotations

import dataclasses
import math
import os


def compile_on_this_host() -> None:
  """Keeps JAX's own computations on the CPU: the host runs the compiler, and no accelerator
  (nor the plugins' search for one) is started. Call before JAX starts."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str  # "cuda" or "tpu"
  peak: float  # dense bfloat16 FLOP/s per device (public datasheets)
  bandwidth: float  # HBM bytes/s per device
  memory: int  # HBM bytes per device
  topology: str = ""  # TPU: the chip family's prefix, e.g. "v5e"
  single_chip: str = ""  # TPU: the one-chip topology of that family


TARGETS = {
    "h100": Target("NVIDIA H100 80GB HBM3", "cuda", 989e12, 3.35e12, 85_520_809_984),
    "h200": Target("NVIDIA H200", "cuda", 989e12, 4.8e12, 150_754_820_096),
    "tpu_v5e": Target("TPU v5e", "tpu", 197e12, 819e9, 16 * 2**30, "v5e", "1x1"),
    "tpu_v5p": Target("TPU v5p", "tpu", 459e12, 2765e9, 95 * 2**30, "v5p", "1x1x1"),
    "tpu_v6e": Target("TPU v6e", "tpu", 918e12, 1640e9, 32 * 2**30, "v6e", "1x1"),
}

# The Hopper SM as XLA's GPU compiler wants it described; memory and bandwidth from the target.
_GPU_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth:.0f} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 }}
dnn_version_info {{ major: 9 minor: 8 }}
platform_name: "CUDA"
device_description_str: "{name}"
"""


def devices(target: Target, topology: str = "") -> list:
  """Compile-only devices of `target`: one GPU, or every chip of a TPU slice of `topology`
  (e.g. "2x2" or "4x4" for v5e, "2x2x2" for v5p; default one chip). Raises SystemExit with
  the install line when the plugin is missing."""
  import jax  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  try:
    if target.platform == "cuda":
      if topology:
        raise SystemExit(f"--topology is for TPU slices; {target.name} compiles for one GPU.")
      desc = topologies.get_topology_desc(
          "audit",
          "cuda",
          target_config=_GPU_TARGET.format(**dataclasses.asdict(target)),
          topology="1x1x1",
      )
    else:
      shape = topology or target.single_chip
      dims = [int(d) for d in shape.split("x")]
      # A slice of at most one host's four chips is that host (libtpu's default host is 2x2x1).
      one_host = (
          dict(chips_per_host_bounds=tuple(dims + [1] * (3 - len(dims))))
          if math.prod(dims) <= 4
          else {}
      )
      desc = topologies.get_topology_desc(
          topology_name=f"{target.topology}:{shape}", platform="tpu", **one_host
      )
  except SystemExit:
    raise
  except Exception as e:  # no plugin, one too old for deviceless compiles, or a bad topology
    if "lockfile" in str(e):  # libtpu admits one process per host
      raise SystemExit(
          f"libtpu is in use by another process on this host (its lock: /tmp/libtpu_lockfile), and it "
          f"serves one at a time: wait for that one to end, then compile for {target.name}."
      ) from None
    extra = "cuda12" if target.platform == "cuda" else "tpu"
    raise SystemExit(
        f"Could not set up a deviceless compile for {target.name}{' ' + topology if topology else ''} "
        f"({type(e).__name__}: "
        f"{str(e).splitlines()[0][:300]}). Install the plugin for this jax, no accelerator needed: "
        f'pip install "jax[{extra}]=={jax.__version__}"'
    ) from None
  return list(desc.devices)
