"""The MLM family: BERT ("mlm": no generator, 80/10/10 masking), the generator's samples in place
of [MASK] ("replace_mlm"), every token predicted with the paper's copy mechanism ("all_tokens_mlm").
"""

import jax
import jax.numpy as jnp

from electra_jax.models import Towers
from electra_jax.objectives import pieces
from electra_jax.objectives.pieces import Objective, Pass


def _no_detector(p: Pass, is_replaced, replaced_prob):
  """The per-token arrays of a tower that detects nothing: zero logits beside what was replaced."""
  zeros = jnp.zeros_like(p.token_weights)
  return pieces.token_arrays(zeros, is_replaced, p.token_weights, replaced_prob)


def _nan(metrics, names) -> None:
  metrics.update(dict.fromkeys(names, jnp.full((), jnp.nan, jnp.float32)))


def _mlm(p: Pass):
  """BERT: the discriminator-sized tower predicts the originals of its [MASK]ed input."""
  _, loss = pieces.tower_mlm(p, p.masked.input_ids, stat="mlm")
  zeros = jnp.zeros_like(p.token_weights)
  return loss, _no_detector(p, zeros > 0, zeros)


def _mlm_metrics(metrics, stats, objective, per_token):
  # No detector, and no samples: nothing replaced to count.
  of_samples = ("sampled_masked_lm_accuracy", "replaced_fraction", *pieces.BINNED_METRICS)
  _nan(metrics, (*of_samples, *pieces.DISC_METRICS))
  metrics["loss"] = metrics["masked_lm_loss"]


def _replace_mlm(p: Pass):
  """The generator's samples replace the masked tokens; the tower predicts the originals there."""
  s = pieces.sample(p, pieces.generator_logits(p))
  _, main_loss = pieces.tower_mlm(p, s.corrupted_ids)
  return s.gen_loss + main_loss, _no_detector(p, s.is_replaced, s.replaced_prob)


def _all_tokens_mlm(p: Pass):
  """The tower predicts every token of the corrupted input, with the paper's copy mechanism:
  p(x_t) = D_t [x_t = input_t] + (1 - D_t) softmax(MLM)_t(x_t), D_t = sigmoid(copy logit)."""
  s = pieces.sample(p, pieces.generator_logits(p))
  input_ids, weights = p.batch["input_ids"], p.token_weights
  copy_logits, main_logits = p.discriminator(s.corrupted_ids)  # the MLM head at every position
  main_logits = pieces.vocabulary_only(main_logits, p.objective.vocab_size)  # [batch, seq, vocab]
  log_softmax = jax.nn.log_softmax(main_logits, axis=-1)
  log_mlm = jnp.take_along_axis(log_softmax, input_ids[..., None], axis=-1)[..., 0]
  log_copy, log_no_copy = jax.nn.log_sigmoid(copy_logits), jax.nn.log_sigmoid(-copy_logits)
  copied = ~s.is_replaced  # the input token is the original one
  log_p = jnp.where(copied, jnp.logaddexp(log_copy, log_no_copy + log_mlm), log_no_copy + log_mlm)
  main_loss_sum = -(log_p * weights).sum()
  p_original = jnp.where(copied, jnp.exp(log_copy), 0.0) + jnp.exp(log_no_copy + log_mlm)
  # The most probable other token: the best MLM alternative, or the (replaced) input token,
  # which also gets the copy probability.
  is_original = jnp.arange(main_logits.shape[-1]) == input_ids[..., None]
  best_alternative = jnp.max(jnp.where(is_original, -jnp.inf, log_softmax), axis=-1)
  best_other = jnp.exp(log_no_copy + best_alternative)
  log_mlm_input = jnp.take_along_axis(log_softmax, s.corrupted_ids[..., None], axis=-1)[..., 0]
  p_input = jnp.exp(log_copy) + jnp.exp(log_no_copy + log_mlm_input)
  best_other = jnp.maximum(best_other, jnp.where(copied, 0.0, p_input))
  main_correct = ((p_original > best_other) * weights).sum()
  p.stats.update(main_loss_sum=main_loss_sum, main_correct=main_correct, main_count=weights.sum())
  main_loss = main_loss_sum / p.normalizers.num_tokens
  return s.gen_loss + main_loss, _no_detector(p, s.is_replaced, s.replaced_prob)


def _tower_mlm_metrics(metrics, stats, objective, per_token):
  # No discriminator: no AUCs, but the replacements' shares by likelihood stand.
  _nan(metrics, pieces.DISC_METRICS)
  pieces.main_mlm_metrics(metrics, stats)
  metrics["loss"] = objective.gen_weight * metrics["masked_lm_loss"] + metrics["main_mlm_loss"]


# BERT: no generator, and of the chosen positions 80% [MASK], 10% a random token, 10% kept.
_BERT = dict(towers=Towers(has_generator=False, mlm_head=True), samples=False, masking=(0.1, 0.1))
ENTRIES = {
    "mlm": Objective(_mlm, _mlm_metrics, **_BERT),
    "replace_mlm": Objective(_replace_mlm, _tower_mlm_metrics, towers=Towers(mlm_head=True)),
    "all_tokens_mlm": Objective(_all_tokens_mlm, _tower_mlm_metrics, towers=Towers(mlm_head=True)),
}
