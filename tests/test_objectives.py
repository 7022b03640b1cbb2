"""The RTD objective: masking rule, sampling, labels, the loss by hand, gradient flow, metrics."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.export  # jax 0.6 (Python 3.10) loads it only when asked
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import config_lib, data, models, objectives, optimizer, partitioning, train_state

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4


def _objective(**changes):
  base = objectives.ElectraObjective(
      mask_prob=0.15,
      max_predictions=19,
      gen_weight=1.0,
      disc_weight=50.0,
      temperature=1.0,
      keep_original_prob=0.15,
      mask_id=MASK,
      pad_id=PAD,
      cls_id=CLS,
      sep_id=SEP,
  )
  return dataclasses.replace(base, **changes)


def _random_batch(seed, batch=64, seq=128, vocab=300):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, vocab, size=(batch, seq)).astype(np.int32)
  lengths = rng.integers(3, seq + 1, size=batch)
  lengths[:4] = [3, 10, min(30, seq), seq]  # 10 * 0.15 = 1.5 and 30 * 0.15 ~ 4.5: rounding
  mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
  ids[:, 0] = CLS
  ids[np.arange(batch), lengths - 1] = SEP
  middle = seq // 3
  ids[:, middle] = np.where(
      lengths > middle + 1, SEP, ids[:, middle]
  )  # a second [SEP] in long rows
  ids = np.where(mask > 0, ids, PAD)
  return ids, mask


def test_official_slot_count():
  assert objectives.official_max_predictions(0.15, 128) == 19
  assert objectives.official_max_predictions(0.15, 512) == 79
  assert objectives.official_max_predictions(0.25, 512) == 130


def test_mask_count_rule_and_candidates():
  ids, mask = _random_batch(0)
  objective = _objective()
  masked = objectives.mask_tokens(jax.random.key(1), jnp.asarray(ids), jnp.asarray(mask), objective)
  positions, weights = np.asarray(masked.positions), np.asarray(masked.weights)
  for row in range(ids.shape[0]):
    n = mask[row].sum()
    candidates = {
        t for t in range(ids.shape[1]) if mask[row, t] and ids[row, t] not in (CLS, SEP, PAD, MASK)
    }
    # float32 arithmetic and round-half-to-even, as the official TF code computes it
    want = int(np.clip(np.round(np.float32(n) * np.float32(0.15)), 1, 19))
    want = min(want, len(candidates))
    used = positions[row][weights[row] > 0]
    assert len(used) == want, (row, n)
    assert len(set(used)) == len(used)
    assert set(used) <= candidates
    # Outside the chosen positions nothing changes; at them: [MASK] or the original token.
    changed = np.flatnonzero(np.asarray(masked.input_ids[row]) != ids[row])
    assert set(changed) <= set(used)
    assert all(masked.input_ids[row, t] == MASK for t in changed)
  assert weights[1].sum() == 2  # length 10: round(1.5) = 2
  assert weights[0].sum() == 1  # length 3: [CLS] x [SEP], at least one and only one candidate


def test_eighty_five_percent_become_mask():
  ids, mask = _random_batch(1, batch=1024)
  masked = objectives.mask_tokens(
      jax.random.key(2), jnp.asarray(ids), jnp.asarray(mask), _objective()
  )
  weights = np.asarray(masked.weights) > 0
  at_positions = np.take_along_axis(np.asarray(masked.input_ids), np.asarray(masked.positions), 1)
  share = (at_positions[weights] == MASK).mean()
  assert weights.sum() > 10_000
  assert abs(share - 0.85) < 0.015


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_gumbel_sampling_matches_softmax(temperature):
  logits = jnp.array([2.0, 0.5, -1.0, 1.0, 0.0])
  keys = jax.random.split(jax.random.key(0), 40_000)
  draws = objectives.sample_tokens(keys, jnp.broadcast_to(logits, (40_000, 5)), temperature)
  freq = np.bincount(np.asarray(draws), minlength=5) / 40_000
  np.testing.assert_allclose(freq, jax.nn.softmax(logits / temperature), atol=0.01)


def test_sample_equal_to_original_is_labelled_original():
  ids = jnp.array([[CLS, 10, 11, 12, SEP]])
  masked = objectives.pieces.MaskedInputs(
      input_ids=jnp.array([[CLS, MASK, 11, MASK, SEP]]),
      positions=jnp.array([[1, 3, 2]]),
      weights=jnp.array([[1.0, 1.0, 0.0]]),
      target_ids=jnp.array([[10, 12, 11]]),
  )
  corrupted, is_replaced = objectives.pieces.corrupt(ids, masked, jnp.array([[10, 99, 55]]))
  np.testing.assert_array_equal(corrupted, [[CLS, 10, 11, 99, SEP]])  # unused slot ignored
  np.testing.assert_array_equal(is_replaced, [[False, False, False, True, False]])


class _FixedLogits:
  """Stands in for ElectraPretrainer with known outputs, so the loss can be worked by hand."""

  towers = models.Towers()

  def __init__(self, gen_logits, disc_logits):
    self.gen_logits, self.disc_logits = gen_logits, disc_logits

  def generator_logits(self):
    raise NotImplementedError

  def discriminator_logits(self):
    raise NotImplementedError

  def apply(self, variables, *args, deterministic, method, rngs):
    return self.gen_logits if method == self.generator_logits else self.disc_logits


def test_hand_computed_loss_and_metrics():
  vocab = 8
  ids = jnp.array([[CLS, 5, 6, 7, SEP, PAD]])
  attention_mask = jnp.array([[1, 1, 1, 1, 1, 0]])
  masked = objectives.pieces.MaskedInputs(
      input_ids=jnp.array([[CLS, MASK, 6, 7, SEP, PAD]]),
      positions=jnp.array([[1, 3, 2]]),
      weights=jnp.array([[1.0, 1.0, 0.0]]),
      target_ids=jnp.array([[5, 7, 6]]),
  )
  # Slot 0: the original token 5 dominates (sampled back: "original"). Slot 1: token 6
  # dominates over the original 7 (sampled: "replaced"). A margin of 40 beats any Gumbel draw.
  gen_logits = np.zeros((1, 3, vocab), np.float32)
  gen_logits[0, 0, 5] = 40.0
  gen_logits[0, 1, 6], gen_logits[0, 1, 7] = 40.0, 1.5
  disc_logits = np.array([[0.5, -1.0, 2.0, 0.3, -0.2, 9.0]], np.float32)
  model = _FixedLogits(jnp.asarray(gen_logits), jnp.asarray(disc_logits))
  batch = {
      "input_ids": ids,
      "token_type_ids": jnp.zeros_like(ids),
      "attention_mask": attention_mask,
  }
  objective = _objective(max_predictions=3)
  normalizers = objectives.Normalizers.of(masked, attention_mask)
  loss, (stats, per_token) = objectives.electra_forward(
      model,
      None,
      batch,
      masked,
      jax.random.split(jax.random.key(0), 1),
      jax.random.key(1),
      objective,
      normalizers,
  )

  def nll(row, target):
    return math.log(sum(math.exp(v) for v in row)) - row[target]

  mlm = (nll(gen_logits[0, 0], 5) + nll(gen_logits[0, 1], 7)) / 2
  labels = [0, 0, 0, 1, 0]  # only position 3 was replaced; padding (position 5) is ignored
  disc = sum(math.log(1 + math.exp(z)) - z * y for z, y in zip(disc_logits[0, :5], labels)) / 5
  assert float(loss) == pytest.approx(mlm + 50.0 * disc, rel=1e-6)

  metrics = objectives.summarize(stats, per_token, objective)
  assert float(metrics["masked_lm_loss"]) == pytest.approx(mlm, rel=1e-6)
  assert float(metrics["disc_loss"]) == pytest.approx(disc, rel=1e-6)
  assert float(metrics["masked_lm_accuracy"]) == 0.5  # argmax right at slot 0 only
  assert float(metrics["sampled_masked_lm_accuracy"]) == 0.5
  # predictions z > 0 at positions 0, 2, 3: TP = 1 (pos 3), FP = 2, TN = 2, FN = 0
  assert float(metrics["disc_accuracy"]) == pytest.approx(3 / 5)
  assert float(metrics["disc_precision"]) == pytest.approx(1 / 3)
  assert float(metrics["disc_recall"]) == 1.0
  # the positive (0.3) outranks 2 of the 4 negatives (-1.0, -0.2)
  assert float(metrics["disc_auc"]) == pytest.approx(0.5)
  # The one replacement (token 6 at logit 40) was near certain for the generator: "likely".
  assert (
      float(metrics["disc_auc_likely"]) == pytest.approx(0.5)
      and float(metrics["replaced_share_likely"]) == 1.0
  )
  assert np.isnan(metrics["disc_auc_unlikely"]) and float(metrics["replaced_share_unlikely"]) == 0.0
  # At each used masked slot (an original sampled back too), 0 elsewhere.
  np.testing.assert_allclose(per_token["replaced_prob"], [[0, 1, 0, 1, 0, 0]], atol=1e-6)


def test_disc_auc_by_how_likely_the_generator_found_the_replacement():
  # Six replaced tokens: probabilities 0.001, 0.005 (unlikely), 0.05 (plausible), 0.1, 0.5,
  # 0.9 (likely: 0.1 opens the bin); four originals; the padding entry (weight 0) is ignored.
  scores = np.array([[0.5, 3.0, 1.0, -1.0, 2.0, 0.0, 0.2, -0.5, 1.5, 0.8, 9.0]], np.float32)
  replaced = np.array([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1]], bool)
  prob = np.array([[0.001, 0.005, 0.05, 0.1, 0.5, 0.9, 0.0, 0.0, 0.0, 0.0, 0.001]], np.float32)
  weights = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], np.float32)
  per_token = {
      "disc_logits": jnp.asarray(scores),
      "is_replaced": jnp.asarray(replaced),
      "token_weights": jnp.asarray(weights),
      "replaced_prob": jnp.asarray(prob),
  }
  stats = {key: jnp.float32(1.0) for key in objectives.pieces.STAT_KEYS}
  metrics = objectives.summarize(stats, per_token, _objective())
  # Negatives 0.2, -0.5, 1.5, 0.8. Unlikely: 0.5 beats 2 of them, 3.0 all 4: (2 + 4) / 8.
  # Plausible: 1.0 beats 3: 3 / 4. Likely: -1.0 none, 2.0 all 4, 0.0 beats 1: 5 / 12.
  assert float(metrics["disc_auc_unlikely"]) == pytest.approx(6 / 8)
  assert float(metrics["disc_auc_plausible"]) == pytest.approx(3 / 4)
  assert float(metrics["disc_auc_likely"]) == pytest.approx(5 / 12)
  assert float(metrics["disc_auc"]) == pytest.approx((6 + 3 + 5) / 24)
  for name, share in (("unlikely", 2 / 6), ("plausible", 1 / 6), ("likely", 3 / 6)):
    assert float(metrics[f"replaced_share_{name}"]) == pytest.approx(share), name
  # An empty bin has no AUC; the mlm objective has no discriminator and no replacements.
  per_token["replaced_prob"] = jnp.asarray(np.where(prob < 0.01, 0.5, prob))
  assert np.isnan(objectives.summarize(stats, per_token, _objective())["disc_auc_unlikely"])
  mlm = objectives.summarize(stats, per_token, _objective(name="mlm"))
  assert all(np.isnan(mlm[name]) for name in objectives.BINNED_METRICS)


def test_sampling_temperature_falls_linearly_then_stays():
  objective = _objective(temperature=1.0, initial_temperature=3.0)
  decay = optimizer.learning_rate_schedule(
      1e-3, 1, 100, temperature_decay_steps=10
  ).temperature_decay
  for step, want in [(0, 3.0), (5, 2.0), (10, 1.0), (25, 1.0)]:
    assert float(objectives.sampling_temperature(objective, jnp.int32(step), decay)) == want, step
  # The final temperature is reached exactly at the last decay step, whatever its count (a step
  # times float32(1 / 49) falls short of 1 at step 49).
  for steps in (49, 427, 1003):
    decay = optimizer.learning_rate_schedule(
        1e-3, 1, 2 * steps, temperature_decay_steps=steps
    ).temperature_decay
    assert float(objectives.sampling_temperature(objective, jnp.int32(steps), decay)) == 1.0, steps
  # No schedule: the constant itself, a Python float, so nothing is traced.
  for constant in (_objective(temperature=2.0), _objective(initial_temperature=1.0)):
    assert objectives.sampling_temperature(constant, jnp.int32(3), decay) is constant.temperature
  # From the config: the decay ends at round(fraction * train.steps), and none is no schedule.
  config = tiny_config(
      **{
          "train.steps": 30,
          "objective.initial_temperature": 2.0,
          "objective.temperature_decay_fraction": 0.25,
      }
  )
  objective = objectives.objective_from_config(config, dict(pad=0, cls=2, sep=3, mask=4))
  assert objective.initial_temperature == 2.0 and objectives.temperature_decay_steps(config) == 8
  assert float(optimizer.make_schedule(config).temperature_decay) == 8
  # A fall shorter than a step takes one (round(0.3) = 0): step 0 samples at the initial
  # temperature, every later one at the final. The objective does not depend on train.steps.
  config.objective.temperature_decay_fraction = 0.01
  assert objectives.objective_from_config(config, dict(pad=0, cls=2, sep=3, mask=4)) == objective
  decay = optimizer.make_schedule(config).temperature_decay
  assert float(decay) == 1
  temperatures = [
      objectives.sampling_temperature(objective, jnp.int32(s), decay) for s in (0, 1, 5)
  ]
  assert [float(t) for t in temperatures] == [2.0, 1.0, 1.0]
  config.objective.temperature_decay_fraction = 0.0  # none: the constant
  assert (
      objectives.objective_from_config(
          config, dict(pad=0, cls=2, sep=3, mask=4)
      ).initial_temperature
      is None
  )


def test_the_default_temperature_compiles_the_constant_step():
  """initial_temperature equal to temperature traces the very step a constant one does; a
  schedule traces another, and the default step's loss is the explicitly constant one's."""
  reference = _traced_step()
  assert (
      _traced_step(
          **{"objective.initial_temperature": 1.0, "objective.temperature_decay_fraction": 0.5}
      )
      == reference
  )
  assert (
      _traced_step(
          **{"objective.initial_temperature": 2.0, "objective.temperature_decay_fraction": 0.5}
      )[0]
      != reference[0]
  )
  losses = []
  for overrides in (
      {},
      {"objective.initial_temperature": 1.0, "objective.temperature_decay_fraction": 1.0},
  ):
    state, batch, schedule = _tiny_state_and_batch(**overrides)
    losses.append(
        float(
            jax.jit(train_state.train_step)(state, batch, train_state.step_rng(0, 0), schedule)[1][
                "loss"
            ]
        )
    )
  assert losses[0] == losses[1]


def _tiny_state_and_batch(**overrides):
  config = tiny_config(**overrides)
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(
      config, dict(pad=0, cls=2, sep=3, mask=4, vocab_size=300)
  )
  state = nn.meta.unbox(train_state.make_init_fn(config, model, objective)(jax.random.key(0)))
  ids, mask = _random_batch(0, batch=config.train.batch_size, seq=config.data.max_seq_len)
  batch = {
      "input_ids": jnp.asarray(ids),
      "token_type_ids": jnp.zeros_like(ids),
      "attention_mask": jnp.asarray(mask),
  }
  return state, batch, optimizer.make_schedule(config)


class _RecordingModel:
  """Stands in for ElectraPretrainer: all-zero generator logits over `vocab_size` rows, and a
  discriminator that records the (corrupted) ids it is given."""

  def __init__(self, vocab_size, mlm_head=False, has_generator=True):
    self.vocab_size, self.mlm_head, self.discriminator_inputs = vocab_size, mlm_head, []
    self.towers = models.Towers(has_generator, mlm_head)

  def generator_logits(self):
    raise NotImplementedError

  def discriminator_logits(self):
    raise NotImplementedError

  def apply(self, variables, input_ids, types, mask, positions, deterministic, method, rngs):
    if method == self.generator_logits:
      return jnp.zeros((*positions.shape, self.vocab_size), jnp.float32)  # [batch, n_pred, rows]
    if self.mlm_head:  # (copy logits, MLM logits at the positions or all)
      rows = input_ids.shape if positions is None else positions.shape
      return jnp.zeros(input_ids.shape, jnp.float32), jnp.zeros(
          (*rows, self.vocab_size), jnp.float32
      )
    self.discriminator_inputs.append(np.asarray(input_ids))
    return jnp.zeros(input_ids.shape, jnp.float32)


@pytest.mark.parametrize("name", ["electra", "uniform"])
def test_replacements_and_mlm_softmax_cover_the_tokenizers_vocabulary_only(name):
  """model.vocab_size may exceed the tokenizer's vocabulary (30522 rows for an 8192-piece
  sentencepiece model in configs/electra_small.py); the rows past it are no tokens, so the
  generator (or the uniform replacement) must never sample them and L_MLM's softmax must not
  spread over them."""
  tokenizer_vocab, model_rows = 12, 64
  ids, mask = _random_batch(5, batch=64, seq=32, vocab=tokenizer_vocab)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  objective = _objective(name=name, max_predictions=4, vocab_size=tokenizer_vocab)
  masked = objectives.mask_tokens(jax.random.key(1), ids, mask, objective)
  model = _RecordingModel(model_rows, has_generator=name != "uniform")
  batch = {"input_ids": ids, "token_type_ids": jnp.zeros_like(ids), "attention_mask": mask}
  _, (stats, _) = objectives.electra_forward(
      model,
      None,
      batch,
      masked,
      jax.random.split(jax.random.key(2), 64),
      jax.random.key(3),
      objective,
      objectives.Normalizers.of(masked, mask),
  )
  (corrupted,) = model.discriminator_inputs
  assert int(corrupted.max()) < tokenizer_vocab  # every sample is a token of the vocabulary
  assert (corrupted != np.asarray(ids)).sum() > 50  # and many positions were replaced
  # All-zero logits over the vocabulary: L_MLM is log(vocabulary), not log(rows).
  mlm_loss = float(stats["mlm_loss_sum"]) / float(masked.weights.sum())
  assert mlm_loss == pytest.approx(math.log(tokenizer_vocab), rel=1e-6)


@pytest.mark.parametrize("name", ["mlm", "replace_mlm", "all_tokens_mlm"])
def test_the_discriminators_mlm_heads_score_the_tokenizers_vocabulary_only(name):
  """The BERT-family ablations' heads over the same rows: their softmax leaves out the rows
  past the tokenizer's vocabulary too, so their losses compare with ELECTRA's generator's."""
  tokenizer_vocab, model_rows = 12, 64
  ids, mask = _random_batch(5, batch=16, seq=32, vocab=tokenizer_vocab)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  objective = _objective(name=name, max_predictions=4, vocab_size=tokenizer_vocab)
  masked = objectives.mask_tokens(jax.random.key(1), ids, mask, objective)
  batch = {"input_ids": ids, "token_type_ids": jnp.zeros_like(ids), "attention_mask": mask}
  _, (stats, per_token) = objectives.electra_forward(
      _RecordingModel(model_rows, mlm_head=True),
      None,
      batch,
      masked,
      jax.random.split(jax.random.key(2), 16),
      jax.random.key(3),
      objective,
      objectives.Normalizers.of(masked, mask),
  )
  v = tokenizer_vocab
  if name == "mlm":
    assert float(stats["mlm_loss_sum"]) / float(masked.weights.sum()) == pytest.approx(
        math.log(v), rel=1e-6
    )
  elif name == "replace_mlm":
    assert float(stats["main_loss_sum"]) / float(stats["main_count"]) == pytest.approx(
        math.log(v), rel=1e-6
    )
  else:  # zero logits: copy probability 1/2; -log(1/2 + 1/(2V)) for a kept token, -log(1/(2V)) for a replaced one
    replaced = np.asarray(per_token["is_replaced"]) & (np.asarray(mask) > 0)
    kept = (np.asarray(mask) > 0) & ~replaced
    assert replaced.sum() > 20
    want = kept.sum() * -math.log(0.5 + 0.5 / v) + replaced.sum() * math.log(2 * v)
    assert float(stats["main_loss_sum"]) == pytest.approx(want, rel=1e-5)


