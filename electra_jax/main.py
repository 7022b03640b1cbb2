"""Command-line entry point (also the `electra-jax` console script):

  python -m electra_jax.main --config=configs/demo.py --workdir=/tmp/electra_demo \
      [--config.train.steps=200 ...]

Re-running the same command resumes from the workdir's latest checkpoint.
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from electra_jax import config_lib, train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a recipe in configs/ (e.g. configs/demo.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, metrics.jsonl and checkpoints.")
_MODE = flags.DEFINE_enum("mode", "train", ["train"], "What to run.")
flags.mark_flags_as_required(["config", "workdir"])


def _quiet_libraries(record) -> bool:
  # orbax logs every save step at INFO through absl, burying our progress lines.
  return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_quiet_libraries)
  if _MODE.value == "train":
    try:
      metrics = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except config_lib.ConfigError as error:
      sys.exit(f"electra-jax: error: {error}")
    if metrics:
      summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
      print(f"Final metrics (step {int(metrics['step'])}): {summary}")
      print(f"Checkpoints: {_WORKDIR.value}/checkpoints  Metrics: {_WORKDIR.value}/metrics.jsonl")


def run():
  app.run(main)


if __name__ == "__main__":
  run()
