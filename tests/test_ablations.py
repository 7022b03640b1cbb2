"""The paper's ablation variants built so far: ELECTRA 15% (L_Disc only on masked positions),
uniform replacements (no generator), the official disallow_correct, and weight sharing
tie=none / tie=gdes (DeBERTa-v3's gradient-disentangled embedding sharing). Each test checks
where the loss goes and where gradients flow, on small hand-made batches."""

import dataclasses
import json
import math
import shutil

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import checkpointing, config_lib, data, interop, models, objectives, partitioning, resolve, train, train_state
from electra_jax.errors import ConfigError

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
VOCAB = 97


def _objective(**changes):
  base = objectives.ElectraObjective(
      mask_prob=0.15,
      max_predictions=6,
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


def _batch(seed=0, batch=4, seq=24):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, VOCAB, size=(batch, seq)).astype(np.int32)
  lengths = np.array([seq, 20, 13, 9][:batch])
  mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
  ids[:, 0] = CLS
  ids[np.arange(batch), lengths - 1] = SEP
  ids = np.where(mask > 0, ids, PAD)
  return {
      "input_ids": jnp.asarray(ids),
      "token_type_ids": jnp.zeros_like(ids),
      "attention_mask": jnp.asarray(mask),
  }


def _model_and_params(tie="embeddings", objective="electra"):
  config = tiny_config(
      **{
          "model.vocab_size": VOCAB,
          "model.tie": tie,
          "model.dropout_rate": 0.0,
          "model.attention_dropout_rate": 0.0,
          "objective.name": objective,
      }
  )
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = nn.meta.unbox(
      jax.jit(model.init)(
          jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32)
      )["params"]
  )
  return model, params


def _forward(model, params, objective, batch, seed=1):
  masked = objectives.mask_tokens(
      jax.random.key(seed), batch["input_ids"], batch["attention_mask"], objective
  )
  keys = jax.random.split(jax.random.key(seed + 1), batch["input_ids"].shape[0])
  normalizers = objectives.Normalizers.of(
      masked,
      batch["attention_mask"],
      objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
  )
  # Compiled: op by op, each of the forward's few hundred ops would compile on its own.
  loss, (stats, per_token) = jax.jit(
      lambda p: objectives.electra_forward(
          model,
          p,
          batch,
          masked,
          keys,
          jax.random.key(3),
          objective,
          normalizers,
          deterministic=True,
      )
  )(params)
  return masked, loss, stats, per_token


def _grads(model, params, objective, batch):
  masked = objectives.mask_tokens(
      jax.random.key(1), batch["input_ids"], batch["attention_mask"], objective
  )
  keys = jax.random.split(jax.random.key(2), batch["input_ids"].shape[0])
  normalizers = objectives.Normalizers.of(
      masked,
      batch["attention_mask"],
      objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
  )

  def loss_fn(p):
    return objectives.electra_forward(
        model, p, batch, masked, keys, jax.random.key(3), objective, normalizers, deterministic=True
    )[0]

  return jax.jit(jax.grad(loss_fn))(params)


