"""The fit check (`--mode=compile`): the train step compiled here for TPU slices this machine does
not have (libtpu comes with the test extras, as jax[tpu]), its memory per chip against the chip's
HBM, XLA's FLOPs against flops.py, the largest batch, and what it refuses before compiling."""

import importlib.util
import re

import pytest

from conftest import REPO, TINY_OVERRIDES, cli, tiny_config
from electra_jax import fit
from electra_jax.errors import ConfigError

NO_DROPOUT = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
# Wide enough that matmuls are most of the step: XLA's count adds LayerNorm, GELU, softmax, the
# sampling noise and Adam, 4% of it here. Dropout's random bits would add as much again as the
# matmuls at this size, so it is off.
WIDE = {**TINY_OVERRIDES, **NO_DROPOUT, "model.hidden_size": 128, "model.intermediate_size": 512}
FLOPS_TOLERANCE = 0.10
# The tests' persistent compilation cache (conftest) keeps the TPU programs too, which libtpu cannot
# load back without a TPU: JAX warns and compiles them again.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")


def _compile_cli(topology, **overrides):
  args = ["python", "-m", "electra_jax.main", "--mode=compile", f"--config={REPO}/configs/base.py"]
  args += [f"--topology={topology}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
  return cli(args)


@pytest.mark.parametrize(
    "name, chips, hosts, kind",
    [
        ("v4-32", 16, 4, "TPU v4"),  # the name counts TensorCores, two a chip
        ("v5p-64", 32, 8, "TPU v5"),
        ("v5e-16", 16, 4, "TPU v5 lite"),  # the name counts chips
        ("v5litepod-16", 16, 4, "TPU v5 lite"),  # gcloud's name for it
        ("v6e-8", 8, 1, "TPU v6 lite"),  # up to 8 chips is one VM
        ("v4-8", 4, 1, "TPU v4"),
    ],
)
def test_slice_names_give_their_chips_and_hosts_as_libtpu_lays_them_out(name, chips, hosts, kind):
  target = fit.lookup(name)
  assert (target.chips, target.hosts) == (chips, hosts)
  devices = fit.devices(target)  # libtpu's own description of the slice: no compile
  assert len(devices) == chips and {d.device_kind for d in devices} == {kind}
  assert len({d.process_index for d in devices}) == hosts


def test_gpu_names_count_gpus_eight_a_host():
  assert [(t.chips, t.hosts) for t in map(fit.lookup, ("h100", "h200-8", "a100-16"))] == [
      (1, 1),
      (8, 1),
      (16, 2),
  ]


@pytest.mark.fault
def test_an_unknown_topology_is_refused_with_the_known_ones():
  result = _compile_cli("v5e-12")
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert error.startswith("electra-jax: error: --topology='v5e-12' is not a TPU slice")
  assert all(name in error for name in ("v4-32", "v5e-16", "v5p-64", "v6e-8", "h100"))
  with pytest.raises(ConfigError, match="v5e-16"):
    fit.lookup("h100-3")


@pytest.mark.fault
@pytest.mark.parametrize(
    "topology, mesh, named",
    [
        # 4 x 8 = 32 devices: v4-32's name counts TensorCores, its chips are 16.
        ("v4-32", {"mesh.data": 4, "mesh.fsdp": 8}, "multiply to 32, but there are 16 devices"),
        ("v5e-16", {"mesh.fsdp": 32}, "multiply to 32, but there are 16 devices: make the"),
    ],
)
def test_a_mesh_that_does_not_match_the_slice_is_refused_before_compiling(topology, mesh, named):
  result = _compile_cli(topology, **TINY_OVERRIDES, **mesh)
  assert result.returncode == 1 and "Traceback" not in result.stderr
  error = result.stderr.strip().splitlines()[-1]
  assert f"--topology={topology}: " in error and named in error, error
  assert all(f"{key}={value}" in error for key, value in mesh.items())
  assert "compiled in" not in result.stderr  # memory.step_memory's line for every compile


@pytest.mark.fault
def test_a_slice_whose_hosts_cannot_each_feed_their_rows_is_refused():
  # v5e-16 is 4 hosts; all 16 chips on the tensor axis leave one batch shard for four readers.
  result = _compile_cli("v5e-16", **{**TINY_OVERRIDES, "mesh.data": 1, "mesh.tensor": 16})
  assert result.returncode == 1 and "over 4 processes" in result.stderr.strip().splitlines()[-1]


@pytest.mark.fault
def test_a_missing_plugin_names_the_extra_to_install():
  """No CUDA plugin in the test extras (it is gigabytes): a GPU target says what to install. Where
  one is installed (the GPU machine), the same command compiles."""
  result = _compile_cli("h100", **TINY_OVERRIDES)
  try:
    installed = any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  except ModuleNotFoundError:
    installed = False
  if installed:
    assert result.returncode == 0 and "Compiled for h100: 1 GPU" in result.stdout
  else:
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "electra-jax: error: --topology=h100 compiles with the CUDA plugin of jax, which is not "
        "installed. No accelerator is needed: pip install 'electra-jax[gpu-compile]'"
    )


def test_a_small_batch_fits_with_flops_py_s_count_and_an_absurd_one_does_not():
  small = _compile_cli("v5e-4", **{**WIDE, "train.batch_size": 8})
  assert small.returncode == 0, small.stderr[-3000:]
  report = small.stdout
  assert "Compiled for v5e-4: 4 chips on 1 host" in report and "mesh data 4 x fsdp 1" in report
  total = re.search(r"total +([\d.]+) MiB of 16.00 GiB HBM", report)
  assert total and 0 < float(total.group(1)) < 1024, report  # a tiny model: MiBs of 16 GiB
  assert (
      f"\nFits: {total.group(1)} MiB per chip is within train.memory_fraction=0.9 of HBM, 14.40 GiB."
      in report
  )
  # FLOPs per chip: a quarter of the step's, each chip computing two of the eight rows.
  xla, share = re.search(
      r"cost analysis\): ([\d.]+) M against .* share ([\d.]+) M", report
  ).groups()
  assert float(xla) == pytest.approx(float(share), rel=FLOPS_TOLERANCE), report
  absurd = _compile_cli("v5e-4", **{**WIDE, "train.batch_size": 2**20})
  assert absurd.returncode == 1 and "\nDoes not fit: " in absurd.stdout, absurd.stdout
  assert "refused the step as more than a chip's HBM" in absurd.stdout


def test_the_largest_batch_fits_and_the_next_one_up_does_not():
  """The search compiles for one v5e chip under a limit just above batch 1's memory: every
  measurement it reports is a real compile, and it stops at a batch that fits with the next one
  (one more example) compiled and over the limit."""
  config = tiny_config(**NO_DROPOUT, **{"train.batch_size": 1})
  target = fit.lookup("v5e-1")
  one = fit.check(config, target).step.bytes_per_device
  config.train.memory_fraction = one * 1.01 / target.chip.hbm
  found = fit.check(config, target, max_batch=True)
  batch, measured = found.largest
  by_batch = {m.batch_size: m.bytes_per_device for m in measured}
  assert by_batch[batch] <= found.limit < (by_batch[batch + 1] or float("inf"))
  assert found.fits and found.step.batch_size == 1
  assert f"Largest batch that fits: {batch} ({batch} per batch shard of 1)" in fit.describe(
      found, config
  )