def _auc(scores, labels, weights):
  """The AUC of every positive against every negative."""
  labels = jnp.asarray(labels)
  return objectives.pieces.binary_aucs(jnp.asarray(scores), labels, jnp.asarray(weights), [labels])[
      0
  ]


def test_binary_auc_matches_pairwise_count_with_ties():
  rng = np.random.default_rng(0)
  scores = np.round(rng.normal(size=300), 1).astype(np.float32)  # rounding makes ties
  labels = rng.random(300) < 0.3
  weights = (rng.random(300) < 0.9).astype(np.float32)
  pos, neg = scores[labels & (weights > 0)], scores[~labels & (weights > 0)]
  pairwise = ((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])).mean()
  got = _auc(scores, labels, weights)
  assert float(got) == pytest.approx(pairwise, abs=1e-6)


def test_binary_auc_of_a_large_batch_and_of_nan_scores():
  # 150k tokens: positives x negatives is past 2**31 pairs, where an int32 count wrapped
  # around (ELECTRA-Base's 256 x 512 batch is 131k tokens).
  rng = np.random.default_rng(0)
  labels = rng.random(150_000) < 0.15
  scores = (rng.normal(size=labels.size) + labels).astype(np.float32)
  weights = np.ones(labels.size, np.float32)
  neg = np.sort(scores[~labels].astype(np.float64))
  pos = scores[labels].astype(np.float64)
  below, up_to = np.searchsorted(neg, pos, "left"), np.searchsorted(neg, pos, "right")
  want = (below + 0.5 * (up_to - below)).sum() / (float(pos.size) * float(neg.size))
  got = _auc(scores, labels, weights)
  assert float(got) == pytest.approx(want, abs=1e-4) and 0.7 < want < 0.8
  scores[7] = np.nan  # a diverged model: no AUC rather than a number
  assert np.isnan(_auc(scores, labels, weights))
  weights[7] = 0.0  # unless the NaN is at a position the metric does not count
  assert float(_auc(scores, labels, weights)) == pytest.approx(want, abs=1e-4)


