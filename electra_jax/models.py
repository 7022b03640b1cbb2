"""ELECTRA's networks as Flax Linen modules: embeddings, the encoder, the two towers, `ElectraPretrainer` (one
embeddings module for both) and the standalone towers. Parameters carry logical axis names (partitioning.py).
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from electra_jax import random_ops, splash_attention
from electra_jax.errors import ConfigError

Dtype = Any
_param = nn.with_logical_partitioning

ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "splash")
# model.remat -> what each encoder layer keeps for the backward pass: everything, the matmul outputs, its input.
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
NORMS = ("post", "pre")  # see EncoderLayer
FFNS = ("gelu", "geglu")  # see _feed_forward
TIE_MODES = ("embeddings", "none", "gdes", "all")  # see ElectraPretrainer


def segment_positions(segment_ids):
  """[batch, seq] segment ids (1, 2, ... for the examples of a packed row, 0 on padding) -> positions that
  restart at 0 where each segment begins, so a packed example is embedded as it would be alone in its row.
  """
  index = jnp.broadcast_to(jnp.arange(segment_ids.shape[-1], dtype=jnp.int32), segment_ids.shape)
  previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = jnp.where(segment_ids != previous, index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def segment_attention_mask(segment_ids):
  """[batch, seq] segment ids -> [batch, seq, seq]: a query attends to the real keys of its own segment only."""
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & (segment_ids[:, None, :] > 0)


def bert_init(stddev: float = 0.02):
  """TF's truncated_normal_initializer: N(0, stddev) cut at two standard deviations, not rescaled."""
  return lambda key, shape, dtype=jnp.float32: stddev * jax.random.truncated_normal(
      key, -2.0, 2.0, shape, dtype
  )


