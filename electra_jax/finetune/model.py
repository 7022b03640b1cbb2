"""The fine-tuning classifier (encoder, pooled -> dropout -> dense) and the backbone it starts from
(a pre-training workdir, a Hugging Face directory or random init) with its tokenizer."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from electra_jax import checkpointing, config_lib, data, objectives, random_ops, resolve
from electra_jax.errors import ConfigError
from electra_jax.encoder import Encoder, EncoderConfig, embeddings_for
from electra_jax.models import ElectraEncoderModel, OneTower, build_model, tower_from_pretrainer

# How the classifier reduces the final hidden states to one vector per example (head.pooling).
POOLINGS = ("cls", "mean")


def sizes_of(model) -> dict[str, int]:
  """The embedding sizes a task model shares with its backbone."""
  sizes = ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size")
  return {key: getattr(model, key) for key in sizes}


def head_dense(
    features: int, dtype, name: str | None = None, fan_out: int | None = None
) -> nn.Dense:
  """A head's dense layer as the official tf.layers.dense: zero bias, TF1's glorot_uniform kernel
  with fan-out `fan_out` if given (each column initialized as its own layer)."""

  def kernel_init(key, shape, dtype=jnp.float32):
    limit = (6.0 / (shape[-2] + (shape[-1] if fan_out is None else fan_out))) ** 0.5
    return jax.random.uniform(key, shape, dtype, -limit, limit)

  kernel = nn.with_logical_partitioning(kernel_init, ("embed", "unmodeled"))
  bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("unmodeled",))
  return nn.Dense(features, dtype=dtype, name=name, kernel_init=kernel, bias_init=bias)


def pool(hidden: jax.Array, attention_mask: jax.Array, pooling: str) -> jax.Array:
  """[batch, seq, hidden] -> [batch, hidden]: the first token's state ("cls"), or the float32 mean
  over the positions where attention_mask is 1 ("mean"; all padding: 0, not NaN)."""
  if pooling == "cls":
    return hidden[:, 0]
  mask = (attention_mask > 0).astype(jnp.float32)[..., None]
  total = jnp.sum(hidden.astype(jnp.float32) * mask, axis=1)
  return (total / jnp.maximum(jnp.sum(mask, axis=1), 1.0)).astype(hidden.dtype)


class EncoderWithHead(OneTower):
  """The discriminator's {embeddings, encoder}, a subclass's `head` on the final hidden states."""

  def setup(self):
    self.embeddings = embeddings_for(self, self.embedding_size, self.config)
    self.encoder = Encoder(self.config, self.embedding_size, self.dtype, self.attention_impl)

  def __call__(self, input_ids, token_type_ids, attention_mask, deterministic: bool = True):
    embedded = self.embeddings(input_ids, token_type_ids, deterministic)
    hidden = self.encoder(embedded, attention_mask, deterministic)
    return self.head(hidden, token_type_ids, attention_mask, deterministic)


class ElectraClassifier(EncoderWithHead, kw_only=True):
  """Parameters {embeddings, encoder, classifier}. [batch, seq] -> float32 [batch, num_outputs]:
  class logits or one regression score (pooled -> dropout -> dense)."""

  num_outputs: int
  head_dropout_rate: float = 0.1
  pooling: str = "cls"

  def setup(self):
    super().setup()
    self.head_dropout = random_ops.Dropout(self.head_dropout_rate)
    self.classifier = head_dense(self.num_outputs, self.dtype)

  def head(self, hidden, token_type_ids, attention_mask, deterministic):
    pooled = self.head_dropout(pool(hidden, attention_mask, self.pooling), deterministic)
    return self.classifier(pooled).astype(jnp.float32)


@dataclasses.dataclass
class Backbone:
  """The encoder a task head goes on: the headless model, its weights and its tokenizer."""

  model: ElectraEncoderModel
  params: dict | None  # {embeddings, encoder}; None: random init
  tokenizer: Any
  source: str  # where the weights came from, for the logs and results

  def task_model(self, module_class, config, **head_fields):
    """`module_class` (ElectraClassifier, SquadModel) on this encoder, config's dropout, dtype."""
    rates = ("dropout_rate", "attention_dropout_rate")
    encoder_config = dataclasses.replace(self.model.config, **{key: config[key] for key in rates})
    dtype = jnp.dtype(config.dtype)
    return module_class(**sizes_of(self.model), config=encoder_config, dtype=dtype, **head_fields)

  def classifier(self, num_outputs: int, config) -> ElectraClassifier:
    """ElectraClassifier on this encoder, with config's dropout, dtype and head."""
    head = dict(head_dropout_rate=config.head_dropout_rate, pooling=config.head.pooling)
    return self.task_model(ElectraClassifier, config, num_outputs=num_outputs, **head)


