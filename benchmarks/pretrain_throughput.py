"""Pre-training throughput of electra-jax's compiled train step: tokens/s, step time, model
FLOPs per token and MFU (where the device's peak is known), on real batches of the built-in
corpus. Compile time is excluded; each figure is the median of several timed windows.

  python benchmarks/pretrain_throughput.py --config=configs/electra_small.py \
      --config.train.batch_size=32 --steps=20 --windows=3

Figures and the commands that produced them are kept in benchmarks/RESULTS.md.
"""

import json
import platform
import statistics
import time

import flax.linen as nn
import jax
from absl import app, flags
from ml_collections import config_flags

from electra_jax import data, flops, partitioning, train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Recipe to measure.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 20, "Train steps per timed window.")
_WINDOWS = flags.DEFINE_integer("windows", 3, "Timed windows; the median is reported.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compiling.")


def main(argv):
  del argv
  config = _CONFIG.value
  mesh, corpus, setup = train.prepare(config)
  batch_size, seq_len = config.train.batch_size, config.data.max_seq_len

  with partitioning.activate(mesh):
    state = jax.jit(lambda r: nn.meta.unbox(setup.init_fn(r)), out_shardings=setup.state_shardings)(
        jax.random.key(0)
    )
    compile_start = time.perf_counter()
    step_fn = train.compile_train_step(setup, config, mesh)
    compile_seconds = time.perf_counter() - compile_start

  batches = [
      partitioning.global_batch_from_local(data.get_batch(corpus, i, batch_size, 0), mesh)
      for i in range(_STEPS.value)
  ]

  def run(num_steps, offset):
    nonlocal state
    for i in range(num_steps):
      state, metrics = step_fn(state, batches[i % len(batches)], train.step_rng(0, offset + i))
    jax.block_until_ready(metrics)

  run(_WARMUP.value, 0)
  seconds = []
  for window in range(_WINDOWS.value):
    start = time.perf_counter()
    run(_STEPS.value, 1000 * (window + 1))
    seconds.append((time.perf_counter() - start) / _STEPS.value)
  step_seconds = statistics.median(seconds)
  tokens_per_sec = batch_size * seq_len / step_seconds
  flops_per_token = flops.train_flops_per_token(setup.model, seq_len, setup.objective.max_predictions)
  peak = flops.peak_flops(jax.devices()[0])
  result = {
      "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "host": platform.processor() or platform.machine(),
      "batch_size": batch_size,
      "seq_len": seq_len,
      "dtype": config.train.dtype,
      "compile_seconds": round(compile_seconds, 1),
      "step_ms": round(1000 * step_seconds, 2),
      "tokens_per_sec": round(tokens_per_sec, 1),
      "model_flops_per_token": round(flops_per_token),
      "achieved_tflops": round(tokens_per_sec * flops_per_token / 1e12, 4),
      "mfu": None if peak is None else round(tokens_per_sec * flops_per_token / (peak * jax.device_count()), 4),
      "jax": jax.__version__,
  }
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main)
