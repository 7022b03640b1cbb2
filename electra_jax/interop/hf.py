"""Hugging Face `transformers` ELECTRA directories (config.json plus model.safetensors, or pytorch_model.bin
through torch.load(weights_only=True)) read as, and written from, electra-jax's standalone models.
"""

import collections
import json
import math
import os
import pathlib
import re
import shutil
from typing import Any

import flax
import flax.linen as nn
import jax
import numpy as np
import safetensors
import safetensors.numpy

from electra_jax import models, workdir_files
from electra_jax.encoder import EncoderConfig
from electra_jax.errors import ConfigError

# The transformers classes we read and write, and what each is here (ElectraModel has no head).
ARCHITECTURES = {
    "ElectraForPreTraining": "discriminator",
    "ElectraForMaskedLM": "generator",
    "ElectraModel": "encoder",
}
ARCHITECTURE_OF_KIND = {kind: architecture for architecture, kind in ARCHITECTURES.items()}
MODEL_CLASSES = {
    "discriminator": models.ElectraDiscriminatorModel,
    "generator": models.ElectraGeneratorModel,
    "encoder": models.ElectraEncoderModel,
}

# transformers.ElectraConfig's defaults (ELECTRA-Small's sizes), for keys a config.json omits.
HF_CONFIG_DEFAULTS = {
    "vocab_size": 30522,
    "embedding_size": 128,
    "hidden_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "layer_norm_eps": 1e-12,
}
# The keys that fill the EncoderConfig, with its field for each; the other keys are the model's own.
ENCODER_FIELDS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "hidden_dropout_prob": "dropout_rate",
    "attention_probs_dropout_prob": "attention_dropout_rate",
    "layer_norm_eps": "layer_norm_eps",
}
MODEL_KEYS = [key for key in HF_CONFIG_DEFAULTS if key not in ENCODER_FIELDS]

# Config values electra-jax computes only one way: that value, and why any other is refused.
SUPPORTED_CONFIG_VALUES = {
    "hidden_act": (
        "gelu",
        'electra-jax\'s encoder uses the exact (erf) GELU, which transformers calls "gelu" '
        '("gelu_new" and "gelu_pytorch_tanh" are the tanh approximation)',
    ),
    "position_embedding_type": ("absolute", "electra-jax has learned absolute positions only"),
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


# Buffers older transformers saved with the weights: arange(seq) and zeros, here as there.
_IGNORED_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
_BACKBONE_PREFIX = "electra."
_HEAD_PREFIXES = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.")
_TIED_DECODER = "generator_lm_head.weight"
_PAD_ID = 0  # [PAD] is id 0 in every electra-jax tokenizer


# transformers' name (without "electra."), our path, and whether it is a kernel ([in, out] here, [out, in] there).
WeightName = collections.namedtuple("WeightName", "hf_name path transposed")


def weight_names(kind: str, num_layers: int, projected: bool) -> list[WeightName]:
  """Every tensor of a standalone `kind` tower, in transformers' order; `projected`: embedding_size != hidden_size."""
  names = []

  def dense(hf_name, path, weight="kernel"):  # weight="scale": a LayerNorm
    names.append(WeightName(f"{hf_name}.weight", (*path, weight), weight == "kernel"))
    names.append(WeightName(f"{hf_name}.bias", (*path, "bias"), False))

  for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
    names.append(
        WeightName(f"embeddings.{table}.weight", ("embeddings", table, "embedding"), False)
    )
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
    names.append(WeightName("generator_lm_head.bias", ("generator", "output_bias"), False))
  return names


def _model_weight_names(kind: str, model) -> list[WeightName]:
  return weight_names(
      kind, model.config.num_layers, model.embedding_size != model.config.hidden_size
  )


def kind_of(model) -> str:
  kind = next(
      (kind for kind, model_class in MODEL_CLASSES.items() if isinstance(model, model_class)), None
  )
  if kind:
    return kind
  raise ConfigError(
      f"{type(model).__name__} has no Hugging Face counterpart; pass an ElectraDiscriminatorModel, "
      "ElectraGeneratorModel, ElectraEncoderModel or ElectraPretrainer."
  )


def _param_shapes(model) -> dict[tuple[str, ...], tuple[int, ...]]:
  abstract = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 1), np.int32))["params"]
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(abstract))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