def _tokenizer_from_file(path: str, lowercase: bool | None, strip_accents: bool | None = None):
  """A sentencepiece .model, or a BERT vocab.txt (lowercase None: True, BERT's uncased default)."""
  if not os.path.isfile(path):
    raise ConfigError(
        f"config.tokenizer={path!r} is not a file; give a sentencepiece .model or a BERT vocab.txt."
    )
  if path.endswith(".model"):
    return data.SentencePieceTokenizer(path)
  return data.WordPieceTokenizer(path, True if lowercase is None else lowercase, strip_accents)


def _from_workdir(config, workdir: str) -> Backbone:
  pretrain_config = config_lib.load_workdir_config(workdir)
  with contextlib.closing(checkpointing.Checkpointer(workdir, keep=1)) as checkpointer:
    step = checkpointer.latest_step(fix="pre-train first, or fix config.init_from")
    meta = checkpointer.read_meta(step)
  if config.tokenizer:
    tokenizer = _tokenizer_from_file(config.tokenizer, config.lowercase)
  else:
    tokenizer = data.workdir_tokenizer(workdir, pretrain_config.data)
  # An imported checkpoint records its vocabulary's fingerprint; a trained one, its data's.
  recorded = meta.get("tokenizer_fingerprint")
  if meta.get("data_fingerprint"):
    parts = [part.partition(":") for part in meta["data_fingerprint"].split("|")]
    recorded = next((value for kind, _, value in parts if kind in ("spm", "wp")), None)
  if recorded is not None and recorded != tokenizer.fingerprint:
    raise ConfigError(
        f"The tokenizer {tokenizer!r} differs from the one the checkpoint in {workdir} was "
        f"pre-trained with (fingerprint {recorded}); leave config.tokenizer empty to use that one."
    )
  pretrainer = build_model(pretrain_config, objectives.towers(pretrain_config))
  source, params = f"random init (sizes of {workdir})", None
  if not config.random_init:
    from electra_jax.interop.export import one_device_setup  # interop only where it is needed

    mesh, setup = one_device_setup(pretrain_config, tokenizer)
    step, state = resolve.restore_checkpoint(workdir, setup, mesh)  # the newest (a live run's)
    source = f"{workdir} step {step}"
    # The standalone discriminator (model.tie resolved), without the RTD head and generator.
    _, tower = tower_from_pretrainer(setup.model, state.params, "discriminator")
    params = {"embeddings": tower["embeddings"], "encoder": tower["discriminator"]["encoder"]}
  encoder_config = dataclasses.replace(pretrainer.discriminator_config, scan_layers=False)
  model = ElectraEncoderModel(**sizes_of(pretrainer), config=encoder_config)
  return Backbone(model, params, tokenizer, source)


def _from_hf(config, path: str) -> Backbone:
  from electra_jax.interop import hf, pretraining  # torch-free, but only needed here

  hf_model, hf_params = hf.load_hf(path)
  tower = hf_params.get("discriminator", hf_params.get("generator", hf_params))
  candidates = [os.path.join(path, name) for name in ("vocab.txt", "spm.model")]  # BERT's, ours
  tokenizer_path = config.tokenizer or next((c for c in candidates if os.path.isfile(c)), "")
  if not tokenizer_path:
    raise ConfigError(
        f"{path} has neither vocab.txt nor spm.model; set config.tokenizer to its vocabulary."
    )
  # How tokenizer_config.json says the text was normalized, unless config.lowercase is set.
  lowercase, strip_accents = pretraining.read_tokenizer_settings(path)
  lowercase = lowercase if config.lowercase is None else config.lowercase
  params = {"embeddings": hf_params["embeddings"], "encoder": tower["encoder"]}
  model = ElectraEncoderModel(**sizes_of(hf_model), config=hf_model.config)
  tokenizer = _tokenizer_from_file(tokenizer_path, lowercase, strip_accents)
  if config.random_init:
    return Backbone(model, None, tokenizer, f"random init (sizes of {path})")
  return Backbone(model, params, tokenizer, f"Hugging Face {path}")