def _grads(objective):
  config = tiny_config()
  model = models.build_model(config, objectives.towers(config))
  ids, mask = _random_batch(3, batch=4, seq=32, vocab=config.model.vocab_size)
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  objective = dataclasses.replace(objective, max_predictions=4)
  positions = jnp.zeros((1, 4), jnp.int32)
  params = nn.meta.unbox(
      jax.jit(model.init)(jax.random.key(0), ids[:1], ids[:1], mask[:1], positions)["params"]
  )
  masked = objectives.mask_tokens(jax.random.key(1), ids, mask, objective)
  batch = {"input_ids": ids, "token_type_ids": jnp.zeros_like(ids), "attention_mask": mask}
  normalizers = objectives.Normalizers.of(masked, mask)
  sample_keys = jax.random.split(jax.random.key(2), 4)
  loss_fn = lambda p: objectives.electra_forward(
      model, p, batch, masked, sample_keys, jax.random.key(3), objective, normalizers
  )[0]
  return jax.jit(jax.grad(loss_fn))(params)


def test_disc_loss_gives_generator_exactly_zero_gradient_and_both_losses_reach_embeddings():
  disc_only = _grads(_objective(gen_weight=0.0))
  mlm_only = _grads(_objective(disc_weight=0.0))
  both = _grads(_objective())
  for leaf in jax.tree.leaves(disc_only["generator"]):
    assert not np.any(np.asarray(leaf))  # exactly zero: sampling is discrete
  for leaf in jax.tree.leaves(mlm_only["discriminator"]):
    assert not np.any(np.asarray(leaf))
  table = lambda g: np.asarray(g["embeddings"]["word_embeddings"]["embedding"])
  assert np.abs(table(disc_only)).sum() > 0 and np.abs(table(mlm_only)).sum() > 0
  # The shared table's gradient is the sum of what each loss sends it.
  np.testing.assert_allclose(table(both), table(disc_only) + table(mlm_only), atol=1e-6)


