"""ELECTRA's two towers over encoder.py's encoder: `ElectraPretrainer` (one embeddings module for
both) built by `build_model`, and the standalone tower models."""

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from electra_jax import encoder, splash_attention
from electra_jax.encoder import Dtype, EmbeddingSizes, Encoder, EncoderConfig, EncoderFields
from electra_jax.errors import ConfigError


def segment_positions(segment_ids):
  """[batch, seq] segment ids (1, 2, ... per packed example, 0 on padding) -> positions restarting
  at 0 at each segment, so a packed example is embedded as it would be alone in its row."""
  index = jnp.broadcast_to(jnp.arange(segment_ids.shape[-1], dtype=jnp.int32), segment_ids.shape)
  previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = jnp.where(segment_ids != previous, index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def segment_attention_mask(segment_ids):
  """[batch, seq] segment ids -> [batch, seq, seq]: a query sees its segment's real keys only."""
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & (segment_ids[:, None, :] > 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tied_vocab_logits(hidden, word_table, output_bias, dtype):
  """float32 logits [..., vocab] = hidden [..., E] @ word_table [vocab, E]^T + output_bias, the
  product in `dtype` accumulated in float32, with a backward in the forms cheapest on a CPU."""
  return _tied_vocab_logits_fwd(hidden, word_table, output_bias, dtype)[0]


def _tied_vocab_logits_fwd(hidden, word_table, output_bias, dtype):
  hidden_c, table_c = hidden.astype(dtype), word_table.astype(dtype)
  logits = jnp.einsum("...e,ve->...v", hidden_c, table_c, preferred_element_type=jnp.float32)
  return logits + output_bias, (hidden, word_table)


def _tied_vocab_logits_bwd(dtype, residuals, grad):
  # The table's gradient via [E, vocab] (the logits' gradient read in place, not copied transposed);
  # the bias's on the CPU a product with ones (XLA:CPU's column reduction is slow), else a sum.
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


def vocab_head(module: nn.Module, hidden, word_table, prefix: str = ""):
  """BERT's MLM head in a tower's compact call: dense(-> E) + GELU + LayerNorm, then the decoder
  tied to `word_table` [vocab, E] plus an output bias; parameter names start with `prefix`."""
  vocab_size, embedding_size = word_table.shape
  dense = encoder.dense(embedding_size, "embed", "mlp", module.dtype, f"{prefix}head_dense")
  norm = encoder.layer_norm(module.config.layer_norm_eps, f"{prefix}head_layer_norm")
  hidden = norm(encoder.gelu_exact(dense(hidden)))
  zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",))
  output_bias = module.param(f"{prefix}output_bias", zeros, (vocab_size,))
  # Pinned to the batch split: left to propagation, E takes the word table's fsdp split, and XLA
  # then swaps batch shards' rows in the head's gradient (docs/performance.md).
  hidden = nn.with_logical_constraint(hidden, ("act_batch",) + (None,) * (hidden.ndim - 1))
  return tied_vocab_logits(hidden, word_table, output_bias, module.dtype)


class _Tower(EncoderFields):
  """A tower's encoder: its own, or the one both towers run under tie="all"."""

  shared_encoder: nn.Module | None = None

  def _encode(self, embedded, attention_mask, deterministic: bool, name: str = "encoder"):
    tower_encoder = self.shared_encoder or Encoder(
        self.config, self.embedding_size, self.dtype, self.attention_impl, name=name
    )
    return tower_encoder(embedded, attention_mask, deterministic)


class Generator(_Tower):
  """Masked LM: encoder, then vocab_head at `masked_positions` (all when None). cloze=True:
  Electric's cloze model, left-to-right and right-to-left encoders over the UNMASKED input."""

  cloze: bool = False

  @nn.compact
  def __call__(self, embedded, attention_mask, deterministic, word_table, masked_positions=None):
    if self.cloze:
      keys = attention_mask.astype(bool)[:, None, :]  # [batch, 1, seq]
      left_to_right = jnp.tril(jnp.ones((keys.shape[-1],) * 2, bool))[None]
      ltr = self._encode(embedded, keys & left_to_right, deterministic, "encoder_ltr")
      right_to_left = jnp.swapaxes(left_to_right, 1, 2)
      rtl = self._encode(embedded, keys & right_to_left, deterministic, "encoder_rtl")
      # Shift: t takes ltr[t - 1] and rtl[t + 1] (wrapping at the ends, as the official roll).
      hidden = jnp.concatenate([jnp.roll(ltr, 1, axis=1), jnp.roll(rtl, -1, axis=1)], axis=-1)
    else:
      hidden = self._encode(embedded, attention_mask, deterministic)
    if masked_positions is not None:
      # Only the masked positions reach the head, the costliest matmul of a small generator.
      hidden = jnp.take_along_axis(hidden, masked_positions[..., None], axis=1)  # [b, n_pred, H_g]
    return vocab_head(self, hidden, word_table)  # [batch, n_pred or seq, vocab]


class Discriminator(_Tower):
  """Replaced-token detector: encoder, then dense(H->H) + GELU + dense(H->1) per token; with
  `mlm_head` also its MLM head's logits (vocab_head, prefix mlm_) at `mlm_positions` (None: all)."""

  mlm_head: bool = False

  @nn.compact
  def __call__(self, embedded, attention_mask, deterministic, word_table=None, mlm_positions=None):
    encoded = self._encode(embedded, attention_mask, deterministic)
    head_dense = encoder.dense(self.config.hidden_size, "embed", "mlp", self.dtype, "head_dense")
    head_out = encoder.dense(1, "mlp", "unmodeled", self.dtype, "head_out", float32_out=True)
    logits = head_out(encoder.gelu_exact(head_dense(encoded)))[..., 0].astype(jnp.float32)
    if not self.mlm_head:
      return logits  # [batch, seq]
    if mlm_positions is not None:
      encoded = jnp.take_along_axis(encoded, mlm_positions[..., None], axis=1)
    return logits, vocab_head(self, encoded, word_table, prefix="mlm_")


class Towers(NamedTuple):
  """What an objective needs built beside the discriminator (objectives.towers(config) says)."""

  has_generator: bool = True  # a generator tower
  mlm_head: bool = False  # an MLM head on the discriminator-sized tower
  cloze: bool = False  # the generator is Electric's two-tower cloze model


class ElectraPretrainer(EmbeddingSizes):
  """Both towers over ONE embeddings module: {embeddings, generator, discriminator}, plus under
  tie="none" `generator_embeddings`, under "gdes" (DeBERTa-v3) a `discriminator_word_delta` added to
  stop_gradient(word table), under "all" one `shared_encoder`. Packed rows' `mask`: segment ids."""

  generator_config: EncoderConfig
  discriminator_config: EncoderConfig
  dtype: Dtype = jnp.float32
  attention_impl: str = "xla"
  tie: str = "embeddings"  # or "none", "gdes", "all" (above)
  towers: Towers = Towers()
  packed: bool = False

  @property
  def generator_embedding_size(self) -> int:
    return self.generator_config.hidden_size if self.tie == "none" else self.embedding_size

  def setup(self):
    disc, gen, towers = self.discriminator_config, self.generator_config, self.towers
    fields = (self.dtype, self.attention_impl)
    self.embeddings = encoder.embeddings_for(self, self.embedding_size, disc)
    if self.tie == "none" and towers.has_generator:
      self.generator_embeddings = encoder.embeddings_for(self, self.generator_embedding_size, gen)
    if self.tie == "gdes":
      zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab", "embed"))
      shape = (self.vocab_size, self.embedding_size)
      self.discriminator_word_delta = self.param("discriminator_word_delta", zeros, shape)
    shared = None
    if self.tie == "all":  # build_model refuses towers of different sizes
      shared = self.shared_encoder = Encoder(disc, self.embedding_size, *fields)
    if towers.has_generator:  # the cloze generator runs encoders of its own
      gen_fields = (self.generator_embedding_size, *fields, None if towers.cloze else shared)
      self.generator = Generator(gen, *gen_fields, towers.cloze)
    self.discriminator = Discriminator(disc, self.embedding_size, *fields, shared, towers.mlm_head)

  def _run(self, tower, embeddings, word_table, inputs):
    """`tower` over `inputs` embedded with `word_table`: packed rows' segment ids give positions
    that restart at each segment and a query x key mask (the splash kernel reads segment ids)."""
    ids, token_type_ids, mask, positions, deterministic = inputs
    position_ids = None
    if self.packed:
      position_ids = segment_positions(mask)
      mask = mask if self.attention_impl == "splash" else segment_attention_mask(mask)
    embedded = embeddings(ids, token_type_ids, deterministic, word_table, position_ids)
    return tower(embedded, mask, deterministic, word_table, positions)

  def generator_logits(self, ids, token_type_ids, mask, positions=None, deterministic=True):
    """Vocabulary logits at `positions` [batch, n_pred] -> [batch, n_pred, vocab], float32 (at every
    position, [batch, seq, vocab], when None: the cloze generator's)."""
    embeddings = self.generator_embeddings if self.tie == "none" else self.embeddings
    inputs = (ids, token_type_ids, mask, positions, deterministic)
    return self._run(self.generator, embeddings, embeddings.word_table(), inputs)

  def discriminator_logits(self, ids, token_type_ids, mask, positions=None, deterministic=True):
    """[batch, seq] float32 "replaced" logits; with the MLM head the pair (them, its logits at
    `positions`, all when None). Over the shared word table (GDES: stop_gradient(it) + delta)."""
    word_table = self.embeddings.word_table()
    if self.tie == "gdes":
      word_table = jax.lax.stop_gradient(word_table) + self.discriminator_word_delta
    inputs = (ids, token_type_ids, mask, positions, deterministic)
    return self._run(self.discriminator, self.embeddings, word_table, inputs)

  def __call__(self, ids, token_type_ids, mask, masked_positions, deterministic=True):
    """Both towers on one input (creates every parameter at init): (generator logits or None,
    discriminator logits, or a pair with an MLM head)."""
    inputs = (ids, token_type_ids, mask)
    generator = None
    if self.towers.has_generator:
      positions = None if self.towers.cloze else masked_positions
      generator = self.generator_logits(*inputs, positions, deterministic)
    return generator, self.discriminator_logits(*inputs, masked_positions, deterministic)


def generator_encoder_config(discriminator: EncoderConfig, fraction: float) -> EncoderConfig:
  """The official generator sizing: `fraction` as wide as the discriminator (FFN alike), same depth,
  head size and options, at least one head."""
  hidden = int(round(discriminator.hidden_size * fraction))
  num_heads = max(1, hidden // discriminator.head_dim)
  if hidden < 1 or hidden % num_heads:
    raise ConfigError(
        f"model.generator_fraction={fraction} gives a generator hidden size of {hidden}, which "
        f"splits into no whole heads of about {discriminator.head_dim}: change the fraction."
    )
  intermediate = int(round(discriminator.intermediate_size * fraction))
  return dataclasses.replace(
      discriminator, hidden_size=hidden, num_heads=num_heads, intermediate_size=intermediate
  )


def build_model(config, towers: Towers) -> ElectraPretrainer:
  """The pre-training model a full electra-jax config (configs/base.py) describes, with `towers`."""
  m = config.model
  choices = {
      "tie": ("embeddings", "none", "gdes", "all"),  # see ElectraPretrainer
      "norm": encoder.NORMS,
      "ffn": encoder.FFNS,
      "remat": encoder.REMAT_POLICIES,
      "attention_impl": encoder.ATTENTION_IMPLEMENTATIONS,
  }
  for key, allowed in choices.items():  # (ConfigDict and config_lib.with_defaults check types)
    if m[key] not in allowed:
      raise ConfigError(f"model.{key}={m[key]!r} is not one of {list(allowed)}.")
  if m.tie == "all" and m.generator_fraction != 1.0:
    raise ConfigError(
        "model.tie='all' runs one encoder in both towers, which must then be one size, but "
        f"model.generator_fraction={m.generator_fraction}: set it to 1.0."
    )
  width = m.attention_conv
  if width < 0 or width % 2 == 0 and width > 0:
    raise ConfigError(
        f"model.attention_conv={width!r} must be 0 (no convolution) or an odd kernel width, e.g. 3."
    )
  sizes = {field.name: m[field.name] for field in dataclasses.fields(EncoderConfig)}
  discriminator = EncoderConfig(**sizes)
  generator = generator_encoder_config(discriminator, m.generator_fraction)
  # What the attention kernel cannot take, refused before compiling.
  impl, seq_len, dtype = m.attention_impl, config.data.max_seq_len, config.train.dtype
  xla = "or model.attention_impl='xla'"
  if impl == "splash" and seq_len % (tile := splash_attention.SEQ_MULTIPLE):
    below = seq_len - seq_len % tile
    choices = " or ".join(map(str, sorted({max(tile, below), below + tile})))
    raise ConfigError(
        f"model.attention_impl='splash' tiles rows into blocks of {tile} tokens, but "
        f"data.max_seq_len={seq_len} is not a multiple of {tile}: choose e.g. {choices}, {xla}."
    )
  if impl == "cudnn" and dtype != "bfloat16":
    raise ConfigError(
        f"model.attention_impl='cudnn' takes bfloat16 only, not train.dtype={dtype!r}: set "
        f"train.dtype=bfloat16 {xla}."
    )
  if impl in ("cudnn", "splash") and m.attention_dropout_rate > 0:
    raise ConfigError(
        f"model.attention_impl={impl!r} has no attention dropout, but model.attention_dropout_rate="
        f"{m.attention_dropout_rate}: set it to 0.0, {xla} to keep it."
    )
  for tower, cfg in {"discriminator": discriminator, "generator": generator}.items():
    if impl == "cudnn" and (cfg.head_dim % 8 or cfg.head_dim > 256):
      raise ConfigError(
          "model.attention_impl='cudnn' needs a head size that is a multiple of 8 and at most 256 "
          f"(128 before Hopper), but the {tower}'s is {cfg.head_dim}: change hidden_size, "
          f"num_heads or generator_fraction {xla}."
      )
  if impl == "cudnn" and (config.data.pack_rows or towers.cloze) and seq_len % 2:
    raise ConfigError(
        "model.attention_impl='cudnn' with packed rows or Electric needs an even sequence length, "
        f"not data.max_seq_len={seq_len}: make it even {xla}."
    )
  same = "vocab_size embedding_size max_position_embeddings type_vocab_size tie attention_impl"
  return ElectraPretrainer(
      **{key: m[key] for key in same.split()},  # model.* keys named as the fields
      generator_config=generator,
      discriminator_config=discriminator,
      dtype=jnp.dtype(config.train.dtype),
      towers=towers,
      packed=config.data.pack_rows,
  )


class OneTower(EmbeddingSizes):
  """A subclass's `_tower` class over its own embeddings: the pre-trainer's subtree, name for name
  (`config` is the tower's own)."""

  config: EncoderConfig
  dtype: Dtype = jnp.float32
  attention_impl: str = "xla"

  @nn.compact
  def __call__(self, input_ids, attention_mask=None, token_type_ids=None, deterministic=True):
    """Every token real and of type 0 unless `attention_mask` and `token_type_ids` say otherwise."""
    attention_mask = jnp.ones_like(input_ids) if attention_mask is None else attention_mask
    token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    embeddings = encoder.embeddings_for(self, self.embedding_size, self.config, name="embeddings")
    embedded = embeddings(input_ids, token_type_ids, deterministic)
    fields = (self.config, self.embedding_size, self.dtype, self.attention_impl)
    tower = self._tower(*fields, name=self._tower.__name__.lower())
    word_table = (embeddings.word_table(),) if self._tower is Generator else ()
    return tower(embedded, attention_mask, deterministic, *word_table)


class ElectraDiscriminatorModel(OneTower):
  """Parameters {embeddings, discriminator}: [batch, seq] -> float32 "replaced" logits."""

  _tower = Discriminator


class ElectraGeneratorModel(OneTower):
  """Parameters {embeddings, generator}: [batch, seq] -> float32 logits [batch, seq, vocab]."""

  _tower = Generator


class ElectraEncoderModel(OneTower):
  """No head; {embeddings, encoder} (either tower's): [batch, seq] -> [batch, seq, hidden]."""

  _tower = Encoder


TOWER_MODELS = {"discriminator": ElectraDiscriminatorModel, "generator": ElectraGeneratorModel}


def no_standalone_generator(pretrainer: ElectraPretrainer) -> str | None:
  """Why this pre-trainer's generator has no standalone (Hugging Face) form; None if it has."""
  if not pretrainer.towers.has_generator:
    return "This pre-trainer has no generator (its objective runs none)"
  if pretrainer.towers.cloze:
    return "Electric's two-tower cloze generator has no standalone (or Hugging Face) form"
  return None


def tower_from_pretrainer(pretrainer: ElectraPretrainer, params, tower: str):
  """(model, {embeddings, <tower>}) of one tower of an ElectraPretrainer tree: the same arrays, but
  the gdes discriminator's word table is shared + delta, the tie="none" generator's its own."""
  if tower not in TOWER_MODELS:
    raise ConfigError(f"tower={tower!r} is not one of {sorted(TOWER_MODELS)}.")
  if why_not := no_standalone_generator(pretrainer) if tower == "generator" else None:
    raise ConfigError(f"{why_not}; export the discriminator.")
  if not {"embeddings", tower} <= set(params):
    raise ConfigError(
        f"The parameter tree's top level is {sorted(params)}, not an ElectraPretrainer's: pass "
        "state.params, not {'params': ...}."
    )
  tower_config = getattr(pretrainer, f"{tower}_config")
  if tower_config.scan_layers:  # standalone towers use the unscanned layout
    tower_config = dataclasses.replace(tower_config, scan_layers=False)
    params = encoder.unscan_layers(params)
  embeddings, tower_params = params["embeddings"], params[tower]
  embedding_size = pretrainer.embedding_size
  if pretrainer.tie == "all":
    tower_params = {**tower_params, "encoder": params["shared_encoder"]}
  if tower == "discriminator":
    # The standalone discriminator (and transformers' ElectraForPreTraining) has no MLM head.
    tower_params = {k: v for k, v in tower_params.items() if not k.startswith("mlm_")}
  if tower == "generator" and pretrainer.tie == "none":
    embeddings, embedding_size = params["generator_embeddings"], pretrainer.generator_embedding_size
  if tower == "discriminator" and pretrainer.tie == "gdes":
    word_table = embeddings["word_embeddings"]["embedding"] + params["discriminator_word_delta"]
    embeddings = {**embeddings, "word_embeddings": {"embedding": word_table}}
  shared = ("vocab_size", "max_position_embeddings", "type_vocab_size", "dtype", "attention_impl")
  fields = {name: getattr(pretrainer, name) for name in shared}
  model = TOWER_MODELS[tower](**fields, embedding_size=embedding_size, config=tower_config)
  return model, {"embeddings": embeddings, tower: tower_params}
