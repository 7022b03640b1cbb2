"""Hugging Face ELECTRA directories (config.json, model.safetensors or pytorch_model.bin read with
weights_only=True, possibly sharded) read as, and written from, electra-jax's standalone models."""

import json
import os
import pathlib
import re
from typing import Any

import flax
import flax.linen as nn
import jax
import numpy as np
import safetensors
import safetensors.numpy

from electra_jax import models, workdir_files
from electra_jax.data import sources
from electra_jax.encoder import EncoderConfig
from electra_jax.errors import ConfigError

# Each kind of standalone model: its transformers class and ours (ElectraModel has no head).
KINDS = {
    "discriminator": ("ElectraForPreTraining", models.ElectraDiscriminatorModel),
    "generator": ("ElectraForMaskedLM", models.ElectraGeneratorModel),
    "encoder": ("ElectraModel", models.ElectraEncoderModel),
}

# config.json's keys: transformers.ElectraConfig's default (ELECTRA-Small's), the EncoderConfig
# field it fills (None: the model's own), and the (tensor, axis) whose size it is, if one is.
CONFIG_KEYS = {
    "vocab_size": (30522, None, ("embeddings.word_embeddings.weight", 0)),
    "embedding_size": (128, None, ("embeddings.word_embeddings.weight", 1)),
    "hidden_size": (256, "hidden_size", ("encoder.layer.0.attention.self.query.weight", 0)),
    "num_hidden_layers": (12, "num_layers", None),
    "num_attention_heads": (4, "num_heads", None),
    "intermediate_size": (1024, "intermediate_size", ("encoder.layer.0.output.dense.weight", 1)),
    "max_position_embeddings": (512, None, ("embeddings.position_embeddings.weight", 0)),
    "type_vocab_size": (2, None, ("embeddings.token_type_embeddings.weight", 0)),
    "hidden_dropout_prob": (0.1, "dropout_rate", None),
    "attention_probs_dropout_prob": (0.1, "attention_dropout_rate", None),
    "layer_norm_eps": (1e-12, "layer_norm_eps", None),
}
MODEL_KEYS = [key for key, (_, field, _) in CONFIG_KEYS.items() if field is None]
ENCODER_FIELDS = {key: field for key, (_, field, _) in CONFIG_KEYS.items() if field}

# Config values electra-jax computes only one way: that value, and why any other is refused.
SUPPORTED_CONFIG_VALUES = {
    "model_type": ("electra", "only ELECTRA checkpoints can be read"),
    "hidden_act": ("gelu", "electra-jax's GELU is the exact (erf) one, not a tanh approximation"),
    "position_embedding_type": ("absolute", "electra-jax learns absolute positions only"),
    "is_decoder": (False, "electra-jax's encoder attends in both directions"),
    "add_cross_attention": (False, "electra-jax's encoder has no cross-attention"),
}

# Encoder options ElectraModel cannot hold: (EncoderConfig field, its only Hugging Face value, why).
HF_ENCODER_FORM = (
    ("norm", "post", "it is post-LayerNorm only"),
    ("ffn", "gelu", "its feed-forward is dense + GELU + dense, without a gate"),
    ("use_bias", True, "every dense layer of its encoder has a bias"),
    ("attention_conv", 0, "its attention has no convolution"),
)


def check_hf_form(tower: EncoderConfig) -> None:
  """Refuses, one line per option, each HF_ENCODER_FORM option that no ElectraModel can hold."""
  lines = [
      f"model.{field}={getattr(tower, field)!r} has no Hugging Face ElectraModel form ({why}); "
      "fine-tune or evaluate it in electra-jax instead."
      for field, value, why in HF_ENCODER_FORM
      if getattr(tower, field) != value
  ]
  if lines:
    raise ConfigError("\n".join(lines))


