"""A released (discriminator, generator) pair, from two Hugging Face directories or an official TF1
checkpoint, written as step 0 of a pre-training workdir with its vocabulary and config.json."""

import contextlib
import dataclasses
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
  """Both towers as standalone models (each `*_params` is {"embeddings", <tower>}), and the data.*
  values that tokenize as they were trained ({} when no vocabulary lies beside the weights)."""

  discriminator: models.ElectraDiscriminatorModel
  discriminator_params: dict
  generator: models.ElectraGeneratorModel
  generator_params: dict
  vocabulary: dict
  source: str  # for messages and the checkpoint's side-car


def read_tokenizer_settings(directory: str) -> tuple[bool | None, bool | None]:
  """(do_lower_case, strip_accents) from a Hugging Face tokenizer_config.json, if any."""
  path = os.path.join(directory, "tokenizer_config.json")
  settings = hf.read_json_object(path) if os.path.isfile(path) else {}
  values = settings.get("do_lower_case"), settings.get("strip_accents")
  if any(type(value) not in (bool, type(None)) for value in values):
    raise ConfigError(
        f"{path}: do_lower_case and strip_accents must each be true, false or null, not {values}."
    )
  return values


def pair_from_hf(discriminator_dir: str, generator_dir: str) -> ImportedPair:
  """Reads an ElectraForPreTraining and an ElectraForMaskedLM directory (see hf.load_hf), with the
  vocab.txt (or an electra-jax export's spm.model) beside them."""
  towers, directories = [], (discriminator_dir, generator_dir)
  for expected, directory in zip(("discriminator", "generator"), directories):
    model, params = hf.load_hf(directory)
    if (kind := hf.kind_of(model)) != expected:
      raise ConfigError(
          f"{directory} holds an {hf.KINDS[kind][0]}, but --hf_{expected} needs an "
          f'{hf.KINDS[expected][0]} (its config.json "architectures").'
      )
    towers += [model, params]
  vocabulary = {}
  if vocab_file := _vocabulary_beside(directories, "vocab.txt"):
    recorded = zip(("lowercase", "strip_accents"), read_tokenizer_settings(discriminator_dir))
    vocabulary = {key: value for key, value in recorded if value is not None}
    vocabulary.update(tokenizer="wordpiece", vocab_file=vocab_file)
  elif spm_model_file := _vocabulary_beside(directories, "spm.model"):
    vocabulary = {"tokenizer": "sentencepiece", "spm_model_file": spm_model_file}
  source = f"Hugging Face: discriminator {discriminator_dir}, generator {generator_dir}"
  return ImportedPair(*towers, vocabulary, source)


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


def pair_from_tf(path: str, num_heads: int | None = None):
  """Reads an official TF1 pre-training checkpoint (see tf_checkpoint.py) and the vocab.txt beside
  it, as the released archives ship it."""
  prefix = tf_checkpoint.resolve_prefix(path)
  towers = tf_checkpoint.read_towers(prefix, num_heads)
  vocab_file = _vocabulary_beside([os.path.dirname(prefix)], "vocab.txt")
  vocabulary = {"tokenizer": "wordpiece", "vocab_file": vocab_file} if vocab_file else {}
  source = f"TensorFlow checkpoint {prefix}"
  return ImportedPair(*towers["discriminator"], *towers["generator"], vocabulary, source)


def _shared_embeddings(pair: ImportedPair, embeddings_from: str | None) -> dict:
  """The one embedding tree of both towers: theirs when equal, else the one `embeddings_from` names
  (refused without it, saying what differs). _model_config has checked that the shapes agree."""
  disc = flax.traverse_util.flatten_dict(pair.discriminator_params["embeddings"], sep="/")
  gen = flax.traverse_util.flatten_dict(pair.generator_params["embeddings"], sep="/")
  differences = "; ".join(
      f"{name}: max |difference| {float(np.max(np.abs(disc[name] - gen[name]))):.3g}"
      for name in sorted(disc)
      if not np.array_equal(disc[name], gen[name])
  )
  if not differences:
    logging.info("The discriminator's and generator's embeddings are equal: one shared table.")
    return pair.discriminator_params["embeddings"]
  if embeddings_from not in ("discriminator", "generator"):
    raise ConfigError(
        f"The towers' embeddings differ ({differences}), but they share ONE embedding tree: pass "
        f"--hf_embeddings_from=discriminator or generator (given: {embeddings_from!r})."
    )
  line = "The towers' embeddings differ (%s); both keep the %s's."
  logging.warning(line, differences, embeddings_from)
  return getattr(pair, f"{embeddings_from}_params")["embeddings"]


