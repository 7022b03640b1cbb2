"""The command line (the `electra-jax` console script, or `python -m electra_jax.main`): one absl
program whose --mode picks the job. USAGE below is what `--help` prints; docs/ has the manual."""

import logging as std_logging
import math
import os
import sys
import time

from electra_jax import xla_flags

# Before JAX starts; run as the program, it may restart the process with glibc's settings for CPU training.
xla_flags.apply_cpu_defaults(
    restart=__name__ == "__main__" or os.path.basename(sys.argv[0]) == "electra-jax"
)

import flax  # noqa: E402
import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from ml_collections.config_flags.config_flags import ConfigFileFlagParser  # noqa: E402

import electra_jax  # noqa: E402
from electra_jax import config_lib, data, distributed, interop, train, workdir_files  # noqa: E402
from electra_jax.errors import ConfigError  # noqa: E402


class _RecipeParser(ConfigFileFlagParser):
  """--config's parser: a recipe's file, or its name (`demo`, `finetune/glue`) from any directory."""

  listing = "configs/base.py"  # the file that lists every key of the loaded recipe

  def parse(self, path):
    path = config_lib.resolve_recipe(path)
    recipe = path.split(":", 1)[0]
    if recipe.endswith(".json"):
      raise ConfigError(
          f"--config={path} is a JSON file; --config takes a recipe (a .py file with get_config()). "
          "To continue a workdir, pass --workdir=DIR alone, or --config=configs/workdir.py:DIR."
      )
    if not os.path.isfile(recipe):
      raise ConfigError(
          f"--config={path}: {recipe} is {'a directory' if os.path.isdir(recipe) else 'not a file'}, "
          "and no recipe has that name. Give a recipe file or a recipe's name, e.g. demo or "
          f"finetune/glue ({config_lib.RECIPES_DIR} lists them)."
      )
    config = super().parse(path)
    if "init_from" in config:
      self.listing = "configs/finetune/base.py"
    return config


FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Path to a recipe in configs/ (e.g. configs/demo.py)."
)
FLAGS["config"].parser = _RecipeParser("config")
flags.DEFINE_string("workdir", None, "Directory for config.json, metrics.jsonl and checkpoints.")
# One line each: `electra-jax --help` lists them (USAGE below).
_MODES = {
    "train": "pre-train, or resume, in --workdir (the default mode)",
    "eval": "held-out metrics of --workdir's latest checkpoint (or --step)",
    "finetune": "a task head on a pre-trained discriminator (configs/finetune/*.py), results in --workdir",
    "export_hf": "write --workdir (pre-training or fine-tuning) as Hugging Face directories in --out",
    "import_hf": "start --workdir from a released Hugging Face pair (--hf_discriminator, --hf_generator)",
    "import_tf": "start --workdir from an official TF1 checkpoint (--tf_checkpoint)",
    "train_tokenizer": "train a sentencepiece model on the config's corpus into --out",
    "prepare_data": "tokenize and pack the config's corpus into shards in data.prepared_dir",
    "sweep": "train the --sweep/--sweep_file runs of --config in sub-workdirs of --workdir and tabulate them",
    "sweep_report": "rewrite a sweep folder's results.csv/results.md without training",
    "plot": "curves of --workdir=W1,W2,... (sweep folders expand to their runs) into --out (PNG)",
}
USAGE = "\n".join(
    [
        "electra-jax: ELECTRA pre-training and fine-tuning in JAX.",
        "",
        "  electra-jax [--mode=MODE] --config=RECIPE --workdir=DIR [--config.group.key=value ...]",
        "  electra-jax --config=configs/demo.py --workdir=workdirs/demo    # the demo, on a CPU",
        "",
        "Modes:",
        *(f"  {mode:<16}{line}" for mode, line in _MODES.items()),
        "",
        "Recipes: configs/*.py (configs/base.py lists every key); docs/ has the manual.",
        "--helpfull lists every flag, those of the libraries too.",
    ]
)
flags.DEFINE_enum("mode", "train", list(_MODES), "What to do; one of the modes above.")
flags.DEFINE_bool("version", False, "Print the version of electra-jax and of JAX, then exit.")
# The other flags, by mode (their help starts with the modes that read them).
for define, name, default, help_text in (
    (
        flags.DEFINE_multi_string,
        "sweep",
        [],
        "sweep: KEY=V1,V2,... (repeatable; the runs are the product of all).",
    ),
    (
        flags.DEFINE_string,
        "sweep_file",
        None,
        "sweep: a file of runs, one line of key=value overrides each.",
    ),
    (
        flags.DEFINE_string,
        "sweep_finetune",
        None,
        "sweep: a fine-tuning recipe run on each finished run.",
    ),
    (
        flags.DEFINE_multi_string,
        "sweep_finetune_override",
        [],
        "sweep: key=value for --sweep_finetune (repeatable).",
    ),
    (
        flags.DEFINE_list,
        "plot_metrics",
        None,
        "plot: metrics to draw (default: loss, masked_lm_accuracy, disc_auc).",
    ),
    (
        flags.DEFINE_integer,
        "workers",
        None,
        "prepare_data: worker processes (default: every core; 0 = this one).",
    ),
    (flags.DEFINE_integer, "step", None, "eval: the checkpoint step (default: the latest)."),
    (
        flags.DEFINE_bool,
        "take_over_workdir",
        False,
        "train and sweep: start though another run's lease holds --workdir (you know that run is dead).",
    ),
    (
        flags.DEFINE_string,
        "coordinator_address",
        None,
        "Multi-process: host:port of process 0 (or ELECTRA_JAX_*).",
    ),
    (
        flags.DEFINE_integer,
        "num_processes",
        None,
        "Multi-process: how many (or ELECTRA_JAX_NUM_PROCESSES).",
    ),
    (
        flags.DEFINE_integer,
        "process_id",
        None,
        "Multi-process: this one's id (or ELECTRA_JAX_PROCESS_ID).",
    ),
    (
        flags.DEFINE_string,
        "out",
        None,
        "export_hf: the output directory; train_tokenizer, plot: the file to write.",
    ),
    (
        flags.DEFINE_bool,
        "export_generator",
        False,
        "export_hf: write the generator too (<out>/generator).",
    ),
    (
        flags.DEFINE_string,
        "hf_discriminator",
        None,
        "import_hf: an ElectraForPreTraining directory.",
    ),
    (flags.DEFINE_string, "hf_generator", None, "import_hf: an ElectraForMaskedLM directory."),
    (
        flags.DEFINE_string,
        "tf_checkpoint",
        None,
        "import_tf: an official checkpoint (model.ckpt-N or its directory).",
    ),
    (
        flags.DEFINE_string,
        "vocab_file",
        None,
        "import_tf: the vocab.txt (default: the one beside the checkpoint).",
    ),
    (
        flags.DEFINE_integer,
        "tf_num_heads",
        None,
        "import_tf: the discriminator's heads (default: hidden // 64).",
    ),
):
  define(name, default, help_text)
flags.DEFINE_enum(
    "hf_embeddings_from",
    None,
    ["discriminator", "generator"],
    "import_hf: whose embeddings both towers keep where the two differ (by default refused).",
)
_DATA_CONFIG = "--config (a recipe with the data.* settings of the corpus)."
_IMPORT_CONFIG = "--config: the recipe whose training, data and mesh settings the workdir will use."
_HF_PAIR = "--hf_discriminator=DIR and --hf_generator=DIR."
# The flags a mode needs beyond --workdir: (flag names, any one of which will do; what "--mode=M needs").
_NEEDS = {
    "prepare_data": (("config", _DATA_CONFIG),),
    "train_tokenizer": (("config", _DATA_CONFIG), ("out", "--out=PATH (the model file to write).")),
    "export_hf": (("out", "--out=DIR (where the model directories go)."),),
    "plot": (("out", "--out=FILE.png."),),
    "sweep": (
        ("config", "--config (the recipe every run starts from)."),
        ("sweep sweep_file", "--sweep=KEY=V1,V2 (repeatable) and/or --sweep_file=FILE."),
    ),
    "finetune": (
        ("config", "--config (configs/finetune/glue.py, squad.py, custom.py or tiny.py)."),
    ),
    "import_hf": (
        ("config", _IMPORT_CONFIG),
        ("hf_discriminator", _HF_PAIR),
        ("hf_generator", _HF_PAIR),
    ),
    "import_tf": (
        ("config", _IMPORT_CONFIG),
        ("tf_checkpoint", "--tf_checkpoint=PATH (model.ckpt-N or its folder)."),
    ),
}
_SUMMARY_METRICS = ("loss", "masked_lm_accuracy", "disc_auc", "disc_precision", "disc_recall")