def gelu_exact(x):
  """The exact GELU written with erf: jax.nn.gelu(approximate=False) goes through erfc, which XLA:CPU
  lowers to a costlier exp-and-select."""
  return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(math.sqrt(0.5), x.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tied_vocab_logits(hidden, word_table, output_bias, dtype):
  """The MLM heads' tied decoder: float32 logits [..., vocab] = hidden [..., E] @ word_table [vocab, E]^T
  + output_bias, the product in `dtype` accumulated in float32; autodiff's gradient in the forms cheapest on a CPU.
  """
  return _tied_vocab_logits_fwd(hidden, word_table, output_bias, dtype)[0]


def _tied_vocab_logits_fwd(hidden, word_table, output_bias, dtype):
  logits = jnp.einsum(
      "...e,ve->...v",
      hidden.astype(dtype),
      word_table.astype(dtype),
      preferred_element_type=jnp.float32,
  )
  return logits + output_bias, (hidden, word_table)


def _tied_vocab_logits_bwd(dtype, residuals, grad):
  # The table's gradient via [E, vocab] (the logits' gradient read in place, not transposed into a copy); the
  # bias's on the CPU a product with ones (XLA:CPU's column reduction is slow), elsewhere a sum a GPU fuses.
  hidden, word_table = residuals
  grad_rows = grad.reshape(-1, grad.shape[-1])  # [n, vocab] float32
  grad_c, hidden_rows = grad_rows.astype(dtype), hidden.reshape(-1, hidden.shape[-1]).astype(dtype)
  d_hidden = (grad_c @ word_table.astype(dtype)).reshape(hidden.shape).astype(hidden.dtype)
  d_table = (hidden_rows.T @ grad_c).T.astype(word_table.dtype)
  d_bias = jax.lax.platform_dependent(
      grad_rows, cpu=lambda g: jnp.ones((g.shape[0],), jnp.float32) @ g, default=lambda g: g.sum(0)
  )
  return d_hidden, d_table, d_bias


tied_vocab_logits.defvjp(_tied_vocab_logits_fwd, _tied_vocab_logits_bwd)


def decoder_input(hidden):
  """The MLM heads' hidden states [batch, ..., E] pinned to the batch split: left to propagation, E takes the
  word table's fsdp split, and XLA then swaps batch shards' rows in the heads' gradient (docs/performance.md).
  """
  return nn.with_logical_constraint(hidden, ("act_batch",) + (None,) * (hidden.ndim - 1))


def rows_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """nn.Dense's product, lhs [..., in] @ rhs [in, out], as one [rows, in] @ [in, out] matmul: the same
  numbers, but XLA:CPU computes the kernel's gradient in place, not from a transposed copy."""
  (lhs_contract, rhs_contract), batch_dims = dimension_numbers
  if (
      lhs_contract != (lhs.ndim - 1,)
      or rhs_contract != (0,)
      or rhs.ndim != 2
      or batch_dims != ((), ())
  ):
    raise ValueError(
        f"rows_dot_general takes nn.Dense's [..., in] x [in, out] product, not {dimension_numbers}."
    )
  rows = jax.lax.dot_general(
      lhs.reshape(-1, lhs.shape[-1]),
      rhs,
      (((1,), (0,)), ((), ())),
      precision=precision,
      preferred_element_type=preferred_element_type,
  )
  return rows.reshape(*lhs.shape[:-1], rhs.shape[-1])


def _dense(
    features, in_axis: str, out_axis: str, dtype: Dtype, name: str, use_bias=True, float32_out=False
):
  """nn.Dense with float32 parameters and `dtype` compute; `float32_out` keeps the product in float32 (logits)."""
  return nn.Dense(
      features,
      use_bias=use_bias,
      dtype=dtype,
      param_dtype=jnp.float32,
      name=name,
      dot_general=functools.partial(
          rows_dot_general, preferred_element_type=jnp.float32 if float32_out else None
      ),
      kernel_init=_param(bert_init(), (in_axis, out_axis)),
      bias_init=_param(nn.initializers.zeros_init(), (out_axis,)),
  )


def _layer_norm(eps: float, name: str):
  # Statistics in float32 whatever the compute dtype.
  return nn.LayerNorm(
      epsilon=eps,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      name=name,
      scale_init=_param(nn.initializers.ones_init(), ("embed",)),
      bias_init=_param(nn.initializers.zeros_init(), ("embed",)),
  )


def vocab_head(module: nn.Module, hidden, word_table, prefix: str = ""):
  """BERT's masked-LM head inside a tower's compact call: dense(-> E) + GELU + LayerNorm (`{prefix}head_dense`,
  `{prefix}head_layer_norm`), then the decoder tied to `word_table` [vocab, E] plus `{prefix}output_bias`.
  """
  vocab_size, embedding_size = word_table.shape
  hidden = _dense(embedding_size, "embed", "mlp", module.dtype, f"{prefix}head_dense")(hidden)
  hidden = _layer_norm(module.config.layer_norm_eps, f"{prefix}head_layer_norm")(gelu_exact(hidden))
  output_bias = module.param(
      f"{prefix}output_bias", _param(nn.initializers.zeros_init(), ("vocab",)), (vocab_size,)
  )
  return tied_vocab_logits(decoder_input(hidden), word_table, output_bias, module.dtype)


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
  # One scanned layer (params stacked on a leading "layers" axis, under encoder/layers/layer) instead of
  # layer_0 .. layer_{L-1}; standalone towers, export and fine-tuning see the unscanned layout.
  scan_layers: bool = False
  norm: str = "post"  # see NORMS
  ffn: str = "gelu"  # see FFNS
  use_bias: bool = (
      True  # False: none in the encoder's dense layers (heads and LayerNorms keep theirs)
  )
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
  """Word + position + token-type embeddings, LayerNorm and dropout: [batch, seq] -> [batch, seq, E]."""

  dropout_rate: float
  layer_norm_eps: float
  dtype: Dtype = jnp.float32

  def setup(self):
    def embed(num, axis, name):  # looked up in float32 whatever the compute dtype (see __call__)
      return nn.Embed(
          num,
          self.embedding_size,
          dtype=jnp.float32,
          param_dtype=jnp.float32,
          embedding_init=_param(bert_init(), (axis, "embed")),
          name=name,
      )

    self.word_embeddings = embed(self.vocab_size, "vocab", "word_embeddings")
    self.position_embeddings = embed(
        self.max_position_embeddings, "position", "position_embeddings"
    )
    self.token_type_embeddings = embed(self.type_vocab_size, "token_type", "token_type_embeddings")
    self.layer_norm = _layer_norm(self.layer_norm_eps, "layer_norm")
    self.dropout = random_ops.Dropout(self.dropout_rate)

  def __call__(
      self,
      input_ids,
      token_type_ids,
      deterministic: bool,
      word_table=None,
      position_ids=None,
  ):
    """`word_table` [vocab, E], if given, replaces the word embeddings' own table (GDES);
    `position_ids` [batch, seq] (packed rows) replace 0, 1, 2, ... (a slice, whose gradient is a pad).
    """
    # Lookups and sum in float32: a lookup's gradient is a scatter-add, and on GPUs a bfloat16
    # scatter-add with repeated indices serializes. Positions and token types need no scatter.
    word_table = self.word_embeddings.embedding if word_table is None else word_table
    words = jnp.take(word_table.astype(jnp.float32), input_ids, axis=0)
    position_table = self.position_embeddings.embedding
    positions = (
        position_table[None, : input_ids.shape[-1]]
        if position_ids is None
        else jnp.take(position_table, position_ids, axis=0)
    )
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


def embeddings_for(
    owner: EmbeddingSizes, embedding_size: int, config: EncoderConfig, **kwargs
) -> Embeddings:
  """The Embeddings module of `owner`'s sizes (bar `embedding_size`) and dtype, with `config`'s dropout and
  LayerNorm epsilon (`kwargs`, e.g. name=, go to the module)."""
  return Embeddings(
      vocab_size=owner.vocab_size,
      embedding_size=embedding_size,
      max_position_embeddings=owner.max_position_embeddings,
      type_vocab_size=owner.type_vocab_size,
      dropout_rate=config.dropout_rate,
      layer_norm_eps=config.layer_norm_eps,
      dtype=owner.dtype,
      **kwargs,
  )


class _Block(nn.Module):
  """The fields of SelfAttention and EncoderLayer."""

  config: EncoderConfig
  dtype: Dtype
  attention_impl: str = "xla"


class SelfAttention(_Block):
  """Multi-head self-attention, [batch, seq, H] -> [batch, seq, H]. `attention_mask`: [batch, seq] real keys
  (or segment ids, for splash), or a [batch, seq, seq] query x key mask. config.attention_conv: the width of a
  depthwise convolution along the sequence after each projection (Primer's multi-dconv-head attention).
  """

  @nn.compact
  def __call__(self, hidden, attention_mask, deterministic: bool):
    cfg = self.config
    mask = attention_mask.astype(bool)
    readable = _readable_neighbours(mask, cfg.attention_conv // 2) if cfg.attention_conv else None

    def project(name):
      # One [H, H] matrix per projection (heads side by side), as BERT stores it.
      projected = _dense(cfg.hidden_size, "embed", "heads", self.dtype, name, cfg.use_bias)(hidden)
      if cfg.attention_conv:
        taps = self.param(
            f"{name}_conv",
            _param(_conv_init(cfg.attention_conv), ("unmodeled", "heads")),
            (cfg.attention_conv, cfg.hidden_size),
            jnp.float32,
        )
        projected = _sequence_conv(projected, taps.astype(projected.dtype), readable)
      return projected.reshape(*hidden.shape[:-1], cfg.num_heads, cfg.head_dim)

    query, key, value = project("query"), project("key"), project("value")
    # Real keys [batch, seq] or a query x key mask [batch, seq, seq] -> [batch, 1, q or 1, seq] for every head.
    key_is_real = mask[:, None, None, :] if mask.ndim == 2 else mask[:, None, :, :]
    if not deterministic and cfg.attention_dropout_rate > 0.0:
      # BERT's dropout on the probabilities, which dot_product_attention lacks; heads next to the batch.
      query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))  # [b, h, s, d]
      scores = jnp.einsum("bhqd,bhkd->bhqk", query, key) / math.sqrt(cfg.head_dim)
      scores = jnp.where(key_is_real, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
      probs = random_ops.Dropout(cfg.attention_dropout_rate)(
          jax.nn.softmax(scores, axis=-1), deterministic=False
      )
      context = jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(self.dtype), value), 1, 2)
    elif self.attention_impl == "splash" and mask.ndim == 2:
      # The kernel takes 0/1 masks, or packed rows' ids as ElectraPretrainer passes them, as segment ids.
      context = splash_attention.splash_attention(query, key, value, attention_mask)
    elif self.attention_impl == "cudnn" and mask.ndim == 2:
      # Right-padded rows' lengths; an all-padding row (evaluation's last batch) gets 1, as cuDNN before
      # 9.25 returns NaN for 0.
      lengths = jnp.maximum(mask.sum(-1, dtype=jnp.int32), 1)
      context = jax.nn.dot_product_attention(
          query,
          key,
          value,
          query_seq_lengths=lengths,
          key_value_seq_lengths=lengths,
          implementation="cudnn",
      )
    else:  # splash cannot take a [batch, q, k] mask (packed rows, the cloze towers' causal ones)
      implementation = "xla" if self.attention_impl == "splash" else self.attention_impl
      context = jax.nn.dot_product_attention(
          query, key, value, mask=key_is_real, implementation=implementation
      )
    context = context.reshape(*hidden.shape[:-1], cfg.hidden_size)
    return _dense(cfg.hidden_size, "heads", "embed", self.dtype, "output", cfg.use_bias)(context)


