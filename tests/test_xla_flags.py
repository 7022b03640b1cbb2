"""The CLI's start-up settings: XLA:CPU flags added only where verified, never over the user's
own setting, and accepted by this machine's XLA (which aborts on a flag it does not know); JAX
kept to its CPU backend where no accelerator is; glibc's huge pages, applied by a restart when the
CLI starts (never when a module is imported) and said in its log."""

import os
import signal
import subprocess
import sys
import textwrap

import jaxlib
import pytest

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


_STARTS = """
import os, sys
print("started", flush=True)
before = os.environ.get("XLA_FLAGS")
from electra_jax import main
print("imported", before == os.environ.get("XLA_FLAGS"), flush=True)
sys.argv = ["electra-jax", "--version"]
try:
  main.run()
except SystemExit:
  pass
import jax
print(jax.devices()[0].platform, os.environ["XLA_FLAGS"], os.environ.get("JAX_PLATFORMS"), sep="\\n")
"""


def test_the_cli_sets_them_when_it_starts_not_when_imported_and_xla_accepts_them():
  env = {"PATH": "/usr/bin:/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  out = subprocess.run(
      [sys.executable, "-c", _STARTS],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.split("\n")
  # Importing main changed nothing and started nothing again; run() did, once, if huge pages apply.
  starts = [line for line in lines if line.startswith(("started", "imported"))]
  restarts = xla_flags.malloc_tunables({"JAX_PLATFORMS": "cpu"}) is not None
  assert starts == ["started", "imported True"] * (2 if restarts else 1)
  platform, flags, platforms = lines[-4:-1]
  assert platform == "cpu"
  assert "--xla_force_host_platform_device_count=2" in flags
  assert (f"{FLAG}=" in flags) == jaxlib.__version__.startswith(xla_flags.VERIFIED_JAXLIB)
  # No accelerator here: JAX starts no plugin (libtpu, installed for the fit check, would look for
  # a TPU and say so on stderr).
  assert platforms == ("None" if xla_flags.accelerator_visible({}) else "cpu")
  assert "libtpu" not in out.stderr and "TPU" not in out.stderr
  off = subprocess.run(
      [sys.executable, "-c", _STARTS],
      cwd=REPO,
      env={**env, "ELECTRA_JAX_XLA_DEFAULTS": "0"},
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert off.returncode == 0 and FLAG not in off.stdout
  assert off.stdout.split("\n")[-2] == "None" and off.stdout.count("started") == 1


def test_the_cli_says_in_its_log_that_it_set_huge_pages():
  result = subprocess.run(
      [sys.executable, "-m", "electra_jax.main", "--mode=compile", "--config=demo", "--topology=x"],
      cwd=REPO,
      env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode == 1 and "--topology='x' is not a TPU slice" in result.stderr
  said = result.stderr.count(f"huge pages (GLIBC_TUNABLES={xla_flags.HUGE_PAGES}, set at start")
  assert said == (xla_flags.malloc_tunables({"JAX_PLATFORMS": "cpu"}) is not None)


_FAULTS = """
import os, resource
from electra_jax import xla_flags
xla_flags.apply_cpu_defaults()
import jax, jax.numpy as jnp
# cos(x) is a 128 MiB temporary of the compiled call (XLA:CPU does not fuse it into the dot).
step = jax.jit(lambda x, w: jnp.cos(x) @ w)
x, w = jnp.ones((8192, 4096)), jnp.ones((4096, 4))
step(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
  step(x, w).block_until_ready()
print(os.environ.get("GLIBC_TUNABLES"), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def _run_faults(**env):
  env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **env}
  out = subprocess.run(
      [sys.executable, "-c", _FAULTS],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  tunables, faults = out.stdout.split()[-2:]
  return tunables, int(faults)


def test_a_cpu_process_restarts_with_huge_pages_and_faults_its_temporaries_in_by_the_2_mib():
  # 128 MiB of temporaries is 32,768 pages of 4 KiB, which each call maps and faults in again;
  # with transparent huge pages, 64 of 2 MiB.
  assert _run_faults(ELECTRA_JAX_XLA_DEFAULTS="0") == ("None", pytest.approx(32_768, rel=0.1))
  assert (
      _run_faults(GLIBC_TUNABLES="glibc.malloc.check=0")[0] == "glibc.malloc.check=0"
  )  # the user's own
  tunables, faults = _run_faults()
  if xla_flags.malloc_tunables({"JAX_PLATFORMS": "cpu"}) is None:  # not glibc 2.35+, or THP off
    assert tunables == "None"
  else:
    assert (tunables, faults) == (xla_flags.HUGE_PAGES, pytest.approx(0, abs=2_000))


def test_the_allocator_is_left_alone_where_an_accelerator_computes_or_the_user_chose(monkeypatch):
  assert xla_flags.accelerator_visible({"JAX_PLATFORMS": "cuda"})
  assert xla_flags.accelerator_visible({"JAX_PLATFORMS": "tpu,cpu"})
  assert not xla_flags.accelerator_visible({"JAX_PLATFORMS": "cpu"})
  assert xla_flags.malloc_tunables({"JAX_PLATFORMS": "cuda"}) is None
  assert xla_flags.malloc_tunables({"JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "2"}) is None
  monkeypatch.setattr(xla_flags, "_THP_MODE", "/nonexistent")
  assert xla_flags.malloc_tunables({"JAX_PLATFORMS": "cpu"}) is None


def test_the_accelerator_check_does_not_import_jax_and_agrees_with_jax():
  """The CLI asks before it may start itself again; importing jax for the answer cost every CPU
  run a second of startup, twice over."""
  probe = (
      "import sys; from electra_jax import xla_flags; visible = xla_flags.accelerator_visible({}); "
      "print(visible, xla_flags.tpu_chips_present(), 'jax' in sys.modules)"
  )
  out = subprocess.run(
      [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
  )
  visible, chips, imported = out.stdout.split()
  assert imported == "False"
  from jax._src import hardware_utils  # noqa: PLC0415

  assert chips == str(hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0)


@pytest.mark.fault
@pytest.mark.parametrize("started_as", ["python -m", "console script"])
def test_a_ctrl_c_while_jax_imports_ends_in_one_line(tmp_path, started_as):
  """main() took SIGINT only once JAX was imported: a Ctrl-C in the seconds before ended in a
  KeyboardInterrupt traceback."""
  (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
          import sys, time
          class PauseAtJax:  # so that the Ctrl-C below lands while JAX is imported
            def find_spec(self, name, path=None, target=None):
              if name == "jax":
                print("importing jax", file=sys.stderr, flush=True)
                time.sleep(120)
          sys.meta_path.insert(0, PauseAtJax())
          """))
  script = tmp_path / "electra-jax"  # as pip writes the console script
  script.write_text("import sys\nfrom electra_jax.main import run\nsys.exit(run())\n")
  start = ["-m", "electra_jax.main"] if started_as == "python -m" else [str(script)]
  process = subprocess.Popen(
      [sys.executable, *start, "--version"],
      env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  assert process.stderr.readline() == "importing jax\n"
  process.send_signal(signal.SIGINT)
  stdout, stderr = process.communicate(timeout=60)
  assert (process.returncode, stdout) == (130, ""), stderr[-2000:]
  assert (
      stderr
      == "electra-jax: stopped by Ctrl-C; what it finished is kept (run it again to go on).\n"
  )
