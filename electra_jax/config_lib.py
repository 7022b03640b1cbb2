"""Loading recipe files from configs/ and checking a config before anything is compiled:
every error names the offending value and what to do about it."""

import difflib
import functools
import importlib.util
import json
import math
import os
import re
import sys

import ml_collections
from absl import flags, logging
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from electra_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16")


def sibling(config_file: str, name: str):
  """Imports <name>.py beside `config_file`, wherever the command runs from (no sys.path needed)."""
  return _load(os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py"))


def _load(path: str):
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"electra_jax_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def define_config_flag(
    default=None, help_text="Path to a recipe in configs/ (e.g. configs/demo.py).", lock_config=True
):
  """--config for an absl program (the CLI, the benchmarks): a recipe file, or a recipe's name."""
  holder = config_flags.DEFINE_config_file("config", default, help_text)
  flags.FLAGS["config"].parser = RecipeParser("config", lock_config)
  return holder


class RecipeParser(ConfigFileFlagParser):
  """--config's parser: a recipe's file, or its name (`demo`, `finetune/glue`) from any directory.
  It keeps the recipe's config before any override (`loaded`) and the ConfigError its file raised
  (`refused`): flags_parser reports a mistake from these, not from another library's message."""

  loaded = refused = None

  def parse(self, path):
    try:  # the recipe's get_config is called here: ml_collections would turn its error into text
      config = load_recipe(path)
    except ConfigError as error:
      self.refused = error
      raise
    if self._lock_config:
      config.lock()
    self.loaded = config.copy_and_resolve_references()  # overrides go into `config` after this
    return config


def unknown_key(config, dotted: str) -> tuple[str, str] | None:
  """(the first part of `dotted` that `config` lacks, its close match as a hint, or ""), or None
  when `config` has the whole key."""
  group = config
  for part in dotted.split("."):
    if not isinstance(group, ml_collections.ConfigDict) or part not in group:
      keys = list(group.keys()) if isinstance(group, ml_collections.ConfigDict) else []
      return part, "".join(f"Did you mean {m!r}?" for m in difflib.get_close_matches(part, keys, 1))
    group = group[part]
  return None


def flags_parser(program: str):
  """For `app.run(main, flags_parser=...)`: absl's parsing, a config flag's mistake in one line."""

  def parse(argv: list[str]) -> list[str]:
    parser = flags.FLAGS["config"].parser  # define_config_flag's
    parser.loaded = parser.refused = None  # absl shares one parser among equal flags: start clean
    try:
      return flags.FLAGS(argv)
    except flags.Error as error:  # one line, as every mistake (--helpfull lists the flags)
      if parser.refused is not None:  # the recipe's own refusal
        error = parser.refused
      elif isinstance(error, flags.UnrecognizedFlagError) and error.flagname.startswith("config."):
        error = (
            f"--{error.flagname} changes a recipe, but no --config was given: to change a workdir's "
            "config.json, pass --config=configs/workdir.py:DIR (DIR = the workdir) with the overrides."
        )
      sys.exit(f"{program}: error: {error}")
    except (AttributeError, KeyError):  # ml_collections: an override of a key the recipe lacks
      for arg in argv[1:] if parser.loaded is not None else ():
        flag = arg.split("=")[0]
        if flag.startswith("--config.") and (found := unknown_key(parser.loaded, flag[9:])):
          key, hint = found
          listing = f"configs/{'finetune/' if 'init_from' in parser.loaded else ''}base.py"
          sys.exit(
              f"{program}: error: {flag}: the config has no key {key!r}. {hint + ' ' if hint else ''}"
              f"{listing} lists every key with its default."
          )
      raise

  return parse


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
  """'group.key: old -> new' for every leaf that differs between two config dicts."""
  changes = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, "absent"), new.get(key, "absent")
    if isinstance(a, dict) and isinstance(b, dict):
      changes += changed_keys(a, b, f"{prefix}{key}.")
    elif a != b:
      changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return changes


# The recipes: electra_jax/configs in an installed wheel, configs/ beside the package in a checkout.
RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
if not os.path.isdir(RECIPES_DIR):
  RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(RECIPES_DIR)), "configs")
_BASE_RECIPE = os.path.join(RECIPES_DIR, "base.py")


