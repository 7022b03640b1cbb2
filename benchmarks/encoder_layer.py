"""One encoder layer, forward and backward with dropout, timed alternately in one process:
electra-jax's `encoder.EncoderLayer`, the same layer with flax's N-D dense product instead of
`encoder.rows_dot_general` (--flax_dense), the layer with Primer's convolution of width K after
q, k and v (--attention_conv=K; its cost is that variant against the first), and, with --torch,
Hugging Face's PyTorch `ElectraLayer` (sdpa) at the same sizes. Reports min and median per
variant.

  python benchmarks/encoder_layer.py --flax_dense --torch     # electra_small's discriminator layer
  python benchmarks/encoder_layer.py --hidden=128 --heads=2 --ffn=512 --batch=64 --attention_conv=3
"""

import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone

from electra_jax import xla_flags  # noqa: E402

xla_flags.apply_cpu_defaults()  # the CLI's start-up settings, before JAX starts

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import app, flags

from electra_jax import encoder

_HIDDEN = flags.DEFINE_integer("hidden", 256, "Hidden size.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_FFN = flags.DEFINE_integer("ffn", 1024, "Intermediate size.")
_BATCH = flags.DEFINE_integer("batch", 32, "Batch size.")
_SEQ = flags.DEFINE_integer(
    "seq", 128, "Sequence length (the last quarter of every row is padding)."
)
_RUNS = flags.DEFINE_integer("runs", 40, "Timed runs per variant.")
_FLAX_DENSE = flags.DEFINE_boolean(
    "flax_dense", False, "Also time the layer with nn.Dense's own N-D product."
)
_CONV = flags.DEFINE_integer(
    "attention_conv", 0, "Also time the layer with model.attention_conv of this width."
)
_TORCH = flags.DEFINE_boolean("torch", False, "Also time transformers' PyTorch ElectraLayer.")
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "Compute dtype (float32 parameters either way; PyTorch under autocast).",
)


def _jax_layer(x, mask, attention_conv=0):
  config = encoder.EncoderConfig(
      _HIDDEN.value, 1, _HEADS.value, _FFN.value, attention_conv=attention_conv
  )
  layer = encoder.EncoderLayer(config, jnp.dtype(_DTYPE.value))
  params = nn.meta.unbox(
      layer.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x, mask, False)
  )

  def loss(p, x, key):
    y = layer.apply(p, x, mask, False, rngs={"dropout": key})
    return (y * y).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  counter = itertools.count()
  step = lambda: jax.block_until_ready(grad(params, x, jax.random.key(next(counter))))  # noqa: E731
  step()  # traces and compiles now, under the dense product chosen at this point
  return step


def _torch_layer():
  import torch  # noqa: PLC0415
  from transformers import ElectraConfig  # noqa: PLC0415
  from transformers.models.electra.modeling_electra import ElectraLayer  # noqa: PLC0415

  torch.set_num_threads(os.cpu_count())
  device = "cuda" if torch.cuda.is_available() else "cpu"
  autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=_DTYPE.value == "bfloat16")
  config = ElectraConfig(
      hidden_size=_HIDDEN.value,
      num_attention_heads=_HEADS.value,
      intermediate_size=_FFN.value,
      hidden_act="gelu",
  )
  config._attn_implementation = "sdpa"  # noqa: SLF001
  layer = ElectraLayer(config).train().to(device)
  x = torch.randn(_BATCH.value, _SEQ.value, _HIDDEN.value, device=device, requires_grad=True)
  real = torch.ones(_BATCH.value, _SEQ.value, device=device)
  real[:, _SEQ.value * 3 // 4 :] = 0
  additive = (1.0 - real[:, None, None, :]) * torch.finfo(torch.float32).min

  def step():
    layer.zero_grad()
    x.grad = None
    with autocast:
      out = layer(x, attention_mask=additive)
      out = out[0] if isinstance(out, tuple) else out
      loss = (out.float() * out.float()).sum()
    loss.backward()
    if device == "cuda":
      torch.cuda.synchronize()

  return step


def main(argv):
  del argv
  x = jax.random.normal(jax.random.key(0), (_BATCH.value, _SEQ.value, _HIDDEN.value))
  mask = jnp.ones((_BATCH.value, _SEQ.value), jnp.int32).at[:, _SEQ.value * 3 // 4 :].set(0)
  variants = {"electra-jax": _jax_layer(x, mask)}
  if _FLAX_DENSE.value:
    rows_dot_general = encoder.rows_dot_general
    encoder.rows_dot_general = jax.lax.dot_general  # what nn.Dense uses by default
    variants["electra-jax, flax N-D dense"] = _jax_layer(x, mask)
    encoder.rows_dot_general = rows_dot_general
  if _CONV.value:
    variants[f"electra-jax, attention_conv={_CONV.value}"] = _jax_layer(x, mask, _CONV.value)
  if _TORCH.value:
    variants["PyTorch ElectraLayer (sdpa)"] = _torch_layer()
  times = {name: [] for name in variants}
  for step in variants.values():
    step()  # warm up
  for _ in range(_RUNS.value):
    for name, step in variants.items():
      start = time.perf_counter()
      step()
      times[name].append(1000 * (time.perf_counter() - start))
  print(
      f"one layer fwd+bwd, H {_HIDDEN.value}, {_HEADS.value} heads, FFN {_FFN.value}, batch {_BATCH.value}, "
      f"seq {_SEQ.value}, dropout 0.1, {_DTYPE.value}, {_RUNS.value} runs each, interleaved ({jax.devices()[0].platform})"
  )
  for name, values in times.items():
    print(f"  {name:32s} min {min(values):7.1f} ms   median {statistics.median(values):7.1f} ms")


if __name__ == "__main__":
  app.run(main)
