"""Reading the tensor files of a Hugging Face checkpoint directory: safetensors, and PyTorch
state dicts only through torch.load(weights_only=True), refusing anything but str -> tensor."""

import json
import os
import pathlib

import jax
import numpy as np
import safetensors

from electra_jax.errors import ConfigError


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
    raise ConfigError(f"{path} is a PyTorch file and reading it needs torch (pip install torch); or save the "
                      "model again with safe_serialization (model.safetensors), which needs no torch.") from error
  try:
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as error:  # pickle.UnpicklingError for anything but tensors, or a bad file
    raise ConfigError(
        f"Refusing {path}: torch.load(weights_only=True) cannot read it as plain tensors "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Only a "
        "state dict (str -> tensor) is accepted; save model.state_dict() or use safetensors."
    ) from error
  if not isinstance(state_dict, dict):
    raise ConfigError(f"Refusing {path}: it holds a {type(state_dict).__name__!r} object, not a state dict "
                      "(a flat dict of str -> torch.Tensor). Save model.state_dict() or use safetensors.")
  for name, tensor in state_dict.items():
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
      wrong = (f"key {name!r} is not a str (its type is {type(name).__name__})" if not isinstance(name, str)
               else f"entry {name!r} is not a torch.Tensor (its type is {type(tensor).__name__})")
      raise ConfigError(f"Refusing {path}: {wrong}; only a flat state dict (str -> torch.Tensor) is accepted. "
                        "Save model.state_dict() or use safetensors.")
  return {
      name: tensor.detach().to(torch.float32).numpy() if tensor.is_floating_point() else tensor.numpy()
      for name, tensor in state_dict.items()
  }


def finite_tensor(name: str, array: np.ndarray, source: str) -> np.ndarray:
  """`array`, refused when it holds a NaN or an infinity."""
  if array.dtype.kind in "fc" or array.dtype.name == "bfloat16":
    finite = np.isfinite(array)
    if not finite.all():
      raise ConfigError(
          f"Refusing {source}: tensor {name!r} holds {finite.size - int(finite.sum())} NaN or infinite "
          f"values of {finite.size} (a model trained into NaN, or a damaged file); use a good checkpoint.")
  return array


def read_hf_weights(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a transformers checkpoint directory: model.safetensors (preferred) or
  pytorch_model.bin, either possibly sharded (*.index.json). Refuses NaN and infinite weights."""
  for file_name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_torch_state_dict)):
    path = os.path.join(directory, file_name)
    if os.path.exists(path):
      return {name: finite_tensor(name, array, path) for name, array in reader(path).items()}
    index_path = path + ".index.json"
    if os.path.exists(index_path):
      try:
        shard_names = sorted(set(json.loads(pathlib.Path(index_path).read_text())["weight_map"].values()))
      except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"Refusing {index_path}: not a sharded-checkpoint index ({type(error).__name__}: "
                          f"{error}); it needs a \"weight_map\" of tensor name -> shard file.") from None
      bad = [name for name in shard_names if os.path.basename(name) != name]
      if bad:
        raise ConfigError(f"Refusing {index_path}: shard {bad[0]!r} is not a file name in {directory}.")
      weights = {}
      for shard_name in shard_names:
        weights.update(reader(os.path.join(directory, shard_name)))
      return {name: finite_tensor(name, array, index_path) for name, array in weights.items()}
  raise ConfigError(f"{directory} has no model.safetensors or pytorch_model.bin (nor a sharded index of "
                    "either): point load_hf at a directory written by save_pretrained.")
