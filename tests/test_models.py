"""The networks: one shared embedding tree, tied generator decoder, BERT encoder details."""

import flax
import flax.linen as nn
import jax
import jax.export  # jax 0.6 (Python 3.10) loads it only when asked
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import models
from electra_jax.config_lib import ConfigError


def _init(config, batch=2, seq=12, n_pred=3):
  model = models.build_model(config)
  ids = jnp.zeros((batch, seq), jnp.int32)
  positions = jnp.zeros((batch, n_pred), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), positions)["params"])
  return model, params


def _inputs(seed=0, batch=2, seq=12, vocab=512):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, vocab, size=(batch, seq)).astype(np.int32)
  ids[:, 0], ids[:, -1] = 2, 3
  mask = np.ones_like(ids)
  ids[1, 8:], mask[1, 8:] = 0, 0  # the second row is padded
  types = np.zeros_like(ids)
  types[:, 6:] = 1
  return jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask)


def test_param_tree_has_three_parts_and_one_word_table():
  config = tiny_config()
  _, params = _init(config)
  assert set(params) == {"embeddings", "generator", "discriminator"}
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  vocab, emb = config.model.vocab_size, config.model.embedding_size
  tables = [name for name, leaf in flat.items() if leaf.shape == (vocab, emb)]
  assert tables == ["embeddings/word_embeddings/embedding"]
  assert not any("embed" in name for name in flat if not name.startswith("embeddings/")
                 and "embeddings_project" not in name)


def test_generator_decoder_is_tied_to_the_shared_table():
  config = tiny_config()
  model, params = _init(config)
  ids, types, mask = _inputs()
  positions = jnp.array([[1, 2, 3], [1, 2, 3]])

  def gen_out(table):
    p = jax.tree.map(lambda x: x, params)
    p["embeddings"]["word_embeddings"]["embedding"] = table
    return model.apply({"params": p}, ids, types, mask, positions, method=model.generator_logits)

  table = params["embeddings"]["word_embeddings"]["embedding"]
  # Changing only the rows of tokens absent from the input moves only their output logits:
  # the table enters the generator's decoder, not just its input lookup.
  unused = np.setdiff1d(np.arange(config.model.vocab_size), np.asarray(ids))[:5]
  bumped = table.at[unused].add(jax.random.normal(jax.random.key(5), (5, table.shape[1])))
  before, after = gen_out(table), gen_out(bumped)
  changed = np.abs(np.asarray(after - before)).max(axis=(0, 1)) > 1e-6
  assert changed[unused].all()
  assert not np.delete(changed, unused).any()


def test_padding_does_not_change_real_token_outputs():
  config = tiny_config()
  model, params = _init(config)
  ids, types, mask = _inputs()
  other_pad = ids.at[1, 8:].set(77)  # different content under the padding mask
  a = model.apply({"params": params}, ids, types, mask, method=model.discriminator_logits)
  b = model.apply({"params": params}, other_pad, types, mask, method=model.discriminator_logits)
  np.testing.assert_allclose(a[1, :8], b[1, :8], atol=1e-6)
  np.testing.assert_allclose(a[0], b[0], atol=0)