def load_recipe(value: str, flag: str = "--config") -> ml_collections.ConfigDict:
  """A recipe's config by its file or name (`demo`, `finetune/glue`, `:ARG`); errors name `flag`."""
  recipe, colon, arg = resolve_recipe(value).partition(":")
  if recipe.endswith(".json"):
    raise ConfigError(
        f"{flag}={value} is a JSON file; {flag} takes a recipe (a .py file with get_config()): to "
        "continue a workdir, pass --workdir=DIR alone, or --config=configs/workdir.py:DIR."
    )
  if not os.path.isfile(recipe):
    raise ConfigError(
        f"{flag}={value}: {recipe} is {'a directory' if os.path.isdir(recipe) else 'not a file'}, "
        f"and no recipe has that name; give a recipe's file or name ({RECIPES_DIR} lists them)."
    )
  try:
    config = _load(recipe).get_config(*([arg] if colon else []))
  except ConfigError:
    raise
  except Exception as error:  # noqa: BLE001 (a recipe is the user's code: its mistake in one line)
    raise ConfigError(f"{flag}={value}: {type(error).__name__}: {error}; fix the recipe.") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{flag}={value}: get_config() returned {config!r}, not a ConfigDict.")
  return config


def resolve_recipe(value: str) -> str:
  """--config's value with a recipe's name (`demo`, `finetune/glue`, `configs/demo.py`) made its path in
  RECIPES_DIR, keeping any ":ARG"; a path that exists, or names no recipe, is returned as is."""
  recipe, colon, rest = value.partition(":")
  if "://" in value or os.path.exists(recipe):
    return value
  name = recipe.removeprefix("configs/").removesuffix(".py")
  candidate = os.path.join(RECIPES_DIR, *name.split("/")) + ".py"
  return candidate + colon + rest if name and os.path.isfile(candidate) else value


def with_defaults(saved: dict, recipe: str = _BASE_RECIPE) -> ml_collections.ConfigDict:
  """A saved config (config.json's, sweep.json's base) less its version, completed with `recipe`'s
  defaults; ValueError names a key they lack or a value of another type (7.9 for an int, a bool)."""

  def merged_over(defaults: dict, saved: dict, prefix: str = "") -> dict:
    merged = dict(defaults)
    for key, value in saved.items():
      name, default = prefix + key, defaults.get(key)
      if key not in defaults:
        where = os.path.relpath(recipe, os.path.dirname(RECIPES_DIR))
        raise ValueError(f"{name} is no key of this electra-jax's config (see {where})")
      if isinstance(default, dict) and isinstance(value, dict):
        merged[key] = merged_over(default, value, name + ".")
      elif default is None or _same_kind(default, value):
        merged[key] = value
      else:
        raise ValueError(
            f"{name}={value!r} is of type {type(value).__name__}, but the key's type is "
            f"{type(default).__name__}"
        )
    return merged

  saved = {key: value for key, value in saved.items() if key != VERSION_KEY}
  return ml_collections.ConfigDict(merged_over(_load(recipe).get_config().to_dict(), saved))


def _same_kind(default, value) -> bool:
  """The default's type (a bool is no number), a list for a tuple (JSON's), an int for a float."""
  kind = lambda x: list if isinstance(x, tuple) else type(x)  # noqa: E731
  return kind(value) is kind(default) or (kind(default), kind(value)) == (float, int)


def saved_config(workdir: str) -> dict | None:
  """<workdir>/config.json as a dict completed with_defaults; None if there is none."""
  from electra_jax import workdir_files  # noqa: PLC0415 (keeps recipes' imports light)

  file = workdir_files.path(workdir, "config.json")
  if workdir_files.exists(file):
    return workdir_files.read_json(file, with_defaults).to_dict()
  return None


def load_workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved as <workdir>/config.json (see saved_config)."""
  if (saved := saved_config(workdir)) is None:
    raise ConfigError(
        f"{workdir} has no config.json, so it is no pre-training workdir to go on with: give --config "
        "(a recipe, e.g. configs/demo.py), or the --workdir a training run wrote."
    )
  return ml_collections.ConfigDict(saved)


_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str) -> float:
  """Seconds in train.time_budget's duration ("90s", "12m", "4h", "1h30m", "1.5h"); else ConfigError."""
  match = _DURATION.fullmatch(text.strip().lower())
  if not text.strip() or match is None:
    raise ConfigError(
        f"train.time_budget={text!r} is not a duration: write hours, minutes and seconds in that "
        'order, e.g. "90s", "12m", "4h" or "1h30m" ("" = no budget).'
    )
  hours, minutes, seconds = (float(part or 0) for part in match.groups())
  if (total := 3600 * hours + 60 * minutes + seconds) <= 0:
    raise ConfigError(f"train.time_budget={text!r} is no time at all: give a positive duration.")
  return total


