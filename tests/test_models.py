"""The networks: one shared embedding tree, tied generator decoder, BERT encoder details, and
the encoder options (pre-LN, GEGLU, no biases) against computations by hand."""

import dataclasses
import functools
import hashlib
import json
import math
import re
import sys

import flax
import flax.linen as nn
import jax
import jax.export  # jax 0.6 (Python 3.10) loads it only when asked
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli
from conftest import deep_tiny_config as tiny_config
from electra_jax import config_lib, encoder, models, objectives, optimizer, train_state
from electra_jax.errors import ConfigError


def _init(config, batch=2, seq=12, n_pred=3):
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((batch, seq), jnp.int32)
  positions = jnp.zeros((batch, n_pred), jnp.int32)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), positions)["params"]
  )
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
  assert not any(
      "embed" in name
      for name in flat
      if not name.startswith("embeddings/") and "embeddings_project" not in name
  )


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
  cfg = encoder.EncoderConfig(32, 1, 2, 64, dropout_rate=0.0, attention_dropout_rate=0.0)
  attn = encoder.SelfAttention(cfg, jnp.float32)
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
  with_dropout = encoder.SelfAttention(
      encoder.EncoderConfig(32, 1, 2, 64, dropout_rate=0.0, attention_dropout_rate=0.5), jnp.float32
  )
  dropped = with_dropout.apply(params, hidden, mask, False, rngs={"dropout": jax.random.key(3)})
  assert not np.allclose(dropped, expected, atol=1e-3)


def test_bert_truncated_normal_init():
  values = encoder.bert_init(jax.random.key(0), (400, 400))
  assert float(jnp.abs(values).max()) <= 0.04 + 1e-7
  # TF's truncated normal keeps the N(0, 0.02) scale before cutting: std = 0.02 * 0.8796.
  assert abs(float(values.std()) - 0.02 * 0.87962566) < 2e-4


@pytest.mark.parametrize(
    "hidden, heads, fraction, want_hidden, want_heads",
    [
        (256, 4, 0.25, 64, 1),
        (768, 12, 1 / 3, 256, 4),
        (1024, 16, 0.25, 256, 4),
        (32, 2, 0.5, 16, 1),
    ],
)
def test_generator_sizes_follow_the_official_rule(hidden, heads, fraction, want_hidden, want_heads):
  disc = encoder.EncoderConfig(hidden, 12, heads, 4 * hidden)
  gen = models.generator_encoder_config(disc, fraction)
  assert (gen.hidden_size, gen.num_heads, gen.intermediate_size, gen.num_layers) == (
      want_hidden,
      want_heads,
      4 * want_hidden,
      12,
  )


def test_bfloat16_compute_keeps_float32_params():
  config = tiny_config(**{"train.dtype": "bfloat16"})
  model, params = _init(config)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  ids, types, mask = _inputs()
  logits = model.apply({"params": params}, ids, types, mask, method=model.discriminator_logits)
  f32_model = models.build_model(tiny_config(), models.Towers())
  reference = f32_model.apply(
      {"params": params}, ids, types, mask, method=f32_model.discriminator_logits
  )
  assert logits.dtype == jnp.float32
  # The scalar head's product (rows x hidden @ hidden x 1) is returned in float32, not rounded.
  program = (
      jax.jit(
          lambda p: model.apply({"params": p}, ids, types, mask, method=model.discriminator_logits)
      )
      .lower(params)
      .as_text()
  )
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
  bias, grad = jnp.asarray(rng.normal(size=(40,)), jnp.float32), jnp.asarray(
      rng.normal(size=(3, 5, 40)), jnp.float32
  )

  def forward(h, t, b):
    return (
        jnp.einsum(
            "bne,ve->bnv", h.astype(dtype), t.astype(dtype), preferred_element_type=jnp.float32
        )
        + b
    )

  def in_compute_dtype(h, t, b):
    return jnp.einsum("bne,ve->bnv", h.astype(dtype), t.astype(dtype)).astype(jnp.float32) + b

  got_out, got_vjp = jax.vjp(
      lambda h, t, b: models.tied_vocab_logits(h, t, b, dtype), hidden, table, bias
  )
  np.testing.assert_array_equal(got_out, forward(hidden, table, bias))
  # The product is asked for in float32 (compute-dtype operands, float32 result), not
  # rounded to the compute dtype first. (XLA:CPU rounds bfloat16 products anyway; GPUs and
  # TPUs accumulate and return float32, so the check is on the program.)
  program = (
      jax.jit(lambda h, t, b: models.tied_vocab_logits(h, t, b, dtype))
      .lower(hidden, table, bias)
      .as_text()
  )
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
  hidden, table, bias = (
      jax.ShapeDtypeStruct(s, jnp.float32) for s in [(4, 19, 16), (30522, 16), (30522,)]
  )

  def backward(h, t, b):
    _, vjp = jax.vjp(lambda h, t, b: models.tied_vocab_logits(h, t, b, jnp.bfloat16), h, t, b)
    return vjp(jnp.ones((4, 19, 30522), jnp.float32))

  module = jax.export.export(jax.jit(backward), platforms=[platform])(
      hidden, table, bias
  ).mlir_module()
  assert module.count("stablehlo.dot_general") == matmuls, module  # (the forward's is not needed)
  sums_over_rows = [l for l in module.split("\n") if "stablehlo.reduce" in l and "x30522xf32>" in l]
  assert len(sums_over_rows) == (0 if platform == "cpu" else 1), sums_over_rows


