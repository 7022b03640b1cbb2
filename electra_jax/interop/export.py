"""Exporting a pre-training workdir: restores its latest checkpoint on one device and writes
the discriminator (and, if asked, the generator) as Hugging Face directories."""

import os

import jax
import ml_collections

from electra_jax import config_lib, data, partitioning, train
from electra_jax.config_lib import ConfigError
from electra_jax.interop.hf import save_hf


def export_workdir(workdir: str, out_dir: str, export_generator: bool = False) -> dict[str, str]:
  """Writes <out_dir>/discriminator (and <out_dir>/generator) from the latest checkpoint in
  `workdir`, using the model described by <workdir>/config.json. Returns {tower: directory}."""
  config = config_lib.load_workdir_config(workdir)
  checkpoints_dir = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(checkpoints_dir):
    raise ConfigError(f"{workdir} has no checkpoints/ directory: nothing to export yet.")

  # One device whatever mesh trained it: orbax re-shards the arrays onto it on restore.
  single_device = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
  mesh = partitioning.make_mesh(single_device, devices=jax.devices()[:1])
  # The objective (built alongside the state) needs the special ids, fixed by the tokenizer.
  tok = data.load_tokenizer(config.data)
  special_ids = dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  setup = train.build_setup(config, mesh, special_ids)

  _, state = train.restore_checkpoint(workdir, setup, mesh)

  towers = ("discriminator", "generator") if export_generator else ("discriminator",)
  return {
      tower: save_hf(setup.model, state.params, os.path.join(out_dir, tower), kind=tower)
      for tower in towers
  }