def _norm(tree):
  return float(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _bce(logits, labels):
  return np.maximum(logits, 0) - logits * labels + np.log1p(np.exp(-np.abs(logits)))


# ---------------------------------------------------------------------------------------
# Objectives
# ---------------------------------------------------------------------------------------
def test_electra_15_puts_the_discriminator_loss_only_on_masked_positions():
  model, params = _model_and_params()
  batch = _batch()
  objective = _objective(name="electra_15")
  masked, loss, stats, per_token = _forward(model, params, objective, batch)
  weights = np.asarray(per_token["token_weights"])
  # Exactly the used masked positions carry weight.
  expected = np.zeros_like(weights)
  for row, (positions, used) in enumerate(
      zip(np.asarray(masked.positions), np.asarray(masked.weights))
  ):
    expected[row, positions[used > 0]] = 1.0
  np.testing.assert_array_equal(weights, expected)
  # The loss by hand: mean BCE over those positions, times 50, plus L_MLM; the metric reports it.
  logits, labels = np.asarray(per_token["disc_logits"]), np.asarray(
      per_token["is_replaced"], np.float32
  )
  disc = (_bce(logits, labels) * expected).sum() / expected.sum()
  mlm = float(stats["mlm_loss_sum"]) / float(masked.weights.sum())
  assert math.isclose(float(loss), mlm + 50.0 * disc, rel_tol=1e-5)
  metrics = objectives.summarize(stats, per_token, objective)
  assert float(metrics["disc_loss"]) == pytest.approx(disc, rel=1e-5)
  # And the plain objective on the same draw weights every real token instead.
  _, _, _, all_tokens = _forward(model, params, _objective(), batch)
  np.testing.assert_array_equal(
      np.asarray(all_tokens["token_weights"]), np.asarray(batch["attention_mask"], np.float32)
  )


def test_uniform_replacements_run_no_generator_and_cover_the_vocabulary():
  model, params = _model_and_params(objective="uniform")
  batch = _batch(batch=4, seq=24)
  objective = _objective(name="uniform")
  grads = _grads(model, params, objective, batch)
  assert "generator" not in params and "generator" not in grads  # no generator tower is built
  assert _norm(grads["discriminator"]) > 0.0
  masked, _, stats, _ = _forward(model, params, objective, batch)
  # All-zero logits: L_MLM is log(V) at every prediction.
  assert math.isclose(
      float(stats["mlm_loss_sum"]) / float(masked.weights.sum()), math.log(VOCAB), rel_tol=1e-6
  )
  # Samples are uniform over the vocabulary: 4000 draws hit nearly all 97 ids, evenly.
  logits = jnp.zeros((4000, 1, VOCAB))
  samples = np.asarray(
      objectives.sample_tokens(jax.random.split(jax.random.key(0), 4000), logits, 1.0)
  )
  counts = np.bincount(samples.ravel(), minlength=VOCAB)
  expected = 4000 / VOCAB
  chi_square = ((counts - expected) ** 2 / expected).sum()
  assert chi_square < 150, chi_square  # 96 degrees of freedom: p(chi2 > 150) < 0.001


def test_disallow_correct_never_samples_the_original():
  targets = jnp.asarray([[7, 9, 11]] * 200)
  # A generator certain of the original token ...
  logits = jax.nn.one_hot(targets, VOCAB) * 30.0
  keys = jax.random.split(jax.random.key(0), 200)
  assert bool(jnp.all(objectives.sample_tokens(keys, logits, 1.0) == targets))
  # ... still never samples it when disallow_correct lowers its logit by 1000.
  disallowed = objectives.sample_tokens(keys, logits, 1.0, disallowed_ids=targets)
  assert not bool(jnp.any(disallowed == targets))
  # The official code lowers the tempered logit (logits / T - 1000): a hot sampler still never
  # draws the original. Lowered before the division, the penalty was only 1000 / T (1 here).
  small = jnp.asarray([[0, 1, 2]] * 200)
  hot = objectives.sample_tokens(keys, jnp.zeros((200, 3, 3)), 1000.0, disallowed_ids=small)
  assert not bool(jnp.any(hot == small))
  # Through the objective: every used masked position ends up replaced.
  model, params = _model_and_params()
  batch = _batch()
  masked, _, stats, per_token = _forward(model, params, _objective(disallow_correct=True), batch)
  replaced = np.asarray(per_token["is_replaced"])
  for row, (positions, used) in enumerate(
      zip(np.asarray(masked.positions), np.asarray(masked.weights))
  ):
    assert replaced[row, positions[used > 0]].all()
  metrics = objectives.summarize(stats, per_token, _objective(disallow_correct=True))
  num_tokens = float(batch["attention_mask"].sum())
  assert float(metrics["replaced_fraction"]) * num_tokens == pytest.approx(masked.weights.sum())


@pytest.mark.fault
def test_unknown_objectives_and_tie_modes_are_refused_by_name():
  with pytest.raises(ConfigError, match="objective.name='electric_two' is not one of"):
    config_lib.validate(tiny_config(**{"objective.name": "electric_two"}))
  with pytest.raises(ConfigError, match="objective.name='bert'"):
    config_lib.validate(tiny_config(**{"objective.name": "bert"}))
  with pytest.raises(ConfigError, match="model.tie='decoder' is not one of"):
    config_lib.validate(tiny_config(**{"model.tie": "decoder"}))
  with pytest.raises(
      ConfigError, match="model.tie='all' .* model.generator_fraction=0.5: set it to 1.0"
  ):
    config_lib.validate(tiny_config(**{"model.tie": "all"}))


def _mlm_objective(name):
  config = tiny_config(
      **{"model.vocab_size": VOCAB, "objective.name": name, "data.max_seq_len": 24}
  )
  special = dict(pad=PAD, cls=CLS, sep=SEP, mask=MASK, vocab_size=VOCAB)
  return dataclasses.replace(objectives.objective_from_config(config, special), max_predictions=6)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return (
      x
      - x.max(-1, keepdims=True)
      - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
  )


def test_mlm_is_bert_80_10_10_on_the_discriminator_tower_alone():
  objective = _mlm_objective("mlm")
  assert (objective.keep_original_prob, objective.random_token_prob) == (0.1, 0.1)
  # Masking statistics over many rows: 80% [MASK], 10% random tokens, 10% kept.
  big = _batch(seed=5, batch=4, seq=24)
  big = jax.tree.map(lambda x: jnp.tile(x, (500, 1)), big)
  masked = objectives.mask_tokens(
      jax.random.key(0),
      big["input_ids"],
      big["attention_mask"],
      dataclasses.replace(objective, max_predictions=6),
  )
  used = np.asarray(masked.weights) > 0
  put = np.take_along_axis(np.asarray(masked.input_ids), np.asarray(masked.positions), axis=1)[used]
  original = np.asarray(masked.target_ids)[used]
  as_mask, kept = np.mean(put == MASK), np.mean(put == original)
  assert abs(as_mask - 0.8) < 0.02 and abs(kept - (0.1 + 0.1 / VOCAB)) < 0.02, (as_mask, kept)
  assert (
      len(np.unique(put[(put != MASK) & (put != original)])) > 0.9 * VOCAB
  )  # random over the vocab

  model, params = _model_and_params(objective="mlm")
  assert "generator" not in params and "mlm_output_bias" in params["discriminator"]
  batch = _batch()
  masked, loss, stats, _ = _forward(model, params, objective, batch)
  _, logits = model.apply(
      {"params": params},
      masked.input_ids,
      batch["token_type_ids"],
      batch["attention_mask"],
      masked.positions,
      method=model.discriminator_logits,
  )
  log_p = np.take_along_axis(_log_softmax(logits), np.asarray(masked.target_ids)[..., None], -1)[
      ..., 0
  ]
  weights = np.asarray(masked.weights)
  assert math.isclose(float(loss), -(log_p * weights).sum() / weights.sum(), rel_tol=1e-5)
  metrics = objectives.summarize(stats, _forward(model, params, objective, batch)[3], objective)
  assert np.isnan(float(metrics["disc_auc"])) and float(metrics["loss"]) == pytest.approx(
      float(loss), rel=1e-6
  )
  grads = _grads(model, params, objective, batch)
  assert _norm(grads["discriminator"]["head_out"]) == 0.0  # the RTD head is not trained
  assert _norm(grads["discriminator"]["mlm_head_dense"]) > 0.0


def _generator_corruption(model, params, objective, batch, masked, keys):
  gen_logits = model.apply(
      {"params": params},
      masked.input_ids,
      batch["token_type_ids"],
      batch["attention_mask"],
      masked.positions,
      method=model.generator_logits,
  )
  sampled = objectives.sample_tokens(keys, gen_logits, objective.temperature)
  corrupted, replaced = objectives.pieces.corrupt(batch["input_ids"], masked, sampled)
  log_p = np.take_along_axis(
      _log_softmax(gen_logits), np.asarray(masked.target_ids)[..., None], -1
  )[..., 0]
  weights = np.asarray(masked.weights)
  return corrupted, np.asarray(replaced), -(log_p * weights).sum() / weights.sum()


def test_replace_mlm_predicts_originals_from_the_generator_corrupted_input():
  objective = _mlm_objective("replace_mlm")
  model, params = _model_and_params(objective="replace_mlm")
  batch = _batch()
  masked, loss, stats, _ = _forward(model, params, objective, batch)
  keys = jax.random.split(jax.random.key(2), batch["input_ids"].shape[0])
  corrupted, _, gen_loss = _generator_corruption(model, params, objective, batch, masked, keys)
  assert not np.any(np.asarray(corrupted) == MASK)  # the tower never sees [MASK]
  _, logits = model.apply(
      {"params": params},
      corrupted,
      batch["token_type_ids"],
      batch["attention_mask"],
      masked.positions,
      method=model.discriminator_logits,
  )
  log_p = np.take_along_axis(_log_softmax(logits), np.asarray(masked.target_ids)[..., None], -1)[
      ..., 0
  ]
  weights = np.asarray(masked.weights)
  assert math.isclose(
      float(loss), gen_loss + -(log_p * weights).sum() / weights.sum(), rel_tol=1e-5
  )
  assert float(stats["main_count"]) == weights.sum()


def test_all_tokens_mlm_uses_the_copy_mechanism_at_every_token():
  objective = _mlm_objective("all_tokens_mlm")
  model, params = _model_and_params(objective="all_tokens_mlm")
  # A non-zero copy head, so both terms of the mixture matter.
  params = jax.tree.map(lambda x: x, params)
  params["discriminator"]["head_out"]["bias"] = jnp.full_like(
      params["discriminator"]["head_out"]["bias"], 0.7
  )
  batch = _batch()
  masked, loss, stats, per_token = _forward(model, params, objective, batch)
  keys = jax.random.split(jax.random.key(2), batch["input_ids"].shape[0])
  corrupted, replaced, gen_loss = _generator_corruption(
      model, params, objective, batch, masked, keys
  )
  copy_logits, logits = model.apply(
      {"params": params},
      corrupted,
      batch["token_type_ids"],
      batch["attention_mask"],
      None,
      method=model.discriminator_logits,
  )
  d = 1 / (1 + np.exp(-np.asarray(copy_logits, np.float64)))
  softmax = np.exp(_log_softmax(logits))
  original = np.asarray(batch["input_ids"])
  p_original = (
      np.take_along_axis(softmax, original[..., None], -1)[..., 0] * (1 - d) + d * ~replaced
  )
  real = np.asarray(batch["attention_mask"], bool)
  assert replaced.any() and (~replaced & real).any()
  want = gen_loss + -np.log(p_original[real]).mean()
  assert math.isclose(float(loss), want, rel_tol=1e-5)
  # Accuracy: the original is the argmax of the mixture.
  mixture = softmax * (1 - d)[..., None]
  np.put_along_axis(
      mixture,
      np.asarray(corrupted)[..., None],
      np.take_along_axis(mixture, np.asarray(corrupted)[..., None], -1) + d[..., None],
      -1,
  )
  correct = (mixture.argmax(-1) == original)[real].sum()
  assert float(stats["main_correct"]) == correct and float(stats["main_count"]) == real.sum()


# ---------------------------------------------------------------------------------------
# Weight sharing
# ---------------------------------------------------------------------------------------
def test_tie_none_gives_the_generator_its_own_embeddings():
  model, params = _model_and_params(tie="none")
  gen_hidden = model.generator_config.hidden_size
  assert params["generator_embeddings"]["word_embeddings"]["embedding"].shape == (VOCAB, gen_hidden)
  assert "embeddings_project" not in params["generator"]["encoder"]  # E_g = H_g, as officially
  batch = _batch()
  only_mlm = _grads(model, params, _objective(disc_weight=0.0), batch)
  only_disc = _grads(model, params, _objective(gen_weight=0.0), batch)
  assert _norm(only_mlm["embeddings"]) == 0.0 and _norm(only_mlm["generator_embeddings"]) > 0.0
  assert _norm(only_disc["generator_embeddings"]) == 0.0 and _norm(only_disc["embeddings"]) > 0.0
  # Each tower exports with its own table.
  gen_model, gen_params = models.tower_from_pretrainer(model, params, "generator")
  assert gen_model.embedding_size == gen_hidden
  assert gen_params["embeddings"] is params["generator_embeddings"]


def test_tie_all_runs_one_encoder_for_both_towers():
  config = tiny_config(
      **{
          "model.vocab_size": VOCAB,
          "model.tie": "all",
          "model.generator_fraction": 1.0,
          "model.dropout_rate": 0.0,
          "model.attention_dropout_rate": 0.0,
      }
  )
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32))[
          "params"
      ]
  )
  assert sorted(params) == ["discriminator", "embeddings", "generator", "shared_encoder"]
  assert "encoder" not in params["generator"] and "encoder" not in params["discriminator"]
  batch = _batch()
  only_mlm = _grads(model, params, _objective(disc_weight=0.0), batch)
  only_disc = _grads(model, params, _objective(gen_weight=0.0), batch)
  assert (
      _norm(only_mlm["shared_encoder"]) > 0 and _norm(only_disc["shared_encoder"]) > 0
  )  # both train it
  # Each exported tower carries the one encoder.
  gen_model, gen_params = models.tower_from_pretrainer(model, params, "generator")
  _, disc_params = models.tower_from_pretrainer(model, params, "discriminator")
  assert (
      gen_params["generator"]["encoder"]
      is disc_params["discriminator"]["encoder"]
      is params["shared_encoder"]
  )
  args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
  positions = jnp.tile(jnp.arange(4)[None], (4, 1))
  np.testing.assert_allclose(  # the standalone generator computes what the pre-trainer's does
      gen_model.apply(
          {"params": gen_params},
          batch["input_ids"],
          attention_mask=batch["attention_mask"],
          token_type_ids=batch["token_type_ids"],
      )[np.arange(4)[:, None], positions],
      model.apply({"params": params}, *args, positions, method=model.generator_logits),
      atol=1e-5,
  )