def test_rows_dot_general_is_nn_dense_with_its_gradients():
  """The encoder's dense layers take their product as one 2-D matmul over all rows: same
  outputs and gradients (inputs, kernel, bias) as flax's own N-D dot_general."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
  plain, rows = nn.Dense(8), nn.Dense(8, dot_general=encoder.rows_dot_general)
  params = plain.init(jax.random.key(0), x)
  grad = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
  want, want_vjp = jax.vjp(lambda p, x: plain.apply(p, x), params, x)
  got, got_vjp = jax.vjp(lambda p, x: rows.apply(p, x), params, x)
  assert got.shape == (3, 5, 8)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for g, w in zip(jax.tree.leaves(got_vjp(grad)), jax.tree.leaves(want_vjp(grad))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="rows_dot_general"):
    encoder.rows_dot_general(x, jnp.ones((5, 8)), (((1,), (0,)), ((), ())))


@pytest.mark.fault
@pytest.mark.parametrize(
    "wrap, tower, named",
    [
        (False, "encoder", r"tower='encoder' is not one of \['discriminator', 'generator'\]"),
        (True, "discriminator", r"top level is \['params'\], not an ElectraPretrainer's: pass"),
    ],
)
def test_a_tower_of_a_pretrainer_is_refused_for_a_name_or_tree_it_does_not_know(wrap, tower, named):
  model, params = _init(tiny_config())
  with pytest.raises(ConfigError, match=named):
    models.tower_from_pretrainer(model, {"params": params} if wrap else params, tower)


def test_cudnn_path_gets_lengths_of_at_least_one(monkeypatch):
  """attention_impl='cudnn' passes the padding as sequence lengths. cuDNN before 9.25 returns
  NaN for a length of 0, so an all-padding row (evaluation fills its last batch with them)
  must be sent as length 1; real rows keep their token counts. cuDNN needs a GPU, so the
  call is recorded and answered by the masked XLA attention."""
  seen, xla_attention = [], jax.nn.dot_product_attention

  def fake_attention(
      query, key, value, *, query_seq_lengths, key_value_seq_lengths, implementation
  ):
    assert implementation == "cudnn"
    seen.append(np.asarray(query_seq_lengths))
    real = jnp.arange(key.shape[1])[None, :] < key_value_seq_lengths[:, None]
    return xla_attention(query, key, value, mask=real[:, None, None, :], implementation="xla")

  config = tiny_config(
      **{
          "model.attention_impl": "cudnn",
          "train.dtype": "bfloat16",
          "model.attention_dropout_rate": 0.0,
      }
  )
  monkeypatch.setattr(jax.nn, "dot_product_attention", fake_attention)
  model, params = _init(config)
  seen.clear()
  ids, types, mask = _inputs()
  ids, types, mask = (
      jnp.concatenate([x, jnp.zeros_like(x[:1])]) for x in (ids, types, mask)
  )  # + a padding row
  logits = model.apply({"params": params}, ids, types, mask, method=model.discriminator_logits)
  assert len(seen) == config.model.num_layers
  np.testing.assert_array_equal(seen[0], [12, 8, 1])
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.fault
def test_cudnn_shapes_are_refused_before_compiling():
  with pytest.raises(
      ConfigError, match=r"head size that is a multiple of 8.*discriminator's is 12"
  ):
    models.build_model(
        tiny_config(
            **{
                "model.attention_impl": "cudnn",
                "train.dtype": "bfloat16",
                "model.attention_dropout_rate": 0.0,
                "model.hidden_size": 36,
                "model.num_heads": 3,
            }
        ),
        models.Towers(),
    )
  config = tiny_config(
      **{
          "model.attention_impl": "cudnn",
          "train.dtype": "bfloat16",
          "model.attention_dropout_rate": 0.0,
          "data.max_seq_len": 31,
      }
  )
  models.build_model(
      config, objectives.towers(config)
  )  # padded rows: cuDNN reads lengths, any length goes
  config.data.pack_rows = True
  with pytest.raises(ConfigError, match="data.max_seq_len=31: make it even"):
    models.build_model(config, objectives.towers(config))


# ---------------------------------------------------------------------------------------
# Encoder options (model.norm, model.ffn, model.use_bias), each against a computation by hand.
# ---------------------------------------------------------------------------------------
def _random_params(params, seed=0):
  """`params` with every leaf replaced by N(0, 0.5) noise: LayerNorm scales and biases away
  from 1 and 0, so a swapped or skipped LayerNorm or bias changes the output."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
      treedef, [0.5 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
  )


