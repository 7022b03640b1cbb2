"""Where does a compiled train step spend its time? Times the whole step and its parts
(forward, forward + backward, the optimizer update, the replacement sampling) on the device
at hand, and with --trace writes a Perfetto trace and prints the top device kernels by total
time (from jax.profiler).

  python benchmarks/step_profile.py --config=configs/electra_small.py \
      --config.train.dtype=bfloat16 --config.train.batch_size=128 --trace=/tmp/trace
"""

import collections
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults()  # the CLI's start-up settings, before JAX starts

import jax
import jax.numpy as jnp
from absl import app, flags

from electra_jax import config_lib, data, objectives, partitioning, resolve, train_state

_CONFIG = config_lib.define_config_flag("configs/demo.py", "Recipe.", lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 20, "Timed calls per part.")
_TRACE = flags.DEFINE_string("trace", "", "Directory for a jax.profiler trace of a few steps.")
_TOP = flags.DEFINE_integer("top", 25, "Kernels listed from the trace.")
_PARTS = flags.DEFINE_boolean("parts", True, "Also time the parts (each is one more compile).")


def _time(fn, *args):
  out = fn(*args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(_STEPS.value):
    out = fn(*args)
  jax.block_until_ready(out)
  return 1000 * (time.perf_counter() - start) / _STEPS.value


def main(argv):
  del argv
  config = _CONFIG.value
  run = resolve.run(config)
  mesh, corpus, setup = run.mesh, run.corpus, run.setup
  objective = setup.objective
  with partitioning.activate(mesh):
    state = train_state.fresh_state(setup, 0)
    batch = partitioning.global_batch_from_local(
        data.get_batch(corpus, 0, config.train.batch_size, 0),
        mesh,
        keys=data.batch_keys(config.data.pack_rows),
    )
    step_fn = train_state.compile_train_step(setup, config, mesh)
    rng = jax.random.key(1)
    masked = objectives.mask_tokens(rng, batch["input_ids"], batch["attention_mask"], objective)
    keys = jax.random.split(rng, batch["input_ids"].shape[0])
    normalizers = objectives.Normalizers.of(
        masked,
        batch["attention_mask"],
        objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
    )

    def loss(params):
      return objectives.electra_forward(
          state.model, params, batch, masked, keys, rng, objective, normalizers
      )[0]

    forward = jax.jit(loss)
    backward = jax.jit(jax.grad(loss))
    grads = backward(state.params) if _PARTS.value else None
    update = jax.jit(lambda g, o, p: state.tx.update(g, o, p, schedule=run.schedule))
    gen_logits = jnp.zeros((*masked.positions.shape, state.model.vocab_size), jnp.float32)
    sample = jax.jit(lambda k, l: objectives.sample_tokens(k, l, objective.temperature, None))

    parts = {}
    if _PARTS.value:
      parts = {
          "forward (loss)": _time(forward, state.params),
          "forward + backward": _time(backward, state.params),
          "optimizer update": _time(update, grads, state.opt_state, state.params),
          "sampling (Gumbel over the vocabulary)": _time(sample, keys, gen_logits),
      }

    def whole(s):
      for i in range(_STEPS.value):
        s, metrics = step_fn(s, batch, train_state.step_rng(0, i), run.schedule)
      return s, metrics

    state, metrics = whole(state)  # warm (the step donates its input state)
    jax.block_until_ready(metrics)  # or the timed calls below would also wait for these
    start = time.perf_counter()
    state, metrics = whole(state)
    jax.block_until_ready(metrics)
    parts["whole train step"] = 1000 * (time.perf_counter() - start) / _STEPS.value

    kernels = []
    if _TRACE.value:
      with jax.profiler.trace(_TRACE.value, create_perfetto_trace=True):
        state, metrics = whole(state)
        jax.block_until_ready(metrics)
      kernels = _top_kernels(_TRACE.value, _STEPS.value)

  print(
      json.dumps(
          {
              "device": jax.devices()[0].device_kind,
              "batch": config.train.batch_size,
              "seq": config.data.max_seq_len,
              "dtype": config.train.dtype,
              "ms_per_call": {k: round(v, 3) for k, v in parts.items()},
              "top_kernels_ms_per_step": kernels,
          },
          indent=1,
      )
  )


def _top_kernels(directory, steps):
  """(name, ms per step, calls per step) of the device events in the Perfetto trace."""
  paths = glob.glob(f"{directory}/**/*perfetto_trace.json.gz", recursive=True)
  if not paths:
    return [["no perfetto trace written", 0, 0]]
  with gzip.open(sorted(paths)[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  # Device rows are the processes whose name mentions the GPU / TPU stream.
  names = {
      e["pid"]: e["args"].get("name", "")
      for e in events
      if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  device_pids = {
      pid for pid, name in names.items() if "/device:" in name or "GPU" in name or "TPU" in name
  }
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (not device_pids or e.get("pid") in device_pids):
      total[e["name"]] += e.get("dur", 0) / 1000
      count[e["name"]] += 1
  busy = sum(total.values())
  rows = [
      [
          "(all device events; processes: "
          + "; ".join(sorted(names[p] for p in device_pids))[:200]
          + ")",
          round(busy / steps, 3),
          sum(count.values()) / steps,
      ]
  ]
  rows += [
      [n[:90], round(t / steps, 3), count[n] / steps] for n, t in total.most_common(_TOP.value)
  ]
  return rows


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.flags_parser("step_profile"))
