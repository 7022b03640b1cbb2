"""Does each attention implementation compute the reference function on this device?

Runs the pre-trainer's discriminator and generator with model.attention_impl=xla (the
reference) and every other implementation that runs here (cudnn needs an NVIDIA GPU, splash a TPU), in
float32 and bfloat16, on right-padded random rows and on packed rows (segment ids), and prints
the relative error ||out - ref|| / ||ref|| of the logits and of the parameter gradients.

  python benchmarks/attention_check.py            # electra_small sizes, seq 128
  python benchmarks/attention_check.py --seq=512 --hidden=768 --heads=12
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from electra_jax import config_lib, models  # noqa: E402


def _config(args, impl, dtype, packed):
  base = config_lib.sibling(
      os.path.join(os.path.dirname(__file__), "..", "configs", "base.py"), "base"
  )
  config = base.get_config()
  config.model.update(
      hidden_size=args.hidden,
      num_heads=args.heads,
      intermediate_size=4 * args.hidden,
      num_layers=2,
      attention_impl=impl,
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
  )
  config.data.max_seq_len = args.seq
  config.data.pack_rows = packed
  config.train.dtype = dtype
  return config


def _batch(args, packed):
  rng = np.random.default_rng(0)
  ids = rng.integers(5, 30000, size=(args.batch, args.seq)).astype(np.int32)
  lengths = rng.integers(args.seq // 4, args.seq + 1, size=args.batch)
  mask = (np.arange(args.seq)[None, :] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, ids, 0)
  if packed:  # two or three examples per row
    cut1, cut2 = lengths // 3, 2 * lengths // 3
    pos = np.arange(args.seq)[None, :]
    mask = mask * (1 + (pos >= cut1[:, None]) + (pos >= cut2[:, None]))
  positions = np.stack([rng.choice(int(n), size=8, replace=False) for n in lengths]).astype(
      np.int32
  )
  return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions)


def _run(args, impl, dtype, packed):
  model = models.build_model(_config(args, impl, dtype, packed), models.Towers())
  ids, mask, positions = _batch(args, packed)
  types = jnp.zeros_like(ids)
  params = model.init(jax.random.key(0), ids, types, mask, positions)["params"]

  def loss(p):
    gen, disc = model.apply({"params": p}, ids, types, mask, positions)
    real = (mask > 0).astype(jnp.float32)
    return (disc * real).sum() / real.sum() + gen.mean(), (gen, disc * real)

  (_, (gen, disc)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return gen, disc, grads


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--heads", type=int, default=4)
  args = parser.parse_args()
  platform = jax.devices()[0].platform
  # splash off TPU would run in Pallas's interpret mode (tests/test_splash_attention.py does).
  impls = ["xla"] + {"gpu": ["cudnn"], "tpu": ["splash"]}.get(platform, [])
  rows = []
  for packed in (False, True):
    for dtype in ("float32", "bfloat16"):
      ref_gen, ref_disc, ref_grads = _run(args, "xla", "float32", packed)  # float32 reference
      for impl in impls:
        try:
          gen, disc, grads = _run(args, impl, dtype, packed)
        except Exception as error:  # an implementation may not support a case: say which
          rows.append(
              {
                  "impl": impl,
                  "dtype": dtype,
                  "packed": packed,
                  "error": f"{type(error).__name__}: {error}"[:300],
              }
          )
          continue
        # Over all gradients at once: a few leaves are zero in exact arithmetic (the key bias
        # shifts every score of a query alike), so their own relative error means nothing.
        flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])  # noqa: E731
        rows.append(
            {
                "impl": impl,
                "dtype": dtype,
                "packed": packed,
                "disc_rel_err": _rel(disc, ref_disc),
                "gen_rel_err": _rel(gen, ref_gen),
                "grad_rel_err": _rel(flat(grads), flat(ref_grads)),
                "finite": bool(np.isfinite(np.asarray(disc)).all()),
            }
        )
  print(
      json.dumps(
          {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, indent=1
      )
  )


if __name__ == "__main__":
  main()