def weight_names(kind: str, num_layers: int, projected: bool) -> dict[str, tuple[str, ...]]:
  """transformers' name (without "electra.") -> our path of every tensor of a standalone `kind`
  tower, in transformers' order; `projected`: embedding_size != hidden_size."""
  names = {}

  def dense(hf_name, path, weight="kernel"):  # weight="scale": a LayerNorm
    names.update({f"{hf_name}.weight": (*path, weight), f"{hf_name}.bias": (*path, "bias")})

  for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
    names[f"embeddings.{table}.weight"] = ("embeddings", table, "embedding")
  dense("embeddings.LayerNorm", ("embeddings", "layer_norm"), "scale")
  encoder = ("encoder",) if kind == "encoder" else (kind, "encoder")
  if projected:
    dense("embeddings_project", (*encoder, "embeddings_project"))
  for i in range(num_layers):
    hf_layer, layer = f"encoder.layer.{i}", (*encoder, f"layer_{i}")
    for projection in ("query", "key", "value"):
      dense(f"{hf_layer}.attention.self.{projection}", (*layer, "attention", projection))
    dense(f"{hf_layer}.attention.output.dense", (*layer, "attention", "output"))
    dense(f"{hf_layer}.attention.output.LayerNorm", (*layer, "attention_layer_norm"), "scale")
    dense(f"{hf_layer}.intermediate.dense", (*layer, "intermediate"))
    dense(f"{hf_layer}.output.dense", (*layer, "output"))
    dense(f"{hf_layer}.output.LayerNorm", (*layer, "output_layer_norm"), "scale")
  if kind == "discriminator":
    dense("discriminator_predictions.dense", ("discriminator", "head_dense"))
    dense("discriminator_predictions.dense_prediction", ("discriminator", "head_out"))
  elif kind == "generator":
    dense("generator_predictions.dense", ("generator", "head_dense"))
    dense("generator_predictions.LayerNorm", ("generator", "head_layer_norm"), "scale")
    # The decoder's weight is the word table (tied); only its bias is the generator's own.
    names["generator_lm_head.bias"] = ("generator", "output_bias")
  return names


def flip(path: tuple[str, ...], array):
  """A kernel is [in, out] here, [out, in] in transformers: transposed; any other array as is."""
  return array.T if path[-1] == "kernel" else array


def kind_of(model) -> str:
  for kind, (_, model_class) in KINDS.items():
    if isinstance(model, model_class):
      return kind
  names = [model_class.__name__ for _, model_class in KINDS.values()]
  raise ConfigError(f"{type(model).__name__} has no Hugging Face form; pass one of {names}.")


def _layout(kind: str, model):
  """(weight_names, {path: shape}) of a standalone model's parameters."""
  abstract = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 1), np.int32))["params"]
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(abstract))
  projected = model.embedding_size != model.config.hidden_size
  names = weight_names(kind, model.config.num_layers, projected)
  return names, {path: tuple(leaf.shape) for path, leaf in flat.items()}


def sizes_held(weights: dict[str, np.ndarray]) -> dict[str, int]:
  """The config.json sizes that transformers-layout `weights` show (those they hold tensors for)."""
  shapes = {name.removeprefix("electra."): np.shape(array) for name, array in weights.items()}
  held = {
      key: shapes[held[0]][held[1]]
      for key, (_, _, held) in CONFIG_KEYS.items()
      if held and held[0] in shapes
  }
  layers = {int(m.group(1)) for name in shapes if (m := re.match(r"encoder\.layer\.(\d+)\.", name))}
  return {**held, "num_hidden_layers": len(layers)} if layers else held


def _mismatch(expected: dict[str, tuple[int, ...]], given: dict[str, Any]) -> str:
  """'missing: [...]; unexpected: [...]' of names with shapes (`given` holds arrays); '' if equal."""
  want = {f"{name} {tuple(shape)}" for name, shape in expected.items()}
  have = {f"{name} {tuple(np.shape(array))}" for name, array in given.items()}
  return "; ".join(
      f"{what}: {names[:8]}{' ...' if len(names) > 8 else ''}"
      for what, names in (("missing", sorted(want - have)), ("unexpected", sorted(have - want)))
      if names
  )