def test_gdes_keeps_the_discriminator_loss_off_the_shared_table():
  model, params = _model_and_params(tie="gdes")
  delta = params["discriminator_word_delta"]
  assert delta.shape == params["embeddings"]["word_embeddings"]["embedding"].shape
  assert not np.any(np.asarray(delta))  # zero-initialised: D starts from the shared table
  batch = _batch()
  only_disc = _grads(model, params, _objective(gen_weight=0.0), batch)
  only_mlm = _grads(model, params, _objective(disc_weight=0.0), batch)
  shared_table = lambda g: g["embeddings"]["word_embeddings"]["embedding"]  # noqa: E731
  assert _norm(shared_table(only_disc)) == 0.0  # stop_gradient: L_Disc does not pull on it
  assert _norm(only_disc["discriminator_word_delta"]) > 0.0  # ... it moves the delta instead
  assert _norm(shared_table(only_mlm)) > 0.0 and _norm(only_mlm["discriminator_word_delta"]) == 0.0
  # With the delta at 0 the discriminator computes exactly what tie=embeddings computes.
  plain = model.clone(tie="embeddings")
  plain_params = {k: v for k, v in params.items() if k != "discriminator_word_delta"}
  args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
  np.testing.assert_array_equal(
      model.apply({"params": params}, *args, method=model.discriminator_logits),
      plain.apply({"params": plain_params}, *args, method=plain.discriminator_logits),
  )
  # The exported discriminator holds the table it reads: shared + delta.
  params = {**params, "discriminator_word_delta": jnp.full_like(delta, 0.25)}
  _, disc_params = models.tower_from_pretrainer(model, params, "discriminator")
  np.testing.assert_allclose(
      disc_params["embeddings"]["word_embeddings"]["embedding"], shared_table(params) + 0.25
  )


