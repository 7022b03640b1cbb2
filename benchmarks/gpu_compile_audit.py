"""The train step as XLA compiles it for an NVIDIA H100 or H200, on a machine without one.

  pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"   # no GPU needed
  python benchmarks/gpu_compile_audit.py --config=configs/electra_small.py \
      --config.train.dtype=bfloat16 --config.train.batch_size=128

XLA's GPU compiler runs here against a description of the device (jax's deviceless
ahead-of-time compilation, `jax.experimental.topologies`), and this script reads the optimized
program it produces: how many kernels one step launches (while loops counted by their trip
counts), the matmul FLOPs in them (a check on electra_jax/flops.py), the bytes each kernel reads
and writes (its operands and results), and, per source operation, a roofline bound
max(bytes / bandwidth, FLOPs / peak). Nothing runs: these are facts about the compiled program
and a bound derived from them, not timings. Without a GPU, XLA cannot autotune, so matmul
tilings differ from a real device's; fusion decisions, kernel counts and bytes do not depend on
that. Use it to find launch-bound or memory-bound parts of a step before spending GPU time.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs the compiler; no GPU is looked for

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from electra_jax import config_lib, flops, partitioning, train  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hlo_audit import Audit  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/electra_small.py", "Recipe.", lock_config=False)
_DEVICE = flags.DEFINE_enum("device", "h100", ["h100", "h200"], "The GPU compiled for (SXM parts).")
_TOP = flags.DEFINE_integer("top", 25, "Source operations listed, by roofline bound.")
_HLO = flags.DEFINE_string("hlo_out", "", "Also write the optimized HLO text here.")

# Dense bf16 peak, HBM bandwidth and memory (public datasheets); the rest is the Hopper SM.
DEVICES = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", peak=989e12, bandwidth=3.35e12, memory=85_520_809_984),
    "h200": dict(name="NVIDIA H200", peak=989e12, bandwidth=4.8e12, memory=150_754_820_096),
}
_TARGET = """gpu_device_info {{
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

def main(argv):
  del argv
  config, device = _CONFIG.value, DEVICES[_DEVICE.value]
  try:
    config_lib.validate(config)  # a bad override is named here, not by the compiler
  except config_lib.ConfigError as e:
    sys.exit(str(e))
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc("audit", "cuda", target_config=_TARGET.format(**device),
                                            topology="1x1x1")
  except Exception as e:  # no CUDA plugin, or one too old for deviceless compiles
    sys.exit(f"Could not set up a deviceless CUDA compile ({type(e).__name__}: {e}). Install jax's CUDA "
             f"plugin for this jax: pip install \"jax[cuda12]=={jax.__version__}\" (no GPU needed).")
  mesh = partitioning.make_mesh(config.mesh, devices=topology.devices)
  # Special ids shape the masking, not the program; the vocabulary is the recipe's.
  setup = train.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4, vocab_size=config.model.vocab_size))
  shape = (config.train.batch_size, config.data.max_seq_len)
  with partitioning.activate(mesh):
    compiled = train.compile_train_step(setup, config, mesh)
  hlo = compiled.as_text()
  if _HLO.value:
    with open(_HLO.value, "w") as f:
      f.write(hlo)
  audit = Audit(hlo, device["peak"], device["bandwidth"])
  t = audit.totals()
  tokens = shape[0] * shape[1]
  model_flops = flops.train_flops_per_token(setup.model, shape[1], setup.objective.max_predictions) * tokens
  print(f"{device['name']} (compiled, not run): batch {shape[0]} x seq {shape[1]}, {config.train.dtype}, "
        f"attention {config.model.attention_impl}")
  print(f"kernel launches per step: {t['launches']}")
  print(f"matmul FLOPs: {t['dot_flops'] / 1e9:,.1f} G (electra_jax/flops.py: {model_flops / 1e9:,.1f} G; "
        "the first adds what the backward of cuDNN's attention computes again)")
  print(f"bytes read and written by kernels: {t['bytes'] / 1e9:.2f} GB")
  print(f"roofline bound: {t['bound_s'] * 1e3:.2f} ms (no launch or latency cost), so MFU at most "
        f"{model_flops / t['bound_s'] / device['peak']:.0%}")
  print("\n| bound (ms) | kernels | GFLOP | MB | source | operation |\n|---|---|---|---|---|---|")
  for (where, operation), (bound, launches, dot, moved) in sorted(
      audit.by_source.items(), key=lambda kv: -kv[1][0])[:_TOP.value]:
    print(f"| {bound * 1e3:.3f} | {launches} | {dot / 1e9:.1f} | {moved / 1e6:.1f} | {where} | {operation} |")


if __name__ == "__main__":
  app.run(main)