# The config.json sizes a tensor's shape (transformers' layout) shows: (tensor, axis).
_SIZES_HELD = {
    "vocab_size": ("embeddings.word_embeddings.weight", 0),
    "embedding_size": ("embeddings.word_embeddings.weight", 1),
    "hidden_size": ("encoder.layer.0.attention.self.query.weight", 0),
    "intermediate_size": ("encoder.layer.0.intermediate.dense.weight", 0),
    "max_position_embeddings": ("embeddings.position_embeddings.weight", 0),
    "type_vocab_size": ("embeddings.token_type_embeddings.weight", 0),
}


def sizes_held(weights: dict[str, np.ndarray]) -> dict[str, int]:
  """The config.json sizes that transformers-layout `weights` show (those they hold tensors for)."""
  shapes = {name.removeprefix(_BACKBONE_PREFIX): np.shape(array) for name, array in weights.items()}
  held = {key: shapes[name][axis] for key, (name, axis) in _SIZES_HELD.items() if name in shapes}
  layers = {int(m.group(1)) for name in shapes if (m := re.match(r"encoder\.layer\.(\d+)\.", name))}
  return {**held, "num_hidden_layers": len(layers)} if layers else held


def _mismatch(expected: dict[str, tuple[int, ...]], given: dict[str, Any]) -> str:
  """ "missing: [...]; unexpected: [...]" between names with their shapes (`given` holds arrays), "" when equal."""
  want = {f"{name} {tuple(shape)}" for name, shape in expected.items()}
  have = {f"{name} {tuple(np.shape(array))}" for name, array in given.items()}
  missing, unexpected = sorted(want - have), sorted(have - want)
  if not missing and not unexpected:
    return ""
  return "; ".join(
      f"{what}: {names[:8] or 'none'}{' ...' if len(names) > 8 else ''}"
      for what, names in (("missing", missing), ("unexpected", unexpected))
  )


def model_from_hf_config(hf_config: dict[str, Any], source: str = "config.json"):
  """(kind, model) for a transformers ELECTRA config dict; refuses, naming the key (and `source`), whatever
  the model could not compute exactly."""
  if hf_config.get("model_type", "electra") != "electra":
    raise ConfigError(
        f"{source}: model_type={hf_config['model_type']!r} is not \"electra\"; only ELECTRA "
        "checkpoints can be read."
    )
  architectures = hf_config.get("architectures")
  if (
      not isinstance(architectures, list)
      or len(architectures) != 1
      or architectures[0] not in ARCHITECTURES
  ):
    raise ConfigError(
        f"{source}: architectures={architectures!r} must name exactly one of {sorted(ARCHITECTURES)}. "
        "To keep only the encoder of a fine-tuned model, save_pretrained its `.electra` submodule."
    )
  kind = ARCHITECTURES[architectures[0]]
  for key, (supported, why) in SUPPORTED_CONFIG_VALUES.items():
    if key in hf_config and hf_config[key] != supported:
      raise ConfigError(
          f"{source}: {key}={hf_config[key]!r} is not supported, only {key}={supported!r}: "
          f"{why}. This checkpoint cannot be converted exactly."
      )
  value = {key: hf_config.get(key, default) for key, default in HF_CONFIG_DEFAULTS.items()}
  for key, default in HF_CONFIG_DEFAULTS.items():
    number = value[key]
    if type(default) is int and (type(number) is not int or number < 1):
      raise ConfigError(f"{source}: {key}={number!r} must be a positive whole number.")
    if type(default) is float and (
        type(number) not in (int, float) or not (math.isfinite(number) and 0 <= number < 1)
    ):
      raise ConfigError(f"{source}: {key}={number!r} must be a number in [0, 1).")
  if value["hidden_size"] % value["num_attention_heads"]:
    raise ConfigError(
        f"{source}: hidden_size={value['hidden_size']} is not divisible by "
        f"num_attention_heads={value['num_attention_heads']}."
    )
  encoder_config = EncoderConfig(**{field: value[key] for key, field in ENCODER_FIELDS.items()})
  return kind, MODEL_CLASSES[kind](**{key: value[key] for key in MODEL_KEYS}, config=encoder_config)


