"""Pre-training throughput of electra-jax's compiled train step: tokens/s, step time, model
FLOPs per token and MFU (where the device's peak is known), on real batches of the built-in
corpus. Compile time is excluded; each figure is the median of several timed windows.

  python benchmarks/pretrain_throughput.py --config=configs/electra_small.py \
      --config.train.batch_size=32 --steps=20 --windows=3

With --vs-huggingface the same run also times the Hugging Face transformers PyTorch ELECTRA
pre-training step (benchmarks/hf_peer.py) on the same batches, interleaving the timed windows
(ours, theirs, ours, theirs, ...) so both see the same machine load, and reports the ratio:

  python benchmarks/pretrain_throughput.py --config=configs/electra_small.py \
      --config.train.batch_size=32 --vs-huggingface

Like the CLI, it applies electra_jax.xla_flags' CPU defaults (ELECTRA_JAX_XLA_DEFAULTS=0 to
measure without them). Figures and the commands that produced them are kept in benchmarks/RESULTS.md.
"""

import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults()  # the CLI's start-up settings, before JAX starts

import jax
import numpy as np
from absl import app, flags

from electra_jax import config_lib, data, flops, partitioning, resolve, train_state

_CONFIG = config_lib.define_config_flag("configs/demo.py", "Recipe to measure.")
_STEPS = flags.DEFINE_integer("steps", 20, "Train steps per timed window.")
_WINDOWS = flags.DEFINE_integer("windows", 3, "Timed windows; the median is reported.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps after compiling.")
_VS_HF = flags.DEFINE_boolean(
    "vs-huggingface", False, "Also time Hugging Face's PyTorch ELECTRA step on the same batches."
)
_HF_GATHERED = flags.DEFINE_boolean(
    "hf-gathered",
    False,
    "With --vs-huggingface, also time a PyTorch variant whose MLM head runs only at the masked "
    "positions (the default peer computes vocabulary logits at every position).",
)


