"""Electric: an energy-based discriminator over a two-tower cloze model's samples (the official
electric_objective)."""

import jax
import jax.numpy as jnp

from electra_jax.errors import ConfigError
from electra_jax.models import Towers
from electra_jax.objectives import pieces
from electra_jax.objectives.pieces import Objective, Pass


def _electric(p: Pass):
  """The cloze model predicts every maskable token of the unmasked input (its loss); its samples
  replace the masked tokens, all labelled replaced; the discriminator's logit gets the energy-based
  + log q(token) (no gradient) + the log prior odds of a mask."""
  input_ids, objective = p.batch["input_ids"], p.objective
  cloze_logits = pieces.vocabulary_only(p.generator(input_ids), objective.vocab_size)
  is_candidate = pieces.candidate_mask(input_ids, p.batch["attention_mask"], objective)
  candidates = is_candidate.astype(jnp.float32)
  cloze_loss_sum = pieces.mlm_sums(cloze_logits, input_ids, candidates)[0]
  p.stats.update(main_loss_sum=cloze_loss_sum, main_count=candidates.sum())
  s = pieces.sample(p, jnp.take_along_axis(cloze_logits, p.masked.positions[..., None], axis=1))
  gen_loss = objective.gen_weight * cloze_loss_sum / p.normalizers.num_candidates
  is_replaced = pieces.at_slots(input_ids.shape, p.masked, p.masked.weights) > 0
  disc_logits, _ = pieces.discriminator_logits(p, s.corrupted_ids)
  log_softmax = jax.nn.log_softmax(cloze_logits, axis=-1)
  log_q = jnp.take_along_axis(log_softmax, s.corrupted_ids[..., None], axis=-1)[..., 0]
  prior = jnp.log(objective.mask_prob / (1.0 - objective.mask_prob))
  disc_logits = disc_logits + jax.lax.stop_gradient(log_q) + prior
  disc_loss, per_token = pieces.detection_loss(p, disc_logits, is_replaced, s.replaced_prob)
  return gen_loss + disc_loss, per_token


def _electric_metrics(metrics, stats, objective, per_token):
  metrics["cloze_loss"] = stats["main_loss_sum"] / jnp.maximum(stats["main_count"], 1.0)
  metrics["loss"] = objective.gen_weight * metrics["cloze_loss"]
  metrics["loss"] += objective.disc_weight * metrics["disc_loss"]


def _check_electric(config):
  if config.data.pack_rows:
    raise ConfigError(
        "Electric's cloze generator reads across the row's ends, so it cannot train on packed "
        "rows: set data.pack_rows=False for objective.name='electric'."
    )


_CLOZE = dict(towers=Towers(cloze=True), check=_check_electric)
ENTRIES = {"electric": Objective(_electric, _electric_metrics, **_CLOZE)}
