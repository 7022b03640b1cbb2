"""The train state and step (train_state.py): one traced step per setting, gradient accumulation,
bfloat16 compute over float32 master weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import (
    data,
    models,
    objectives,
    optimizer,
    partitioning,
    train_state,
)


def _state_and_batch(config):
  corpus = data.load_pretraining_data(config.data)
  tok = corpus.tokenizer
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(
      config, dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  )
  state = nn.meta.unbox(train_state.make_init_fn(config, model, objective)(jax.random.key(0)))
  batch = {
      k: jnp.asarray(v) for k, v in data.get_batch(corpus, 0, config.train.batch_size, 0).items()
  }
  return state, batch, optimizer.make_schedule(config)


def test_a_config_built_again_has_the_same_state_structure_so_its_traced_step_is_reused():
  """The optimizer, init and objective are static fields of the state: built again from an equal
  config (a notebook cell run twice, a resume, a sweep's runs) they compare equal, so jax reuses
  the traced and compiled step. train.steps, the warmup and the peak rate are the schedule's
  arrays, an argument of the step: changing them keeps the structure and the traced step; a
  setting that changes the step gives another structure."""
  mesh = partitioning.make_mesh(tiny_config().mesh)
  ids = dict(pad=0, cls=2, sep=3, mask=4)
  first = train_state.build_setup(tiny_config(), mesh, ids)

  def traced(setup):
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), setup.abstract_state)
    batch = {
        k: jax.ShapeDtypeStruct((8, 32), jnp.int32)
        for k in ("input_ids", "token_type_ids", "attention_mask")
    }
    with partitioning.activate(mesh):
      rng = jax.eval_shape(lambda: jax.random.key(0))
      schedule = optimizer.make_schedule(tiny_config())
      return str(jax.make_jaxpr(train_state.train_step)(state, batch, rng, schedule))

  for change in (
      {},
      {"train.steps": 7},
      {"optimizer.learning_rate": 2e-3},
      {"optimizer.warmup_steps": 5},
  ):
    again = train_state.build_setup(tiny_config(**change), mesh, ids)
    assert jax.tree.structure(again.abstract_state) == jax.tree.structure(
        first.abstract_state
    ), change
    assert again.init_fn == first.init_fn and hash(again.init_fn) == hash(first.init_fn), change
    rates = lambda config: tuple(float(optimizer.make_schedule(config)(s)) for s in (1, 6))  # noqa: E731
    assert (rates(tiny_config(**change)) != rates(tiny_config())) == bool(change), change
  assert traced(train_state.build_setup(tiny_config(**{"train.steps": 7}), mesh, ids)) == traced(
      first
  )
  for change in (
      {"optimizer.bias_correction": False},
      {"objective.initial_temperature": 2.0, "objective.temperature_decay_fraction": 0.5},
  ):
    other = train_state.build_setup(tiny_config(**change), mesh, ids)
    assert jax.tree.structure(other.abstract_state) != jax.tree.structure(
        first.abstract_state
    ), change


def test_gradient_accumulation_equals_the_full_batch():
  no_dropout = {
      "model.dropout_rate": 0.0,
      "model.attention_dropout_rate": 0.0,
      "optimizer.warmup_steps": 1,
  }
  full_state, batch, schedule = _state_and_batch(tiny_config(**no_dropout))
  accum_state = full_state.replace(grad_accum_steps=4)
  rng = train_state.step_rng(0, 3)
  full_state, full_metrics = jax.jit(train_state.train_step)(full_state, batch, rng, schedule)
  accum_state, accum_metrics = jax.jit(train_state.train_step)(accum_state, batch, rng, schedule)
  for name in ("loss", "masked_lm_loss", "disc_loss", "disc_auc", "grad_norm"):
    assert float(accum_metrics[name]) == pytest.approx(float(full_metrics[name]), rel=1e-5), name
  for a, b in zip(jax.tree.leaves(full_state.params), jax.tree.leaves(accum_state.params)):
    np.testing.assert_allclose(a, b, atol=2e-6)


def test_bfloat16_step_keeps_float32_master_weights_and_learns():
  config = tiny_config(
      **{"train.dtype": "bfloat16", "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
  )
  state, batch, schedule = _state_and_batch(config)
  step = jax.jit(train_state.train_step)
  losses = []
  for i in range(8):
    state, metrics = step(state, batch, train_state.step_rng(0, i), schedule)
    losses.append(float(metrics["loss"]))
  assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
  assert {
      leaf.dtype
      for leaf in jax.tree.leaves(state.opt_state)
      if hasattr(leaf, "dtype") and leaf.ndim
  } == {jnp.dtype("float32")}
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # same batch: the loss must drop
