"""The largest training batch that fits on this machine's device, per recipe and sequence length.

  python benchmarks/max_batch.py --configs=electra_small,electra_base,electra_large --seq_lens=128,512

For each (recipe, max_seq_len) it searches the largest batch whose compiled train step fits in
--memory_fraction of one device's memory, as `train.batch_size=-1` does at start
(electra_jax/memory.py): two compiles give bytes = fixed + per_example * batch from XLA's memory
analysis, then the answer is bracketed and bisected down to --step examples. Prints a markdown
table: fixed and per-example memory, the largest batch, its bytes and the compiles it took.
Nothing runs a step; on a CPU, whose compiles are slow, a coarser --step saves compiles.

--topology=v5e-1 (v4-8, v5p-8, v6e-1, h100, h200, a100, ...) answers for that target without
one: the step is compiled for it ahead of time (electra_jax/fit.py, as `electra-jax
--mode=compile --max_batch` does for one recipe; it needs the `tpu-compile` or `gpu-compile`
extra) and held against its chips' HBM. A data-parallel slice needs the same per chip.
"""

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--configs", default="electra_small,electra_base,electra_large")
  parser.add_argument("--seq_lens", default="128,512")
  parser.add_argument("--memory_fraction", type=float, default=0.9)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument(
      "--step",
      type=int,
      default=0,
      help="Resolution of the search in examples (default: the batch shards, as at start).",
  )
  parser.add_argument(
      "--topology",
      default="",
      help="Compile for this TPU slice or GPU instead of this machine's devices (e.g. v5e-1, h100).",
  )
  parser.add_argument(
      "--set",
      action="append",
      default=[],
      metavar="KEY=VALUE",
      help="A config override for every recipe, e.g. model.attention_impl=splash (repeatable).",
  )
  args = parser.parse_args()
  for spec in args.set:
    if "=" not in spec:
      sys.exit(f"--set {spec}: give KEY=VALUE, e.g. --set model.attention_impl=splash")
  # Refused here, before any compile, rather than by a traceback halfway through the table.
  for name in args.configs.split(","):
    if not os.path.isfile(os.path.join(REPO, "configs", f"{name}.py")):
      sys.exit(
          f"--configs: no recipe configs/{name}.py (give names like electra_small,electra_base)."
      )
  if not all(s.strip().isdigit() and int(s) > 0 for s in args.seq_lens.split(",")):
    sys.exit(
        f"--seq_lens={args.seq_lens!r}: give positive whole numbers separated by commas, e.g. 128,512."
    )
  if args.step < 0 or not 0 < args.memory_fraction <= 1:
    sys.exit(
        f"--step={args.step} must be >= 0 (0 = the batch shards) and --memory_fraction="
        f"{args.memory_fraction} in (0, 1]."
    )
  import jax  # noqa: PLC0415
  from absl import logging  # noqa: PLC0415

  logging.set_verbosity(logging.INFO)  # a line per compile: on a CPU host each takes minutes
  from electra_jax import config_lib, fit, memory, partitioning, sweep, train_state  # noqa: PLC0415
  from electra_jax.errors import ConfigError  # noqa: PLC0415

  if args.topology:
    jax.config.update("jax_platforms", "cpu")  # compile here, before JAX starts a backend
    try:
      target = fit.lookup(args.topology)
      devices = fit.devices(target)
    except ConfigError as e:
      sys.exit(str(e))
    kind, limit = str(target), int(args.memory_fraction * target.chip.hbm)
  else:
    devices = jax.devices()
    kind, limit = devices[0].device_kind, int(
        args.memory_fraction * memory.device_memory_bytes(devices[0])
    )
  print(
      f"device: {kind} x {len(devices)}{' (compiled for, not present)' if args.topology else ''}, "
      f"{limit / 2**30:.1f} GiB allowed per device ({args.memory_fraction:.0%}), dtype {args.dtype}\n"
  )
  print(
      "| recipe | max_seq_len | fixed (GiB) | per example (MiB) | largest batch | its bytes (GiB) | compiles | time |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for name in args.configs.split(","):
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
      config = config_lib.sibling(os.path.join(REPO, "configs", f"{name}.py"), name).get_config()
      config.data.max_seq_len = seq_len
      config.model.max_position_embeddings = max(config.model.max_position_embeddings, seq_len)
      config.train.dtype = args.dtype
      try:
        config = sweep.apply_overrides(config, [tuple(spec.split("=", 1)) for spec in args.set])
        config_lib.validate(config)
      except ConfigError as e:
        sys.exit(f"--set {' '.join(args.set)}: {e}")
      mesh = partitioning.make_mesh(config.mesh, devices=devices)
      # Special ids only shape the masking, not the memory; the vocabulary size is the recipe's.
      setup = train_state.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4))
      quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
      if args.step % quantum:
        sys.exit(
            f"--step={args.step} is not a multiple of {quantum} (batch shards x grad_accum_steps)."
        )
      quantum = args.step or quantum
      start = time.perf_counter()
      try:
        batch, measured = memory.largest_batch(
            functools.partial(train_state.compile_train_step, setup, config, mesh), limit, quantum
        )
      except ConfigError as e:  # not even one quantum fits: say so, go on to the next
        print(f"| `{name}` | {seq_len} | - | - | none | - | - | {e} |", flush=True)
        continue
      fit = memory.fit_of(measured)
      fixed, per_example = (
          ("-", "-") if fit is None else (f"{fit[0] / 2**30:.2f}", f"{fit[1] / 2**20:.1f}")
      )
      chosen = next(m for m in measured if m.batch_size == batch)
      print(
          f"| `{name}` | {seq_len} | {fixed} | {per_example} | {batch} | "
          f"{chosen.bytes_per_device / 2**30:.2f} | {len(measured)} | {time.perf_counter() - start:.0f} s |",
          flush=True,
      )


if __name__ == "__main__":
  main()