def model_from_hf_config(hf_config: dict[str, Any], source: str):
  """(kind, model) for a transformers ELECTRA config dict; refuses, naming the key (and `source`),
  whatever the model could not compute exactly."""
  for key, (supported, why) in SUPPORTED_CONFIG_VALUES.items():
    if hf_config.get(key, supported) != supported:
      raise ConfigError(f"{source}: {key}={hf_config[key]!r}, not {supported!r}: {why}.")
  architectures = hf_config.get("architectures")
  kind = next((kind for kind, (name, _) in KINDS.items() if architectures == [name]), None)
  if kind is None:
    raise ConfigError(
        f"{source}: architectures={architectures!r} must be one of {[n for n, _ in KINDS.values()]}"
        "; of a fine-tuned model, save_pretrained its `.electra` submodule (the encoder)."
    )
  value = {}
  for key, (default, _, _) in CONFIG_KEYS.items():
    number = value[key] = hf_config.get(key, default)
    if type(default) is int and (type(number) is not int or number < 1):
      raise ConfigError(f"{source}: {key}={number!r} must be a positive whole number.")
    if type(default) is float and not (type(number) in (int, float) and 0 <= number < 1):
      raise ConfigError(f"{source}: {key}={number!r} must be a number in [0, 1).")
  if value["hidden_size"] % value["num_attention_heads"]:
    raise ConfigError(
        f"{source}: hidden_size={value['hidden_size']} is not divisible by "
        f"num_attention_heads={value['num_attention_heads']}."
    )
  encoder = EncoderConfig(**{field: value[key] for key, field in ENCODER_FIELDS.items()})
  return kind, KINDS[kind][1](**{key: value[key] for key in MODEL_KEYS}, config=encoder)


def hf_config_of(model, kind: str, pad_token_id: int) -> dict[str, Any]:
  """The config.json of a standalone model, as transformers.ElectraConfig reads it."""
  return {
      **{key: getattr(model, key) for key in MODEL_KEYS},
      **{key: getattr(model.config, field) for key, field in ENCODER_FIELDS.items()},
      **{key: value for key, (value, _) in SUPPORTED_CONFIG_VALUES.items()},
      "architectures": [KINDS[kind][0]],
      "initializer_range": 0.02,
      "pad_token_id": pad_token_id,
      "tie_word_embeddings": True,
      "dtype": "float32",
  }


def params_from_hf_weights(model, kind: str, weights: dict, source: str, decoder_tied=True):
  """Our float32 parameter tree from transformers tensors, every name and shape checked; a stored
  decoder (needed when `decoder_tied`, tie_word_embeddings, is false) must equal the word table."""
  by_name = {key.removeprefix("electra."): array for key, array in weights.items()}
  if len(by_name) != len(weights):
    raise ConfigError(f"{source}: a tensor is stored twice, with and without 'electra.'.")
  for buffer in ("embeddings.position_ids", "embeddings.token_type_ids"):  # older transformers'
    by_name.pop(buffer, None)
  decoder = by_name.pop("generator_lm_head.weight", None) if kind == "generator" else None

  names, shapes = _layout(kind, model)
  expected = {n: shapes[p][:: -1 if p[-1] == "kernel" else 1] for n, p in names.items()}
  if mismatch := _mismatch(expected, by_name):
    raise ConfigError(
        f"{source}: the weights do not match an {KINDS[kind][0]} with this config.json "
        f'({mismatch}). Check that "architectures" and num_hidden_layers describe these weights.'
    )
  flat = {
      p: np.ascontiguousarray(flip(p, finite_tensor(n, by_name[n], source)), np.float32)
      for n, p in names.items()
  }
  if kind == "generator" and (decoder is not None or not decoder_tied):
    word_table = flat[("embeddings", "word_embeddings", "embedding")]
    if decoder is None or not np.array_equal(decoder.astype(np.float32), word_table):
      why = "is absent (tie_word_embeddings=false)" if decoder is None else "differs"
      raise ConfigError(
          f"{source}: generator_lm_head.weight {why}: electra-jax's generator ties it to the "
          "word embeddings, as ELECTRA does, and cannot hold an untied decoder."
      )
  return flax.traverse_util.unflatten_dict(flat)