def end_summary(config, metrics: dict, workdir: str, seconds: float) -> str:
  """The end of a training run: wall time, tokens, the last train and held-out metrics, the files."""
  step = int(metrics["step"])
  rows = [("train (last log window)", metrics)]
  if held_out := workdir_files.last_record(workdir_files.path(workdir, "eval_metrics.jsonl")):
    rows.append((f"held-out (step {held_out['step']})", held_out))
  cell = (
      lambda row, key: f"{row[key]:.4f}"
      if isinstance(row.get(key), float) and math.isfinite(row[key])
      else "-"
  )
  width = max(len(name) for name, _ in rows)
  table = [" " * width + "".join(f"  {key}" for key in _SUMMARY_METRICS)]
  table += [
      f"{name:<{width}}" + "".join(f"  {cell(row, key):>{len(key)}}" for key in _SUMMARY_METRICS)
      for name, row in rows
  ]
  tokens = step * config.train.batch_size * config.data.max_seq_len
  return "\n".join(
      [
          f"{'Done' if step >= config.train.steps else 'Stopped'}: step {step} of {config.train.steps}, "
          f"{tokens:,} tokens in all (padding included); this command ran {config_lib.format_duration(seconds)}.",
          *table,
          f"Files: {workdir}/checkpoints, {workdir}/metrics.jsonl, {workdir}/eval_metrics.jsonl, {workdir}/config.json",
      ]
  )


def _quiet_libraries(record) -> bool:
  # orbax logs every save at INFO through absl; JAX says at INFO that it found no TPU.
  return record.levelno >= std_logging.WARNING or (
      "orbax" not in record.pathname and "Unable to initialize backend" not in record.getMessage()
  )