def _ln_by_hand(x, p, eps=1e-12):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(
      p["bias"], np.float64
  )


def _dense_by_hand(x, p):
  out = x @ np.asarray(p["kernel"], np.float64)
  return out + np.asarray(p["bias"], np.float64) if "bias" in p else out


def _gelu_by_hand(x):
  return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _conv_by_hand(x, taps, readable):
  """out[b, i] = sum over offsets o of taps[o + r] * x[b, i + o], where i may read i + o:
  `readable` [batch, seq] (real keys) or [batch, seq, seq] (i reads j), inside the row."""
  radius = taps.shape[0] // 2
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for i in range(x.shape[1]):
      for o in range(-radius, radius + 1):
        j = i + o
        if 0 <= j < x.shape[1] and (readable[b, j] if readable.ndim == 2 else readable[b, i, j]):
          out[b, i] += taps[o + radius] * x[b, j]
  return out


def _layer_by_hand(p, x, mask, cfg):
  """One encoder layer in float64 numpy from its parameter tree: softmax attention over the
  real keys, the residuals and LayerNorms where cfg.norm puts them, cfg.ffn's FFN."""
  heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads

  def project(h, a, name):
    out = _dense_by_hand(h, a[name])
    if cfg.attention_conv:
      out = _conv_by_hand(out, np.asarray(a[f"{name}_conv"], np.float64), np.asarray(mask) > 0)
    return out.reshape(*h.shape[:2], heads, head_dim)

  def attention(h):
    a = p["attention"]
    q, k, v = (project(h, a, n) for n in ("query", "key", "value"))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    scores = np.where(np.asarray(mask)[:, None, None, :] > 0, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(h.shape)
    return _dense_by_hand(context, a["output"])

  def ffn(h):
    inner = _dense_by_hand(h, p["intermediate"])
    if cfg.ffn == "geglu":  # the first I columns gate, the last I are the value
      inner = (
          _gelu_by_hand(inner[..., : cfg.intermediate_size]) * inner[..., cfg.intermediate_size :]
      )
    else:
      inner = _gelu_by_hand(inner)
    return _dense_by_hand(inner, p["output"])

  if cfg.norm == "pre":
    x = x + attention(_ln_by_hand(x, p["attention_layer_norm"]))
    return x + ffn(_ln_by_hand(x, p["output_layer_norm"]))
  x = _ln_by_hand(x + attention(x), p["attention_layer_norm"])
  return _ln_by_hand(x + ffn(x), p["output_layer_norm"])


def _encoder_by_hand(p, x, mask, cfg):
  x = np.asarray(x, np.float64)
  if "embeddings_project" in p:
    x = _dense_by_hand(x, p["embeddings_project"])
  for i in range(cfg.num_layers):
    x = _layer_by_hand(p[f"layer_{i}"], x, mask, cfg)
  return _ln_by_hand(x, p["final_layer_norm"]) if cfg.norm == "pre" else x


def _encoder_against_hand(cfg, embedding_size=32):
  module = encoder.Encoder(cfg, embedding_size, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (2, 12, embedding_size))
  _, _, mask = _inputs()
  params = _random_params(nn.meta.unbox(module.init(jax.random.key(0), x, mask, True))["params"])
  got = module.apply({"params": params}, x, mask, True)
  want = _encoder_by_hand(params, x, mask, cfg)
  # Padded query rows are computed too (they attend to the real keys): compare everything.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  return params


def test_pre_layer_norm_encoder_by_hand():
  cfg = encoder.EncoderConfig(
      32, 1, 2, 64, dropout_rate=0.0, attention_dropout_rate=0.0, norm="pre"
  )
  params = _encoder_against_hand(cfg)
  assert set(params) == {"layer_0", "final_layer_norm"}
  # Post-LN (the default) has no final LayerNorm, and the hand formula for it differs.
  post = encoder.Encoder(encoder.EncoderConfig(32, 1, 2, 64), 32, jnp.float32)
  x = jnp.ones((1, 4, 32))
  assert "final_layer_norm" not in post.init(jax.random.key(0), x, jnp.ones((1, 4)), True)["params"]


def test_geglu_ffn_by_hand():
  cfg = encoder.EncoderConfig(
      32, 1, 2, 48, dropout_rate=0.0, attention_dropout_rate=0.0, ffn="geglu"
  )
  params = _encoder_against_hand(cfg)
  ffn = params["layer_0"]
  assert ffn["intermediate"]["kernel"].shape == (32, 2 * 48) and ffn["output"]["kernel"].shape == (
      48,
      32,
  )


def test_all_three_options_by_hand_with_a_projection():
  cfg = encoder.EncoderConfig(
      32,
      2,
      2,
      48,
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
      norm="pre",
      ffn="geglu",
      use_bias=False,
  )
  params = _encoder_against_hand(cfg, embedding_size=16)
  assert set(params["embeddings_project"]) == {"kernel"}


def test_attention_conv_encoder_by_hand():
  """Primer's depthwise convolution after q, k and v (model.attention_conv), over padded rows."""
  for width in (3, 5):
    cfg = encoder.EncoderConfig(
        32, 1, 2, 48, dropout_rate=0.0, attention_dropout_rate=0.0, attention_conv=width
    )
    params = _encoder_against_hand(cfg)
    assert {
        n: params["layer_0"]["attention"][f"{n}_conv"].shape for n in ("query", "key", "value")
    } == dict.fromkeys(("query", "key", "value"), (width, 32))


@pytest.mark.parametrize("mask_kind", ["segments", "causal"])
def test_attention_conv_reads_only_what_attention_may(mask_kind):
  """Packed rows: no tap reaches into the neighbouring example or the padding; causal towers
  (the cloze generator's): no tap reaches the right. Against the hand formula, and by moving
  what must not be read."""
  segments = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  if mask_kind == "segments":
    mask = models.segment_attention_mask(segments)
  else:
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))
  x = jax.random.normal(jax.random.key(0), (2, 8, 6))
  taps = jax.random.normal(jax.random.key(1), (3, 6))
  got = encoder._sequence_conv(x, taps, encoder._readable_neighbours(mask, 1))
  np.testing.assert_allclose(
      got,
      _conv_by_hand(np.asarray(x, np.float64), np.asarray(taps, np.float64), np.asarray(mask)),
      rtol=1e-5,
      atol=1e-6,
  )
  # Position 5 (the third example; for causal masks, 4's right neighbour) reaches no output
  # before it, and its own output does move.
  moved = encoder._sequence_conv(x.at[0, 5].add(10.0), taps, encoder._readable_neighbours(mask, 1))
  np.testing.assert_array_equal(moved[0, :5], got[0, :5])
  assert not np.allclose(moved[0, 5], got[0, 5])