def test_argmax_first_is_jnp_argmax_ties_included():
  """The CPU-friendly argmax must return jnp.argmax's answer, the FIRST maximal index, also
  when many entries tie (integer-valued logits) and over a full vocabulary."""
  rng = np.random.default_rng(3)
  for shape in [(5, 7), (3, 4, 30522)]:
    for z in (rng.integers(-2, 3, size=shape), rng.normal(size=shape)):
      z = jnp.asarray(z, jnp.float32)
      np.testing.assert_array_equal(objectives.pieces._two_reductions(z)[1], jnp.argmax(z, axis=-1))
      np.testing.assert_array_equal(objectives.pieces._max_and_argmax(z)[1], jnp.argmax(z, axis=-1))


@pytest.mark.parametrize("platform, reductions", [("cpu", 2), ("cuda", 1), ("tpu", 1)])
def test_argmax_takes_one_reduction_off_the_cpu(platform, reductions):
  """On GPUs and TPUs the argmax is one (value, index) reduction, which XLA fuses with the
  Gumbel noise it reads; the CPU keeps its two faster plain ones."""
  z = jax.ShapeDtypeStruct((4, 19, 30522), jnp.float32)
  module = jax.export.export(
      jax.jit(lambda z: objectives.pieces._max_and_argmax(z)[1]), platforms=[platform]
  )(z).mlir_module()
  assert module.count("stablehlo.reduce") == reductions, module


