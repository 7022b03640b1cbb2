"""Probes of replaced-token detection on the demo's data: how well simple models detect replacements
drawn from the corpus's unigram distribution, and whether the demo's discriminator learns to.

  python benchmarks/rtd_probes.py ceiling     # bigram counts (no training) on the held-out rows
  python benchmarks/rtd_probes.py bilinear --learning_rate=1e-2   # a neighbour bilinear model
  python benchmarks/rtd_probes.py unigram --workdir=W -- --config.objective.temperature=1.0 ...

`unigram` runs `electra-jax --config=configs/demo.py` (with the overrides after --) with the
generator's logits replaced by the log unigram frequencies of the training rows: its gradient is 0,
so the discriminator learns from its own loss alone, against replacements a bigram model tells
apart. `ceiling` and `bilinear` read the demo's prepared data: run the demo once first (it builds
the cache). The figures and their reading: docs/small_budget.md.
"""

import argparse
import glob
import os
import sys

import numpy as np

MASK_PROB = 0.15


def _prepared(cache: str):
  """(train rows, eval rows) of the demo's prepared cache, each a list of int arrays ([CLS] .. [SEP])."""
  found = sorted(glob.glob(os.path.join(cache, "builtin", "*", "len128")))
  if not found:
    sys.exit(
        f"no prepared built-in corpus under {cache}: run `electra-jax --config=configs/demo.py "
        "--workdir=W` once first (or pass --cache)."
    )
  rows = {}
  for split in ("train", "eval"):
    ids = np.load(os.path.join(found[-1], f"{split}-00000.npy"))[:, 0].astype(np.int64)
    lengths = np.load(os.path.join(found[-1], f"{split}-00000.lengths.npy"))
    rows[split] = [ids[i, :n] for i, n in enumerate(lengths)]
  return rows["train"], rows["eval"]


def _unigram(rows, vocab: int) -> np.ndarray:
  counts = np.bincount(np.concatenate([r[1:-1] for r in rows]), minlength=vocab).astype(np.float64)
  return counts + 0.01


def _corrupt(row, probs, rng):
  """A row with MASK_PROB of its inner tokens replaced by unigram draws; (row, replaced mask)."""
  inner = np.arange(1, len(row) - 1)
  positions = inner[rng.random(len(inner)) < MASK_PROB]
  out = row.copy()
  out[positions] = rng.choice(len(probs), size=len(positions), p=probs)
  return out, out != row


def _auc(labels, scores) -> float:
  from sklearn.metrics import roc_auc_score  # noqa: PLC0415 (a test extra)

  return float(roc_auc_score(labels, scores))


def ceiling(args) -> None:
  """Bigram counts of the training rows: score = -(PMI of (left, token) + PMI of (token, right)),
  add-k smoothed towards the unigram frequencies; AUC over the held-out rows' inner tokens."""
  train, held_out = _prepared(args.cache)
  unigram = _unigram(train, args.vocab)
  probs = unigram / unigram.sum()
  pairs = {}
  for row in train:
    for a, b in zip(row[:-1].tolist(), row[1:].tolist()):
      pairs[a, b] = pairs.get((a, b), 0) + 1
  k = 0.1

  def pmi(a, b):
    return np.log(
        (pairs.get((a, b), 0) + k * probs[b] * args.vocab) / (unigram[a] + k * args.vocab)
    ) - np.log(probs[b])

  rng = np.random.default_rng(0)
  labels, scores = [], []
  for _ in range(args.rounds):
    for row in held_out:
      corrupted, replaced = _corrupt(row, probs, rng)
      for i in range(1, len(row) - 1):
        scores.append(-(pmi(corrupted[i - 1], corrupted[i]) + pmi(corrupted[i], corrupted[i + 1])))
        labels.append(replaced[i])
  print(
      f"bigram counts, {len(held_out)} held-out rows x {args.rounds} draws: AUC {_auc(labels, scores):.3f}"
  )