def main(argv):
  del argv
  if _STEPS.value < 1 or _WINDOWS.value < 1 or _WARMUP.value < 0:
    sys.exit(
        f"--steps={_STEPS.value} and --windows={_WINDOWS.value} must be >= 1, --warmup={_WARMUP.value} >= 0."
    )
  config = _CONFIG.value
  resolved = resolve.run(config)
  mesh, corpus, setup, schedule = resolved.mesh, resolved.corpus, resolved.setup, resolved.schedule
  batch_size, seq_len = config.train.batch_size, config.data.max_seq_len

  with partitioning.activate(mesh):
    state = train_state.fresh_state(setup, 0)
    compile_start = time.perf_counter()
    step_fn = train_state.compile_train_step(setup, config, mesh)
    per_call = config.train.get("steps_per_call", 1)
    if per_call > 1:  # train.steps_per_call: k steps per compiled call (lax.scan)
      steps_fn = train_state.compile_train_step(setup, config, mesh, per_call)
    compile_seconds = time.perf_counter() - compile_start

  keys = data.batch_keys(config.data.pack_rows)
  batches = [
      partitioning.global_batch_from_local(
          data.get_batch(corpus, i, batch_size, 0), mesh, keys=keys
      )
      for i in range(_STEPS.value)
  ]

  first_loss = None

  stacked = []
  if per_call > 1:
    host = [data.get_batch(corpus, i, batch_size, 0) for i in range(per_call)]
    stacked = [
        partitioning.global_batch_from_local(
            {name: np.stack([b[name] for b in host]) for name in keys}, mesh, stacked=True
        )
    ]

  def run(num_steps, offset):
    nonlocal state, first_loss
    if num_steps == 0:
      return
    i = 0
    while i < num_steps:
      if first_loss is None or per_call == 1 or num_steps - i < per_call:
        state, metrics = step_fn(
            state, batches[i % len(batches)], train_state.step_rng(0, offset + i), schedule
        )
        i += 1
      else:
        state, metrics = steps_fn(
            state, stacked[0], train_state.step_rngs(0, offset + i, per_call), schedule
        )
        i += per_call
      if first_loss is None:  # the freshly initialized model on batch 0
        first_loss = float(metrics["loss"])
    jax.block_until_ready(metrics)

  def time_ours(window):
    start = time.perf_counter()
    run(_STEPS.value, 1000 * (window + 1))
    return (time.perf_counter() - start) / _STEPS.value

  # Peers: name -> (object with .step(numpy batch), the loss of its first step on batch 0).
  peers = {}
  if _VS_HF.value:
    import hf_peer  # torch and transformers are needed only here

    host_batches = [data.get_batch(corpus, i, batch_size, 0) for i in range(_STEPS.value)]
    variants = {"huggingface": False}
    if _HF_GATHERED.value:
      variants["huggingface_gathered"] = True
    import torch

    on_gpu = jax.devices()[0].platform == "gpu"
    for key, peer_value in (("norm", "post"), ("ffn", "gelu"), ("use_bias", True)):
      if config.model[key] != peer_value:  # transformers' ELECTRA has only the default encoder
        raise SystemExit(
            f"--vs-huggingface: model.{key}={config.model[key]!r} has no transformers "
            "ElectraModel form, so the peer would not be like for like."
        )
    if on_gpu and not torch.cuda.is_available():
      raise SystemExit(
          "JAX runs on a GPU but PyTorch sees none: the peer would not be like for like."
      )
    # Like for like: the peer runs where we run, in bfloat16 autocast when we compute in bf16.
    peer_device = "cuda" if on_gpu else "cpu"
    autocast = torch.bfloat16 if config.train.dtype == "bfloat16" else None
    for name, gather in variants.items():
      peer = hf_peer.HfElectraPretraining(
          config, setup.objective, gather_masked=gather, device=peer_device, autocast_dtype=autocast
      )
      assert peer.shares_embeddings()
      peers[name] = [peer, peer.step(host_batches[0])]
      for i in range(1, _WARMUP.value):
        peer.step(host_batches[i % len(host_batches)])

    def time_peer(peer):
      start = time.perf_counter()
      for i in range(_STEPS.value):
        peer.step(host_batches[i % len(host_batches)], sync=False)
      peer.synchronize()
      return (time.perf_counter() - start) / _STEPS.value

  run(_WARMUP.value, 0)
  seconds = {"electra_jax": []}
  seconds.update({name: [] for name in peers})
  for window in range(_WINDOWS.value):  # interleaved: ours, theirs, ours, theirs, ...
    seconds["electra_jax"].append(time_ours(window))
    for name, (peer, _) in peers.items():
      seconds[name].append(time_peer(peer))
  step_seconds = statistics.median(seconds["electra_jax"])
  tokens_per_sec = batch_size * seq_len / step_seconds
  flops_per_token = flops.objective_flops_per_token(setup.model, setup.objective, seq_len)
  peak = flops.peak_flops(jax.devices()[0])
  result = {
      "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "host": platform.processor() or platform.machine(),
      "batch_size": batch_size,
      "seq_len": seq_len,
      "dtype": config.train.dtype,
      "steps_per_call": per_call,
      "compile_seconds": round(compile_seconds, 1),
      "step_ms": round(1000 * step_seconds, 2),
      "tokens_per_sec": round(tokens_per_sec, 1),
      "model_flops_per_token": round(flops_per_token),
      "achieved_tflops": round(tokens_per_sec * flops_per_token / 1e12, 4),
      "mfu": None
      if peak is None
      else round(tokens_per_sec * flops_per_token / (peak * jax.device_count()), 4),
      "jax": jax.__version__,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  if peers:
    import torch
    import transformers

    result["step0_loss"] = round(first_loss, 4)
    result["window_step_ms"] = {
        name: [round(1000 * s, 1) for s in values] for name, values in seconds.items()
    }
    result["windows_interleaved"] = _WINDOWS.value
    result["steps_per_window"] = _STEPS.value
    for name, (peer, peer_first_loss) in peers.items():
      peer_seconds = statistics.median(seconds[name])
      peer_tokens_per_sec = batch_size * seq_len / peer_seconds
      result[name] = {
          "mlm_head": "masked positions only"
          if peer.gather_masked
          else "every position (labels=-100)",
          "step_ms": round(1000 * peer_seconds, 2),
          "tokens_per_sec": round(peer_tokens_per_sec, 1),
          "step0_loss": round(peer_first_loss, 4),
          "parameters": peer.num_parameters(),
          "ratio_ours_over_theirs": round(tokens_per_sec / peer_tokens_per_sec, 3),
      }
    result["torch"] = torch.__version__
    result["torch_device"] = peer_device
    result["torch_autocast"] = str(autocast)
    result["torch_attention"] = peer.discriminator.config._attn_implementation
    result["torch_threads"] = torch.get_num_threads()
    result["transformers"] = transformers.__version__
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.flags_parser("pretrain_throughput"))
