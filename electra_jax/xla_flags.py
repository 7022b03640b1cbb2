"""CPU settings the CLI applies at its start, before JAX's backend: XLA flags, and on Linux without
a GPU or TPU, JAX on its CPU alone and glibc's huge pages. The user's own settings win."""

import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import runpy
import sys

# flag -> value, added only for jaxlib versions that have them (XLA aborts on an unknown flag).
CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
VERIFIED_JAXLIB = ("0.10.",)
HUGE_PAGES = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def cpu_defaults(jaxlib_version: str, xla_flags: str) -> str:
  """$XLA_FLAGS with our CPU flags added (those the user has not set), for a verified jaxlib."""
  if not jaxlib_version.startswith(VERIFIED_JAXLIB):
    return xla_flags
  added = [f"--{name}={value}" for name, value in CPU_FLAGS.items() if f"--{name}" not in xla_flags]
  return " ".join([xla_flags, *added]).strip()


def malloc_tunables(environ=os.environ) -> str | None:
  """GLIBC_TUNABLES for a CPU process (XLA maps its temporaries afresh each call: huge pages fault
  them in; glibc 2.35+); None where off, where an accelerator computes or the user tunes malloc."""
  libc, version = platform.libc_ver()
  usable = (
      libc == "glibc"
      and tuple(map(int, version.split(".")[:2])) >= (2, 35)
      and os.path.exists(_THP_MODE)
      and "[never]" not in pathlib.Path(_THP_MODE).read_text()
  )
  user_tunes = any(name == "GLIBC_TUNABLES" or name.startswith("MALLOC_") for name in environ)
  return HUGE_PAGES if usable and not user_tunes and not accelerator_visible(environ) else None


def accelerator_visible(environ=os.environ) -> bool:
  """Whether this process will compute on a GPU or TPU ($JAX_PLATFORMS, else the devices here)."""
  if platforms := environ.get("JAX_PLATFORMS", "").strip():
    return platforms.split(",")[0].strip().lower() != "cpu"
  return any(map(os.path.exists, ("/dev/nvidiactl", "/dev/kfd"))) or tpu_chips_present()


def tpu_chips_present() -> bool:
  """Whether TPU chips sit on the PCI bus, by JAX's check run from its file (not importing jax)."""
  try:
    jax_dir = os.path.dirname(importlib.util.find_spec("jax").origin)
    found = runpy.run_path(os.path.join(jax_dir, "_src", "hardware_utils.py"))
    return found["num_available_tpu_chips_and_device_id"]()[0] > 0
  except Exception:  # noqa: BLE001 (a private helper: its absence means "cannot tell")
    return False


def apply_cpu_defaults(restart: bool = True, environ=os.environ) -> None:
  """Adds our flags to $XLA_FLAGS; on Linux with no accelerator, sets JAX_PLATFORMS=cpu and, if
  `restart`, starts this process again (same id and arguments) with malloc_tunables(), which glibc
  reads only at start. The user's values stay; ELECTRA_JAX_XLA_DEFAULTS=0 sets nothing."""
  if environ.get("ELECTRA_JAX_XLA_DEFAULTS", "1") == "0":
    return
  jaxlib = importlib.metadata.version("jaxlib")  # without importing it
  environ["XLA_FLAGS"] = cpu_defaults(jaxlib, environ.get("XLA_FLAGS", ""))
  if platform.system() != "Linux" or accelerator_visible(environ):
    return
  environ.setdefault("JAX_PLATFORMS", "cpu")
  if restart and (tunables := malloc_tunables(environ)) and sys.executable:
    environ["GLIBC_TUNABLES"] = tunables  # also what stops a second restart
    sys.stdout.flush()
    sys.stderr.flush()
    try:
      os.execv(sys.executable, sys.orig_argv)
    except OSError:  # could not start again: carry on as we are, without the tunables
      del environ["GLIBC_TUNABLES"]
