"""Adversarial ELECTRA: the generator is trained by REINFORCE to fool the discriminator (plus
adversarial_mlm_weight * L_MLM)."""

import jax
import jax.numpy as jnp

from electra_jax.objectives.pieces import Objective, Pass, bce, detect


def _adversarial(p: Pass):
  """REINFORCE (reward: the discriminator's loss on a slot's sample) + adversarial_mlm_weight *
  L_MLM. A slot's baseline, the mean reward of its example's other slots (0 without), depends on
  neither its own sample (the estimate stays unbiased) nor the batch's split."""
  s, disc_logits, disc_loss, _, per_token = detect(p)
  per_token_bce = bce(disc_logits, s.is_replaced.astype(jnp.float32))
  reward = jax.lax.stop_gradient(jnp.take_along_axis(per_token_bce, p.masked.positions, axis=1))
  weights = p.masked.weights
  slots = weights.sum(-1, keepdims=True)
  others = (reward * weights).sum(-1, keepdims=True) - reward * weights
  baseline = jnp.where(slots > 1, others / jnp.maximum(slots - 1, 1.0), 0.0)
  log_policy = jax.nn.log_softmax(s.gen_logits / p.temperature, axis=-1)  # the policy that sampled
  sample_log_prob = jnp.take_along_axis(log_policy, s.sampled_ids[..., None], axis=-1)[..., 0]
  num_predictions = p.normalizers.num_predictions
  reinforce = -((reward - baseline) * sample_log_prob * weights).sum() / num_predictions
  mlm = p.objective.adversarial_mlm_weight * p.stats["mlm_loss_sum"] / num_predictions
  p.stats.update(main_loss_sum=(reward * weights).sum(), main_count=weights.sum())
  return reinforce + mlm + disc_loss, per_token


def _adversarial_metrics(metrics, stats, objective, per_token):
  # The REINFORCE surrogate is no quantity to watch; the generator's mean reward is.
  metrics["generator_reward"] = stats["main_loss_sum"] / jnp.maximum(stats["main_count"], 1.0)
  mlm_loss = objective.adversarial_mlm_weight * metrics["masked_lm_loss"]
  metrics["loss"] = mlm_loss + objective.disc_weight * metrics["disc_loss"]


ENTRIES = {"adversarial": Objective(_adversarial, _adversarial_metrics)}