def hf_weights_from_params(model, kind: str, params) -> dict[str, np.ndarray]:
  """transformers' tensors (float32, contiguous, full names) from our parameter tree."""
  flat = flax.traverse_util.flatten_dict(jax.device_get(nn.meta.unbox(params)))
  names, shapes = _layout(kind, model)
  joined = lambda tree: {"/".join(path): value for path, value in tree.items()}
  if mismatch := _mismatch(joined(shapes), joined(flat)):
    raise ConfigError(
        f"The parameters do not match the {type(model).__name__} ({mismatch}); pass its "
        "variables['params'], or a pre-training state's with the ElectraPretrainer and kind=."
    )
  heads = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.")
  full = {n: n if kind == "encoder" or n.startswith(heads) else f"electra.{n}" for n in names}
  return {full[n]: np.ascontiguousarray(flip(p, flat[p]), np.float32) for n, p in names.items()}


def _regular_file(path: str) -> bool:
  """Whether `path` exists; refused when it is not a regular file (a FIFO would wait forever)."""
  problem = sources.not_a_regular_file(path)
  if problem not in (None, "does not exist"):
    raise ConfigError(f"Refusing {path}: it {problem}; put the file save_pretrained wrote there.")
  return problem is None


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  # Through jax rather than numpy, which has no bfloat16; on the host, whatever the backend.
  try:
    with jax.default_device(jax.devices("cpu")[0]):
      with safetensors.safe_open(path, framework="flax") as tensors:
        return {name: np.asarray(tensors.get_tensor(name)) for name in tensors.keys()}
  except (safetensors.SafetensorError, OSError) as error:
    raise ConfigError(f"{path} is not a readable safetensors file: {error}") from error


def finite_tensor(name: str, array: np.ndarray, source: str) -> np.ndarray:
  """`array`, refused unless its values are finite floating-point numbers."""
  if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
    raise ConfigError(
        f"Refusing {source}: tensor {name!r} has dtype {array.dtype}, not floating point (a "
        "quantized or damaged checkpoint); use one saved in float32, float16 or bfloat16."
    )
  finite = np.isfinite(array)
  if not finite.all():
    raise ConfigError(
        f"Refusing {source}: tensor {name!r} holds {finite.size - int(finite.sum())} NaN or "
        f"infinite values of {finite.size} (trained into NaN, or damaged); use a good checkpoint."
    )
  return array