def test_attention_conv_with_identity_taps_is_the_plain_encoder():
  """Taps [0, 1, 0] make the convolution the identity: the same outputs as attention_conv=0
  with the rest of the parameters equal; the initial taps are the identity plus noise."""
  plain_cfg = encoder.EncoderConfig(32, 2, 2, 48, dropout_rate=0.0, attention_dropout_rate=0.0)
  conv_cfg = dataclasses.replace(plain_cfg, attention_conv=3)
  x = jax.random.normal(jax.random.key(1), (2, 12, 32))
  _, _, mask = _inputs()
  conv = encoder.Encoder(conv_cfg, 32, jnp.float32)
  params = nn.meta.unbox(conv.init(jax.random.key(0), x, mask, True))["params"]
  taps = params["layer_0"]["attention"]["query_conv"]
  assert abs(float(taps[1].mean()) - 1.0) < 0.2 and 0.3 < float(taps[0].std()) < 0.7
  identity = jax.tree_util.tree_map_with_path(
      lambda path, leaf: jnp.zeros_like(leaf).at[1].set(1.0)
      if str(path[-1].key).endswith("_conv")
      else leaf,
      params,
  )
  plain = jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf,
      {
          layer: {
              **tree,
              "attention": {k: v for k, v in tree["attention"].items() if not k.endswith("_conv")},
          }
          for layer, tree in params.items()
      },
  )
  real = (
      np.asarray(mask) > 0
  )  # padded positions read nothing, themselves included, under a convolution
  np.testing.assert_allclose(
      np.asarray(conv.apply({"params": identity}, x, mask, True))[real],
      np.asarray(
          encoder.Encoder(plain_cfg, 32, jnp.float32).apply({"params": plain}, x, mask, True)
      )[real],
      rtol=1e-5,
      atol=1e-5,
  )


