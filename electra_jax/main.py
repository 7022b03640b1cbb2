"""Command-line entry point (also the `electra-jax` console script):

  python -m electra_jax.main --config=configs/demo.py --workdir=/tmp/electra_demo \
      [--config.train.steps=200 ...]

Re-running the same command resumes from the workdir's latest checkpoint. Held-out metrics
of its latest checkpoint (the config defaults to the workdir's config.json):

  python -m electra_jax.main --mode=eval --workdir=/tmp/electra_demo

To write the
latest checkpoint of a workdir as Hugging Face directories (<out>/discriminator, and
<out>/generator with --export_generator):

  python -m electra_jax.main --mode=export_hf --workdir=/tmp/electra_demo --out=/tmp/electra_hf
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from electra_jax import config_lib, distributed, interop, train

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a recipe in configs/ (e.g. configs/demo.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for config.json, metrics.jsonl and checkpoints.")
_MODE = flags.DEFINE_enum(
    "mode", "train", ["train", "eval", "export_hf"],
    "train: pre-train (or resume) in --workdir; eval: held-out metrics of its latest checkpoint "
    "(or --step); export_hf: write its latest checkpoint to --out.",
)
_STEP = flags.DEFINE_integer("step", None, "eval: the checkpoint step (default: the latest).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process runs: host:port of process 0 (or ELECTRA_JAX_COORDINATOR_ADDRESS)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process runs: how many (or ELECTRA_JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process runs: this one's id (or ELECTRA_JAX_PROCESS_ID).")
_OUT = flags.DEFINE_string("out", None, "export_hf: directory for the Hugging Face model directories.")
_EXPORT_GENERATOR = flags.DEFINE_bool(
    "export_generator", False, "export_hf: write the generator too (<out>/generator)."
)
flags.mark_flags_as_required(["workdir"])


def _quiet_libraries(record) -> bool:
  # orbax logs every save step at INFO through absl, burying our progress lines.
  return record.levelno >= std_logging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_quiet_libraries)
  try:
    # First, before anything touches the devices. TPU VM slices and SLURM need no flags.
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if _MODE.value == "train":
      if _CONFIG.value is None:
        raise app.UsageError("--mode=train needs --config (a recipe, e.g. configs/demo.py).")
      metrics = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
      if metrics:
        summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
        print(f"Final metrics (step {int(metrics['step'])}): {summary}")
        print(f"Checkpoints: {_WORKDIR.value}/checkpoints  Metrics: {_WORKDIR.value}/metrics.jsonl")
    elif _MODE.value == "eval":
      config = _CONFIG.value or config_lib.load_workdir_config(_WORKDIR.value)
      held_out = train.evaluate_checkpoint(config, _WORKDIR.value, _STEP.value)
      summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(held_out.items()))
      print(f"Held-out metrics (checkpoint {held_out['step']}): {summary}")
      print(f"Written to {_WORKDIR.value}/eval_step_{held_out['step']}.json")
    elif _MODE.value == "export_hf":
      if _OUT.value is None:
        raise app.UsageError("--mode=export_hf needs --out=DIR (where the model directories go).")
      written = interop.export_workdir(_WORKDIR.value, _OUT.value, _EXPORT_GENERATOR.value)
      for tower, directory in written.items():
        print(f"Wrote the {tower} (Hugging Face format) to {directory}")
  except config_lib.ConfigError as error:
    sys.exit(f"electra-jax: error: {error}")


def run():
  app.run(main)


if __name__ == "__main__":
  run()