def test_mlm_sums_equal_autodiffs_loss_gradient_and_accuracy():
  """_mlm_sums has a hand-written backward pass (weights * (softmax - one_hot)) and finds the
  logsumexp's shift with the accuracy's argmax: the loss must be the very number of
  jax.nn.logsumexp minus the target logit, its gradient autodiff's, and the count of correct
  argmaxes jnp.argmax's, also with zero weights and tied maxima."""
  rng = np.random.default_rng(5)
  logits = rng.normal(scale=3.0, size=(3, 7, 301)).astype(np.float32)
  logits[0, 0, [4, 9]] = 20.0  # a tie for the maximum: the first index counts
  targets = rng.integers(0, 301, size=(3, 7)).astype(np.int32)
  targets[0, 0], targets[0, 1] = 9, int(np.argmax(logits[0, 1]))
  weights = (rng.random((3, 7)) < 0.7).astype(np.float32)
  weights[0, :2] = 1.0
  logits, targets, weights = jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights)

  def reference(z):
    target = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return ((jax.nn.logsumexp(z, axis=-1) - target) * weights).sum()

  loss, correct, _ = objectives.pieces.mlm_sums(logits, targets, weights)
  grad = jax.grad(lambda z: objectives.pieces.mlm_sums(z, targets, weights)[0])(logits)
  assert float(loss) == float(reference(logits))
  np.testing.assert_allclose(grad, jax.grad(reference)(logits), rtol=1e-5, atol=1e-7)
  assert not np.any(np.asarray(grad)[np.asarray(weights) == 0])  # unweighted rows send nothing
  want_correct = ((jnp.argmax(logits, -1) == targets) * weights).sum()
  assert (
      float(correct) == float(want_correct) and float(correct) >= 1.0
  )  # row (0, 1) is right, (0, 0) is not