def bilinear(args) -> None:
  """score(i) = bias[t_i] - u[t_i] . (A e[t_{i-1}] + B e[t_{i+1}]), trained with AdamW on the demo's
  batches (32 rows, warmup 60 steps, linear decay over 600) against unigram replacements."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  train, held_out = _prepared(args.cache)
  unigram = _unigram(train, args.vocab)
  probs = unigram / unigram.sum()
  width, vocab = args.width, args.vocab
  keys = jax.random.split(jax.random.key(0), 4)
  params = dict(
      e=0.02 * jax.random.normal(keys[0], (vocab, width)),
      u=0.02 * jax.random.normal(keys[1], (vocab, width)),
      a=jnp.eye(width) + 0.02 * jax.random.normal(keys[2], (width, width)),
      b=jnp.eye(width) + 0.02 * jax.random.normal(keys[3], (width, width)),
      bias=jnp.zeros(vocab),
  )

  def logits(p, ids):
    e = p["e"][ids]
    left = jnp.pad(e[:, :-1], ((0, 0), (1, 0), (0, 0)))
    right = jnp.pad(e[:, 1:], ((0, 0), (0, 1), (0, 0)))
    return p["bias"][ids] - (p["u"][ids] * (left @ p["a"] + right @ p["b"])).sum(-1)

  def loss(p, ids, labels, weights):
    per_token = optax.sigmoid_binary_cross_entropy(logits(p, ids), labels)
    return (per_token * weights).sum() / weights.sum()

  warmup, steps = 60, args.steps
  schedule = optax.join_schedules(
      [
          optax.linear_schedule(0.0, args.learning_rate, warmup),
          optax.linear_schedule(args.learning_rate, 0.0, steps - warmup),
      ],
      [warmup],
  )
  tx = optax.adamw(schedule, weight_decay=0.01)
  state = tx.init(params)

  @jax.jit
  def step(p, s, ids, labels, weights):
    value, grads = jax.value_and_grad(loss)(p, ids, labels, weights)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value

  def batch(rows, rng):
    corrupted = [_corrupt(row, probs, rng) for row in rows]
    length = max(len(r) for r in rows)
    ids, labels, weights = (
        np.zeros((len(rows), length), t) for t in (np.int32, np.float32, np.float32)
    )
    for i, (row, replaced) in enumerate(corrupted):
      ids[i, : len(row)], labels[i, : len(row)], weights[i, 1 : len(row) - 1] = row, replaced, 1.0
    return ids, labels, weights

  rng, eval_rng = np.random.default_rng(0), np.random.default_rng(1)
  held_out_batches = [batch(held_out, eval_rng) for _ in range(4)]
  for i in range(1, steps + 1):
    rows = [train[j] for j in rng.integers(0, len(train), 32)]
    params, state, _ = step(params, state, *batch(rows, rng))
    if i % 200 == 0 or i == steps:
      scores = [
          (np.asarray(logits(params, ids))[w > 0], lab[w > 0]) for ids, lab, w in held_out_batches
      ]
      auc = _auc(np.concatenate([s[1] for s in scores]), np.concatenate([s[0] for s in scores]))
      print(f"step {i}: held-out AUC {auc:.3f}", flush=True)


def unigram(args, overrides) -> None:
  """The demo, its generator's logits replaced by the training rows' log unigram frequencies."""
  import jax.numpy as jnp  # noqa: PLC0415

  from electra_jax import main, objectives  # noqa: PLC0415

  train, _ = _prepared(args.cache)
  log_unigram = jnp.asarray(np.log(_unigram(train, args.vocab)), jnp.float32)
  generator_logits = objectives.pieces.generator_logits

  def from_unigram(p):
    logits = generator_logits(
        p
    )  # kept in the graph (times 0): the generator's parameters get zero gradients
    return jnp.broadcast_to(log_unigram[: logits.shape[-1]], logits.shape) + 0.0 * logits

  objectives.pieces.generator_logits = from_unigram  # what pieces.detect calls
  sys.argv = [sys.argv[0], "--config=configs/demo.py", f"--workdir={args.workdir}", *overrides]
  main.run()


if __name__ == "__main__":
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("probe", choices=["ceiling", "bilinear", "unigram"])
  parser.add_argument(
      "--cache",
      default=os.environ.get("ELECTRA_JAX_CACHE", os.path.expanduser("~/.cache/electra_jax")),
  )
  parser.add_argument("--vocab", type=int, default=8192, help="the demo's vocabulary size")
  parser.add_argument(
      "--rounds", type=int, default=5, help="ceiling: replacement draws per held-out row"
  )
  parser.add_argument(
      "--learning_rate", type=float, default=1e-2, help="bilinear: peak learning rate"
  )
  parser.add_argument("--width", type=int, default=64, help="bilinear: embedding width")
  parser.add_argument("--steps", type=int, default=600, help="bilinear: optimizer steps")
  parser.add_argument(
      "--workdir", default="workdirs/rtd_unigram", help="unigram: the run's workdir"
  )
  known, rest = parser.parse_known_args()
  rest = rest[1:] if rest[:1] == ["--"] else rest
  if known.probe != "unigram" and rest:
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  {
      "ceiling": lambda: ceiling(known),
      "bilinear": lambda: bilinear(known),
      "unigram": lambda: unigram(known, rest),
  }[known.probe]()