def hf_config_of(model, kind: str, pad_token_id: int = _PAD_ID) -> dict[str, Any]:
  """The config.json of a standalone model, as transformers.ElectraConfig reads it."""
  return {
      **{key: getattr(model, key) for key in MODEL_KEYS},
      **{key: getattr(model.config, field) for key, field in ENCODER_FIELDS.items()},
      "architectures": [ARCHITECTURE_OF_KIND[kind]],
      "model_type": "electra",
      "hidden_act": "gelu",
      "initializer_range": 0.02,
      "pad_token_id": pad_token_id,
      "tie_word_embeddings": True,
      "dtype": "float32",
  }


def params_from_hf_weights(
    model, kind: str, weights: dict[str, np.ndarray], source: str, decoder_tied: bool = True
):
  """Our parameter tree (float32 numpy leaves) from transformers tensors, every name and shape checked.
  `decoder_tied`: config.json's tie_word_embeddings (false: the decoder must be stored); a stored decoder must
  equal the word table."""
  by_name = {}
  for key, array in weights.items():
    name = key.removeprefix(_BACKBONE_PREFIX)
    if name in by_name:
      raise ConfigError(
          f"{source}: {name!r} is stored twice, with and without {_BACKBONE_PREFIX!r}."
      )
    by_name[name] = array
  for buffer in _IGNORED_BUFFERS:
    by_name.pop(buffer, None)
  tied_decoder = by_name.pop(_TIED_DECODER, None) if kind == "generator" else None

  names, shapes = _model_weight_names(kind, model), _param_shapes(model)
  mismatch = _mismatch(
      {w.hf_name: shapes[w.path][::-1] if w.transposed else shapes[w.path] for w in names}, by_name
  )
  if mismatch:
    raise ConfigError(
        f"{source}: the weights do not match an {ARCHITECTURE_OF_KIND[kind]} with this config.json "
        f'({mismatch}). Check that "architectures" and num_hidden_layers describe these weights.'
    )
  flat = {
      w.path: np.ascontiguousarray(
          by_name[w.hf_name].T if w.transposed else by_name[w.hf_name], dtype=np.float32
      )
      for w in names
  }
  if kind == "generator":
    word_table = flat[("embeddings", "word_embeddings", "embedding")]
    if tied_decoder is None and not decoder_tied:
      raise ConfigError(
          f"{source}: tie_word_embeddings=false but the weights hold no {_TIED_DECODER}; "
          "electra-jax's generator needs its decoder tied to the word embeddings."
      )
    if tied_decoder is not None and not np.array_equal(tied_decoder.astype(np.float32), word_table):
      raise ConfigError(
          f"{source}: {_TIED_DECODER} differs from electra.embeddings.word_embeddings.weight; "
          "electra-jax's generator ties them, as ELECTRA does, and cannot hold an untied decoder."
      )
  return flax.traverse_util.unflatten_dict(flat)


