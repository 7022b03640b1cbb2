"""The CPU XLA flag the CLI sets before JAX starts.

jaxlib 0.10's CPU backend hands matmuls and reductions to YNNPACK by default. On the CPUs we
measured (benchmarks/RESULTS.md), its matmuls at ELECTRA's shapes are about 20% slower than
XLA's Eigen path, while its reductions are much faster for the many small per-parameter sums
(the gradient norm). Keeping YNNPACK for reductions only gives the fastest step: about 7%
more tokens/s for electra_small. The flag concerns the CPU backend only (GPU and TPU ignore
it), and is added only for jaxlib versions where it was verified to exist, since XLA aborts on
an unknown flag. A flag already in $XLA_FLAGS is left as the user set it.
"""

from __future__ import annotations

import os

# flag -> value, per verified jaxlib version prefix.
CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
VERIFIED_JAXLIB = ("0.10.",)


def cpu_defaults(jaxlib_version: str, xla_flags: str) -> str:
  """$XLA_FLAGS with our CPU flags added (those the user has not set), for a verified jaxlib."""
  if not jaxlib_version.startswith(VERIFIED_JAXLIB):
    return xla_flags
  added = [f"--{name}={value}" for name, value in CPU_FLAGS.items() if f"--{name}" not in xla_flags]
  return " ".join([xla_flags, *added]).strip()


def apply_cpu_defaults() -> None:
  """Sets $XLA_FLAGS for this process; call before JAX initialises its backends (the first
  computation or jax.devices()). ELECTRA_JAX_XLA_DEFAULTS=0 leaves it as it is."""
  if os.environ.get("ELECTRA_JAX_XLA_DEFAULTS", "1") == "0":
    return
  import jaxlib  # noqa: PLC0415 (imported only to read its version)

  os.environ["XLA_FLAGS"] = cpu_defaults(jaxlib.__version__, os.environ.get("XLA_FLAGS", ""))