def _read_torch_state_dict(path: str) -> dict[str, np.ndarray]:
  """A flat dict of str -> tensor, read with weights_only=True: no pickled code runs."""
  try:
    import torch  # noqa: PLC0415 (only pytorch_model.bin needs it)
  except ImportError as error:
    raise ConfigError(
        f"{path} is a PyTorch file: reading it needs torch (pip install torch), or save the model "
        "again with transformers' save_pretrained (model.safetensors)."
    ) from error
  fix = "Save model.state_dict(), or use safetensors."
  try:
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as error:  # pickle.UnpicklingError for anything but tensors, or a bad file
    first_line = (str(error).splitlines() or [""])[0]
    raise ConfigError(
        f"Refusing {path}: torch.load(weights_only=True) cannot read it as plain tensors "
        f"({type(error).__name__}: {first_line}). {fix}"
    ) from error
  if not isinstance(state_dict, dict):
    raise ConfigError(f"Refusing {path}: it holds a {type(state_dict).__name__!r} object. {fix}")
  for name, tensor in state_dict.items():
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
      raise ConfigError(
          f"Refusing {path}: entry {name!r} is not a str -> torch.Tensor (its types are "
          f"{type(name).__name__}, {type(tensor).__name__}). {fix}"
      )
  return {
      name: (tensor.detach().to(torch.float32) if tensor.is_floating_point() else tensor).numpy()
      for name, tensor in state_dict.items()
  }


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a transformers directory: model.safetensors (preferred) or pytorch_model.bin
  (read with weights_only=True), either possibly sharded (its .index.json names the shards)."""
  for file_name, reader in (
      ("model.safetensors", _read_safetensors),
      ("pytorch_model.bin", _read_torch_state_dict),
  ):
    path = os.path.join(directory, file_name)
    if _regular_file(path):
      return reader(path)
    index_path = path + ".index.json"
    if _regular_file(index_path):
      break
  else:
    raise ConfigError(
        f"{directory} has no model.safetensors or pytorch_model.bin (nor a sharded index of "
        "either); give the folder transformers' save_pretrained wrote."
    )
  weight_map = read_json_object(index_path).get("weight_map")
  if not isinstance(weight_map, dict) or not all(type(v) is str for v in weight_map.values()):
    raise ConfigError(f'Refusing {index_path}: its "weight_map" is not tensor name -> shard file.')
  weights = {}
  for shard_name in sorted(set(weight_map.values())):
    shard = os.path.join(directory, shard_name)
    if os.path.basename(shard) != shard_name or not _regular_file(shard):
      raise ConfigError(f"Refusing {index_path}: shard {shard_name!r} is not a file beside it.")
    weights.update(reader(shard))
  return weights


def read_json_object(path: str) -> dict:
  """The JSON object in `path` (a UTF-8 BOM allowed), refused by name when it holds none."""
  try:
    value = json.loads(pathlib.Path(path).read_text(encoding="utf-8-sig"))
  except (ValueError, OSError) as error:
    raise ConfigError(f"{path} is not a readable JSON file ({error}).") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object.")
  return value


def load_hf(path: str):
  """(model, params) from a transformers ELECTRA directory, float32: the KINDS model of its
  architecture (ElectraForPreTraining, ElectraForMaskedLM or ElectraModel)."""
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise ConfigError(f"{path} has no config.json; point load_hf at what save_pretrained wrote.")
  hf_config = read_json_object(config_path)
  weights = read_hf_weights(path)
  kind, model = model_from_hf_config(hf_config, config_path)
  for key, actual in sizes_held(weights).items():  # named by the key, before any tensor is matched
    if (stated := hf_config.get(key, CONFIG_KEYS[key][0])) != actual:
      raise ConfigError(
          f"{config_path}: {key}={stated!r}, but the weight files hold {actual}; this config.json "
          "is not the one these weights were saved with."
      )
  decoder_tied = hf_config.get("tie_word_embeddings", True) is not False
  return model, params_from_hf_weights(model, kind, weights, path, decoder_tied)


def save_hf(model, params, out_dir: str, kind: str | None = None, pad_token_id: int = 0) -> str:
  """Writes config.json and model.safetensors to `out_dir` for from_pretrained; `model` is a
  standalone model, or an ElectraPretrainer whose tower `kind` picks. Returns `out_dir`."""
  if isinstance(model, models.ElectraPretrainer):
    model, params = models.tower_from_pretrainer(model, params, kind)
  model_kind = kind_of(model)
  check_hf_form(model.config)
  if kind not in (None, model_kind):
    raise ConfigError(
        f"kind={kind!r} does not match the {type(model).__name__} (a {model_kind}); leave kind "
        "out or pass the matching model."
    )
  tensors = hf_weights_from_params(model, model_kind, params)
  config = hf_config_of(model, model_kind, pad_token_id)
  workdir_files.write_json(os.path.join(out_dir, "config.json"), config)  # makes out_dir
  # The metadata save_pretrained writes; transformers 4.x checks it when loading.
  path = os.path.join(out_dir, "model.safetensors")
  workdir_files.write_bytes(path, safetensors.numpy.save(tensors, metadata={"format": "pt"}))
  return out_dir
