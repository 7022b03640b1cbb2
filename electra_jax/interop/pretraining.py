"""A released (discriminator, generator) pair, from two Hugging Face directories or one official TF1
checkpoint, checked and written as step 0 of a pre-training workdir with its vocabulary and config.json.
"""

import contextlib
import copy
import dataclasses
import json
import os
import pathlib

import flax
import jax
import ml_collections
import numpy as np
from absl import logging

from electra_jax import checkpointing, config_lib, data, models, partitioning, train_state, workdir_files
from electra_jax.encoder import scan_layers
from electra_jax.errors import ConfigError
from electra_jax.interop import hf, tf_checkpoint
from electra_jax.interop.export import one_device_setup


@dataclasses.dataclass
class ImportedPair:
  """Both towers as standalone models; each `*_params` is {"embeddings", <tower>}."""

  discriminator: models.ElectraDiscriminatorModel
  discriminator_params: dict
  generator: models.ElectraGeneratorModel
  generator_params: dict
  vocab_file: str | None  # a BERT vocab.txt that gives the ids their meaning
  lowercase: bool | None  # from the tokenizer's settings, where the source records them
  strip_accents: bool | None
  source: str  # for messages and the checkpoint's side-car
  spm_model_file: str | None = (
      None  # a sentencepiece model, when there is no vocab.txt (our exports)
  )


def read_tokenizer_settings(directory: str) -> tuple[bool | None, bool | None]:
  """(do_lower_case, strip_accents) from a Hugging Face tokenizer_config.json, if any."""
  path = os.path.join(directory, "tokenizer_config.json")
  settings = json.loads(pathlib.Path(path).read_text()) if os.path.isfile(path) else {}
  return settings.get("do_lower_case"), settings.get("strip_accents")


def pair_from_hf(discriminator_dir: str, generator_dir: str) -> ImportedPair:
  """Reads an ElectraForPreTraining and an ElectraForMaskedLM directory (see hf.load_hf)."""
  towers = {}
  for expected, directory in (("discriminator", discriminator_dir), ("generator", generator_dir)):
    model, params = hf.load_hf(directory)
    kind = hf.kind_of(model)
    if kind != expected:
      raise ConfigError(
          f"{directory} holds an {hf.ARCHITECTURE_OF_KIND[kind]}, but --hf_{expected} needs an "
          f'{hf.ARCHITECTURE_OF_KIND[expected]} (its config.json "architectures").'
      )
    towers[expected] = (model, params)
  vocab_file = _vocabulary_beside((discriminator_dir, generator_dir), "vocab.txt")
  spm_file = _vocabulary_beside((discriminator_dir, generator_dir), "spm.model")
  return ImportedPair(
      *towers["discriminator"],
      *towers["generator"],
      vocab_file,
      *read_tokenizer_settings(discriminator_dir),
      source=f"Hugging Face: discriminator {discriminator_dir}, generator {generator_dir}",
      spm_model_file=None if vocab_file else spm_file,
  )


def _vocabulary_beside(directories, name: str) -> str | None:
  """The `name` file beside the towers (the first tower's if both have one), refused when the two
  differ or one links outside its directory (an import copies it into the workdir)."""
  paths = []
  for directory in directories:
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      real, inside = os.path.realpath(path), os.path.realpath(directory)
      if os.path.commonpath([real, inside]) != inside:
        raise ConfigError(
            f"Refusing {path}: it links to {real}, outside {directory}. Put the file itself there."
        )
      paths.append(path)
  if len(paths) == 2 and pathlib.Path(paths[0]).read_bytes() != pathlib.Path(paths[1]).read_bytes():
    raise ConfigError(
        f"{paths[0]} and {paths[1]} differ: the two towers were trained with different "
        "vocabularies and cannot share one embedding table."
    )
  return paths[0] if paths else None


def pair_from_tf(
    path: str, vocab_file: str | None = None, num_heads: int | None = None
) -> ImportedPair:
  """Reads an official TF1 pre-training checkpoint (see tf_checkpoint.py); `vocab_file`
  defaults to the vocab.txt beside it, as the released archives ship it."""
  prefix = tf_checkpoint.resolve_prefix(path)
  towers = tf_checkpoint.read_towers(prefix, num_heads)
  if vocab_file is None:
    vocab_file = _vocabulary_beside([os.path.dirname(prefix)], "vocab.txt")
  elif not os.path.isfile(vocab_file):
    raise ConfigError(f"--vocab_file={vocab_file} does not exist; give the checkpoint's vocab.txt.")
  return ImportedPair(
      *towers["discriminator"],
      *towers["generator"],
      vocab_file,
      lowercase=None,
      strip_accents=None,
      source=f"TensorFlow checkpoint {prefix}",
  )