def _from_config(config) -> Backbone:
  if not config.tokenizer:
    raise ConfigError(
        "config.init_from is empty, so the model starts from scratch and needs config.tokenizer (a "
        "sentencepiece .model or a BERT vocab.txt), or set config.init_from to a pre-trained model."
    )
  m = config.model
  sizes = [key for key in m if key != "vocab_size"]  # vocab_size 0: the tokenizer's
  config_lib.check_encoder_sizes(m, sizes, "config.model.", "the random-init model's sizes")
  tokenizer = _tokenizer_from_file(config.tokenizer, config.lowercase)
  encoder = EncoderConfig(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size)
  vocab_size = m.vocab_size or tokenizer.vocab_size
  model = ElectraEncoderModel(vocab_size, m.embedding_size, m.max_position_embeddings, 2, encoder)
  return Backbone(model, None, tokenizer, "random init (config.model)")


def load_backbone(config) -> Backbone:
  """The encoder config.init_from names: a pre-training workdir, a Hugging Face directory, or "" for
  config.model's sizes; config.random_init keeps the sizes and tokenizer, not the weights."""
  init_from = config.init_from
  if not init_from:
    backbone = _from_config(config)
  elif os.path.isdir(os.path.join(init_from, "checkpoints")):
    backbone = _from_workdir(config, init_from)
  elif os.path.isfile(os.path.join(init_from, "config.json")):
    backbone = _from_hf(config, init_from)
  else:
    raise ConfigError(
        f"config.init_from={init_from!r} is neither a pre-training workdir (with checkpoints/) nor "
        "a Hugging Face directory (with config.json)."
    )
  if backbone.tokenizer.vocab_size > backbone.model.vocab_size:
    raise ConfigError(
        f"The tokenizer has {backbone.tokenizer.vocab_size} tokens but the model's vocabulary only "
        f"{backbone.model.vocab_size}; use the tokenizer the model was trained with."
    )
  if config.max_seq_len > backbone.model.max_position_embeddings:
    raise ConfigError(
        f"config.max_seq_len={config.max_seq_len} exceeds the model's max_position_embeddings="
        f"{backbone.model.max_position_embeddings}; lower max_seq_len."
    )
  if config.reinit_layers > backbone.model.config.num_layers:
    raise ConfigError(
        f"config.reinit_layers={config.reinit_layers} exceeds the encoder's "
        f"{backbone.model.config.num_layers} layers; use at most that many."
    )
  return backbone


@functools.lru_cache(maxsize=4)
def _compiled_init(model: nn.Module):
  """One compiled init per model (modules compare by fields), shared by all seeds and trials."""
  return jax.jit(model.init)


def init_params(backbone: Backbone, model, rng: jax.Array, seq_len: int, reinit_layers: int = 0):
  """Fresh parameters for `model`, the backbone's weights (if any) in the embeddings and encoder
  but for the top `reinit_layers` layers (and a pre-LN final LayerNorm with them)."""
  ids = jnp.zeros((1, seq_len), jnp.int32)
  params = nn.meta.unbox(_compiled_init(model)(rng, ids, ids, jnp.ones_like(ids))["params"])
  if backbone.params is not None:
    # Copies: the training step donates its parameters, and the next seed starts from these.
    pretrained = jax.tree.map(lambda x: jnp.array(x, copy=True), nn.meta.unbox(backbone.params))
    num_layers = backbone.model.config.num_layers
    fresh = {f"layer_{i}" for i in range(num_layers - reinit_layers, num_layers)}
    fresh |= {"final_layer_norm"} if reinit_layers else set()
    params["embeddings"] = pretrained["embeddings"]
    params["encoder"] = {
        key: params["encoder"][key] if key in fresh else value
        for key, value in pretrained["encoder"].items()
    }
  return params