@pytest.mark.parametrize("name", ["mlm", "replace_mlm", "all_tokens_mlm"])
def test_mlm_family_trains_and_exports_the_discriminator(tmp_path, name):
  config = tiny_config(
      **{
          "objective.name": name,
          "train.steps": 2,
          "checkpoint.every_steps": 2,
          "eval.every_steps": 2,
          "eval.num_batches": 1,
      }
  )
  metrics = train.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(metrics["loss"]) and np.isnan(metrics["disc_auc"])
  if name != "mlm":
    assert 0 <= metrics["main_mlm_accuracy"] <= 1 and np.isfinite(metrics["main_mlm_loss"])
  exported = interop.export_workdir(str(tmp_path), str(tmp_path / "hf"))
  model, params = interop.load_hf(exported["discriminator"])  # no MLM head in the export
  assert "mlm_head_dense" not in params["discriminator"]


@pytest.mark.fault
@pytest.mark.parametrize(
    "name, why",
    [
        ("mlm", "This pre-trainer has no generator"),
        ("uniform", "has no generator"),
        ("electric", "cloze generator has no standalone"),
    ],
)
def test_a_generator_without_a_standalone_form_is_refused_before_the_restore(tmp_path, name, why):
  config = tiny_config(**{"objective.name": name, "model.generator_fraction": 1.0})
  (tmp_path / "checkpoints").mkdir()  # no checkpoint in it: the refusal must come first
  (tmp_path / "config.json").write_text(config_lib.config_file_text(config))
  with pytest.raises(
      ConfigError, match=f"--export_generator: .*{why}.*objective.name='{name}'.* Nothing was"
  ):
    interop.export_workdir(str(tmp_path), str(tmp_path / "hf"), export_generator=True)
  assert not (tmp_path / "hf").exists()