def _shared_embeddings(pair: ImportedPair, embeddings_from: str | None) -> dict:
  """The one embedding tree of both towers: theirs when equal, else the one `embeddings_from` names (refused
  without it, saying what differs). _model_config has checked that the shapes agree."""
  disc = flax.traverse_util.flatten_dict(pair.discriminator_params["embeddings"], sep="/")
  gen = flax.traverse_util.flatten_dict(pair.generator_params["embeddings"], sep="/")
  differences = [
      f"{name}: max |difference| {float(np.max(np.abs(disc[name] - gen[name]))):.3g}"
      for name in sorted(disc)
      if not np.array_equal(disc[name], gen[name])
  ]
  if not differences:
    logging.info("The discriminator's and generator's embeddings are equal: one shared table.")
    return pair.discriminator_params["embeddings"]
  if embeddings_from is None:
    raise ConfigError(
        f"The discriminator's and generator's embeddings differ ({'; '.join(differences)}), but the "
        "towers share ONE embedding tree: pass --hf_embeddings_from=discriminator (or generator)."
    )
  if embeddings_from not in ("discriminator", "generator"):
    raise ConfigError(
        f"embeddings_from={embeddings_from!r} is not one of ['discriminator', 'generator']."
    )
  logging.warning(
      "The towers' embeddings differ (%s); both will use the %s's, as --hf_embeddings_from asks.",
      "; ".join(differences),
      embeddings_from,
  )
  return getattr(pair, f"{embeddings_from}_params")["embeddings"]


def _model_config(pair: ImportedPair) -> dict:
  """config.model values that build exactly these two towers; refuses a generator no `generator_fraction` gives."""
  disc, gen = pair.discriminator, pair.generator
  for field in hf.MODEL_KEYS:
    if getattr(disc, field) != getattr(gen, field):
      raise ConfigError(
          f"The discriminator has {field}={getattr(disc, field)} but the generator "
          f"{getattr(gen, field)}; towers sharing one embedding table must agree on it."
      )
  fraction = gen.config.hidden_size / disc.config.hidden_size
  try:
    derived = models.generator_encoder_config(disc.config, fraction) if fraction <= 1 else None
  except ConfigError:  # no whole number of discriminator-sized heads
    derived = None
  if derived != gen.config:
    mismatched = (
        f"hidden_size={gen.config.hidden_size}, num_heads={gen.config.num_heads}"
        if derived is None
        else (
            ", ".join(
                f"{f.name}={getattr(gen.config, f.name)} (derived: {getattr(derived, f.name)})"
                for f in dataclasses.fields(derived)
                if getattr(gen.config, f.name) != getattr(derived, f.name)
            )
        )
    )
    raise ConfigError(
        f"The generator's sizes are not those the official code derives from the discriminator "
        f"and generator_fraction={fraction:.6g}: {mismatched}. This pair cannot be represented."
    )
  # Imported towers always have HF_ENCODER_FORM's options: a recipe asking for others gets these.
  encoder_fields = [*hf.ENCODER_FIELDS.values(), *(field for field, _, _ in hf.HF_ENCODER_FORM)]
  return {
      **{key: getattr(disc, key) for key in hf.MODEL_KEYS},
      **{field: getattr(disc.config, field) for field in encoder_fields},
      "generator_fraction": fraction,
  }


def _data_config(pair: ImportedPair, config, workdir: str) -> dict:
  """data.* values that tokenize as the released model did: its vocab.txt (or an electra-jax export's
  spm.model), copied into the workdir, which then stands on its own."""

  def copy_into_workdir(source: str, name: str) -> str:
    target = os.path.join(os.path.abspath(workdir), name)
    workdir_files.write_bytes(target, pathlib.Path(source).read_bytes())
    return target

  if pair.vocab_file is None and pair.spm_model_file is not None:
    return {
        "tokenizer": "sentencepiece",
        "spm_model_file": copy_into_workdir(pair.spm_model_file, "spm.model"),
    }
  if pair.vocab_file is None:
    if config.data.tokenizer == "wordpiece" and config.data.vocab_file:
      logging.warning(
          "%s has no vocab.txt; using data.vocab_file=%s. The ids must mean what they meant in "
          "pre-training.",
          pair.source,
          config.data.vocab_file,
      )
      return {}
    raise ConfigError(
        f"{pair.source}: no vocab.txt (or spm.model) beside the weights to give the ids a meaning. "
        "Put it there, or pass --config.data.tokenizer=wordpiece --config.data.vocab_file=PATH."
    )
  data.WordPieceTokenizer(
      pair.vocab_file
  )  # refuses a vocabulary without ELECTRA's special tokens, before the copy
  recorded = {"lowercase": pair.lowercase, "strip_accents": pair.strip_accents}
  return {
      "tokenizer": "wordpiece",
      "vocab_file": copy_into_workdir(pair.vocab_file, "vocab.txt"),
      **{key: bool(value) for key, value in recorded.items() if value is not None},
  }