def test_attention_dropout_path_equals_fused_path_at_rate_zero():
  """With attention dropout 0 in training mode both code paths must agree; the explicit one
  (used when attention dropout is on) is a plain softmax(QK^T / sqrt(d)) V with the mask."""
  cfg = models.EncoderConfig(32, 1, 2, 64, dropout_rate=0.0, attention_dropout_rate=0.0)
  attn = models.SelfAttention(cfg, jnp.float32)
  hidden = jax.random.normal(jax.random.key(1), (2, 12, 32))
  _, _, mask = _inputs()
  params = attn.init(jax.random.key(0), hidden, mask, True)
  fused = attn.apply(params, hidden, mask, False)
  # Reference computed by hand from the same parameters.
  p = nn.meta.unbox(params)["params"]
  q, k, v = (hidden @ p[n]["kernel"] + p[n]["bias"] for n in ("query", "key", "value"))
  q, k, v = (x.reshape(2, 12, 2, 16) for x in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
  scores = jnp.where(mask[:, None, None, :] > 0, scores, -1e30)
  context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(2, 12, 32)
  expected = context @ p["output"]["kernel"] + p["output"]["bias"]
  np.testing.assert_allclose(fused, expected, atol=1e-5)
  with_dropout = models.SelfAttention(
      models.EncoderConfig(32, 1, 2, 64, dropout_rate=0.0, attention_dropout_rate=0.5), jnp.float32
  )
  dropped = with_dropout.apply(params, hidden, mask, False, rngs={"dropout": jax.random.key(3)})
  assert not np.allclose(dropped, expected, atol=1e-3)


def test_bert_truncated_normal_init():
  values = models.bert_init(0.02)(jax.random.key(0), (400, 400))
  assert float(jnp.abs(values).max()) <= 0.04 + 1e-7
  # TF's truncated normal keeps the N(0, 0.02) scale before cutting: std = 0.02 * 0.8796.
  assert abs(float(values.std()) - 0.02 * 0.87962566) < 2e-4


@pytest.mark.parametrize(
    "hidden, heads, fraction, want_hidden, want_heads",
    [(256, 4, 0.25, 64, 1), (768, 12, 1 / 3, 256, 4), (1024, 16, 0.25, 256, 4), (32, 2, 0.5, 16, 1)],
)
def test_generator_sizes_follow_the_official_rule(hidden, heads, fraction, want_hidden, want_heads):
  disc = models.EncoderConfig(hidden, 12, heads, 4 * hidden)
  gen = models.generator_encoder_config(disc, fraction)
  assert (gen.hidden_size, gen.num_heads, gen.intermediate_size, gen.num_layers) == (
      want_hidden, want_heads, 4 * want_hidden, 12)


def test_bfloat16_compute_keeps_float32_params():
  config = tiny_config(**{"train.dtype": "bfloat16"})
  model, params = _init(config)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  ids, types, mask = _inputs()
  logits = model.apply({"params": params}, ids, types, mask, method=model.discriminator_logits)
  f32_model = models.build_model(tiny_config())
  reference = f32_model.apply({"params": params}, ids, types, mask, method=f32_model.discriminator_logits)
  assert logits.dtype == jnp.float32
  # The scalar head's product (rows x hidden @ hidden x 1) is returned in float32, not rounded.
  program = jax.jit(
      lambda p: model.apply({"params": p}, ids, types, mask, method=model.discriminator_logits)
  ).lower(params).as_text()
  assert "tensor<32x1xbf16>) -> tensor<24x1xf32>" in program
  np.testing.assert_allclose(logits, reference, atol=0.1)
  assert not np.array_equal(np.asarray(logits), np.asarray(reference))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tied_vocab_logits_gradients_are_autodiffs(dtype):
  """tied_vocab_logits has a hand-written backward pass. Its output is einsum(hidden,
  table^T) of compute-dtype operands with a float32 result, + bias; its gradients must be
  autodiff's for the product taken in the compute dtype (the float32 cotangent cast to that
  dtype, so the backward matmuls run in it) for all three inputs."""
  rng = np.random.default_rng(0)
  hidden, table = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(3, 5, 16), (40, 16)])
  bias, grad = jnp.asarray(rng.normal(size=(40,)), jnp.float32), jnp.asarray(rng.normal(size=(3, 5, 40)), jnp.float32)

  def forward(h, t, b):
    return jnp.einsum("bne,ve->bnv", h.astype(dtype), t.astype(dtype), preferred_element_type=jnp.float32) + b

  def in_compute_dtype(h, t, b):
    return jnp.einsum("bne,ve->bnv", h.astype(dtype), t.astype(dtype)).astype(jnp.float32) + b

  got_out, got_vjp = jax.vjp(lambda h, t, b: models.tied_vocab_logits(h, t, b, dtype), hidden, table, bias)
  np.testing.assert_array_equal(got_out, forward(hidden, table, bias))
  # The product is asked for in float32 (compute-dtype operands, float32 result), not
  # rounded to the compute dtype first. (XLA:CPU rounds bfloat16 products anyway; GPUs and
  # TPUs accumulate and return float32, so the check is on the program.)
  program = jax.jit(lambda h, t, b: models.tied_vocab_logits(h, t, b, dtype)).lower(hidden, table, bias).as_text()
  name = jnp.dtype(dtype).name.replace("float", "f")
  assert f"tensor<40x16x{name}>) -> tensor<3x5x40xf32>" in program, program
  _, want_vjp = jax.vjp(in_compute_dtype, hidden, table, bias)
  for got, want in zip(got_vjp(grad), want_vjp(grad)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform, matmuls", [("cpu", 3), ("cuda", 2), ("tpu", 2)])
def test_tied_vocab_bias_gradient_is_a_product_on_cpu_only(platform, matmuls):
  """The output bias's gradient sums the logits' gradient over the rows: on the CPU as a
  product with a ones vector (its column reduction is slow there), elsewhere as a plain sum,
  which a GPU fuses with the pass that makes the logits' gradient (a product made it write
  that gradient out once more). The backward pass has two matmuls besides, table and hidden."""
  hidden, table, bias = (jax.ShapeDtypeStruct(s, jnp.float32) for s in [(4, 19, 16), (30522, 16), (30522,)])

  def backward(h, t, b):
    _, vjp = jax.vjp(lambda h, t, b: models.tied_vocab_logits(h, t, b, jnp.bfloat16), h, t, b)
    return vjp(jnp.ones((4, 19, 30522), jnp.float32))

  module = jax.export.export(jax.jit(backward), platforms=[platform])(hidden, table, bias).mlir_module()
  assert module.count("stablehlo.dot_general") == matmuls, module  # (the forward's is not needed)
  sums_over_rows = [l for l in module.split("\n") if "stablehlo.reduce" in l and "x30522xf32>" in l]
  assert len(sums_over_rows) == (0 if platform == "cpu" else 1), sums_over_rows


def test_rows_dot_general_is_nn_dense_with_its_gradients():
  """The encoder's dense layers take their product as one 2-D matmul over all rows: same
  outputs and gradients (inputs, kernel, bias) as flax's own N-D dot_general."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
  plain, rows = nn.Dense(8), nn.Dense(8, dot_general=models.rows_dot_general)
  params = plain.init(jax.random.key(0), x)
  grad = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
  want, want_vjp = jax.vjp(lambda p, x: plain.apply(p, x), params, x)
  got, got_vjp = jax.vjp(lambda p, x: rows.apply(p, x), params, x)
  assert got.shape == (3, 5, 8)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for g, w in zip(jax.tree.leaves(got_vjp(grad)), jax.tree.leaves(want_vjp(grad))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="rows_dot_general"):
    models.rows_dot_general(x, jnp.ones((5, 8)), (((1,), (0,)), ((), ())))


def test_cudnn_path_gets_lengths_of_at_least_one(monkeypatch):
  """attention_impl='cudnn' passes the padding as sequence lengths. cuDNN before 9.25 returns
  NaN for a length of 0, so an all-padding row (evaluation fills its last batch with them)
  must be sent as length 1; real rows keep their token counts. cuDNN needs a GPU, so the
  call is recorded and answered by the masked XLA attention."""
  seen, xla_attention = [], jax.nn.dot_product_attention

  def fake_attention(query, key, value, *, query_seq_lengths, key_value_seq_lengths, implementation):
    assert implementation == "cudnn"
    seen.append(np.asarray(query_seq_lengths))
    real = jnp.arange(key.shape[1])[None, :] < key_value_seq_lengths[:, None]
    return xla_attention(query, key, value, mask=real[:, None, None, :], implementation="xla")

  config = tiny_config(**{"model.attention_impl": "cudnn", "train.dtype": "bfloat16",
                          "model.attention_dropout_rate": 0.0})
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_attention)
  model, params = _init(config)
  seen.clear()
  ids, types, mask = _inputs()
  ids, types, mask = (jnp.concatenate([x, jnp.zeros_like(x[:1])]) for x in (ids, types, mask))  # + a padding row
  logits = model.apply({"params": params}, ids, types, mask, method=model.discriminator_logits)
  assert len(seen) == config.model.num_layers
  np.testing.assert_array_equal(seen[0], [12, 8, 1])
  assert np.isfinite(np.asarray(logits)).all()


def test_cudnn_shapes_are_refused_before_compiling():
  with pytest.raises(ConfigError, match=r"head size that is a multiple of 8.*discriminator's is 12"):
    models.build_model(tiny_config(**{"model.attention_impl": "cudnn", "train.dtype": "bfloat16",
                                      "model.attention_dropout_rate": 0.0, "model.hidden_size": 36,
                                      "model.num_heads": 3}))
  config = tiny_config(**{"model.attention_impl": "cudnn", "train.dtype": "bfloat16",
                          "model.attention_dropout_rate": 0.0, "data.max_seq_len": 31})
  models.build_model(config)  # padded rows: cuDNN reads lengths, any length goes
  config.data.pack_rows = True
  with pytest.raises(ConfigError, match="data.max_seq_len=31: make it even"):
    models.build_model(config)
