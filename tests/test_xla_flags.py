"""The CLI's XLA:CPU defaults: added only where verified, never over the user's own setting,
and accepted by this machine's XLA (which aborts on a flag it does not know)."""

import subprocess
import sys

import jaxlib

from conftest import REPO
from electra_jax import xla_flags

FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def test_defaults_respect_the_version_and_the_users_flags():
  assert xla_flags.cpu_defaults("0.10.2", "") == f"{FLAG}=LIBRARY_FUSION_TYPE_REDUCE"
  assert xla_flags.cpu_defaults("0.10.2", "--xla_force_host_platform_device_count=8") == (
      f"--xla_force_host_platform_device_count=8 {FLAG}=LIBRARY_FUSION_TYPE_REDUCE"
  )
  mine = f"{FLAG}=LIBRARY_FUSION_TYPE_DOT"
  assert xla_flags.cpu_defaults("0.10.2", mine) == mine
  assert xla_flags.cpu_defaults("0.99.0", "--a=1") == "--a=1"


def test_the_cli_module_sets_them_and_xla_accepts_them():
  code = "import os, electra_jax.main, jax; print(jax.devices()[0].platform); print(os.environ['XLA_FLAGS'])"
  env = {"PATH": "/usr/bin:/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  platform, flags = out.stdout.split("\n")[:2]
  assert platform == "cpu"
  assert "--xla_force_host_platform_device_count=2" in flags
  assert (f"{FLAG}=" in flags) == jaxlib.__version__.startswith(xla_flags.VERIFIED_JAXLIB)
  off = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "ELECTRA_JAX_XLA_DEFAULTS": "0"},
                       capture_output=True, text=True, timeout=300)
  assert off.returncode == 0 and FLAG not in off.stdout