def test_variants_train_through_the_usual_loop(tmp_path):
  config = tiny_config(
      **{
          "objective.name": "electra_15",
          "model.tie": "gdes",
          "objective.disallow_correct": True,
          "train.steps": 3,
          "checkpoint.every_steps": 3,
          "eval.every_steps": 0,
      }
  )
  metrics = train.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(metrics["loss"]) and metrics["step"] == 3
  # disallow_correct: every prediction slot is a replacement, so recall's denominator is them all.
  assert metrics["replaced_fraction"] == pytest.approx(
      1.0
  )  # electra_15: only masked positions count
  mesh = partitioning.make_mesh(config.mesh)
  setup = train_state.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4))
  checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=1)
  with partitioning.activate(mesh):
    state = checkpointer.restore(3, setup.abstract_state)
  checkpointer.close()
  assert np.any(np.asarray(state.params["discriminator_word_delta"]))  # the delta trained
  flat = flax.traverse_util.flatten_dict(state.params, sep="/")
  assert sorted(k.split("/")[0] for k in flat if k.endswith("/embedding")) == ["embeddings"] * 3


def test_two_stage_trains_the_generator_then_a_discriminator_started_from_it():
  config = tiny_config(
      **{
          "objective.name": "two_stage",
          "objective.two_stage_switch": 2,
          "model.generator_fraction": 1.0,
          "train.steps": 4,
      }
  )
  run = resolve.run(config)
  mesh, corpus, setup = run.mesh, run.corpus, run.setup
  with partitioning.activate(mesh):
    state = train_state.fresh_state(setup, 0)
    step_fn = train_state.compile_train_step(setup, config, mesh)
    history = [jax.device_get(state.params)]
    for step in range(4):
      batch = partitioning.global_batch_from_local(data.get_batch(corpus, step, 8, 0), mesh)
      state, _ = step_fn(state, batch, train_state.step_rng(0, step), run.schedule)
      history.append(jax.device_get(state.params))
  changed = lambda a, b: any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
  # Stage one (steps 0, 1): only the generator (and the shared embeddings) move.
  assert changed(history[0]["generator"], history[2]["generator"])
  assert not changed(history[0]["discriminator"], history[2]["discriminator"])
  # Stage two (from step 2): the generator is frozen ...
  assert not changed(history[2]["generator"], history[4]["generator"])
  # ... and the discriminator started from its encoder: one Adam step away from it, where it
  # was a random initialization away before.
  gen_encoder = history[2]["generator"]["encoder"]
  distance = lambda a, b: max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
  assert distance(history[2]["discriminator"]["encoder"], gen_encoder) > 1e-2
  assert distance(history[3]["discriminator"]["encoder"], gen_encoder) < 1.5e-3
  assert changed(history[3]["discriminator"], history[4]["discriminator"])


@pytest.mark.fault
def test_two_stage_needs_towers_of_one_size():
  with pytest.raises(ConfigError, match="two_stage' .* model.generator_fraction=1.0 \\(is 0.5\\)"):
    config_lib.validate(tiny_config(**{"objective.name": "two_stage"}))


@pytest.mark.fault
def test_two_stage_refuses_untied_embeddings_it_could_not_start_the_discriminator_from():
  # The generator's own embeddings (tie=none) are not the discriminator's; with an embedding
  # size below the hidden size the copy at the switch failed on the tree's structure.
  with pytest.raises(
      ConfigError, match="two_stage' .* model.tie='embeddings' or 'gdes' \\(is 'none'\\)"
  ):
    config_lib.validate(
        tiny_config(
            **{"objective.name": "two_stage", "model.generator_fraction": 1.0, "model.tie": "none"}
        )
    )