def _flat(params):
  return flax.traverse_util.flatten_dict(params, sep="/")


def test_use_bias_false_drops_only_the_encoder_dense_biases():
  config = tiny_config(**{"model.use_bias": False})
  model, params = _init(config)
  flat = _flat(params)
  encoder_biases = [
      n for n in flat if "/encoder/" in n and n.endswith("/bias") and "layer_norm" not in n
  ]
  assert not encoder_biases
  # Every Dense inside the encoders lost its bias, and only those: the biased tree differs by them.
  _, biased = _init(tiny_config())
  dropped = set(_flat(biased)) - set(flat)
  assert dropped and all(
      "/encoder/" in n and n.endswith("/bias") and "layer_norm" not in n for n in dropped
  )
  assert {n.rsplit("/", 2)[-2] for n in dropped} == {
      "query",
      "key",
      "value",
      "output",
      "intermediate",
      "embeddings_project",
  }
  for head in (
      "generator/head_dense/bias",
      "generator/output_bias",
      "discriminator/head_dense/bias",
      "discriminator/head_out/bias",
      "generator/head_layer_norm/bias",
      "discriminator/encoder/layer_0/output_layer_norm/bias",
      "embeddings/layer_norm/bias",
  ):
    assert head in flat, head
  # The same model as the biased one whose encoder dense biases are zero.
  zeroed = flax.traverse_util.unflatten_dict(
      {n: jnp.zeros_like(x) if n in dropped else x for n, x in _flat(biased).items()}, sep="/"
  )
  unbiased = flax.traverse_util.unflatten_dict(
      {n: x for n, x in _flat(biased).items() if n not in dropped}, sep="/"
  )
  ids, types, mask = _inputs()
  biased_model = models.build_model(tiny_config(), models.Towers())
  for method in ("discriminator_logits",):
    want = biased_model.apply(
        {"params": zeroed}, ids, types, mask, method=getattr(biased_model, method)
    )
    got = model.apply({"params": unbiased}, ids, types, mask, method=getattr(model, method))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  positions = jnp.array([[1, 2, 3], [1, 2, 3]])
  np.testing.assert_allclose(
      model.apply({"params": unbiased}, ids, types, mask, positions, method=model.generator_logits),
      biased_model.apply(
          {"params": zeroed}, ids, types, mask, positions, method=biased_model.generator_logits
      ),
      rtol=1e-6,
      atol=1e-6,
  )