def hf_weights_from_params(model, kind: str, params) -> dict[str, np.ndarray]:
  """transformers' tensors (float32, contiguous, full names) from our parameter tree."""
  flat = flax.traverse_util.flatten_dict(jax.device_get(nn.meta.unbox(params)))
  mismatch = _mismatch(
      {"/".join(p): shape for p, shape in _param_shapes(model).items()},
      {"/".join(p): array for p, array in flat.items()},
  )
  if mismatch:
    hint = " Pass variables['params'], not the variables dict." if "params" in params else ""
    raise ConfigError(
        f"The parameters do not match the {type(model).__name__} ({mismatch}).{hint} For a pre-training "
        "state pass the ElectraPretrainer and kind='discriminator' or 'generator'."
    )
  tensors = {}
  for w in _model_weight_names(kind, model):
    array = np.asarray(flat[w.path], dtype=np.float32)
    prefix = "" if kind == "encoder" or w.hf_name.startswith(_HEAD_PREFIXES) else _BACKBONE_PREFIX
    tensors[prefix + w.hf_name] = np.ascontiguousarray(array.T if w.transposed else array)
  return tensors


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  # Through jax rather than numpy, which has no bfloat16; on the host, whatever the backend.
  try:
    with jax.default_device(jax.devices("cpu")[0]):
      with safetensors.safe_open(path, framework="flax") as tensors:
        return {name: np.asarray(tensors.get_tensor(name)) for name in tensors.keys()}
  except (safetensors.SafetensorError, OSError) as error:
    raise ConfigError(f"{path} is not a readable safetensors file: {error}") from error


def _read_torch_state_dict(path: str) -> dict[str, np.ndarray]:
  """Only a flat dict of str -> tensor, read with weights_only=True: no pickled code runs."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ConfigError(
        f"{path} is a PyTorch file and reading it needs torch (pip install torch); or save the "
        "model again with safe_serialization (model.safetensors), which needs no torch."
    ) from error
  try:
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as error:  # pickle.UnpicklingError for anything but tensors, or a bad file
    raise ConfigError(
        f"Refusing {path}: torch.load(weights_only=True) cannot read it as plain tensors "
        f"({type(error).__name__}: {(str(error).splitlines() or [''])[0]}). Save model.state_dict() "
        "or use safetensors."
    ) from error
  if not isinstance(state_dict, dict):
    raise ConfigError(
        f"Refusing {path}: it holds a {type(state_dict).__name__!r} object, not a state dict "
        "(str -> torch.Tensor). Save model.state_dict() or use safetensors."
    )
  for name, tensor in state_dict.items():
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
      wrong = (
          f"key {name!r} is not a str"
          if not isinstance(name, str)
          else (f"entry {name!r} is not a torch.Tensor (its type is {type(tensor).__name__})")
      )
      raise ConfigError(
          f"Refusing {path}: {wrong}; only a state dict (str -> torch.Tensor) is accepted. "
          "Save model.state_dict() or use safetensors."
      )
  return {
      name: tensor.detach().to(torch.float32).numpy()
      if tensor.is_floating_point()
      else tensor.numpy()
      for name, tensor in state_dict.items()
  }


def finite_tensor(name: str, array: np.ndarray, source: str) -> np.ndarray:
  """`array`, refused when it holds a NaN or an infinity."""
  if array.dtype.kind in "fc" or array.dtype.name == "bfloat16":
    finite = np.isfinite(array)
    if not finite.all():
      raise ConfigError(
          f"Refusing {source}: tensor {name!r} holds {finite.size - int(finite.sum())} NaN or "
          f"infinite values of {finite.size} (trained into NaN, or damaged); use a good checkpoint."
      )
  return array


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a transformers directory: model.safetensors (preferred) or pytorch_model.bin, either
  possibly sharded (*.index.json). Refuses NaN and infinite weights."""
  for file_name, reader in (
      ("model.safetensors", _read_safetensors),
      ("pytorch_model.bin", _read_torch_state_dict),
  ):
    path = os.path.join(directory, file_name)
    if os.path.exists(path):
      return {name: finite_tensor(name, array, path) for name, array in reader(path).items()}
    index_path = path + ".index.json"
    if os.path.exists(index_path):
      try:
        shard_names = sorted(
            set(json.loads(pathlib.Path(index_path).read_text())["weight_map"].values())
        )
      except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(
            f"Refusing {index_path}: not a sharded-checkpoint index ({type(error).__name__}: "
            f'{error}); it needs a "weight_map" of tensor name -> shard file.'
        ) from None
      bad = [name for name in shard_names if os.path.basename(name) != name]
      if bad:
        raise ConfigError(
            f"Refusing {index_path}: shard {bad[0]!r} is not a file name in {directory}."
        )
      weights = {}
      for shard_name in shard_names:
        weights.update(reader(os.path.join(directory, shard_name)))
      return {name: finite_tensor(name, array, index_path) for name, array in weights.items()}
  raise ConfigError(
      f"{directory} has no model.safetensors or pytorch_model.bin (nor a sharded index of "
      "either): point load_hf at a directory written by save_pretrained."
  )