def _model_config(pair: ImportedPair) -> dict:
  """config.model values building exactly these towers; refuses a generator no fraction gives."""
  disc, gen = pair.discriminator, pair.generator
  for key in hf.MODEL_KEYS:
    if getattr(disc, key) != getattr(gen, key):
      raise ConfigError(
          f"The discriminator has {key}={getattr(disc, key)} but the generator "
          f"{getattr(gen, key)}; towers sharing one embedding table must agree on it."
      )
  fraction = gen.config.hidden_size / disc.config.hidden_size
  derived = models.generator_encoder_config(disc.config, fraction)  # refuses no whole heads
  if mismatched := ", ".join(
      f"{field}={value} (derived: {getattr(derived, field)})"
      for field, value in dataclasses.asdict(gen.config).items()
      if value != getattr(derived, field)
  ):
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


def write_pretraining_workdir(
    pair: ImportedPair,
    config: ml_collections.ConfigDict,
    workdir: str,
    embeddings_from: str | None = None,
) -> dict:
  """Writes <workdir>/config.json (`config` with the pair's sizes and vocabulary) and a step-0
  checkpoint, fresh optimizer state, all checked first; a workdir with checkpoints is refused."""
  workdir_files.check_usable(workdir)
  # Steps are numbered directories ("<step>.orbax-checkpoint-tmp": a save orbax will remove).
  if any(path.name.isdigit() for path in pathlib.Path(workdir, "checkpoints").glob("*")):
    raise ConfigError(
        f"{workdir} already holds checkpoints; import into a new --workdir (nothing was changed)."
    )
  model_values = _model_config(pair)
  embeddings = _shared_embeddings(pair, embeddings_from)
  config = config.copy_and_resolve_references()  # the caller's config stays as it was
  changed = {key: value for key, value in model_values.items() if config.model[key] != value}
  logging.info("model values from the imported weights, not the recipe's: %s", changed)
  config.model.update(model_values)
  if not pair.vocabulary and not (config.data.tokenizer == "wordpiece" and config.data.vocab_file):
    raise ConfigError(
        f"{pair.source}: no vocab.txt (or spm.model) beside the weights gives the ids a meaning; "
        "put it there, or pass --config.data.tokenizer=wordpiece --config.data.vocab_file=PATH."
    )
  config.data.update(pair.vocabulary)
  config_lib.validate(config)
  tokenizer = data.load_tokenizer(config.data)  # refuses a vocabulary without ELECTRA's specials
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(
        f"The vocabulary has {tokenizer.vocab_size} tokens but the imported model only "
        f"{config.model.vocab_size} rows of embeddings; this is not the model's vocabulary."
    )
  params = {
      "embeddings": embeddings,
      "generator": pair.generator_params["generator"],
      "discriminator": pair.discriminator_params["discriminator"],
  }
  if config.model.scan_layers:  # the recipe trains scanned layers
    params = scan_layers(params)
  # The recipe's model must have exactly the pair's parameters (no GDES delta, MLM head...).
  mesh, setup = one_device_setup(config, tokenizer)
  imported, wanted = train_state.param_shapes(params), setup.param_shapes
  if imported != wanted:
    name = next(n for n in sorted(set(imported) | set(wanted)) if imported.get(n) != wanted.get(n))
    raise ConfigError(
        f"The recipe's model is not the one an imported pair fills: parameter {name!r} is "
        f"{wanted.get(name, 'absent')} in it but {imported.get(name, 'absent')} in the pair "
        f"({config.objective.name=}, {config.model.tie=}). Nothing was written; import with "
        "model.tie='embeddings' and objective.name electra, electra_15, two_stage or adversarial."
    )

  # The vocabulary goes into the workdir, which then stands on its own.
  for key, name in (("vocab_file", "vocab.txt"), ("spm_model_file", "spm.model")):
    if key in pair.vocabulary:
      config.data[key] = os.path.join(os.path.abspath(workdir), name)
      workdir_files.write_bytes(config.data[key], pathlib.Path(pair.vocabulary[key]).read_bytes())
  with partitioning.activate(mesh):
    fresh = train_state.fresh_state(setup, config.train.seed)
    params = jax.device_put(params, setup.state_shardings.params)
    state = fresh.replace(params=params, opt_state=fresh.tx.init(params))
  # No data fingerprint yet: the first training save binds the checkpoints to their data.
  meta = dict(param_shapes=setup.param_shapes, data_fingerprint=None, imported_from=pair.source)
  with contextlib.closing(checkpointing.Checkpointer(workdir, keep=1)) as saver:
    saver.save(0, state, dict(meta, tokenizer_fingerprint=tokenizer.fingerprint))
    saver.wait()
  config_path = os.path.join(workdir, "config.json")
  workdir_files.write_text(config_path, config_lib.config_file_text(config))
  return {
      "workdir": workdir,
      "vocab_file": config.data.vocab_file or config.data.spm_model_file,
      "num_params": int(sum(np.prod(s) for s in setup.param_shapes.values())),
      "generator_fraction": config.model.generator_fraction,
  }