def format_duration(seconds: float) -> str:
  """ "1h05m" or "3m07s": how progress lines and ETAs show a duration."""
  minutes, secs = divmod(int(max(0, seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


# config.json's record of the electra-jax version that wrote it (not a config key: readers drop it).
VERSION_KEY = "electra_jax_version"


def config_file_text(config: ml_collections.ConfigDict) -> str:
  """A workdir's config.json: the config and the version of electra-jax that wrote it."""
  from electra_jax import __version__  # noqa: PLC0415 (the package's face imports nothing)

  return json.dumps({**config.to_dict(), VERSION_KEY: __version__}, indent=2, sort_keys=True)


def as_saved(config: ml_collections.ConfigDict) -> dict:
  """The config as its config.json reads back (tuples become lists), to compare with one."""
  return json.loads(json.dumps(config.to_dict(), sort_keys=True))


def save_config(workdir: str, config, before: dict | None, start_step: int | None) -> None:
  """Writes <workdir>/config.json. A resume (from `start_step`) with settings other than `before`
  (the config.json it found) says which, and first keeps that file as config.step<N>.json."""
  from electra_jax import workdir_files  # noqa: PLC0415 (keeps recipes' imports light)

  changes = before is not None and start_step is not None and changed_keys(before, as_saved(config))
  file = workdir_files.path(workdir, "config.json")
  workdir_files.makedirs(file.parent)
  if changes:
    kept = workdir_files.path(workdir, f"config.step{start_step}.json")
    # A second resume from the same checkpoint finds the first one's settings in config.json,
    # which never trained it: the file the first resume kept stays as it is.
    if not workdir_files.exists(kept):
      workdir_files.write_text(kept, workdir_files.read_text(file))
    logging.warning(
        f"Resuming at step {start_step} with settings that differ from the workdir's config.json "
        f"(kept as {kept.name}): {'; '.join(changes)}"
    )
  workdir_files.write_text(file, config_file_text(config))


_WITHIN = {  # a bound as the messages state it: its test
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "finite and > 0": lambda v: math.isfinite(v) and v > 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in (0, 1)": lambda v: 0 < v < 1,
}


def check_bounds(group, bounds: dict, prefix: str = "") -> None:
  """ConfigError for the first key of `bounds` ({dotted key: (bound, what it means)}) whose value
  in `group` is outside its bound; `prefix` names the group."""
  for key, (bound, meaning) in bounds.items():
    value = functools.reduce(lambda group, name: group[name], key.split("."), group)
    if not _WITHIN[bound](value):
      raise ConfigError(f"{prefix}{key}={value} must be {bound} ({meaning}).")


def check_encoder_sizes(m, keys, prefix: str, why: str) -> None:
  """Refuses a size in `keys` of model config `m` below 1, or heads that do not divide the hidden size."""
  check_bounds(m, {key: (">= 1", why) for key in keys}, prefix)
  if m.hidden_size % m.num_heads:
    raise ConfigError(
        f"{prefix}hidden_size={m.hidden_size} is not divisible by {prefix}num_heads={m.num_heads}: "
        "pick num_heads dividing hidden_size (ELECTRA uses hidden_size / 64 heads)."
    )


def check_finite(config: ml_collections.ConfigDict, prefix: str = "") -> None:
  """Every float in the config is finite (`x > 0` lets inf through, and NaN fails every comparison)."""
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      check_finite(value, name + ".")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"{name}={value} is not a finite number; give a finite one.")


def check_optimizer(o: ml_collections.ConfigDict, typical_lr: str) -> None:
  """The AdamW keys pre-training and fine-tuning share; `typical_lr` goes into the message."""
  bounds = {
      "learning_rate": ("> 0", f"the schedule's peak; {typical_lr}"),
      "weight_decay": (">= 0", "0 = none; official 0.01"),
      "b1": ("in [0, 1)", "official 0.9"),
      "b2": ("in [0, 1)", "official 0.999"),
      "eps": ("> 0", "official 1e-6"),
      "clip_norm": ("> 0", "the global gradient norm's cap; official 1.0"),
  }
  check_bounds(o, bounds, "optimizer.")


def check_rates(group: ml_collections.ConfigDict, keys, prefix: str) -> None:
  """Dropout rates: in [0, 1) (a rate of 1 would drop everything)."""
  check_bounds(group, {key: ("in [0, 1)", "the paper: 0.1") for key in keys}, prefix + ".")


_SIZES = ("hidden_size", "num_heads", "intermediate_size", "embedding_size", "vocab_size")
_BOUNDS = {  # validate's bounds on single keys
    "model.generator_fraction": ("in (0, 1]", "of the discriminator's width; paper: 1/4-1/2"),
    "train.grad_accum_steps": (">= 1", "micro-batches per step"),
    "train.memory_fraction": ("in (0, 1]", "the share of a device's memory a step may use"),
    "train.steps_per_call": (">= 1", "optimizer steps per compiled call"),
    "train.steps": (">= 1", "optimizer steps in all"),
    "train.log_every": (">= 1", "steps per logged line"),
    "checkpoint.every_steps": (">= 1", "steps between checkpoints"),
    "checkpoint.keep": (">= 1", "checkpoints kept; a run that keeps none could never resume"),
    "optimizer.warmup_steps": (">= 0", "0 = no warmup; the paper uses 10000"),
    "optimizer.warmup_fraction": ("in [0, 1)", "of train.steps; 0 = optimizer.warmup_steps"),
    "eval.every_steps": (">= 0", "0 = no held-out evaluation"),
    "eval.num_batches": (">= 1", "batches of held-out data per evaluation"),
    "eval.batch_size": (">= 0", "0 = the training micro-batch"),
    "objective.mask_prob": ("in (0, 1)", "the share of positions chosen; official 0.15"),
    "objective.keep_original_prob": ("in [0, 1]", "chosen ones left un-[MASK]ed; official 0.15"),
    "objective.temperature": ("finite and > 0", "the sampling temperature; official 1.0"),
    "objective.initial_temperature": ("finite and > 0", "the sampling temperature at step 0"),
    "objective.temperature_decay_fraction": ("in [0, 1]", "of train.steps it falls over; 0 = none"),
}


def validate(config: ml_collections.ConfigDict) -> None:
  """The checks that need no devices and no data; ConfigError naming the key and the fix."""
  from electra_jax import models, objectives, tensorboard_log  # noqa: PLC0415 (recipes need no jax)
  from electra_jax.data.config import check_config as check_data_config  # noqa: PLC0415

  try:  # every key of configs/base.py and of its type: a Python caller may set None or True anywhere
    with_defaults(config.to_dict())
  except ValueError as error:
    raise ConfigError(f"{error}.") from None
  m, t, d = config.model, config.train, config.data
  sizes = (*_SIZES, "max_position_embeddings")
  check_encoder_sizes(m, sizes, "model.", "configs/base.py gives its typical value")
  check_bounds(config, _BOUNDS)
  check_rates(m, ("dropout_rate", "attention_dropout_rate"), "model")
  if d.max_seq_len > m.max_position_embeddings:
    raise ConfigError(
        f"data.max_seq_len={d.max_seq_len} exceeds model.max_position_embeddings="
        f"{m.max_position_embeddings}. Lower data.max_seq_len or raise max_position_embeddings."
    )
  check_data_config(d, config.eval.every_steps)
  if t.dtype not in DTYPES:
    raise ConfigError(f"train.dtype={t.dtype!r} is not one of {DTYPES}.")
  if t.batch_size < 1 and t.batch_size != -1:
    raise ConfigError(
        f"train.batch_size={t.batch_size}: give a positive global batch size, or -1 for the largest "
        "that fits in train.memory_fraction of a device's memory."
    )
  if t.batch_size != -1 and t.batch_size % t.grad_accum_steps:
    raise ConfigError(
        f"train.batch_size={t.batch_size} is not divisible by train.grad_accum_steps="
        f"{t.grad_accum_steps}: each micro-batch must have the same size."
    )
  if t.time_budget:
    parse_duration(t.time_budget)
  check_optimizer(config.optimizer, "ELECTRA-Small uses 5e-4, Base 2e-4")
  check_finite(config)  # after the checks above, whose messages say more where they apply
  tensorboard_log.writer_names(t.metric_writers)
  objectives.check_config(config)
  models.build_model(config, objectives.towers(config))  # its own refusals; nothing initialized