def _check_flags(mode: str, config) -> None:
  """The flags `mode` needs, and a recipe of its kind (fine-tuning ones have init_from)."""
  if config is not None and mode not in ("plot", "sweep_report"):
    if "init_from" in config and mode != "finetune":
      raise ConfigError(
          f"--config is a fine-tuning recipe (configs/finetune/), but --mode={mode} takes a pre-training "
          "one (configs/demo.py, configs/electra_small.py, ...). To fine-tune, add --mode=finetune."
      )
    if mode == "finetune" and "init_from" not in config:
      raise ConfigError(
          "--mode=finetune takes a fine-tuning recipe (configs/finetune/*.py; the pre-training workdir "
          "goes in --config.init_from), but --config is a pre-training one."
      )
  if mode in ("finetune", "export_hf", "import_hf", "import_tf") and jax.process_count() > 1:
    raise ConfigError(
        f"--mode={mode} runs in one process, but this is process {jax.process_index()} of "
        f"{jax.process_count()}. Start it once, without the multi-process settings "
        "(--coordinator_address/--num_processes/--process_id, ELECTRA_JAX_* variables, or srun)."
    )
  if mode not in ("prepare_data", "train_tokenizer") and FLAGS.workdir is None:
    raise ConfigError(f"--mode={mode} needs --workdir.")
  for names, what in _NEEDS.get(mode, ()):
    if all(FLAGS[name].value in (None, "", []) for name in names.split()):
      raise ConfigError(f"--mode={mode} needs {what}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.version:
    print(f"electra-jax {electra_jax.__version__} (jax {jax.__version__}, flax {flax.__version__})")
    return
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_quiet_libraries)
  if os.environ.get("GLIBC_TUNABLES") == xla_flags.HUGE_PAGES:
    logging.vlog(
        1,
        "CPU: glibc allocates large buffers on huge pages (GLIBC_TUNABLES=%s; "
        "ELECTRA_JAX_XLA_DEFAULTS=0 turns it off).",
        xla_flags.HUGE_PAGES,
    )
  mode, config, workdir, out = FLAGS.mode, FLAGS.config, FLAGS.workdir, FLAGS.out
  try:
    distributed.initialize(
        FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id
    )  # before any device
    _check_flags(mode, config)
    if mode == "train":
      if config is None and not workdir_files.exists(workdir_files.path(workdir, "config.json")):
        raise ConfigError(
            "--mode=train needs --config (a recipe, e.g. configs/demo.py), unless --workdir already "
            "holds a config.json to continue with."
        )
      config = config or config_lib.load_workdir_config(workdir)
      started = time.perf_counter()
      metrics = train.train_and_evaluate(config, workdir, take_over_workdir=FLAGS.take_over_workdir)
      if metrics and jax.process_index() == 0:  # one summary per job, not per host
        print(end_summary(config, metrics, workdir, time.perf_counter() - started))
    elif mode == "eval":
      held_out = train.evaluate_checkpoint(
          config or config_lib.load_workdir_config(workdir), workdir, FLAGS.step
      )
      summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(held_out.items()))
      print(f"Held-out metrics (checkpoint {held_out['step']}): {summary}")
      print(f"Written to {workdir}/eval_step_{held_out['step']}.json")
    elif mode == "finetune":
      from electra_jax.finetune import trainer  # noqa: PLC0415 (tfds/squad stay out of other modes)

      results = trainer.run_finetune(config, workdir)  # prints its table itself
      print(f"Results: {workdir}/{results['task']}/results.json")
    elif mode == "export_hf":
      from electra_jax.finetune import export  # noqa: PLC0415 (as finetune)

      for name, directory in export.export_hf(workdir, out, FLAGS.export_generator).items():
        print(f"Wrote the {name} (Hugging Face format) to {directory}")
    elif mode in ("import_hf", "import_tf"):
      pair = (
          interop.pair_from_hf(FLAGS.hf_discriminator, FLAGS.hf_generator)
          if mode == "import_hf"
          else interop.pair_from_tf(FLAGS.tf_checkpoint, FLAGS.vocab_file, FLAGS.tf_num_heads)
      )
      summary = interop.write_pretraining_workdir(pair, config, workdir, FLAGS.hf_embeddings_from)
      print(
          f"Imported {pair.source} ({summary['num_params']:,} parameters, generator_fraction="
          f"{summary['generator_fraction']:.4g}) as step 0 of {summary['workdir']}; vocabulary "
          f"{summary['vocab_file']}.\nContinue pre-training with: electra-jax --workdir={summary['workdir']}"
      )
    elif mode == "prepare_data":
      manifest = data.prepare_data(config.data, num_workers=FLAGS.workers)
      totals = manifest["totals"]
      print(
          f"Prepared {len(manifest['shards'])} shards in {config.data.prepared_dir}: {totals['train_examples']} "
          f"train / {totals['eval_examples']} eval examples, {totals['train_tokens']} train tokens. Train with "
          "--config.data.source=prepared."
      )
    elif mode == "train_tokenizer":
      info = data.train_tokenizer(config.data, out)
      print(
          f"Wrote {info['path']} ({info['vocab_size']} pieces, fingerprint {info['fingerprint']}); "
          f"use it with --config.data.spm_model_file={info['path']}"
      )
    elif mode == "plot":
      from electra_jax import plots  # noqa: PLC0415 (matplotlib: the `plots` extra)

      plots.plot_curves(workdir.split(","), out, FLAGS.plot_metrics)
      print(f"Wrote {out}")
    else:
      from electra_jax import sweep  # noqa: PLC0415

      if mode == "sweep_report":
        sweep.write_report(workdir)
        print(f"Wrote {workdir}/results.md and {workdir}/results.csv")
        return
      finetune_config = (
          sweep.load_finetune_config(FLAGS.sweep_finetune, FLAGS.sweep_finetune_override)
          if FLAGS.sweep_finetune
          else None
      )
      result = sweep.run_sweep(
          config,
          workdir,
          FLAGS.sweep,
          FLAGS.sweep_file,
          finetune_config,
          take_over_workdir=FLAGS.take_over_workdir,
      )
      print(workdir_files.read_text(workdir_files.path(workdir, "results.md")))
      curves = workdir_files.exists(workdir_files.path(workdir, "curves.png"))
      print(
          f"Tables: {workdir}/results.md, {workdir}/results.csv"
          + (f"  Curves: {workdir}/curves.png" if curves else "")
      )
      if result["preempted"]:
        print("The sweep stopped at a SIGTERM; run the same command to go on where it stopped.")
      if result["failed"]:
        sys.exit(
            f"electra-jax: {len(result['failed'])} sweep run(s) failed: {', '.join(result['failed'])} "
            "(see the log; re-run the same command to retry them)."
        )
  except (ConfigError, FloatingPointError) as error:  # a mistake, or a diverged run
    sys.exit(f"electra-jax: error: {error}")


def run():
  sys.modules["__main__"].__doc__ = USAGE  # what absl's --help prints first
  for name in (
      "mode",
      "config",
      "workdir",
      "out",
      "step",
      "take_over_workdir",
      "version",
  ):  # what --help shows
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])
  app.run(main, flags_parser=config_lib.flags_parser("electra-jax"))


if __name__ == "__main__":
  run()