@pytest.mark.parametrize("platform, passes", [("cpu", 3), ("cuda", 2), ("tpu", 2)])
def test_mlm_sums_read_the_vocabulary_logits_in_few_passes(platform, passes):
  """The forward pass reduces over the [..., vocab] logits only where it must: off the CPU one
  (value, index) reduction serves the accuracy and the logsumexp's shift, then the
  exponentials; on the CPU the maximum, the index search and the exponentials. The target
  logit is gathered, not found by a pass over the vocabulary."""
  z, ids, w = (
      jax.ShapeDtypeStruct(s, d)
      for s, d in [((4, 19, 30522), jnp.float32), ((4, 19), jnp.int32), ((4, 19), jnp.float32)]
  )
  module = jax.export.export(jax.jit(objectives.pieces.mlm_sums), platforms=[platform])(
      z, ids, w
  ).mlir_module()
  over_vocab = [
      line for line in module.split("\n") if "stablehlo.reduce" in line and "4x19x30522x" in line
  ]
  assert len(over_vocab) == passes, "\n".join(over_vocab)


def _traced_step(**overrides):
  """The train step's jaxpr and the parameter shapes for a tiny config: what a run trains."""
  config = tiny_config(**overrides)
  config_lib.validate(config)
  mesh = partitioning.make_mesh(config.mesh, devices=jax.devices()[:1])
  setup = train_state.build_setup(
      config, mesh, dict(pad=0, cls=2, sep=3, mask=4, vocab_size=config.model.vocab_size)
  )
  state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), setup.abstract_state)
  shape = (config.train.batch_size, config.data.max_seq_len)
  batch = {
      k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in data.batch_keys(config.data.pack_rows)
  }
  with partitioning.activate(mesh):
    jaxpr = jax.make_jaxpr(train_state.train_step)(
        state, batch, jax.eval_shape(lambda: jax.random.key(0)), optimizer.make_schedule(config)
    )
  return str(jaxpr), setup.param_shapes


