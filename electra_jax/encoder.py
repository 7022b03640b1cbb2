"""The transformer encoder both towers run, as Flax Linen modules: EncoderConfig, the embeddings,
self-attention (XLA, cuDNN or splash), the layer and the stack of layers, scanned or not.
Parameters carry logical axis names (partitioning.py)."""

import dataclasses
import functools
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from electra_jax import random_ops, splash_attention

Dtype = Any
_param = nn.with_logical_partitioning

ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "splash")
# model.remat -> what a layer keeps for the backward pass: all, the matmul outputs, or its input.
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
NORMS = ("post", "pre")  # see EncoderLayer
FFNS = ("gelu", "geglu")  # see _feed_forward


def bert_init(key, shape, dtype=jnp.float32):
  """TF's truncated_normal_initializer(stddev=0.02): N(0, 0.02) cut at two standard deviations."""
  return 0.02 * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


def gelu_exact(x):
  """The exact GELU by erf (jax.nn.gelu goes through erfc: a costlier exp-and-select on XLA:CPU)."""
  return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(math.sqrt(0.5), x.dtype)))


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """nn.Dense's product as one [rows, in] @ [in, out] matmul: the same numbers, but XLA:CPU takes
  the kernel's gradient in place, not from a transposed copy."""
  if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
    raise ValueError(f"rows_dot_general takes nn.Dense's product, not {dimension_numbers}.")
  rows = lhs.reshape(-1, lhs.shape[-1])
  out = jax.lax.dot(rows, rhs, precision=precision, preferred_element_type=preferred_element_type)
  return out.reshape(*lhs.shape[:-1], rhs.shape[-1])


def dense(features, in_axis, out_axis, dtype, name, use_bias=True, float32_out=False):
  """nn.Dense with float32 parameters and `dtype` compute (a float32 product with `float32_out`)."""
  out_type = jnp.float32 if float32_out else None
  return nn.Dense(
      features,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=jnp.float32,
      name=name,
      dot_general=functools.partial(rows_dot_general, preferred_element_type=out_type),
      kernel_init=_param(bert_init, (in_axis, out_axis)),
      bias_init=_param(nn.initializers.zeros_init(), (out_axis,)),
  )


def layer_norm(eps: float, name: str):
  """LayerNorm with its statistics in float32 whatever the compute dtype."""
  return nn.LayerNorm(
      epsilon=eps,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      name=name,
      scale_init=_param(nn.initializers.ones_init(), ("embed",)),
      bias_init=_param(nn.initializers.zeros_init(), ("embed",)),
  )


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
  """Sizes and options of one transformer tower (the model.* keys of the same names)."""

  hidden_size: int
  num_layers: int
  num_heads: int
  intermediate_size: int
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  remat: str = "none"  # see REMAT_POLICIES
  scan_layers: bool = False  # params stacked as encoder/layers/layer (see unscan_layers)
  norm: str = "post"  # see NORMS
  ffn: str = "gelu"  # see FFNS
  use_bias: bool = True  # in the encoder's dense layers (heads and LayerNorms keep theirs)
  attention_conv: int = 0  # see SelfAttention

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


class EmbeddingSizes(nn.Module):
  """The sizes of an Embeddings module: the first fields of it and of every model that owns one."""

  vocab_size: int
  embedding_size: int
  max_position_embeddings: int
  type_vocab_size: int