def write_pretraining_workdir(
    pair: ImportedPair,
    config: ml_collections.ConfigDict,
    workdir: str,
    embeddings_from: str | None = None,
) -> dict:
  """Writes <workdir>/config.json (`config` with the pair's model sizes and vocabulary) and a step-0 checkpoint
  of both towers over one embedding tree, fresh optimizer state. Refuses a workdir with checkpoints.
  """
  workdir_files.check_usable(workdir)
  checkpoints_dir = os.path.join(workdir, "checkpoints")
  # Steps are numbered directories; "<step>.orbax-checkpoint-tmp" is an unfinished save orbax removes.
  if os.path.isdir(checkpoints_dir) and any(name.isdigit() for name in os.listdir(checkpoints_dir)):
    raise ConfigError(
        f"{workdir} already holds checkpoints; import into a new --workdir (nothing was changed)."
    )
  model_values = _model_config(pair)
  embeddings = _shared_embeddings(pair, embeddings_from)
  config = copy.deepcopy(config)  # the caller's config stays as it was
  changed = {k: (config.model[k], v) for k, v in model_values.items() if config.model[k] != v}
  config.model.update(model_values)
  if changed:
    logging.info(
        "Model sizes taken from the imported weights: %s",
        ", ".join(f"model.{k}={new} (recipe: {old})" for k, (old, new) in sorted(changed.items())),
    )
  config_lib.validate(config)
  params = {
      "embeddings": embeddings,
      "generator": pair.generator_params["generator"],
      "discriminator": pair.discriminator_params["discriminator"],
  }
  if config.model.scan_layers:  # the recipe trains scanned layers
    params = scan_layers(params)
  # The recipe's model must have exactly the pair's parameters (no GDES delta, MLM head...) before any write.
  imported, wanted = train_state.param_shapes(params), one_device_setup(config)[1].param_shapes
  if imported != wanted:
    name = next(n for n in sorted(set(imported) | set(wanted)) if imported.get(n) != wanted.get(n))
    raise ConfigError(
        f"The recipe's model is not the one an imported pair fills: parameter {name!r} is {wanted.get(name, 'absent')} "
        f"in it but {imported.get(name, 'absent')} in the pair (objective.name={config.objective.name!r}, model.tie="
        f"{config.model.tie!r}). Import with objective.name electra, electra_15, two_stage or adversarial and "
        "model.tie='embeddings' (the defaults). Nothing was written."
    )
  os.makedirs(workdir, exist_ok=True)
  config.data.update(_data_config(pair, config, workdir))
  tokenizer = data.load_tokenizer(config.data)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(
        f"The vocabulary has {tokenizer.vocab_size} tokens but the imported model only "
        f"{config.model.vocab_size} rows of embeddings; this is not the model's vocabulary."
    )

  mesh, setup = one_device_setup(config, tokenizer)
  with partitioning.activate(mesh):
    fresh = train_state.fresh_state(setup, config.train.seed)
    params = jax.device_put(params, setup.state_shardings.params)
    state = fresh.replace(params=params, opt_state=fresh.tx.init(params))

  with contextlib.closing(
      checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep)
  ) as checkpointer:
    # No data fingerprint yet: the first training save binds the checkpoints to their data.
    checkpointer.save(
        0,
        state,
        {
            "param_shapes": setup.param_shapes,
            "data_fingerprint": None,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "imported_from": pair.source,
        },
    )
    checkpointer.wait()
  config_path = os.path.join(workdir, "config.json")
  workdir_files.write_text(config_path, config_lib.config_file_text(config))
  return {
      "workdir": workdir,
      "config": config_path,
      "vocab_file": config.data.vocab_file or config.data.spm_model_file,
      "num_params": int(sum(np.prod(s) for s in setup.param_shapes.values())),
      "generator_fraction": config.model.generator_fraction,
  }