def test_no_objective_depends_on_the_run_length_or_the_switch_which_the_schedule_carries():
  """objective.two_stage_switch and train.steps enter the step through the Schedule, an argument:
  every objective (two_stage too) is the same for any of them, so a time budget's step count, a
  resume with more steps and the switch reuse one compiled step."""
  special_ids = dict(pad=0, cls=2, sep=3, mask=4)
  for name in objectives.REGISTRY:
    made = {
        objectives.objective_from_config(
            tiny_config(
                **{
                    "objective.name": name,
                    "objective.two_stage_switch": switch,
                    "train.steps": steps,
                }
            ),
            special_ids,
        )
        for switch, steps in ((0, 10), (3, 10), (0, 20))
    }
    assert len(made) == 1, name
  assert (
      float(optimizer.make_schedule(tiny_config(**{"objective.two_stage_switch": 3})).switch) == 3
  )


def test_a_registered_objective_trains_through_the_step_with_its_hooks(monkeypatch):
  """The step reads the registry, not objective names: a new entry whose update hook freezes
  the generator trains its discriminator alone, and its config check runs in validate."""

  def freeze_generator(updates, step, schedule):
    return {**updates, "generator": jax.tree.map(jnp.zeros_like, updates["generator"])}

  def refuse_temperature(config):
    if config.objective.temperature != 1.0:
      raise config_lib.ConfigError("frozen_generator samples at temperature 1.0")

  electra = objectives.REGISTRY["electra"].forward
  entry = objectives.Objective(electra, check=refuse_temperature, updates=freeze_generator)
  monkeypatch.setitem(objectives.REGISTRY, "frozen_generator", entry)
  config_lib.validate(tiny_config(**{"objective.name": "frozen_generator"}))
  with pytest.raises(config_lib.ConfigError, match="samples at temperature 1.0"):
    config_lib.validate(
        tiny_config(**{"objective.name": "frozen_generator", "objective.temperature": 2.0})
    )
  state, batch, schedule = _tiny_state_and_batch(**{"objective.name": "frozen_generator"})
  step = jax.jit(train_state.train_step)
  after, metrics = step(
      step(state, batch, train_state.step_rng(0, 0), schedule)[0],
      batch,
      train_state.step_rng(0, 1),
      schedule,
  )  # lr(0) = 0
  moved = lambda part: any(  # noqa: E731
      not np.array_equal(a, b)
      for a, b in zip(jax.tree.leaves(state.params[part]), jax.tree.leaves(after.params[part]))
  )
  assert (
      not moved("generator") and moved("discriminator") and np.isfinite(float(metrics["disc_auc"]))
  )