# One two-stage run of 4 steps at the default switch (half of them), evaluated at 2 and 4 and
# checkpointed at every step, for the two tests below (the resume trains on a copy).
TWO_STAGE = {
    "objective.name": "two_stage",
    "model.generator_fraction": 1.0,
    "train.steps": 4,
    "checkpoint.every_steps": 1,
    "checkpoint.keep": 10,
    "eval.every_steps": 2,
    "eval.num_batches": 1,
}


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("two_stage") / "run"
  train.train_and_evaluate(tiny_config(**TWO_STAGE), str(workdir))
  return workdir


def test_two_stage_resumed_with_more_steps_keeps_its_switch(tmp_path, two_stage_run):
  # The default switch is half of train.steps: a resume with more steps used to move it and
  # copy the generator's encoder over the discriminator its stage had trained.
  first = TWO_STAGE
  shutil.copytree(two_stage_run, tmp_path, dirs_exist_ok=True)  # trained with tiny_config(**first)
  assert json.loads((tmp_path / "config.json").read_text())["objective"]["two_stage_switch"] == 2
  # Resumed to 8 steps at a learning rate too small to move anything visibly.
  train.train_and_evaluate(
      tiny_config(**{**first, "train.steps": 8, "optimizer.learning_rate": 1e-9}), str(tmp_path)
  )
  assert json.loads((tmp_path / "config.json").read_text())["objective"]["two_stage_switch"] == 2
  config = tiny_config(**{**first, "train.steps": 8, "objective.two_stage_switch": 2})
  mesh = partitioning.make_mesh(config.mesh)
  setup = train_state.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4))

  def encoders_apart(step):
    _, state = resolve.restore_checkpoint(str(tmp_path), setup, mesh, step=step)
    params = jax.device_get(state.params)
    return max(
        float(np.max(np.abs(g - d)))
        for g, d in zip(
            jax.tree.leaves(params["generator"]["encoder"]),
            jax.tree.leaves(params["discriminator"]["encoder"]),
        )
    )

  # Two stage-two steps at 1e-3 set the discriminator apart from the generator; a second copy
  # at step 4 would have brought them back to a 1e-9 step apart.
  assert encoders_apart(4) > 1e-4
  assert encoders_apart(5) == pytest.approx(encoders_apart(4), rel=1e-3)
  # Moving the switch explicitly once the checkpoint is past it is refused.
  with pytest.raises(
      ConfigError,
      match="two_stage_switch=6, but this workdir's run switches at step 2 and its "
      "checkpoint is at step 8: .* over the trained discriminator again",
  ):
    train.train_and_evaluate(
        tiny_config(**{**first, "train.steps": 10, "objective.two_stage_switch": 6}), str(tmp_path)
    )


@pytest.mark.fault
@pytest.mark.parametrize(
    "switch, steps, resumed, harm",
    [
        (6, 10, True, "checkpoint is at step 4: .* over the trained discriminator again"),
        (1, 10, True, "checkpoint is at step 4: .* without the generator's encoder"),
        (10, 10, False, "switch=10 leaves a stage no step of train.steps=10: give a step from 1"),
        (0, 1, False, "switch=0 leaves a stage no step of train.steps=1: give a step from 1 to 0"),
    ],
)
def test_two_stage_refuses_a_switch_that_would_skip_or_repeat_a_stage(switch, steps, resumed, harm):
  # Resumed: a workdir that switched at step 2 and saved step 4. Fresh: a run whose switch is its
  # end, and a run of one step, whose half is 0.
  saved = config_lib.as_saved(tiny_config(**{**TWO_STAGE, "objective.two_stage_switch": 2}))
  config = tiny_config(**{**TWO_STAGE, "train.steps": steps, "objective.two_stage_switch": switch})
  with pytest.raises(ConfigError, match=harm):
    objectives.REGISTRY["two_stage"].fixed_at_start(
        config, saved if resumed else None, 4 if resumed else None
    )


def test_two_stage_evaluates_held_out_data_on_both_sides_of_the_switch(two_stage_run):
  # Evaluation used to hand electra_forward no stage, which two_stage's loss cannot do without.
  assert (
      json.loads((two_stage_run / "config.json").read_text())["objective"]["two_stage_switch"] == 2
  )
  lines = [
      json.loads(line) for line in (two_stage_run / "eval_metrics.jsonl").read_text().splitlines()
  ]
  assert [m["step"] for m in lines] == [2, 4]
  for m in lines:
    assert all(np.isfinite(m[k]) for k in ("masked_lm_loss", "disc_loss", "disc_auc")), m
  # At step 2 the discriminator is still its initialization; by step 4 it has been copied from
  # the generator and trained twice.
  assert lines[0]["disc_loss"] != lines[1]["disc_loss"]


