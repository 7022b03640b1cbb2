"""The Python API for notebooks and scripts: a recipe with overrides, then pre-training, evaluation,
fine-tuning and export, each logging to stderr and returning what the CLI prints."""

from collections.abc import Mapping

import ml_collections
from absl import logging

from electra_jax import config_lib, sweep, train


def load_config(recipe: str, overrides: Mapping[str, object] | None = None):
  """A recipe by name or path (as --config takes it) with `{"group.key": value}` overrides, each
  checked as `--config.group.key=value` is; a list is the comma-separated value the flag takes."""

  def as_typed(value) -> str:  # what the flag would say (a list: data.files=a.txt,b.txt)
    values = value if isinstance(value, (list, tuple)) else [value]
    return ",".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)

  pairs = [(key, as_typed(value)) for key, value in (overrides or {}).items()]
  return sweep.apply_overrides(config_lib.load_recipe(recipe, "recipe"), pairs, "Override")


def _log_progress() -> None:
  # Outside absl's app.run, absl logs nothing below WARNING and only through Python's root logger.
  logging.set_verbosity(logging.INFO)
  logging.use_absl_handler()


def pretrain(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Pre-trains (or resumes) in `workdir`, as `--mode=train`; the final metrics."""
  _log_progress()
  return train.train_and_evaluate(config, workdir)


def evaluate(workdir: str, step: int | None = None) -> dict[str, float]:
  """Held-out metrics of `workdir`'s checkpoint at `step` (None: the latest), as `--mode=eval`."""
  _log_progress()
  return train.evaluate_checkpoint(config_lib.load_workdir_config(workdir), workdir, step)


def finetune(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Fine-tunes as `--mode=finetune`; what `<workdir>/<task>/results.json` holds."""
  from electra_jax.finetune import trainer  # noqa: PLC0415 (tfds and SQuAD stay out of pre-training)

  _log_progress()
  return trainer.run_finetune(config, workdir)


def export_hf(workdir: str, out: str, export_generator: bool = False) -> dict[str, str]:
  """A workdir as Hugging Face directories in `out`, as `--mode=export_hf`; {what: directory}."""
  from electra_jax.finetune import export  # noqa: PLC0415 (as finetune)

  _log_progress()
  return export.export_hf(workdir, out, export_generator)