# electra_small's pre-training tree before the encoder options existed: its leaf count,
# parameter count and the sha256 of its sorted "path:shape" lines (from jax.eval_shape).
ELECTRA_SMALL_TREE = (402, 14_196_219, "067aa7cee54b6cfd")


def _tree_fingerprint(model, seq=128, n_pred=19):
  ids = jnp.zeros((1, seq), jnp.int32)
  shapes = jax.eval_shape(
      model.init, jax.random.key(0), ids, ids, ids, jnp.zeros((1, n_pred), jnp.int32)
  )
  flat = _flat(nn.meta.unbox(shapes["params"]))
  listing = "\n".join(f"{name}:{tuple(leaf.shape)}" for name, leaf in sorted(flat.items()))
  return (
      len(flat),
      sum(leaf.size for leaf in flat.values()),
      hashlib.sha256(listing.encode()).hexdigest()[:16],
  )


def test_defaults_keep_the_electra_small_model(tmp_path):
  recipe = config_lib.sibling(f"{REPO}/configs/base.py", "electra_small").get_config()
  model = models.build_model(recipe, objectives.towers(recipe))
  assert _tree_fingerprint(model) == ELECTRA_SMALL_TREE
  explicit = config_lib.sibling(f"{REPO}/configs/base.py", "electra_small").get_config()
  explicit.model.update(norm="post", ffn="gelu", use_bias=True, attention_conv=0)
  assert models.build_model(explicit, objectives.towers(explicit)) == model
  # A workdir saved before these keys existed loads (one place fills them) into the same model.
  saved = recipe.to_dict()
  for key in ("norm", "ffn", "use_bias", "attention_conv"):
    del saved["model"][key]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  old = config_lib.load_workdir_config(str(tmp_path))
  assert models.build_model(old, objectives.towers(old)) == model
  assert config_lib.saved_config(str(tmp_path))["model"] == config_lib.as_saved(recipe)["model"]


def test_options_agree_under_scan_layers_and_remat():
  options = {
      "model.norm": "pre",
      "model.ffn": "geglu",
      "model.use_bias": False,
      "model.attention_conv": 3,
      "model.dropout_rate": 0.0,
      "model.attention_dropout_rate": 0.0,
  }
  model, params = _init(tiny_config(**options))
  ids, types, mask = _inputs()

  def loss(model, params):
    return model.apply(
        {"params": params}, ids, types, mask, method=model.discriminator_logits
    ).sum()

  want, want_grads = jax.value_and_grad(functools.partial(loss, model))(params)
  scanned = models.build_model(
      tiny_config(**options, **{"model.scan_layers": True}), models.Towers()
  )
  got, got_grads = jax.value_and_grad(functools.partial(loss, scanned))(encoder.scan_layers(params))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
      encoder.unscan_layers(got_grads),
      want_grads,
  )
  for remat in ("full", "dots"):
    for scan in (False, True):
      rematted = models.build_model(
          tiny_config(**options, **{"model.remat": remat, "model.scan_layers": scan}),
          models.Towers(),
      )
      p = encoder.scan_layers(params) if scan else params
      np.testing.assert_allclose(loss(rematted, p), want, rtol=1e-5)


@pytest.mark.fault
@pytest.mark.parametrize(
    "key, value, named",
    [
        ("norm", "middle", r"model.norm='middle' is not one of \['post', 'pre'\]"),
        ("ffn", "swiglu", r"model.ffn='swiglu' is not one of \['gelu', 'geglu'\]"),
        ("use_bias", "False", r"model.use_bias='False' is of type str, but the key's type is bool"),
        ("use_bias", 0, r"model.use_bias=0 is of type int, but the key's type is bool"),
        (
            "attention_conv",
            2,
            r"model.attention_conv=2 must be 0 \(no convolution\) or an odd kernel width",
        ),
        ("attention_conv", -3, r"model.attention_conv=-3 must be 0"),
        ("attention_conv", "3", r"model.attention_conv='3' is of type str"),
    ],
)
def test_bad_encoder_options_are_refused_by_name(key, value, named):
  # As a hand-edited config.json would give them: a value of another type is refused where the
  # file is read (with_defaults, as ml_collections refuses it on assignment), the rest by validate.
  saved = tiny_config().to_dict()
  saved["model"][key] = value
  with pytest.raises((ConfigError, ValueError), match=named):
    config_lib.validate(config_lib.with_defaults(saved))