def load_hf(path: str):
  """(model, params) from a transformers ELECTRA directory: the MODEL_CLASSES model of its architecture
  (ElectraForPreTraining: discriminator, ElectraForMaskedLM: generator, ElectraModel: encoder), float32.
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise ConfigError(
        f"{path} has no config.json; point load_hf at a directory written by save_pretrained "
        "(or save_hf)."
    )
  try:
    hf_config = json.loads(pathlib.Path(config_path).read_text(encoding="utf-8-sig"))
  except (ValueError, OSError) as error:
    raise ConfigError(f"{config_path} is not a readable JSON file ({error}).") from None
  if not isinstance(hf_config, dict):
    raise ConfigError(
        f"{config_path} holds a JSON {type(hf_config).__name__}, not the object of a model config."
    )
  weights = read_hf_weights(path)
  kind, model = model_from_hf_config(hf_config, config_path)
  for key, actual in sizes_held(weights).items():  # named by the key, before any tensor is matched
    if (stated := hf_config.get(key, HF_CONFIG_DEFAULTS[key])) != actual:
      raise ConfigError(
          f"{config_path}: {key}={stated!r}, but the weight files hold {actual}; the config.json is "
          "not the one these weights were saved with."
      )
  decoder_tied = hf_config.get("tie_word_embeddings", True) is not False
  return model, params_from_hf_weights(model, kind, weights, path, decoder_tied)


def save_hf(
    model,
    params,
    out_dir: str,
    kind: str | None = None,
    vocab_file: str | None = None,
    pad_token_id: int = _PAD_ID,
) -> str:
  """Writes config.json, model.safetensors (and a copy of `vocab_file`) to `out_dir` for from_pretrained;
  `model` is a standalone model, or an ElectraPretrainer whose tower `kind` picks. Returns `out_dir`.
  """
  if isinstance(model, models.ElectraPretrainer):
    if kind not in models.TOWER_MODELS:
      raise ConfigError(
          f"kind={kind!r}: exporting an ElectraPretrainer needs kind='discriminator' or "
          "'generator' (the tower to write)."
      )
    model, params = models.tower_from_pretrainer(model, params, kind)
  model_kind = kind_of(model)
  check_hf_form(model.config)
  if kind is not None and kind != model_kind:
    raise ConfigError(
        f"kind={kind!r} does not match the {type(model).__name__} (a {model_kind}); leave kind "
        "out or pass the matching model."
    )
  tensors = hf_weights_from_params(model, model_kind, params)
  if vocab_file is not None and not os.path.isfile(vocab_file):
    raise ConfigError(
        f"vocab_file={vocab_file!r} does not exist; pass the vocabulary's path or None."
    )
  os.makedirs(out_dir, exist_ok=True)
  workdir_files.write_json(
      os.path.join(out_dir, "config.json"), hf_config_of(model, model_kind, pad_token_id)
  )
  # The metadata save_pretrained writes; transformers 4.x checks it when loading.
  safetensors.numpy.save_file(
      tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"}
  )
  if vocab_file is not None:
    shutil.copyfile(vocab_file, os.path.join(out_dir, os.path.basename(vocab_file)))
  return out_dir
