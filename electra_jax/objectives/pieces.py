"""What the objectives share: masking, sampling, corruption, the losses, `Pass` (one micro-batch
through the towers, via `model.apply`) and the forward's steps on it, the official metrics, and
`Objective`, the registry entry each objective file fills in."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from electra_jax import random_ops
from electra_jax.errors import ConfigError
from electra_jax.models import Towers

# The additive counts of a forward: each starts at zero, so every objective reports them all (the
# detector's counts come from the per-token arrays, see official_metrics).
STAT_KEYS = (
    "mlm_loss_sum",
    "mlm_correct",
    "sampled_correct",
    "num_predictions",
    "main_loss_sum",
    "main_correct",
    "main_count",
)


@dataclasses.dataclass(frozen=True)
class ElectraObjective:
  """Hyperparameters of the objective plus the token ids it needs."""

  mask_prob: float
  max_predictions: int  # N: masked-position slots per example
  gen_weight: float
  disc_weight: float
  temperature: float  # the sampling temperature once the schedule has fallen, and in evaluation
  keep_original_prob: float  # share of chosen positions left unmasked (official: 0.15)
  mask_id: int
  pad_id: int
  cls_id: int
  sep_id: int
  name: str = "electra"
  random_token_prob: float = 0.0  # of the chosen positions, the share given a random token
  # The tokenizer's (0: the model's rows, which may be more): softmaxes and samples keep to it.
  vocab_size: int = 0
  adversarial_mlm_weight: float = 0.0  # adversarial: the weight of L_MLM beside REINFORCE
  disallow_correct: bool = False  # the official option: the original's logit loses 1000
  # The sampling temperature at step 0 (None: `temperature`), falling linearly to `temperature`.
  initial_temperature: float | None = None
  disc_mlm_weight: float = 0.0  # electra(_15): the discriminator's own MLM loss (0: none)

  @property
  def never_masked_ids(self) -> tuple[int, ...]:
    return (self.pad_id, self.cls_id, self.sep_id, self.mask_id)


def temperature_falls(o) -> bool:
  return o.temperature_decay_fraction > 0 and o.initial_temperature != o.temperature


def temperature_decay_steps(config) -> int:
  """The steps over which the sampling temperature falls to its final value (0: no schedule)."""
  o = config.objective
  if not temperature_falls(o):
    return 0
  return max(1, round(o.temperature_decay_fraction * config.train.steps))


def sampling_temperature(objective: ElectraObjective, step, decay_steps):
  """The temperature at `step` (a resume samples as an uninterrupted run): float32, linear from the
  initial to the final one, reached at `decay_steps`; without a schedule the Python float."""
  initial, final = objective.initial_temperature, objective.temperature
  if initial is None or initial == final:
    return final
  # 0 decay steps (no schedule) stays at the initial temperature rather than divide 0 by 0.
  step = jnp.minimum(jnp.asarray(step, jnp.float32), decay_steps)
  return initial + (final - initial) * (step / jnp.maximum(decay_steps, 1.0))


def official_max_predictions(mask_prob: float, max_seq_len: int) -> int:
  """The official slot count: int((mask_prob + 0.005) * max_seq_len), 19 for 0.15 and 128."""
  return int((mask_prob + 0.005) * max_seq_len)


class MaskedInputs(NamedTuple):
  input_ids: jax.Array  # [batch, seq] with [MASK] put in
  positions: jax.Array  # [batch, n_pred] int32, distinct within a row
  weights: jax.Array  # [batch, n_pred] float32, 1 for a real prediction, 0 for an unused slot
  target_ids: jax.Array  # [batch, n_pred] the original tokens at `positions`


def vocabulary_only(logits, vocab_size: int):
  """Logits [..., rows] with the rows past the tokenizer's `vocab_size` (model.vocab_size may be
  rounded up for sharding) at -1e9: they are no tokens."""
  if not 0 < vocab_size < logits.shape[-1]:
    return logits
  in_vocabulary = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) < vocab_size
  return jnp.where(in_vocabulary, logits, jnp.float32(-1e9))


def at_slots(shape, masked: MaskedInputs, values) -> jax.Array:
  """[batch, seq] float32: `values` [batch, n_pred] at the masked positions, 0 elsewhere."""
  rows = jnp.arange(shape[0])[:, None]
  return jnp.zeros(shape, jnp.float32).at[rows, masked.positions].max(values)


def candidate_mask(input_ids, attention_mask, objective: ElectraObjective):
  """[batch, seq] bool: the tokens masking may choose (not [CLS], [SEP], [MASK] or padding)."""
  return attention_mask.astype(bool) & ~jnp.isin(input_ids, jnp.asarray(objective.never_masked_ids))


def mask_tokens(rng, input_ids, attention_mask, objective: ElectraObjective) -> MaskedInputs:
  """Chooses clip(round(n * mask_prob), 1, N) distinct candidates per row of n real tokens and puts
  [MASK] at each with probability 1 - keep_original_prob (a random token: random_token_prob)."""
  batch_size, seq_len = input_ids.shape
  num_slots = objective.max_predictions
  choose_rng, replace_rng = jax.random.split(rng)
  is_candidate = candidate_mask(input_ids, attention_mask, objective)
  num_tokens = attention_mask.astype(jnp.float32).sum(-1)
  # jnp.round rounds half to even, as TF's round in the official code does.
  num_to_predict = jnp.clip(jnp.round(num_tokens * objective.mask_prob), 1, num_slots)
  num_to_predict = jnp.minimum(num_to_predict, is_candidate.sum(-1)).astype(jnp.int32)

  # A uniform score per candidate and top-k gives a uniform draw without replacement.
  scores = jnp.where(is_candidate, jax.random.uniform(choose_rng, (batch_size, seq_len)), -1.0)
  positions = jax.lax.top_k(scores, num_slots)[1].astype(jnp.int32)
  is_used = jnp.arange(num_slots)[None, :] < num_to_predict[:, None]  # [batch, n_pred]

  target_ids = jnp.take_along_axis(input_ids, positions, axis=1)
  draw = jax.random.uniform(replace_rng, (batch_size, num_slots))
  put_mask = is_used & (draw >= objective.keep_original_prob + objective.random_token_prob)
  new_ids = jnp.where(put_mask, objective.mask_id, target_ids)
  if objective.random_token_prob > 0:
    put_random = is_used & (draw >= objective.keep_original_prob) & ~put_mask
    random_rng = jax.random.fold_in(replace_rng, 1)  # leaves the default draws as they were
    random_ids = jax.random.randint(random_rng, (batch_size, num_slots), 0, objective.vocab_size)
    new_ids = jnp.where(put_random, random_ids, new_ids)
  masked_ids = input_ids.at[jnp.arange(batch_size)[:, None], positions].set(new_ids)
  return MaskedInputs(masked_ids, positions, is_used.astype(jnp.float32), target_ids)


def sample_tokens(keys, logits, temperature: float, disallowed_ids=None):
  """Gumbel-max samples [batch, n_pred] of softmax(logits / temperature), one key per example (the
  batch's split changes no draw); `disallowed_ids` lose 1000 (disallow_correct)."""
  logits = jax.lax.stop_gradient(logits.astype(jnp.float32)) / temperature
  if disallowed_ids is not None:
    logits = logits - 1000.0 * jax.nn.one_hot(disallowed_ids, logits.shape[-1], dtype=jnp.float32)
  gumbel = jax.vmap(lambda key: random_ops.gumbel(key, logits.shape[1:]))(keys)
  return jax.lax.stop_gradient(_max_and_argmax(logits + gumbel)[1])


def corrupt(input_ids, masked: MaskedInputs, sampled_ids):
  """(corrupted_ids, is_replaced): the ORIGINAL input with the samples at the used masked
  positions; a sample equal to the original token is labelled original."""
  new_tokens = jnp.where(masked.weights > 0, sampled_ids, masked.target_ids)
  rows = jnp.arange(input_ids.shape[0])[:, None]
  corrupted_ids = input_ids.at[rows, masked.positions].set(new_tokens)
  return corrupted_ids, corrupted_ids != input_ids


class Normalizers(NamedTuple):
  """The losses' denominators over the WHOLE batch: micro-batches add up to the full-batch loss."""

  num_predictions: jax.Array  # sum of MaskedInputs.weights
  num_tokens: jax.Array  # sum of attention_mask
  num_candidates: jax.Array  # maskable tokens (Electric's cloze loss covers them all)

  @classmethod
  def of(cls, masked: MaskedInputs, attention_mask, candidates=None):
    count = lambda x: jnp.maximum(x.astype(jnp.float32).sum(), 1.0)  # noqa: E731
    candidates = attention_mask if candidates is None else candidates
    return cls(count(masked.weights), count(attention_mask), count(candidates))


def _max_and_argmax(z):
  """(maximum, first maximal index) over the last axis: one reduction, but on the CPU (whose
  variadic reduce runs unvectorised) the maximum, then a search for its first index."""

  def one_reduction(z):
    index = jnp.argmax(z, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(z, index[..., None], axis=-1)[..., 0], index

  return jax.lax.platform_dependent(z, cpu=_two_reductions, default=one_reduction)


def _two_reductions(z):
  assert z.shape[-1] < 2**24, z.shape
  top = z.max(-1)
  index = jax.lax.broadcasted_iota(jnp.float32, z.shape, z.ndim - 1)
  first = jnp.min(jnp.where(z == top[..., None], index, float(z.shape[-1])), -1)
  return top, first.astype(jnp.int32)


@jax.custom_vjp
def _weighted_nll_sum(logits, top, target_ids, weights):
  """(sum(weights * (logsumexp(logits) - logits[target_ids])), logsumexp), `top` the rows' maxima;
  only the sum has a gradient, one elementwise pass: weights * (softmax - one_hot(target))."""
  return _weighted_nll_sum_fwd(logits, top, target_ids, weights)[0]


def _weighted_nll_sum_fwd(logits, top, target_ids, weights):
  # logsumexp as jax.nn.logsumexp computes it (shifted by the maximum): the same number.
  shifted_exp = jnp.exp(logits - top[..., None])
  total = shifted_exp.sum(-1)
  lse = jnp.log(total) + top
  target = jnp.take_along_axis(logits, target_ids[..., None], axis=-1)[..., 0]
  nll_sum = ((lse - target) * weights).sum()
  return (nll_sum, lse), (logits, shifted_exp, total, lse, target_ids, weights)


def _weighted_nll_sum_bwd(residuals, grads):
  logits, shifted_exp, total, lse, target_ids, weights = residuals
  # The CPU reads the forward's exponentials back (an exp costs more there than the memory);
  # elsewhere they are recomputed, so they are never written out.
  softmax = jax.lax.platform_dependent(
      *residuals[:4],  # logits, shifted_exp, total, lse
      cpu=lambda _, shifted_exp, total, __: shifted_exp / total[..., None],
      default=lambda logits, _, __, lse: jnp.exp(logits - lse[..., None]),
  )
  vocab_index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  is_target = vocab_index == target_ids[..., None]
  d_logits = (grads[0] * weights)[..., None] * (softmax - is_target.astype(jnp.float32))
  return d_logits, None, None, None


_weighted_nll_sum.defvjp(_weighted_nll_sum_fwd, _weighted_nll_sum_bwd)


def mlm_sums(logits, target_ids, weights):
  """(summed cross-entropy, summed correct argmax, each row's logsumexp without gradient) against
  the targets; the accuracy's argmax also gives the logsumexp's shift (fewer reads of logits)."""
  top, predicted = _max_and_argmax(jax.lax.stop_gradient(logits))
  nll_sum, log_normalizer = _weighted_nll_sum(logits, top, target_ids, weights)
  correct = ((predicted == target_ids) * weights).sum()
  return nll_sum, correct, jax.lax.stop_gradient(log_normalizer)


def bce(logits, labels):
  # Sigmoid cross-entropy in its overflow-free form: max(z, 0) - z * y + log(1 + exp(-|z|)).
  return jnp.maximum(logits, 0.0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


# --- The forward pass: the pieces the objectives are built from
@dataclasses.dataclass
class Pass:
  """One (micro-)batch through the towers with its masking drawn: what an objective's forward
  reads, and the `stats` it adds its counts to. `sample_keys` [batch]: per-example keys;
  `temperature` None: objective.temperature (evaluation's); `schedule`: the optimizer's."""

  model: Any
  params: Any
  batch: dict
  masked: MaskedInputs
  sample_keys: jax.Array
  dropout_rng: jax.Array
  objective: ElectraObjective
  normalizers: Normalizers
  deterministic: bool = False
  step: Any = None
  temperature: Any = None
  schedule: Any = None

  def __post_init__(self):
    self.gen_rng, self.disc_rng = jax.random.split(self.dropout_rng)
    if self.temperature is None:
      self.temperature = self.objective.temperature
    self.token_weights = self.batch["attention_mask"].astype(jnp.float32)
    self.stats = dict.fromkeys(STAT_KEYS, jnp.zeros((), jnp.float32))
    self.stats["num_predictions"] = self.masked.weights.sum()

  def generator(self, ids, positions=None):
    """The generator's logits on `ids` at `positions` (every position when None)."""
    return self._apply(self.model.generator_logits, ids, positions, self.gen_rng)

  def discriminator(self, ids, positions=None):
    """The discriminator's logits on `ids`; with its MLM head, a pair (see ElectraPretrainer)."""
    return self._apply(self.model.discriminator_logits, ids, positions, self.disc_rng)

  def _apply(self, method, ids, positions, rng):
    # Packed rows (data.pack_rows) carry segment ids, which the model reads in place of the
    # padding mask; losses and masking still weigh real tokens only.
    mask = self.batch.get("segment_ids", self.batch["attention_mask"])
    inputs = (ids, self.batch["token_type_ids"], mask, positions)
    kwargs = dict(deterministic=self.deterministic, method=method, rngs={"dropout": rng})
    return self.model.apply({"params": self.params}, *inputs, **kwargs)


class Sampled(NamedTuple):
  """The generator's step: logits at the masked slots, samples, the corrupted input, what was
  replaced and the generator's probability (T=1) of it, its weighted L_MLM (the sum: p.stats)."""

  gen_logits: jax.Array
  sampled_ids: jax.Array
  corrupted_ids: jax.Array
  is_replaced: jax.Array
  replaced_prob: jax.Array
  gen_loss: jax.Array  # gen_weight * L_MLM


def generator_logits(p: Pass):
  """[batch, n_pred, vocab]: the generator at the masked slots, or without one (the official
  uniform_generator) zeros: uniform samples and a constant L_MLM."""
  if p.model.towers.has_generator:
    logits = p.generator(p.masked.input_ids, p.masked.positions)
  else:
    # Zeros made from the batch: XLA would fold the losses and sampling over a constant array
    # at compile time, for seconds to minutes.
    zeros = (p.masked.weights * 0.0)[..., None]
    logits = jnp.broadcast_to(zeros, (*p.masked.positions.shape, p.model.vocab_size))
  return vocabulary_only(logits, p.objective.vocab_size)


def sample(p: Pass, gen_logits) -> Sampled:
  """L_MLM of `gen_logits`, samples, the corrupted input; the generator's counts go to p.stats."""
  masked, objective, targets, weights = p.masked, p.objective, p.masked.target_ids, p.masked.weights
  mlm_loss_sum, mlm_correct, log_normalizer = mlm_sums(gen_logits, targets, weights)
  disallowed = targets if objective.disallow_correct else None
  sampled_ids = sample_tokens(p.sample_keys, gen_logits, p.temperature, disallowed)
  corrupted_ids, is_replaced = corrupt(p.batch["input_ids"], masked, sampled_ids)
  # The generator's probability (T=1) of each token it put in, for `summarize`'s AUCs by difficulty.
  frozen_logits = jax.lax.stop_gradient(gen_logits).astype(jnp.float32)
  sampled_logit = jnp.take_along_axis(frozen_logits, sampled_ids[..., None], axis=-1)[..., 0]
  sampled_prob = jnp.where(weights > 0, jnp.exp(sampled_logit - log_normalizer), 0.0)
  p.stats["sampled_correct"] = ((sampled_ids == targets) * weights).sum()
  p.stats.update(mlm_loss_sum=mlm_loss_sum, mlm_correct=mlm_correct)
  gen_loss = objective.gen_weight * mlm_loss_sum / p.normalizers.num_predictions
  replaced_prob = at_slots(is_replaced.shape, masked, sampled_prob)
  return Sampled(gen_logits, sampled_ids, corrupted_ids, is_replaced, replaced_prob, gen_loss)


def tower_mlm(p: Pass, input_ids, stat: str = "main"):
  """(replaced-token logits, MLM loss at the masked slots) of the discriminator tower in one pass;
  the sums go to p.stats as <stat>_loss_sum and <stat>_correct (main_*: with main_count)."""
  positions, targets, weights = p.masked.positions, p.masked.target_ids, p.masked.weights
  disc_logits, logits = p.discriminator(input_ids, positions)
  loss_sum, correct, _ = mlm_sums(vocabulary_only(logits, p.objective.vocab_size), targets, weights)
  p.stats.update({f"{stat}_loss_sum": loss_sum, f"{stat}_correct": correct})
  if stat == "main":
    p.stats["main_count"] = weights.sum()
  return disc_logits, loss_sum / p.normalizers.num_predictions


def discriminator_logits(p: Pass, corrupted_ids):
  """(replaced-token logits, the tower's own MLM loss times disc_mlm_weight, or None without)."""
  if p.objective.disc_mlm_weight > 0:
    disc_logits, disc_mlm_loss = tower_mlm(p, corrupted_ids)
    return disc_logits, p.objective.disc_mlm_weight * disc_mlm_loss
  return p.discriminator(corrupted_ids), None


def token_arrays(*arrays) -> dict:
  """The per-token arrays `summarize` reads, [batch, seq] each, by name."""
  return dict(zip(("disc_logits", "is_replaced", "token_weights", "replaced_prob"), arrays))


def detection_loss(p: Pass, disc_logits, is_replaced, replaced_prob, only_masked: bool = False):
  """(disc_weight * L_Disc over the real tokens (or the used masked positions), per_token)."""
  token_weights, normalizer = p.token_weights, p.normalizers.num_tokens
  if only_masked:
    token_weights = at_slots(is_replaced.shape, p.masked, p.masked.weights)
    normalizer = p.normalizers.num_predictions
  disc_loss_sum = (bce(disc_logits, is_replaced.astype(jnp.float32)) * token_weights).sum()
  loss = p.objective.disc_weight * disc_loss_sum / normalizer
  return loss, token_arrays(disc_logits, is_replaced, token_weights, replaced_prob)


def detect(p: Pass, only_masked: bool = False):
  """Samples, then the discriminator: (sampled, disc_logits, L_Disc, tower MLM loss, per_token)."""
  s = sample(p, generator_logits(p))
  disc_logits, main_loss = discriminator_logits(p, s.corrupted_ids)
  disc_loss, per_token = detection_loss(p, disc_logits, s.is_replaced, s.replaced_prob, only_masked)
  return s, disc_logits, disc_loss, main_loss, per_token


def main_mlm_metrics(metrics, stats) -> None:
  main_count = jnp.maximum(stats["main_count"], 1.0)
  metrics["main_mlm_loss"] = stats["main_loss_sum"] / main_count
  metrics["main_mlm_accuracy"] = stats["main_correct"] / main_count


def rtd_metrics(metrics, stats, objective, per_token):
  """The reported loss: gen_weight * L_MLM + disc_weight * L_Disc (+ the tower's own MLM)."""
  metrics["loss"] = objective.gen_weight * metrics["masked_lm_loss"]
  metrics["loss"] += objective.disc_weight * metrics["disc_loss"]
  if objective.disc_mlm_weight > 0:
    main_mlm_metrics(metrics, stats)
    metrics["loss"] += objective.disc_mlm_weight * metrics["main_mlm_loss"]


@dataclasses.dataclass(frozen=True)
class Objective:
  """A registry entry: `forward(Pass) -> (loss, per_token)`, `metrics` setting "loss" and its own
  keys, the towers it needs, its config check, and hooks on the step or start (two_stage.py)."""

  forward: Callable
  metrics: Callable = rtd_metrics
  towers: Towers = Towers()
  samples: bool = True  # replacements are sampled at a temperature
  disc_mlm: bool = False  # objective.disc_mlm_weight may add the tower's own MLM loss
  # (keep_original_prob, random_token_prob) in place of (objective.keep_original_prob, 0).
  masking: tuple[float, float] | None = None
  check: Callable = lambda config: None  # raises ConfigError
  # (params, step, schedule) -> the parameters the step at `step` trains from.
  before_step: Callable = lambda params, step, schedule: params
  # (updates, step, schedule) -> the updates the step at `step` applies.
  updates: Callable = lambda updates, step, schedule: updates
  # (config, saved config.json or None, checkpoint step or None) -> {dotted key: value} the run
  # fixes at its start; refuses a resume that would move them.
  fixed_at_start: Callable = lambda config, saved, start_step: {}


# --- Metrics
def binary_aucs(scores, labels, weights, positive_subsets) -> list:
  """Exact ROC AUC (Mann-Whitney U, ties half) of each subset of the positives (masks like `labels`)
  against all negatives, over entries of weight > 0; NaN if either is absent or a score is NaN."""
  scores, labels = scores.reshape(-1), labels.reshape(-1).astype(bool)
  valid = weights.reshape(-1) > 0
  is_neg = valid & ~labels
  negatives_sorted = jnp.sort(jnp.where(is_neg, scores, jnp.inf))
  below = jnp.searchsorted(negatives_sorted, scores, side="left")
  up_to = jnp.searchsorted(negatives_sorted, scores, side="right")
  credit = below + 0.5 * (up_to - below)
  has_nan = jnp.isnan(scores).any(where=valid)
  aucs = []
  for subset in positive_subsets:
    is_pos = valid & labels & subset.reshape(-1).astype(bool)
    # The pair count in float32: int32 wraps past 2**31 pairs (ELECTRA-Base's 256 x 512 batch).
    num_pairs = is_pos.sum().astype(jnp.float32) * is_neg.sum().astype(jnp.float32)
    auc = jnp.where(is_pos, credit, 0.0).sum() / num_pairs
    aucs.append(jnp.where(has_nan, jnp.nan, auc))
  return aucs


# The replaced tokens by the generator's probability (at temperature 1) of the token it put
# in, [low, high): where the discriminator's detection of hard replacements shows.
REPLACED_BINS = {"unlikely": (0.0, 0.01), "plausible": (0.01, 0.1), "likely": (0.1, math.inf)}
BINNED_METRICS = tuple(
    f"{kind}_{name}" for kind in ("disc_auc", "replaced_share") for name in REPLACED_BINS
)
DISC_METRICS = ("disc_loss", "disc_auc", "disc_accuracy", "disc_precision", "disc_recall")
DISC_METRICS += tuple(f"disc_auc_{name}" for name in REPLACED_BINS)


def official_metrics(stats, per_token_arrays) -> dict[str, jax.Array]:
  """The official metrics from summed stats and the detector's per-token arrays, and by
  REPLACED_BINS disc_auc_<bin> (its replaced tokens against all originals), replaced_share_<bin>."""
  num_predictions = jnp.maximum(stats["num_predictions"], 1.0)
  logits, weights = per_token_arrays["disc_logits"], per_token_arrays["token_weights"]
  is_replaced = per_token_arrays["is_replaced"].astype(bool)
  prob, predicted = per_token_arrays["replaced_prob"], logits > 0
  in_bins = [(prob >= low) & (prob < high) for low, high in REPLACED_BINS.values()]
  aucs = binary_aucs(logits, is_replaced, weights, [is_replaced] + in_bins)
  count = lambda where: (where * weights).sum()  # noqa: E731
  num_tokens, replaced = jnp.maximum(weights.sum(), 1.0), count(is_replaced)
  true_pos = count(predicted & is_replaced)
  metrics = {
      "masked_lm_loss": stats["mlm_loss_sum"] / num_predictions,
      "masked_lm_accuracy": stats["mlm_correct"] / num_predictions,
      "sampled_masked_lm_accuracy": stats["sampled_correct"] / num_predictions,
      "disc_loss": count(bce(logits, is_replaced.astype(jnp.float32))) / num_tokens,
      "disc_auc": aucs[0],
      "disc_accuracy": count(predicted == is_replaced) / num_tokens,
      "disc_precision": true_pos / jnp.maximum(count(predicted), 1.0),
      "disc_recall": true_pos / jnp.maximum(replaced, 1.0),
      "replaced_fraction": replaced / num_tokens,
  }
  for name, auc, in_bin in zip(REPLACED_BINS, aucs[1:], in_bins):
    metrics[f"disc_auc_{name}"] = auc
    metrics[f"replaced_share_{name}"] = count(is_replaced & in_bin) / replaced
  return metrics