def test_a_pretraining_step_with_all_options_on():
  """Pre-LN, GEGLU, no encoder biases and the convolution together: one train_step gives a finite loss
  and moves the parameters only these options have (both towers' final LayerNorms and taps)."""
  config = tiny_config(
      **{
          "model.norm": "pre",
          "model.ffn": "geglu",
          "model.use_bias": False,
          "model.attention_conv": 3,
          "data.max_seq_len": 16,
          "train.batch_size": 4,
      }
  )
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(config, dict(pad=0, cls=2, sep=3, mask=4))
  state = nn.meta.unbox(train_state.make_init_fn(config, model, objective)(jax.random.key(0)))
  ids, types, mask = _inputs(batch=4, seq=16)
  batch = dict(input_ids=ids, token_type_ids=types, attention_mask=mask)
  step = jax.jit(train_state.train_step)
  schedule = optimizer.make_schedule(config)
  state_after, metrics = step(state, batch, train_state.step_rng(0, 0), schedule)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 0
  state_after, metrics = step(
      state_after, batch, train_state.step_rng(0, 1), schedule
  )  # step 0's learning rate is 0
  assert np.isfinite(float(metrics["loss"]))
  for tower in ("generator", "discriminator"):
    before = state.params[tower]["encoder"]["final_layer_norm"]["scale"]
    after = state_after.params[tower]["encoder"]["final_layer_norm"]["scale"]
    assert not np.array_equal(before, after), tower
    taps = [
        s.params[tower]["encoder"]["layer_0"]["attention"]["key_conv"] for s in (state, state_after)
    ]
    assert not np.array_equal(*taps), tower


def test_the_demo_at_temperature_1_is_a_variant_of_the_demo():
  """configs/demo.py:t1: the demo's sizes and schedule at sampling temperature 1, with the convolution
  in both towers, pre-LN, GEGLU and no biases; the plain demo keeps the paper's (Hugging Face
  exportable) encoder."""
  from electra_jax import api  # noqa: PLC0415

  demo, t1 = api.load_config("demo"), api.load_config("demo:t1")
  assert demo.objective.temperature == 2.0 and t1.objective.temperature == 1.0
  assert (demo.model.attention_conv, demo.model.norm) == (0, "post")
  changed = [
      line.split(":")[0]
      for line in config_lib.changed_keys(config_lib.as_saved(demo), config_lib.as_saved(t1))
  ]
  assert changed == [
      "model.attention_conv",
      "model.ffn",
      "model.norm",
      "model.use_bias",
      "objective.temperature",
  ], changed
  model = models.build_model(t1, objectives.towers(t1))
  assert model.discriminator_config.attention_conv == model.generator_config.attention_conv == 3
  with pytest.raises(ConfigError, match=r"configs/demo.py has no variant 't2'"):
    api.load_config("demo:t2")


@pytest.mark.fault
@pytest.mark.parametrize("key", ["model.ngram_buckets", "model.generator_attention_conv"])
def test_a_workdir_of_a_removed_model_key_is_refused_by_name(tmp_path, key):
  """A config.json written before a key was removed, even at the value that means what this
  version does: no older workdir is read, and the error names the file and the key."""
  group, name = key.split(".")
  saved = config_lib.as_saved(tiny_config())
  saved[group][name] = 0
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ConfigError, match=rf"{tmp_path}/config.json .*{re.escape(key)} is no key"):
    config_lib.load_workdir_config(str(tmp_path))
  # Continuing such a workdir from the command line: one line, no traceback.
  args = [f"--config=configs/workdir.py:{tmp_path}", f"--workdir={tmp_path}"]
  result = cli([sys.executable, "-m", "electra_jax.main", *args])
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert f"{key} is no key" in result.stderr.strip().splitlines()[-1]