def _readable_neighbours(mask, radius: int):
  """[2 * radius + 1, batch, seq] bool: whether position i may read i + offset (offsets -radius..radius), by
  attention's `mask` ([batch, seq] or [batch, seq, seq]) and never across the row's ends."""
  seq = mask.shape[-1]
  rows = []
  for offset in range(-radius, radius + 1):
    target = jnp.arange(seq) + offset
    inside = (target >= 0) & (target < seq)
    target = jnp.clip(target, 0, seq - 1)
    allowed = (
        mask[:, target]
        if mask.ndim == 2
        else jnp.take_along_axis(
            mask, jnp.broadcast_to(target[None, :, None], (mask.shape[0], seq, 1)), 2
        )[..., 0]
    )
    rows.append(allowed & inside)
  return jnp.stack(rows)


def _sequence_conv(x, taps, readable):
  """Depthwise convolution along the sequence: out[b, i, c] = sum_k taps[k, c] * x[b, i + k - r, c] over the
  neighbours `readable` allows."""
  radius = taps.shape[0] // 2
  out = jnp.zeros_like(x)
  for k in range(taps.shape[0]):
    shifted = jnp.roll(x, radius - k, axis=1)  # shifted[:, i] = x[:, i + k - radius]
    out = out + jnp.where(readable[k][..., None], shifted, 0) * taps[k]
  return out


