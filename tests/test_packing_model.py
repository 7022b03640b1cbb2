"""Model side of packed rows (segment-aware attention, per-segment positions) and remat.

A packed row holds several whole examples; the model must treat each exactly as if it were
alone in a row of its own: same embeddings (positions restart), no attention across examples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import deep_tiny_config as tiny_config
from electra_jax import config_lib, encoder, models, objectives, resolve, train
from electra_jax.errors import ConfigError


def test_segment_positions_restart_at_each_example():
  segments = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  positions = models.segment_positions(segments)
  np.testing.assert_array_equal(positions[0, :6], [0, 1, 2, 0, 1, 0])
  np.testing.assert_array_equal(positions[1], np.arange(8))


def test_segment_attention_mask_keeps_queries_in_their_example():
  mask = np.asarray(models.segment_attention_mask(jnp.array([[1, 1, 2, 0]])))[0]
  want = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(mask, want)


def _model_and_params(**overrides):
  config = tiny_config(
      **{"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0, **overrides}
  )
  config.data.pack_rows = True
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 32), jnp.int32)
  params = jax.jit(model.init)(
      jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 4), jnp.int32)
  )["params"]
  return model, params


def _example(rng, length, vocab=500):
  # [CLS]=2 ... [SEP]=3 with one segment-B part, as the packer writes examples.
  tokens = rng.integers(5, vocab, size=length)
  tokens[0], tokens[length // 2], tokens[-1] = 2, 3, 3
  types = np.zeros(length, np.int32)
  types[length // 2 + 1 :] = 1
  return tokens.astype(np.int32), types


def test_packed_examples_equal_the_same_examples_alone():
  model, params = _model_and_params()
  assert model.packed
  rng = np.random.default_rng(0)
  examples = [_example(rng, n) for n in (9, 12, 6)]
  seq = 32
  packed_ids, packed_types, segments = (np.zeros((1, seq), np.int32) for _ in range(3))
  alone_ids, alone_types, alone_mask = (np.zeros((3, seq), np.int32) for _ in range(3))
  starts, offset = [], 0
  for row, (tokens, types) in enumerate(examples):
    n = len(tokens)
    starts.append(offset)
    packed_ids[0, offset : offset + n], packed_types[0, offset : offset + n] = tokens, types
    segments[0, offset : offset + n] = row + 1
    alone_ids[row, :n], alone_types[row, :n], alone_mask[row, :n] = tokens, types, 1
    offset += n

  # Compiled: run op by op, each of the forward's few hundred ops would compile on its own.
  apply = lambda *args, method: jax.jit(
      lambda p, *a: model.apply({"params": p}, *a, method=method)
  )(params, *args)
  packed_disc = apply(packed_ids, packed_types, segments, method=model.discriminator_logits)
  alone_disc = apply(alone_ids, alone_types, alone_mask, method=model.discriminator_logits)
  # The generator at two slots of each example (positions inside the row / inside the example).
  slots = [(1, 4), (2, 7), (1, 3)]
  packed_slots = jnp.array([[starts[r] + p for r, pair in enumerate(slots) for p in pair]])
  alone_slots = jnp.array(slots)
  packed_gen = apply(
      packed_ids, packed_types, segments, packed_slots, method=model.generator_logits
  )
  alone_gen = apply(alone_ids, alone_types, alone_mask, alone_slots, method=model.generator_logits)

  labels = rng.integers(0, 2, size=(3, seq)).astype(np.float32)
  for row, (tokens, _) in enumerate(examples):
    n, start = len(tokens), starts[row]
    # Relative errors: at initialization the logits are small (about 1e-2).
    assert rel_err(packed_disc[0, start : start + n], alone_disc[row, :n]) < 1e-5
    # Per-token L_Disc on the same labels: equal, so packing changes no token's loss.
    packed_bce = optax_bce(packed_disc[0, start : start + n], labels[row, :n])
    alone_bce = optax_bce(alone_disc[row, :n], labels[row, :n])
    np.testing.assert_allclose(packed_bce, alone_bce, rtol=1e-6)
    assert rel_err(packed_gen[0, 2 * row : 2 * row + 2], alone_gen[row]) < 1e-5
  # Without segment ids (or with positions that do not restart) the examples read each other
  # and shift: the checks above would fail.
  leaky = apply(
      packed_ids, packed_types, (segments > 0).astype(np.int32), method=model.discriminator_logits
  )
  assert rel_err(leaky[0, starts[1] : starts[1] + 12], alone_disc[1, :12]) > 1e-3


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def optax_bce(logits, labels):
  return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def test_packed_model_on_unpacked_rows_equals_the_unpacked_model():
  packed_model, params = _model_and_params()
  config = tiny_config(**{"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0})
  plain_model = models.build_model(config, objectives.towers(config))
  assert not plain_model.packed
  rng = np.random.default_rng(1)
  tokens, types = _example(rng, 20)
  ids = np.zeros((1, 32), np.int32)
  ids[0, :20] = tokens
  type_ids = np.zeros_like(ids)
  type_ids[0, :20] = types
  mask = (ids != 0).astype(np.int32)
  got = packed_model.apply(
      {"params": params}, ids, type_ids, mask, method=packed_model.discriminator_logits
  )
  want = plain_model.apply(
      {"params": params}, ids, type_ids, mask, method=plain_model.discriminator_logits
  )
  np.testing.assert_allclose(got[0, :20], want[0, :20], atol=1e-6)


@pytest.mark.fault
def test_electric_refuses_packed_rows():
  # Before any data: config_lib.validate is what train.prepare and sweeps check first.
  with pytest.raises(ConfigError, match="set data.pack_rows=False for objective.name='electric'"):
    config_lib.validate(
        tiny_config(
            **{
                "objective.name": "electric",
                "model.generator_fraction": 1.0,
                "data.pack_rows": True,
            }
        )
    )


def _loss_and_grads(remat, params=None):
  """(loss, grads) of the tiny pretrainer under `remat`, and the parameters (drawn if None)."""
  config = tiny_config(
      **{"model.remat": remat, "model.dropout_rate": 0.1, "model.attention_dropout_rate": 0.1}
  )
  model = models.build_model(config, objectives.towers(config))
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(5, 500, size=(2, 32)), jnp.int32)
  mask = jnp.ones_like(ids)
  positions = jnp.array([[1, 5, 9], [2, 3, 30]])
  if params is None:
    params = jax.jit(model.init)(jax.random.key(0), ids, ids * 0, mask, positions)["params"]

  def loss(p):
    gen, disc = model.apply(
        {"params": p},
        ids,
        ids * 0,
        mask,
        positions,
        deterministic=False,
        rngs={"dropout": jax.random.key(3)},
    )
    return (gen**2).mean() + (disc**2).mean()

  return jax.jit(jax.value_and_grad(loss))(params), params


def test_remat_policies_change_nothing_but_memory():
  (loss, grads), params = _loss_and_grads("none")  # remat leaves the parameters as they are
  for policy in ("dots", "full"):
    (other_loss, other_grads), _ = _loss_and_grads(policy, params)
    assert jax.tree.structure(other_grads) == jax.tree.structure(grads)
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def _count_barriers(scan_layers):
  """optimization_barrier ops in the lowered gradient of the tiny model under model.remat=full."""
  config = tiny_config(**{"model.remat": "full", "model.scan_layers": scan_layers})
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.ones((2, 32), jnp.int32)
  positions = jnp.array([[1, 5, 9], [2, 3, 30]])
  params = model.init(jax.random.key(0), ids, ids * 0, ids, positions)["params"]

  def loss(p):
    gen, disc = model.apply({"params": p}, ids, ids * 0, ids, positions)
    return (gen**2).mean() + (disc**2).mean()

  return jax.jit(jax.grad(loss)).lower(params).as_text().count("optimization_barrier")


def test_remat_inside_scanned_layers_leaves_xla_free_to_fuse():
  # Unrolled layers need jax.checkpoint's barriers (else XLA merges the recomputation with
  # the forward pass); in a scan's body they only block fusion, so there are none.
  assert _count_barriers(scan_layers=False) > 0
  assert _count_barriers(scan_layers=True) == 0


@pytest.mark.fault
def test_unknown_remat_and_attention_are_refused_by_name():
  with pytest.raises(ConfigError, match="model.remat='some'"):
    models.build_model(tiny_config(**{"model.remat": "some"}), models.Towers())
  with pytest.raises(
      ConfigError, match="model.remat='fulll'"
  ):  # before any data, so a sweep refuses it up front
    config_lib.validate(tiny_config(**{"model.remat": "fulll"}))
  with pytest.raises(ConfigError, match="model.attention_impl='flash'"):
    models.build_model(tiny_config(**{"model.attention_impl": "flash"}), models.Towers())
  with pytest.raises(ConfigError, match="train.dtype=bfloat16"):
    models.build_model(tiny_config(**{"model.attention_impl": "cudnn"}), models.Towers())


@pytest.mark.fault
def test_packed_training_runs_evaluates_and_refuses_an_unpacked_resume(tmp_path):

  overrides = {
      "train.steps": 3,
      "eval.every_steps": 3,
      "eval.num_batches": 2,
      "checkpoint.every_steps": 3,
  }
  config = tiny_config(**overrides)
  config.data.pack_rows = True
  metrics = train.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(metrics["loss"]) and 0.0 <= metrics["disc_auc"] <= 1.0
  assert (tmp_path / "eval_metrics.jsonl").read_text().count("\n") == 1
  unpacked = tiny_config(**{**overrides, "train.steps": 4})
  with pytest.raises(ConfigError, match="pack_rows"):
    train.train_and_evaluate(unpacked, str(tmp_path))


def _init(config, ids, positions):
  model = models.build_model(config, objectives.towers(config))
  boxed = model.init(jax.random.key(0), ids, ids * 0, jnp.ones_like(ids), positions)["params"]
  return model, boxed


def _unbox(tree):
  import flax.linen as nn  # noqa: PLC0415

  return nn.meta.unbox(tree)


def test_scanned_layers_compute_the_same_function_in_the_stacked_layout():
  no_dropout = {"model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(5, 500, size=(2, 32)), jnp.int32)
  positions = jnp.array([[1, 5, 9], [2, 3, 30]])
  plain, plain_params = _init(tiny_config(**no_dropout), ids, positions)
  plain_params = _unbox(plain_params)
  scanned, boxed = _init(tiny_config(**no_dropout, **{"model.scan_layers": True}), ids, positions)
  # The stacked axis is named "layers" for the sharding rules (replicated).
  assert boxed["discriminator"]["encoder"]["layers"]["layer"]["attention"]["query"][
      "kernel"
  ].names == ("layers", "embed", "heads")
  scanned_params = _unbox(boxed)
  # encoder/layers/layer holds each layer's parameters stacked on a leading axis of length L.
  stacked = scanned_params["discriminator"]["encoder"]["layers"]["layer"]
  assert "layer_0" not in scanned_params["discriminator"]["encoder"]
  assert stacked["attention"]["query"]["kernel"].shape == (2, 32, 32)
  converted = encoder.scan_layers(plain_params)
  assert jax.tree.structure(converted) == jax.tree.structure(scanned_params)
  assert jax.tree.map(jnp.shape, converted) == jax.tree.map(jnp.shape, scanned_params)
  back = encoder.unscan_layers(converted)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(plain_params)):
    np.testing.assert_array_equal(a, b)
  mask = jnp.ones_like(ids)
  want = plain.apply({"params": plain_params}, ids, ids * 0, mask, positions)
  got = scanned.apply({"params": converted}, ids, ids * 0, mask, positions)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The standalone discriminator of a scanned pre-trainer is the usual one, same outputs.
  tower, tower_params = models.tower_from_pretrainer(scanned, converted, "discriminator")
  assert "layer_1" in tower_params["discriminator"]["encoder"]
  np.testing.assert_allclose(
      tower.apply({"params": tower_params}, ids, mask), want[1], rtol=1e-5, atol=1e-6
  )


def test_scanned_training_exports_to_hugging_face(tmp_path):
  from electra_jax.interop import hf  # noqa: PLC0415

  config = tiny_config(
      **{"model.scan_layers": True, "model.remat": "dots", "train.steps": 2, "eval.every_steps": 0}
  )
  metrics = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert np.isfinite(metrics["loss"])
  run = resolve.run(config)
  mesh, corpus, setup = run.mesh, run.corpus, run.setup
  _, state = resolve.restore_checkpoint(str(tmp_path / "run"), setup, mesh, None, corpus)
  hf.save_hf(setup.model, state.params, str(tmp_path / "hf"), kind="discriminator")
  model, params = hf.load_hf(str(tmp_path / "hf"))
  unscanned = encoder.unscan_layers(state.params)
  np.testing.assert_array_equal(
      params["discriminator"]["encoder"]["layer_1"]["attention"]["query"]["kernel"],
      unscanned["discriminator"]["encoder"]["layer_1"]["attention"]["query"]["kernel"],
  )