class Embeddings(EmbeddingSizes):
  """Word + position + token-type embeddings, LayerNorm, dropout: [batch, seq] -> [..., E]."""

  dropout_rate: float
  layer_norm_eps: float
  dtype: Dtype = jnp.float32

  def setup(self):
    def embed(num, axis):  # float32 whatever the compute dtype (see __call__); named by attribute
      init = _param(bert_init, (axis, "embed"))
      return nn.Embed(num, self.embedding_size, jnp.float32, jnp.float32, init)

    self.word_embeddings = embed(self.vocab_size, "vocab")
    self.position_embeddings = embed(self.max_position_embeddings, "position")
    self.token_type_embeddings = embed(self.type_vocab_size, "token_type")
    self.layer_norm = layer_norm(self.layer_norm_eps, "layer_norm")
    self.dropout = random_ops.Dropout(self.dropout_rate)

  def __call__(self, input_ids, token_type_ids, deterministic, word_table=None, position_ids=None):
    """`word_table` [vocab, E] replaces the word embeddings' own (GDES); `position_ids` [batch, seq]
    (packed rows) replace 0, 1, 2, ... (a slice, whose gradient is a pad)."""
    # Lookups and sum in float32: a lookup's gradient is a scatter-add, and on GPUs a bfloat16
    # scatter-add with repeated indices serializes. Positions and token types need no scatter.
    word_table = self.word_table() if word_table is None else word_table
    words = jnp.take(word_table.astype(jnp.float32), input_ids, axis=0)
    position_table = self.position_embeddings.embedding
    if position_ids is None:
      positions = position_table[None, : input_ids.shape[-1]]
    else:
      positions = jnp.take(position_table, position_ids, axis=0)
    # A handful of token types: a select per type, whose gradient is a masked sum.
    type_table = self.token_type_embeddings.embedding
    types = jnp.zeros((), jnp.float32)
    for type_id in range(self.type_vocab_size):
      types = types + jnp.where((token_type_ids == type_id)[..., None], type_table[type_id], 0.0)
    embedded = self.layer_norm(words + positions + types).astype(self.dtype)
    embedded = self.dropout(embedded, deterministic=deterministic)
    return nn.with_logical_constraint(embedded, ("act_batch", "act_len", "act_embed"))

  def word_table(self):
    """The [vocab, E] table; the MLM heads' decoder is its transpose."""
    return self.word_embeddings.embedding


def embeddings_for(owner: EmbeddingSizes, embedding_size: int, config: EncoderConfig, **kwargs):
  """Embeddings of `owner`'s sizes (but `embedding_size`) and dtype, `config`'s dropout, epsilon."""
  sizes = (owner.vocab_size, embedding_size, owner.max_position_embeddings, owner.type_vocab_size)
  return Embeddings(*sizes, config.dropout_rate, config.layer_norm_eps, owner.dtype, **kwargs)


class _Block(nn.Module):
  """The fields of SelfAttention, EncoderLayer and the scan body."""

  config: EncoderConfig
  dtype: Dtype
  attention_impl: str = "xla"


class SelfAttention(_Block):
  """[batch, seq, H] -> [batch, seq, H]; `attention_mask` [batch, seq] (real keys, or splash's
  segment ids) or [batch, seq, seq]. attention_conv: Primer's convolution per projection."""

  @nn.compact
  def __call__(self, hidden, attention_mask, deterministic: bool):
    cfg = self.config
    mask = attention_mask.astype(bool)
    readable = _readable_neighbours(mask, cfg.attention_conv // 2) if cfg.attention_conv else None

    def project(name):
      # One [H, H] matrix per projection (heads side by side), as BERT stores it.
      projected = dense(cfg.hidden_size, "embed", "heads", self.dtype, name, cfg.use_bias)(hidden)
      if cfg.attention_conv:
        shape = (cfg.attention_conv, cfg.hidden_size)
        taps = self.param(f"{name}_conv", _param(_conv_init, ("unmodeled", "heads")), shape)
        projected = _sequence_conv(projected, taps.astype(projected.dtype), readable)
      return projected.reshape(*hidden.shape[:-1], cfg.num_heads, cfg.head_dim)

    query, key, value = project("query"), project("key"), project("value")
    # [batch, seq] or [batch, seq, seq] -> [batch, 1, q or 1, seq] for every head.
    key_is_real = mask[:, None, None, :] if mask.ndim == 2 else mask[:, None, :, :]
    if not deterministic and cfg.attention_dropout_rate > 0.0:
      # BERT's dropout on the probabilities, which dot_product_attention lacks.
      query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))  # [b, h, s, d]
      scores = jnp.einsum("bhqd,bhkd->bhqk", query, key) / math.sqrt(cfg.head_dim)
      scores = jnp.where(key_is_real, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
      probs = jax.nn.softmax(scores, axis=-1)
      probs = random_ops.Dropout(cfg.attention_dropout_rate)(probs, deterministic=False)
      context = jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(self.dtype), value), 1, 2)
    elif self.attention_impl == "splash" and mask.ndim == 2:
      # The kernel reads 0/1 masks, or packed rows' ids, as segment ids.
      context = splash_attention.splash_attention(query, key, value, attention_mask)
    elif self.attention_impl == "cudnn" and mask.ndim == 2:
      # Right-padded rows' lengths; an all-padding row gets 1 (cuDNN before 9.25 gives NaN for 0).
      lengths = jnp.maximum(mask.sum(-1, dtype=jnp.int32), 1)
      seq_lens = dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
      context = jax.nn.dot_product_attention(query, key, value, **seq_lens, implementation="cudnn")
    else:  # splash cannot take a [batch, q, k] mask (packed rows, the cloze towers' causal ones)
      impl = "xla" if self.attention_impl == "splash" else self.attention_impl
      context = jax.nn.dot_product_attention(
          query, key, value, mask=key_is_real, implementation=impl
      )
    context = context.reshape(*hidden.shape[:-1], cfg.hidden_size)
    return dense(cfg.hidden_size, "heads", "embed", self.dtype, "output", cfg.use_bias)(context)