def test_adversarial_generator_learns_from_the_discriminators_reward():
  model, params = _model_and_params()
  batch = _batch()
  objective = _objective(name="adversarial", disc_weight=0.0)  # only the REINFORCE term
  grads = _grads(model, params, objective, batch)
  assert _norm(grads["generator"]) > 0.0  # the reward reaches the generator ...
  assert _norm(grads["discriminator"]) == 0.0  # ... which does not train the discriminator
  # A discriminator that says the same about every token gives every sample the same reward:
  # nothing to learn from once the baseline (the other slots' mean) is subtracted, in examples
  # of several slots. An example of one slot (the batch's 4th, 9 tokens) has no other slot:
  # its baseline is 0 and it still learns (the example's own mean gave it nothing).
  flat = jax.tree.map(jnp.zeros_like, params["discriminator"]["head_out"])
  constant = {**params, "discriminator": {**params["discriminator"], "head_out": flat}}
  assert _norm(_grads(model, constant, objective, _batch(batch=3))["generator"]) < 1e-12
  assert _norm(_grads(model, constant, objective, batch)["generator"]) > 1e-4
  batch = _batch(batch=3)  # the REINFORCE loss by hand, over examples of several slots
  # The REINFORCE loss by hand.
  masked, loss, stats, per_token = _forward(model, params, objective, batch)
  keys = jax.random.split(jax.random.key(2), batch["input_ids"].shape[0])
  gen_logits = model.apply(
      {"params": params},
      masked.input_ids,
      batch["token_type_ids"],
      batch["attention_mask"],
      masked.positions,
      method=model.generator_logits,
  )
  sampled = np.asarray(objectives.sample_tokens(keys, gen_logits, 1.0))
  logits, replaced = np.asarray(per_token["disc_logits"], np.float64), np.asarray(
      per_token["is_replaced"], np.float64
  )
  positions, weights = np.asarray(masked.positions), np.asarray(masked.weights)
  reward = np.take_along_axis(_bce(logits, replaced), positions, 1)
  slots = weights.sum(1, keepdims=True)
  assert slots.min() > 1
  baseline = ((reward * weights).sum(1, keepdims=True) - reward * weights) / (
      slots - 1
  )  # the other slots' mean
  log_p = np.take_along_axis(_log_softmax(gen_logits), sampled[..., None], -1)[..., 0]
  want = -((reward - baseline) * log_p * weights).sum() / weights.sum()
  assert math.isclose(float(loss), want, rel_tol=1e-4, abs_tol=1e-6)
  metrics = objectives.summarize(stats, per_token, objective)
  assert float(metrics["generator_reward"]) == pytest.approx(
      (reward * weights).sum() / weights.sum(), rel=1e-5
  )


def test_electric_cloze_generator_and_energy_based_discriminator():
  model, params = _model_and_params(objective="electric")
  assert sorted(params["generator"]) == [
      "encoder_ltr",
      "encoder_rtl",
      "head_dense",
      "head_layer_norm",
      "output_bias",
  ]
  batch = _batch()
  ids, types, mask = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
  cloze = model.apply({"params": params}, ids, types, mask, method=model.generator_logits)
  # Position t's prediction never depends on token t itself (nor on padding).
  changed = ids.at[0, 5].set(7 if int(ids[0, 5]) != 7 else 8)
  cloze_changed = model.apply(
      {"params": params}, changed, types, mask, method=model.generator_logits
  )
  np.testing.assert_allclose(cloze_changed[0, 5], cloze[0, 5], atol=1e-5)
  assert not np.allclose(cloze_changed[0, 6], cloze[0, 6], atol=1e-5)  # its neighbours see it

  objective = _mlm_objective("electric")
  masked, loss, stats, per_token = _forward(model, params, objective, batch)
  keys = jax.random.split(jax.random.key(2), ids.shape[0])
  gen_logits = np.take_along_axis(np.asarray(cloze), np.asarray(masked.positions)[..., None], 1)
  sampled = objectives.sample_tokens(keys, jnp.asarray(gen_logits), 1.0)
  corrupted, _ = objectives.pieces.corrupt(ids, masked, sampled)
  # Labels: every used masked slot is "replaced".
  np.testing.assert_array_equal(
      np.asarray(per_token["is_replaced"]),
      np.asarray(objectives.pieces.at_slots(mask.shape, masked, masked.weights)) > 0,
  )
  # The loss by hand: cloze CE over the maskable tokens + 50 x BCE of (D + log q + log prior odds).
  log_softmax = _log_softmax(cloze)
  candidates = np.asarray(objectives.candidate_mask(ids, mask, objective), np.float64)
  cloze_ce = (
      -(np.take_along_axis(log_softmax, np.asarray(ids)[..., None], -1)[..., 0] * candidates).sum()
      / candidates.sum()
  )
  raw = np.asarray(
      model.apply({"params": params}, corrupted, types, mask, method=model.discriminator_logits),
      np.float64,
  )
  log_q = np.take_along_axis(log_softmax, np.asarray(corrupted)[..., None], -1)[..., 0]
  logits = raw + log_q + np.log(0.15 / 0.85)
  np.testing.assert_allclose(np.asarray(per_token["disc_logits"]), logits, atol=1e-4)
  labels = np.asarray(per_token["is_replaced"], np.float64)
  real = np.asarray(mask, np.float64)
  want = cloze_ce + 50.0 * (_bce(logits, labels) * real).sum() / real.sum()
  assert math.isclose(float(loss), want, rel_tol=1e-4)
  # L_Disc does not reach the cloze model through log q.
  grads = _grads(model, params, dataclasses.replace(objective, gen_weight=0.0), batch)
  assert _norm(grads["generator"]) == 0.0 and _norm(grads["discriminator"]) > 0.0