def _conv_init(width: int, stddev: float = 0.5):
  """The identity (centre tap 1) plus N(0, stddev) on every tap (stddev: docs/small_budget.md)."""
  return (
      lambda key, shape, dtype=jnp.float32: (stddev * jax.random.normal(key, shape, dtype))
      .at[width // 2]
      .add(1.0)
  )


class EncoderLayer(_Block):
  """One transformer block. norm="post" (BERT's): LN(x + attn(x)), then LN(x + FFN(x)); norm="pre":
  x + attn(LN(x)), then x + FFN(LN(x)), and Encoder's final_layer_norm after the last layer."""

  @nn.compact
  def __call__(self, hidden, attention_mask, deterministic: bool):
    cfg = self.config
    attention = SelfAttention(cfg, self.dtype, self.attention_impl, name="attention")
    blocks = (
        (
            functools.partial(
                attention, attention_mask=attention_mask, deterministic=deterministic
            ),
            _layer_norm(cfg.layer_norm_eps, "attention_layer_norm"),
        ),
        (
            functools.partial(_feed_forward, cfg, self.dtype),
            _layer_norm(cfg.layer_norm_eps, "output_layer_norm"),
        ),
    )
    for block, norm in blocks:
      dropout = random_ops.Dropout(cfg.dropout_rate)
      if (
          cfg.norm == "pre"
      ):  # the residual stream is never normalized; each block reads a normalized copy
        hidden = hidden + dropout(
            block(norm(hidden).astype(self.dtype)), deterministic=deterministic
        )
      else:
        hidden = norm(hidden + dropout(block(hidden), deterministic=deterministic)).astype(
            self.dtype
        )
    return nn.with_logical_constraint(hidden, ("act_batch", "act_len", "act_embed"))


def _feed_forward(cfg: EncoderConfig, dtype: Dtype, hidden):
  """ffn="gelu": BERT's dense(H->I) + GELU + dense(I->H) (`intermediate`, `output`); "geglu": gelu(gate) *
  value of the first's [H, 2I] kernel, gate columns first, so a GELU tree never loads into it."""
  width = 2 * cfg.intermediate_size if cfg.ffn == "geglu" else cfg.intermediate_size
  inner = _dense(width, "embed", "mlp", dtype, "intermediate", cfg.use_bias)(hidden)
  if cfg.ffn == "geglu":
    gate, value = jnp.split(inner, 2, axis=-1)
    inner = gelu_exact(gate) * value
  else:
    inner = gelu_exact(inner)
  return _dense(cfg.hidden_size, "mlp", "embed", dtype, "output", cfg.use_bias)(inner)


class _EncoderFields(nn.Module):
  """The fields of Encoder and of the towers."""

  config: EncoderConfig
  embedding_size: int
  dtype: Dtype
  attention_impl: str = "xla"


class Encoder(_EncoderFields):
  """The E->H projection (only when sizes differ), the encoder layers and, for norm="pre", `final_layer_norm`."""

  @nn.compact
  def __call__(self, embedded, attention_mask, deterministic: bool):
    cfg = self.config
    hidden = embedded
    if self.embedding_size != cfg.hidden_size:
      hidden = _dense(
          cfg.hidden_size, "embed", "mlp", self.dtype, "embeddings_project", cfg.use_bias
      )(hidden)
    layer = EncoderLayer
    if cfg.remat != "none":
      # Argument 3 of __call__ (self, hidden, attention_mask, deterministic) is a Python bool. A scan keeps the
      # recomputation apart by itself, where CSE barriers would only stop fusion.
      layer = nn.remat(
          layer,
          policy=REMAT_POLICIES[cfg.remat],
          static_argnums=(3,),
          prevent_cse=not cfg.scan_layers,
      )
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
        hidden = layer(cfg, self.dtype, self.attention_impl, name=f"layer_{i}")(
            hidden, attention_mask, deterministic
        )
    if cfg.norm == "pre":
      hidden = _layer_norm(cfg.layer_norm_eps, "final_layer_norm")(hidden).astype(self.dtype)
    return hidden  # [batch, seq, hidden]


class _ScanBody(_Block):
  """`layer` (EncoderLayer or its remat) as nn.scan's body: (hidden, mask) -> (hidden, None); `deterministic`
  is a field, as scan would trace a Python bool argument."""

  layer: type = None
  deterministic: bool = True

  @nn.compact
  def __call__(self, hidden, attention_mask):
    layer = self.layer(self.config, self.dtype, self.attention_impl, name="layer")
    return layer(hidden, attention_mask, self.deterministic), None


def unscan_layers(tree):
  """A parameter (or gradient, optimizer-moment) tree with every scanned encoder ({"layers": {"layer":
  stacked}}) rewritten as layer_0 .. layer_{L-1}; other trees as they are."""
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
  layer_keys = sorted(
      (k for k in tree if k.startswith("layer_") and k[6:].isdigit()), key=lambda k: int(k[6:])
  )
  out = {k: scan_layers(v) for k, v in tree.items() if k not in layer_keys}
  if layer_keys:
    out["layers"] = {
        "layer": jax.tree.map(lambda *xs: jnp.stack(xs), *(tree[k] for k in layer_keys))
    }
  return out


class _Tower(_EncoderFields):
  """A tower's encoder: its own, or the one both towers run under tie="all"."""

  shared_encoder: nn.Module | None = None

  def _encode(self, embedded, attention_mask, deterministic: bool, name: str = "encoder"):
    """The tower's own encoder, or the shared one, over `embedded` (called inside the compact call)."""
    encoder = self.shared_encoder or Encoder(
        self.config, self.embedding_size, self.dtype, self.attention_impl, name=name
    )
    return encoder(embedded, attention_mask, deterministic)


class Generator(_Tower):
  """Masked LM tower: encoder, then vocab_head at `masked_positions` (every position when None). cloze=True:
  Electric's generator (the official two-tower cloze model), a left-to-right and a right-to-left encoder over the
  UNMASKED input; position t reads the first at t - 1 and the second at t + 1, so it sees every token but its own.
  """

  cloze: bool = False

  @nn.compact
  def __call__(
      self, embedded, attention_mask, deterministic: bool, word_table, masked_positions=None
  ):
    if self.cloze:
      keys = attention_mask.astype(bool)[:, None, :]  # [batch, 1, seq]
      left_to_right = jnp.tril(jnp.ones((keys.shape[-1],) * 2, bool))[None]
      ltr = self._encode(embedded, keys & left_to_right, deterministic, "encoder_ltr")
      rtl = self._encode(
          embedded, keys & jnp.swapaxes(left_to_right, 1, 2), deterministic, "encoder_rtl"
      )
      # Shift: t takes ltr[t - 1] and rtl[t + 1] (wrapping at the ends, as the official roll).
      hidden = jnp.concatenate([jnp.roll(ltr, 1, axis=1), jnp.roll(rtl, -1, axis=1)], axis=-1)
    else:
      hidden = self._encode(embedded, attention_mask, deterministic)
    if masked_positions is not None:
      # Only the masked positions reach the head, the costliest matmul of a small generator.
      hidden = jnp.take_along_axis(
          hidden, masked_positions[..., None], axis=1
      )  # [batch, n_pred, H_g]
    return vocab_head(self, hidden, word_table)  # [batch, n_pred or seq, vocab]


class Discriminator(_Tower):
  """Replaced-token detector: encoder, then dense(H->H) + GELU + dense(H->1) per token. `with_mlm=True` also
  returns the logits of its MLM head (vocab_head, prefix mlm_) at `mlm_positions` (all when None).
  """

  @nn.compact
  def __call__(
      self,
      embedded,
      attention_mask,
      deterministic: bool,
      word_table=None,
      mlm_positions=None,
      with_mlm: bool = False,
  ):
    encoded = self._encode(embedded, attention_mask, deterministic)
    hidden = gelu_exact(
        _dense(self.config.hidden_size, "embed", "mlp", self.dtype, "head_dense")(encoded)
    )
    logits = _dense(1, "mlp", "unmodeled", self.dtype, "head_out", float32_out=True)(hidden)
    logits = logits[..., 0].astype(jnp.float32)  # [batch, seq]
    if not with_mlm:
      return logits
    if mlm_positions is not None:
      encoded = jnp.take_along_axis(encoded, mlm_positions[..., None], axis=1)
    return logits, vocab_head(self, encoded, word_table, prefix="mlm_")


class ElectraPretrainer(EmbeddingSizes):
  """Generator and discriminator over ONE embeddings module: with the default tie="embeddings" the tree's top
  level is exactly {embeddings, generator, discriminator}. tie="none" adds the generator's own
  `generator_embeddings` (of its hidden size); tie="gdes" (DeBERTa-v3) `discriminator_word_delta`, which the
  discriminator adds to stop_gradient(shared word table); tie="all" runs one `shared_encoder` in both towers.
  """

  generator_config: EncoderConfig
  discriminator_config: EncoderConfig
  dtype: Dtype = jnp.float32
  attention_impl: str = "xla"
  tie: str = "embeddings"  # see TIE_MODES
  has_generator: bool = (
      True  # False for objectives without one (mlm, uniform): no generator parameters
  )
  discriminator_mlm_head: bool = (
      False  # the MLM-family objectives: the discriminator gets a masked-LM head
  )
  cloze_generator: bool = False  # Electric: the generator is the two-tower cloze Generator
  # Packed rows: every method's `attention_mask` is the segment ids (see segment_positions); a 0/1 mask is
  # one segment per row, so unpacked batches give the same results.
  packed: bool = False

  @property
  def generator_embedding_size(self) -> int:
    return self.generator_config.hidden_size if self.tie == "none" else self.embedding_size

  def setup(self):
    self.embeddings = embeddings_for(self, self.embedding_size, self.discriminator_config)
    if self.tie == "none" and self.has_generator:
      self.generator_embeddings = embeddings_for(
          self, self.generator_embedding_size, self.generator_config
      )
    if self.tie == "gdes":
      self.discriminator_word_delta = self.param(
          "discriminator_word_delta",
          _param(nn.initializers.zeros_init(), ("vocab", "embed")),
          (self.vocab_size, self.embedding_size),
      )
    shared = None
    if self.tie == "all":  # config_lib.validate refuses towers of different sizes
      shared = self.shared_encoder = Encoder(
          self.discriminator_config, self.embedding_size, self.dtype, self.attention_impl
      )
    if self.has_generator:  # the cloze generator runs encoders of its own
      self.generator = Generator(
          self.generator_config,
          self.generator_embedding_size,
          self.dtype,
          self.attention_impl,
          None if self.cloze_generator else shared,
          self.cloze_generator,
      )
    self.discriminator = Discriminator(
        self.discriminator_config, self.embedding_size, self.dtype, self.attention_impl, shared
    )

  def _embed(
      self,
      embeddings: Embeddings,
      word_table,
      input_ids,
      token_type_ids,
      attention_mask,
      deterministic,
  ):
    """(the inputs embedded over `word_table`, the mask the towers read): packed rows' segment ids give positions
    that restart at each segment and a query x key mask (the splash kernel reads segment ids itself).
    """
    positions, mask = None, attention_mask
    if self.packed:
      positions = segment_positions(attention_mask)
      mask = (
          attention_mask
          if self.attention_impl == "splash"
          else segment_attention_mask(attention_mask)
      )
    return embeddings(input_ids, token_type_ids, deterministic, word_table, positions), mask

  def generator_logits(
      self, input_ids, token_type_ids, attention_mask, masked_positions, deterministic: bool = True
  ):
    """Vocabulary logits at `masked_positions` [batch, n_pred] -> [batch, n_pred, vocab], float32 (every
    position, [batch, seq, vocab], for the cloze generator and None)."""
    embeddings = self.generator_embeddings if self.tie == "none" else self.embeddings
    word_table = embeddings.word_table()
    embedded, mask = self._embed(
        embeddings, word_table, input_ids, token_type_ids, attention_mask, deterministic
    )
    return self.generator(embedded, mask, deterministic, word_table, masked_positions)

  def cloze_logits(self, input_ids, token_type_ids, attention_mask, deterministic: bool = True):
    """Electric's generator: [batch, seq] -> vocabulary logits at every position, float32."""
    return self.generator_logits(input_ids, token_type_ids, attention_mask, None, deterministic)

  def discriminator_logits(
      self, input_ids, token_type_ids, attention_mask, deterministic: bool = True, **head
  ):
    """One "replaced" logit per token: [batch, seq] -> [batch, seq], float32; the discriminator reads the shared
    word table, or for GDES stop_gradient(shared) + delta."""
    word_table = self.embeddings.word_table()
    if self.tie == "gdes":
      word_table = jax.lax.stop_gradient(word_table) + self.discriminator_word_delta
    embedded, mask = self._embed(
        self.embeddings, word_table, input_ids, token_type_ids, attention_mask, deterministic
    )
    return self.discriminator(embedded, mask, deterministic, word_table, **head)

  def discriminator_mlm_logits(
      self,
      input_ids,
      token_type_ids,
      attention_mask,
      mlm_positions=None,
      deterministic: bool = True,
  ):
    """(per-token logits [batch, seq], the discriminator tower's MLM logits [batch, n, vocab] at
    `mlm_positions`, or [batch, seq, vocab] when None); needs discriminator_mlm_head."""
    return self.discriminator_logits(
        input_ids,
        token_type_ids,
        attention_mask,
        deterministic,
        with_mlm=True,
        mlm_positions=mlm_positions,
    )

  def __call__(
      self, input_ids, token_type_ids, attention_mask, masked_positions, deterministic: bool = True
  ):
    """Both towers on the same input, which creates every parameter at init: (generator's logits or None,
    discriminator's, a pair with an MLM head)."""
    inputs = (input_ids, token_type_ids, attention_mask)
    generator = None
    if self.has_generator:
      generator = self.generator_logits(
          *inputs, None if self.cloze_generator else masked_positions, deterministic
      )
    if self.discriminator_mlm_head:
      return generator, self.discriminator_mlm_logits(*inputs, masked_positions, deterministic)
    return generator, self.discriminator_logits(*inputs, deterministic)


def generator_encoder_config(discriminator: EncoderConfig, fraction: float) -> EncoderConfig:
  """The generator `fraction` as wide as the discriminator (same depth and head size, FFN scaled alike), as
  the official code sizes it, with at least one head; its other options (norm, convolution, ...) are the
  discriminator's."""
  hidden = int(round(discriminator.hidden_size * fraction))
  num_heads = max(1, hidden // discriminator.head_dim)
  if hidden < 1 or hidden % num_heads:
    raise ConfigError(
        f"model.generator_fraction={fraction} gives a generator hidden size of {hidden}, which does not split "
        f"into {num_heads} heads of the discriminator's head size {discriminator.head_dim}; choose a fraction "
        f"so hidden_size * fraction is a multiple of {discriminator.head_dim} (or smaller than it)."
    )
  intermediate = int(round(discriminator.intermediate_size * fraction))
  return dataclasses.replace(
      discriminator, hidden_size=hidden, num_heads=num_heads, intermediate_size=intermediate
  )


def _check_attention(config, towers: dict[str, EncoderConfig], cloze: bool) -> None:
  """Refuses, before compiling, what the chosen attention kernel cannot take."""
  impl, dropout, seq_len = (
      config.model.attention_impl,
      config.model.attention_dropout_rate,
      config.data.max_seq_len,
  )
  if impl == "splash":
    splash_attention.check_seq_len(seq_len)
  if impl == "cudnn" and config.train.dtype != "bfloat16":
    raise ConfigError(
        f"model.attention_impl='cudnn' takes bfloat16 inputs only, but train.dtype="
        f"{config.train.dtype!r}: set --config.train.dtype=bfloat16 or model.attention_impl='xla'."
    )
  if impl in ("cudnn", "splash") and dropout > 0:
    raise ConfigError(
        f"model.attention_impl={impl!r} runs a fused kernel without dropout on the attention "
        f"probabilities, but model.attention_dropout_rate={dropout}: set "
        "--config.model.attention_dropout_rate=0.0, or model.attention_impl='xla' to keep it."
    )
  if impl != "cudnn":
    return
  for tower, cfg in towers.items():
    if cfg.head_dim % 8 or cfg.head_dim > 256:
      raise ConfigError(
          f"model.attention_impl='cudnn' needs a head size that is a multiple of 8 and at most 256 (128 before "
          f"Hopper GPUs), but the {tower}'s is {cfg.head_dim} (hidden {cfg.hidden_size} over {cfg.num_heads} "
          "heads): change model.hidden_size, num_heads or generator_fraction, or use model.attention_impl='xla'."
      )
  if (config.data.pack_rows or cloze) and seq_len % 2:
    raise ConfigError(
        f"model.attention_impl='cudnn' with packed rows or Electric needs an even sequence length, "
        f"but data.max_seq_len={seq_len}: make it even, or use model.attention_impl='xla'."
    )


class Towers(NamedTuple):
  """What an objective needs built beside the discriminator (objectives.towers(config) says)."""

  has_generator: bool = True  # a generator tower
  mlm_head: bool = False  # an MLM head on the discriminator-sized tower
  cloze: bool = False  # the generator is Electric's two-tower cloze model


def build_model(config, towers: Towers) -> ElectraPretrainer:
  """The pre-training model a full electra-jax config (configs/base.py) describes, with `towers`."""
  m = config.model
  sizes = {field.name: m[field.name] for field in dataclasses.fields(EncoderConfig)}
  discriminator = EncoderConfig(**{**sizes, "scan_layers": bool(m.scan_layers)})
  choices = (
      ("tie", TIE_MODES),
      ("norm", NORMS),
      ("ffn", FFNS),
      ("use_bias", (True, False)),
      ("remat", REMAT_POLICIES),
      ("attention_impl", ATTENTION_IMPLEMENTATIONS),
  )
  for key, allowed in choices:
    # `in` alone would take 1 and 0 for True and False.
    if not any(m[key] == value and type(m[key]) is type(value) for value in allowed):
      raise ConfigError(f"model.{key}={m[key]!r} is not one of {list(allowed)}.")
  if m.tie == "all" and m.generator_fraction != 1.0:
    raise ConfigError(
        f"model.tie='all' runs one encoder for both towers, so they must be the same size, but "
        f"model.generator_fraction={m.generator_fraction}: set it to 1.0."
    )
  width = m.attention_conv
  if not (type(width) is int and (width == 0 or width > 0 and width % 2)):
    raise ConfigError(
        f"model.attention_conv={width!r} must be 0 (no convolution) or an odd kernel width such as 3 "
        "(the position and its two neighbours)."
    )
  generator = generator_encoder_config(discriminator, m.generator_fraction)
  _check_attention(config, {"discriminator": discriminator, "generator": generator}, towers.cloze)
  return ElectraPretrainer(
      vocab_size=m.vocab_size,
      embedding_size=m.embedding_size,
      max_position_embeddings=m.max_position_embeddings,
      type_vocab_size=m.type_vocab_size,
      generator_config=generator,
      discriminator_config=discriminator,
      dtype=jnp.dtype(config.train.dtype),
      attention_impl=m.attention_impl,
      tie=m.tie,
      has_generator=towers.has_generator,
      discriminator_mlm_head=towers.mlm_head,
      cloze_generator=towers.cloze,
      packed=bool(config.data.pack_rows),
  )


class OneTower(EmbeddingSizes):
  """The fields of a model of one tower over its own embeddings (`config` is the tower's own)."""

  config: EncoderConfig
  dtype: Dtype = jnp.float32
  attention_impl: str = "xla"


class _TowerOverEmbeddings(OneTower):
  """The subclass's `_tower` over its own embeddings; its parameter tree is the pre-trainer's subtree, name for
  name."""

  @nn.compact
  def __call__(
      self, input_ids, attention_mask=None, token_type_ids=None, deterministic: bool = True
  ):
    """Every token real and of type 0 unless `attention_mask` and `token_type_ids` say otherwise."""
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else attention_mask
    token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    embeddings = embeddings_for(self, self.embedding_size, self.config, name="embeddings")
    embedded = embeddings(input_ids, token_type_ids, deterministic)
    tower_class = {"discriminator": Discriminator, "generator": Generator, "encoder": Encoder}[
        self._tower
    ]
    tower = tower_class(
        self.config, self.embedding_size, self.dtype, self.attention_impl, name=self._tower
    )
    word_table = (embeddings.word_table(),) if self._tower == "generator" else ()
    return tower(embedded, attention_mask, deterministic, *word_table)


class ElectraDiscriminatorModel(_TowerOverEmbeddings):
  """Parameters {embeddings, discriminator}: [batch, seq] -> "replaced" logits [batch, seq] float32."""

  _tower = "discriminator"


class ElectraGeneratorModel(_TowerOverEmbeddings):
  """Parameters {embeddings, generator}: [batch, seq] -> vocabulary logits [batch, seq, vocab] float32."""

  _tower = "generator"


class ElectraEncoderModel(_TowerOverEmbeddings):
  """No head; parameters {embeddings, encoder} (either tower's `encoder`): [batch, seq] -> [batch, seq, hidden]."""

  _tower = "encoder"


TOWER_MODELS = {"discriminator": ElectraDiscriminatorModel, "generator": ElectraGeneratorModel}


def no_standalone_generator(pretrainer: ElectraPretrainer) -> str | None:
  """Why this pre-trainer's generator has no standalone (Hugging Face) form; None if it has."""
  if not pretrainer.has_generator:
    return "This pre-trainer has no generator (its objective runs none)"
  if pretrainer.cloze_generator:
    return "Electric's two-tower cloze generator has no standalone (or Hugging Face) form"
  return None


def tower_from_pretrainer(pretrainer: ElectraPretrainer, params, tower: str):
  """(model, params) of one tower of a pre-trainer: `params` is an ElectraPretrainer tree; the result's is
  {embeddings, <tower>}, the same arrays, but the discriminator's word table under tie="gdes" is the sum it
  reads (shared + delta), and the generator's embeddings under tie="none" its own."""
  if tower not in TOWER_MODELS:
    raise ConfigError(f"tower={tower!r} is not one of {sorted(TOWER_MODELS)}.")
  why_not = no_standalone_generator(pretrainer) if tower == "generator" else None
  if why_not:
    raise ConfigError(f"{why_not}; export the discriminator.")
  if not {"embeddings", tower} <= set(params):
    raise ConfigError(
        f"The parameter tree's top level is {sorted(params)}, not an ElectraPretrainer's {{embeddings, generator, "
        "discriminator}. Pass the `params` of a pre-training state (e.g. state.params, not {'params': ...})."
    )
  tower_config = (
      pretrainer.discriminator_config if tower == "discriminator" else pretrainer.generator_config
  )
  if tower_config.scan_layers:  # standalone towers use the unscanned layout
    tower_config = dataclasses.replace(tower_config, scan_layers=False)
    params = unscan_layers(params)
  embeddings, tower_params, embedding_size = (
      params["embeddings"],
      params[tower],
      pretrainer.embedding_size,
  )
  if pretrainer.tie == "all":
    tower_params = {**tower_params, "encoder": params["shared_encoder"]}
  if tower == "discriminator" and pretrainer.discriminator_mlm_head:
    # The standalone discriminator (and transformers' ElectraForPreTraining) has no MLM head.
    tower_params = {k: v for k, v in tower_params.items() if not k.startswith("mlm_")}
  if tower == "generator" and pretrainer.tie == "none":
    embeddings, embedding_size = params["generator_embeddings"], pretrainer.generator_embedding_size
  if tower == "discriminator" and pretrainer.tie == "gdes":
    word_table = embeddings["word_embeddings"]["embedding"] + params["discriminator_word_delta"]
    embeddings = {**embeddings, "word_embeddings": {"embedding": word_table}}
  model = TOWER_MODELS[tower](
      vocab_size=pretrainer.vocab_size,
      embedding_size=embedding_size,
      max_position_embeddings=pretrainer.max_position_embeddings,
      type_vocab_size=pretrainer.type_vocab_size,
      config=tower_config,
      dtype=pretrainer.dtype,
      attention_impl=pretrainer.attention_impl,
  )
  return model, {"embeddings": embeddings, tower: tower_params}