def _readable_neighbours(mask, radius: int):
  """[2 * radius + 1, batch, seq] bool: whether position i may read i + offset by attention's `mask`
  ([batch, seq] or [batch, seq, seq]), never across the row's ends."""
  seq = mask.shape[-1]
  rows = []
  for offset in range(-radius, radius + 1):
    target = jnp.arange(seq) + offset
    inside = (target >= 0) & (target < seq)
    target = jnp.clip(target, 0, seq - 1)
    allowed = mask[:, target] if mask.ndim == 2 else mask[:, jnp.arange(seq), target]
    rows.append(allowed & inside)
  return jnp.stack(rows)


def _sequence_conv(x, taps, readable):
  """out[b, i, c] = sum_k taps[k, c] * x[b, i + k - r, c] over the neighbours `readable` allows."""
  radius = taps.shape[0] // 2
  out = jnp.zeros_like(x)
  for k in range(taps.shape[0]):
    shifted = jnp.roll(x, radius - k, axis=1)  # shifted[:, i] = x[:, i + k - radius]
    out = out + jnp.where(readable[k][..., None], shifted, 0) * taps[k]
  return out


def _conv_init(key, shape, dtype=jnp.float32):
  """The identity (centre tap 1) plus N(0, 0.5) on every tap (the scale: docs/small_budget.md)."""
  return (0.5 * jax.random.normal(key, shape, dtype)).at[shape[0] // 2].add(1.0)


class EncoderLayer(_Block):
  """One transformer block. norm="post" (BERT's): LN(x + attn(x)), then LN(x + FFN(x)); norm="pre":
  x + attn(LN(x)), then x + FFN(LN(x)), and Encoder's final_layer_norm after the last layer."""

  @nn.compact
  def __call__(self, hidden, attention_mask, deterministic: bool):
    cfg = self.config
    attention = SelfAttention(cfg, self.dtype, self.attention_impl, name="attention")
    sublayers = (
        (lambda x: attention(x, attention_mask, deterministic), "attention_layer_norm"),
        (lambda x: _feed_forward(cfg, self.dtype, x), "output_layer_norm"),
    )
    norms = [layer_norm(cfg.layer_norm_eps, name) for _, name in sublayers]
    for (sublayer, _), norm in zip(sublayers, norms):
      dropout = functools.partial(random_ops.Dropout(cfg.dropout_rate), deterministic=deterministic)
      if cfg.norm == "pre":  # the residual stream is never normalized; each sublayer reads a copy
        hidden = hidden + dropout(sublayer(norm(hidden).astype(self.dtype)))
      else:
        hidden = norm(hidden + dropout(sublayer(hidden))).astype(self.dtype)
    return nn.with_logical_constraint(hidden, ("act_batch", "act_len", "act_embed"))


def _feed_forward(cfg: EncoderConfig, dtype: Dtype, hidden):
  """ffn="gelu": BERT's dense(H->I) + GELU + dense(I->H); "geglu": gelu(gate) * value of an [H, 2I]
  kernel, gate columns first, so a GELU tree never loads into it."""
  width = 2 * cfg.intermediate_size if cfg.ffn == "geglu" else cfg.intermediate_size
  inner = dense(width, "embed", "mlp", dtype, "intermediate", cfg.use_bias)(hidden)
  if cfg.ffn == "geglu":
    gate, value = jnp.split(inner, 2, axis=-1)
    inner = gelu_exact(gate) * value
  else:
    inner = gelu_exact(inner)
  return dense(cfg.hidden_size, "mlp", "embed", dtype, "output", cfg.use_bias)(inner)


class EncoderFields(nn.Module):
  """The fields of Encoder and of the towers that run one."""

  config: EncoderConfig
  embedding_size: int
  dtype: Dtype
  attention_impl: str = "xla"


class Encoder(EncoderFields):
  """The E->H projection (when sizes differ), the layers and, for norm="pre", `final_layer_norm`."""

  @nn.compact
  def __call__(self, hidden, attention_mask, deterministic: bool):
    cfg = self.config  # hidden: the embedded input [batch, seq, E] until the projection
    if self.embedding_size != cfg.hidden_size:
      name = "embeddings_project"
      hidden = dense(cfg.hidden_size, "embed", "mlp", self.dtype, name, cfg.use_bias)(hidden)
    layer = EncoderLayer
    if cfg.remat != "none":
      # Argument 3 (deterministic) is a Python bool. A scan keeps the recomputation apart by itself,
      # where CSE barriers would only stop fusion.
      policy, prevent_cse = REMAT_POLICIES[cfg.remat], not cfg.scan_layers
      layer = nn.remat(layer, policy=policy, static_argnums=(3,), prevent_cse=prevent_cse)
    if cfg.scan_layers:
      scanned = nn.scan(
          _ScanBody,
          variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast,),
          length=cfg.num_layers,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      body = scanned(cfg, self.dtype, self.attention_impl, layer, deterministic, name="layers")
      hidden, _ = body(hidden, attention_mask)
    else:
      for i in range(cfg.num_layers):
        block = layer(cfg, self.dtype, self.attention_impl, name=f"layer_{i}")
        hidden = block(hidden, attention_mask, deterministic)
    if cfg.norm == "pre":
      hidden = layer_norm(cfg.layer_norm_eps, "final_layer_norm")(hidden).astype(self.dtype)
    return hidden


class _ScanBody(_Block):
  """`layer` as nn.scan's body, (hidden, mask) -> (hidden, None); `deterministic` is a field, as
  scan would trace a Python bool argument."""

  layer: type = None
  deterministic: bool = True

  @nn.compact
  def __call__(self, hidden, attention_mask):
    layer = self.layer(self.config, self.dtype, self.attention_impl, name="layer")
    return layer(hidden, attention_mask, self.deterministic), None


def unscan_layers(tree):
  """A parameter (or gradient, moment) tree with each scanned encoder rewritten as layer_0 ...."""
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if key == "layers" and isinstance(value, dict) and set(value) == {"layer"}:
      for i in range(jax.tree.leaves(value["layer"])[0].shape[0]):
        out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], value["layer"])
    else:
      out[key] = unscan_layers(value)
  return out


def scan_layers(tree):
  """The inverse of unscan_layers, for trees imported from unscanned models."""
  if not isinstance(tree, dict):
    return tree
  layers = [tree[f"layer_{i}"] for i in range(len(tree)) if f"layer_{i}" in tree]
  out = {k: scan_layers(v) for k, v in tree.items() if not re.fullmatch(r"layer_\d+", k)}
  if layers:
    out["layers"] = {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
  return out