def test_disc_mlm_weight_adds_the_discriminators_own_mlm_at_the_masked_slots():
  """objective.disc_mlm_weight: loss = L_MLM(generator) + 50 L_Disc + w * L_MLM(discriminator on
  the corrupted input, at the masked slots), all from one pass of the discriminator; 0 builds
  no MLM head at all."""
  weight = 0.5
  objective = _objective(disc_mlm_weight=weight)
  config = tiny_config(
      **{
          "model.vocab_size": VOCAB,
          "model.dropout_rate": 0.0,
          "model.attention_dropout_rate": 0.0,
          "objective.disc_mlm_weight": weight,
      }
  )
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32))[
          "params"
      ]
  )
  assert "mlm_output_bias" in params["discriminator"] and "generator" in params
  batch = _batch()
  masked, loss, stats, per_token = _forward(model, params, objective, batch)
  keys = jax.random.split(jax.random.key(2), batch["input_ids"].shape[0])
  corrupted, replaced, gen_loss = _generator_corruption(
      model, params, objective, batch, masked, keys
  )
  disc_logits, logits = model.apply(
      {"params": params},
      corrupted,
      batch["token_type_ids"],
      batch["attention_mask"],
      masked.positions,
      method=model.discriminator_logits,
  )
  z, real = np.asarray(disc_logits, np.float64), np.asarray(batch["attention_mask"], bool)
  bce = np.maximum(z, 0) - z * replaced + np.log1p(np.exp(-np.abs(z)))
  log_p = np.take_along_axis(_log_softmax(logits), np.asarray(masked.target_ids)[..., None], -1)[
      ..., 0
  ]
  weights = np.asarray(masked.weights)
  disc_mlm = -(log_p * weights).sum() / weights.sum()
  assert math.isclose(
      float(loss), gen_loss + 50.0 * bce[real].mean() + weight * disc_mlm, rel_tol=1e-5
  )
  metrics = objectives.summarize(stats, per_token, objective)
  assert float(metrics["main_mlm_loss"]) == pytest.approx(disc_mlm, rel=1e-5)
  assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
  assert 0.0 <= float(metrics["disc_auc"]) <= 1.0
  # Both heads of the discriminator learn.
  grads = _grads(model, params, objective, batch)
  assert (
      _norm(grads["discriminator"]["head_out"]) > 0.0
      and _norm(grads["discriminator"]["mlm_head_dense"]) > 0.0
  )
  # Off: no head, and the plain ELECTRA tree.
  plain, _ = _model_and_params()
  assert not plain.towers.mlm_head


NO_GENERATOR = "has no generator tower to share an encoder with: use model.tie='embeddings'"
CUDNN = {"model.attention_impl": "cudnn", "train.dtype": "bfloat16"}


@pytest.mark.fault
@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"objective.disc_mlm_weight": -1.0}, "objective.disc_mlm_weight=-1.0"),
        ({"objective.disc_mlm_weight": float("nan")}, "objective.disc_mlm_weight=nan"),
        ({"objective.disc_mlm_weight": 1.0, "objective.name": "uniform"}, "not 'uniform'"),
        ({"objective.gen_weight": -1.0}, "objective.gen_weight=-1.0 must be >= 0"),
        ({"objective.disc_weight": -50.0}, "objective.disc_weight=-50.0 must be >= 0"),
        (
            {"objective.name": "adversarial", "objective.adversarial_mlm_weight": -0.5},
            "objective.adversarial_mlm_weight=-0.5 must be >= 0",
        ),
        (
            {"objective.mask_prob": 0.01},
            r"objective.mask_prob=0.01 masks no position of a row of data.max_seq_len=32",
        ),
        (
            {
                "objective.name": "two_stage",
                "model.generator_fraction": 1.0,
                "objective.two_stage_switch": -3,
            },
            "objective.two_stage_switch=-3 is no step",
        ),
        *(
            (
                {"objective.name": name, "model.tie": "all", "model.generator_fraction": 1.0},
                f"objective.name='{name}' {NO_GENERATOR}",
            )
            for name in ("uniform", "mlm", "electric")
        ),
        ({"model.generator_fraction": 0.01}, "generator_fraction=0.01 gives a generator hidden "),
        (
            {"model.hidden_size": 64, "model.num_heads": 4, "model.generator_fraction": 0.7},
            "generator_fraction=0.7 gives a generator hidden size of 45",
        ),
        (
            {
                **CUDNN,
                "model.attention_dropout_rate": 0.0,
                "data.max_seq_len": 31,
                "objective.name": "electric",
                "model.generator_fraction": 1.0,
            },
            "packed rows or Electric needs an even sequence length, not data.max_seq_len=31",
        ),
    ],
)
def test_bad_objective_and_model_settings_are_refused_by_name(overrides, named):
  with pytest.raises(ConfigError, match=named):
    config_lib.validate(tiny_config(**overrides))
