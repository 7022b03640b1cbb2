"""The train step as XLA compiles it for a GPU or a TPU slice, on a machine without either.

  pip install 'electra-jax[gpu-compile]'   # GPU targets (the CUDA plugin of jax)
  pip install 'electra-jax[tpu-compile]'   # TPU targets (libtpu)
  python benchmarks/compile_audit.py --topology=h100 --config=configs/electra_small.py \
      --config.train.dtype=bfloat16 --config.train.batch_size=128
  python benchmarks/compile_audit.py --topology=v5e-16 --config=configs/electra_base.py \
      --config.train.dtype=bfloat16 --config.train.batch_size=256 --config.data.max_seq_len=512 \
      --config.model.attention_impl=splash --config.model.attention_dropout_rate=0 --config.mesh.fsdp=4

XLA's compiler runs here against a description of the device (jax's deviceless ahead-of-time
compilation, electra_jax/fit.py: the same targets and checks as `electra-jax --mode=compile`),
and nothing runs: these are facts about the compiled program, not timings.

For a GPU it reads the optimized program: how many kernels one step launches (while loops
counted by their trip counts), the matmul FLOPs in them (a check on electra_jax/flops.py), the
bytes each kernel reads and writes, and per source operation a roofline bound
max(bytes / bandwidth, FLOPs / peak) (benchmarks/hlo_audit.py). Without a GPU, XLA cannot
autotune, so matmul tilings differ from a real device's; fusion decisions, kernel counts and
bytes do not depend on that. Use it to find launch- or memory-bound parts of a step before
spending GPU time.

For a TPU slice (every chip of it, over its hosts) it reports per chip the memory XLA assigns
against the chip's HBM (`--mode=compile` shows its parts and searches the largest batch), XLA's
FLOPs against flops.py's share, and the Mosaic (Pallas) kernel calls in the program (model.attention_impl=splash compiles the real Mosaic kernel, not the interpreter). It
gives no roofline: a TPU program's traffic goes through on-chip memory the compiler manages
(its own "bytes accessed" counts that too), so a bound from it would mislead.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from electra_jax import config_lib, fit, flops, memory, partitioning, train_state  # noqa: E402
from electra_jax.errors import ConfigError  # noqa: E402
from hlo_audit import Audit  # noqa: E402

_CONFIG = config_lib.define_config_flag("configs/electra_small.py", "Recipe.", lock_config=False)
_TOPOLOGY = flags.DEFINE_string(
    "topology", "h100", "What to compile for: a TPU slice (v5e-16, v4-32, ...) or GPUs (h100, ...)."
)
_TOP = flags.DEFINE_integer("top", 25, "GPU: source operations listed, by roofline bound.")
_HLO = flags.DEFINE_string("hlo_out", "", "Also write the optimized HLO text here.")


def main(argv):
  del argv
  jax.config.update("jax_platforms", "cpu")  # compile here: take no accelerator of this machine
  config = _CONFIG.value
  try:
    target = fit.lookup(_TOPOLOGY.value)
    config_lib.validate(config)  # a bad override is named here, not by the compiler
    fit.check_mesh(config.mesh, target)
    devices = fit.devices(target)
  except ConfigError as e:
    sys.exit(str(e))
  mesh = partitioning.make_mesh(config.mesh, devices=devices)
  # Special ids shape the masking, not the program; the vocabulary is the recipe's.
  setup = train_state.build_setup(
      config, mesh, dict(pad=0, cls=2, sep=3, mask=4, vocab_size=config.model.vocab_size)
  )
  with partitioning.activate(mesh):
    compiled = train_state.compile_train_step(setup, config, mesh)
  hlo = compiled.as_text()
  if _HLO.value:
    with open(_HLO.value, "w") as f:
      f.write(hlo)
  batch, seq = config.train.batch_size, config.data.max_seq_len
  model_flops = flops.objective_flops_per_token(setup.model, setup.objective, seq) * batch * seq
  print(
      f"{target} (compiled, not run): batch {batch} x seq {seq}, {config.train.dtype}, "
      f"attention {config.model.attention_impl}, mesh {dict(mesh.shape)}"
  )
  if target.platform == "cuda":
    _report_gpu(hlo, target, flops.peak_flops(devices[0]), model_flops / target.chips)
  else:
    _report_tpu(compiled, hlo, target, model_flops / target.chips, config.model.scan_layers)


def _report_gpu(hlo, target, peak, model_flops):
  audit = Audit(hlo, peak, target.chip.bandwidth)
  t = audit.totals()
  print(f"kernel launches per step: {t['launches']}")
  print(
      f"matmul FLOPs: {t['dot_flops'] / 1e9:,.1f} G (electra_jax/flops.py: {model_flops / 1e9:,.1f} G; "
      "the first adds what the backward of cuDNN's attention computes again)"
  )
  print(f"bytes read and written by kernels: {t['bytes'] / 1e9:.2f} GB")
  print(
      f"roofline bound: {t['bound_s'] * 1e3:.2f} ms (no launch or latency cost), so MFU at most "
      f"{model_flops / t['bound_s'] / peak:.0%}"
  )
  if _TOP.value:
    print("\n| bound (ms) | kernels | GFLOP | MB | source | operation |\n|---|---|---|---|---|---|")
  for (where, operation), (bound, launches, dot, moved) in sorted(
      audit.by_source.items(), key=lambda kv: -kv[1][0]
  )[: _TOP.value]:
    print(
        f"| {bound * 1e3:.3f} | {launches} | {dot / 1e9:.1f} | {moved / 1e6:.1f} | {where} | {operation} |"
    )


def _report_tpu(compiled, hlo, target, model_flops_per_chip, scanned):
  held = sum(memory.memory_parts(compiled).values())
  print(
      f"memory per chip: {held / 2**30:.2f} GiB of {target.chip.hbm / 2**30:.0f} GiB HBM "
      f"({held / target.chip.hbm:.0%}; `electra-jax --mode=compile` shows its parts)"
  )
  # XLA's cost analysis and a count of the program's text both see a loop's body once.
  looped = " (the scanned layers' loop body counted once)" if scanned else ""
  xla_flops = memory.compiled_flops(compiled) or 0
  print(
      f"FLOPs per chip (XLA's cost analysis, Mosaic kernels not included): {xla_flops / 1e9:,.1f} G "
      f"(electra_jax/flops.py's share: {model_flops_per_chip / 1e9:,.1f} G){looped}"
  )
  mosaic = hlo.count('custom_call_target="tpu_custom_call"')
  print(f"Mosaic (Pallas) kernel calls in the program: {mosaic}{looped}")


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.flags_parser("compile_audit"))
