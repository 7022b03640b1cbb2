"""The pre-training optimizer (optimizer.py): the official schedule and Adam, warmup, weight decay."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import (
    models,
    objectives,
    optimizer,
)


def test_learning_rate_schedule_is_the_official_one():
  schedule = optimizer.learning_rate_schedule(1e-3, warmup_steps=10, total_steps=100)
  for step, want in [
      (0, 0.0),
      (5, 1e-3 * 0.5 * 0.95),
      (10, 1e-3 * 0.9),
      (60, 1e-3 * 0.4),
      (100, 0.0),
  ]:
    assert float(schedule(step)) == pytest.approx(want, rel=1e-6, abs=1e-12)  # float32
  # The rate is exactly 0 at the last step and the peak exactly at the warmup's end, whatever the
  # counts (1 - 427 * float32(1 / 427) is 6e-8, not 0).
  for total in (49, 427, 1003, 9973):
    schedule = optimizer.learning_rate_schedule(1e-3, total // 10, total)
    assert float(schedule(total)) == 0.0 and float(schedule(total + 5)) == 0.0, total
    assert float(schedule(total // 10)) == np.float32(1e-3) * (
        (np.float32(total) - total // 10) / np.float32(total)
    )
  # No warmup (0 steps, as fine-tuning's warmup_fraction gives a short run): the peak at once.
  assert float(optimizer.learning_rate_schedule(1e-3, 0, 100)(0)) == np.float32(1e-3)


def test_warmup_fraction_takes_its_share_of_the_steps():
  config = tiny_config(
      **{"train.steps": 30, "optimizer.warmup_steps": 2, "optimizer.warmup_fraction": 0.25}
  )
  assert optimizer.warmup_steps(config) == 8  # round(7.5) = 8 (half to even), over warmup_steps=2
  schedule = optimizer.make_schedule(config)
  assert float(schedule(4)) == pytest.approx(1e-3 * 0.5 * (1 - 4 / 30), rel=1e-6)
  config.optimizer.warmup_fraction = 0.0
  assert optimizer.warmup_steps(config) == 2


def test_official_adam_step_by_hand():
  """BERT's AdamWeightDecayOptimizer: no bias correction, decay added to the direction."""
  config = tiny_config(**{"optimizer.bias_correction": False, "optimizer.clip_norm": 1e9})
  tx, schedule = optimizer.make_optimizer(config.optimizer), optimizer.make_schedule(config)
  params = {"dense": {"kernel": jnp.array([[1.0, -2.0]]), "bias": jnp.array([0.5])}}
  grads = {"dense": {"kernel": jnp.array([[0.3, -0.1]]), "bias": jnp.array([0.2])}}
  state = tx.init(params)
  _, state = tx.update(grads, state, params, schedule=schedule)  # step 0 has learning rate 0
  updates, _ = tx.update(grads, state, params, schedule=schedule)
  lr, wd, eps = float(schedule(1)), 0.01, 1e-6

  def by_hand(g, p, decay):
    m = 0.9 * (0.1 * g) + 0.1 * g
    v = 0.999 * (0.001 * g * g) + 0.001 * g * g
    return -lr * (m / (np.sqrt(v) + eps) + (wd * p if decay else 0.0))

  np.testing.assert_allclose(
      updates["dense"]["kernel"],
      by_hand(np.array([[0.3, -0.1]]), np.array([[1.0, -2.0]]), True),
      rtol=1e-5,
  )
  np.testing.assert_allclose(
      updates["dense"]["bias"], by_hand(np.array([0.2]), np.array([0.5]), False), rtol=1e-5
  )


def test_weight_decay_skips_layer_norm_and_biases():
  config = tiny_config()
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32))[
          "params"
      ]
  )
  mask = flax.traverse_util.flatten_dict(
      jax.tree_util.tree_map_with_path(optimizer._decays, params), sep="/"
  )
  decayed = {name for name, on in mask.items() if on}
  assert decayed == {name for name in mask if name.endswith(("/kernel", "/embedding"))}
  assert not any("layer_norm" in name or "bias" in name for name in decayed)
  assert "embeddings/word_embeddings/embedding" in decayed
