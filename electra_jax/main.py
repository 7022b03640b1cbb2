"""The command line (the `electra-jax` console script, or `python -m electra_jax.main`): one absl
program whose --mode picks the job. USAGE below is what `--help` prints; docs/ has the manual."""

import _thread
import contextlib
import dataclasses
import logging as std_logging
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

_terminal = []  # stderr as it was before a Ctrl-C sent it to /dev/null (_ctrl_c)


def _stopped(signum=None, frame=None):
  # Not Python's exit: XLA's threads, stopped mid-work, can crash it.
  sys.stdout.flush()
  message = b"electra-jax: stopped by Ctrl-C; what it finished is kept (run it again to go on).\n"
  os.write(_terminal[0] if _terminal else 2, message)
  os._exit(130)


# A Ctrl-C while JAX imports (seconds) ends in one line, not a traceback: until main() takes
# SIGINT, nothing has started or all has ended. Only as the CLI (`python -m`, the console script).
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "electra-jax":
  signal.signal(signal.SIGINT, _stopped)

import flax  # noqa: E402 (the imports that take seconds come after the handler)
import jax
from absl import app, flags, logging

import electra_jax
from electra_jax import api, config_lib, data, distributed, fit, interop, memory, plots, sweep, train, workdir_files, xla_flags
from electra_jax.errors import ConfigError

FLAGS = flags.FLAGS
config_lib.define_config_flag()
flags.DEFINE_string("workdir", None, "Directory for config.json, metrics.jsonl and checkpoints.")
flags.DEFINE_bool("version", False, "Print the version of electra-jax and of JAX, then exit.")
# The other flags, by mode (their help starts with the modes that read them).
flags.DEFINE_multi_string("sweep", [], "sweep: KEY=V1,V2,... (repeatable; runs all combinations).")
flags.DEFINE_string("sweep_file", None, "sweep: a file of runs, one line of overrides each.")
flags.DEFINE_string("sweep_finetune", None, "sweep: a fine-tuning recipe run on each finished run.")
flags.DEFINE_multi_string("sweep_finetune_override", [], "sweep: key=value for --sweep_finetune.")
flags.DEFINE_list("plot_metrics", None, "plot: metrics (default loss,masked_lm_accuracy,...).")
flags.DEFINE_integer("workers", None, "prepare_data: processes (default: every core; 0: this one).")
flags.DEFINE_integer("step", None, "eval: the checkpoint step (default: the latest).")
flags.DEFINE_bool("take_over_workdir", False, "train, sweep: take it from a dead run's lease.")
flags.DEFINE_string("topology", None, "compile: a TPU slice or GPUs, e.g. v5e-16, v4-32, h100-8.")
flags.DEFINE_bool("max_batch", False, "compile: also search the largest batch that fits.")
flags.DEFINE_string("coordinator_address", None, "Multi-process: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-process: how many (or ELECTRA_JAX_*).")
flags.DEFINE_integer("process_id", None, "Multi-process: this one's id (or ELECTRA_JAX_*).")
flags.DEFINE_string(
    "out",
    None,
    "export_hf, train_tokenizer, plot: the output (a folder for export_hf, else a file).",
)
flags.DEFINE_bool("export_generator", False, "export_hf: write the generator too, in <out>.")
flags.DEFINE_string("hf_discriminator", None, "import_hf: an ElectraForPreTraining directory.")
flags.DEFINE_string("hf_generator", None, "import_hf: an ElectraForMaskedLM directory.")
flags.DEFINE_string("tf_checkpoint", None, "import_tf: an official checkpoint (or its folder).")
flags.DEFINE_integer("tf_num_heads", None, "import_tf: the discriminator's heads (hidden/64).")
flags.DEFINE_enum(
    "hf_embeddings_from",
    None,
    ["discriminator", "generator"],
    "import_hf: whose embeddings both towers keep where the two differ (by default refused).",
)
_SUMMARY_METRICS = ("loss", "masked_lm_accuracy", "disc_auc", "disc_precision", "disc_recall")


def end_summary(config, metrics: dict, workdir: str, seconds: float) -> str:
  """The end of a training run: wall time, tokens, the last train and held-out metrics, files."""
  step = int(metrics["step"])
  rows = [("train (last log window)", metrics)]
  if held_out := workdir_files.last_record(workdir_files.path(workdir, "eval_metrics.jsonl")):
    rows.append((f"held-out (step {held_out['step']})", held_out))
  cell = lambda value: f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else "-"
  width = max(len(name) for name, _ in rows)
  table = [" " * width + "".join(f"  {key}" for key in _SUMMARY_METRICS)]
  table += [
      name.ljust(width) + "".join(f"  {cell(row.get(k)):>{len(k)}}" for k in _SUMMARY_METRICS)
      for name, row in rows
  ]
  tokens = step * config.train.batch_size * config.data.max_seq_len
  names = ("checkpoints", "metrics.jsonl", "eval_metrics.jsonl", "config.json")
  written = [f"{workdir}/{name}" for name in names if workdir_files.exists(f"{workdir}/{name}")]
  head = (
      f"{'Done' if step >= config.train.steps else 'Stopped'}: step {step} of {config.train.steps}"
      f", {tokens:,} tokens in all (padding included); this command ran "
      f"{config_lib.format_duration(seconds)}."
  )
  return "\n".join([head, *table, "Files: " + ", ".join(written)])


# --- The modes: each takes (config, workdir), reads its own flags and prints what it made; its
# docstring is its line of --help.
def _train(config, workdir):
  """pre-train, or resume, in --workdir (the default mode)"""
  config = config or config_lib.load_workdir_config(workdir)
  started = time.perf_counter()
  metrics = train.train_and_evaluate(config, workdir, take_over_workdir=FLAGS.take_over_workdir)
  if metrics and jax.process_index() == 0:  # one summary per job, not per host
    print(end_summary(config, metrics, workdir, time.perf_counter() - started))


def _eval(config, workdir):
  """held-out metrics of --workdir's latest checkpoint (or --step)"""
  config = config or config_lib.load_workdir_config(workdir)
  held_out = train.evaluate_checkpoint(config, workdir, FLAGS.step)
  summary = ", ".join(f"{k}={v:.4g}" for k, v in sorted(held_out.items()))
  print(f"Held-out metrics (checkpoint {held_out['step']}): {summary}")
  print(f"Written to {workdir}/eval_step_{held_out['step']}.json")


def _compile(config, workdir):
  """compile the train step for a --topology (v5e-16, h100-8, ...) without one: fits or not"""
  found = fit.check(config, fit.lookup(FLAGS.topology), FLAGS.max_batch)
  print(fit.describe(found, config))
  if not found.fits:
    sys.exit(1)  # the report says why; a script can test the exit status


def _finetune(config, workdir):
  """a task head on a pre-trained discriminator (configs/finetune/*.py), results in --workdir"""
  results = api.finetune(config, workdir)  # prints its table itself
  print(f"Results: {workdir}/{results['task']}/results.json")


def _export_hf(config, workdir):
  """write --workdir (pre-training or fine-tuning) as Hugging Face directories in --out"""
  for name, directory in api.export_hf(workdir, FLAGS.out, FLAGS.export_generator).items():
    print(f"Wrote the {name} (Hugging Face format) to {directory}")


def _write_imported(pair, config, workdir):
  summary = interop.write_pretraining_workdir(pair, config, workdir, FLAGS.hf_embeddings_from)
  print(
      f"Imported {pair.source} ({summary['num_params']:,} parameters, generator_fraction="
      f"{summary['generator_fraction']:.4g}) as step 0 of {summary['workdir']}; vocabulary "
      f"{summary['vocab_file']}.\nContinue pre-training with: "
      f"electra-jax --workdir={summary['workdir']}"
  )


def _import_hf(config, workdir):
  """start --workdir from a released Hugging Face pair (--hf_discriminator, --hf_generator)"""
  _write_imported(interop.pair_from_hf(FLAGS.hf_discriminator, FLAGS.hf_generator), config, workdir)


def _import_tf(config, workdir):
  """start --workdir from an official TF1 checkpoint (--tf_checkpoint)"""
  pair = interop.pair_from_tf(FLAGS.tf_checkpoint, num_heads=FLAGS.tf_num_heads)
  _write_imported(pair, config, workdir)


def _train_tokenizer(config, workdir):
  """train a sentencepiece model on the config's corpus into --out"""
  tokenizer = data.train_tokenizer(config.data, FLAGS.out)
  print(
      f"Wrote {tokenizer.model_path} ({tokenizer.vocab_size} pieces, fingerprint "
      f"{tokenizer.fingerprint}); use it with --config.data.spm_model_file={tokenizer.model_path}"
  )


def _prepare_data(config, workdir):
  """tokenize and pack the config's corpus into shards in data.prepared_dir"""
  manifest = data.prepare_data(config.data, num_workers=FLAGS.workers)
  totals = manifest["totals"]
  print(
      f"Prepared {len(manifest['shards'])} shards in {config.data.prepared_dir}: "
      f"{totals['train_examples']} train / {totals['eval_examples']} eval examples, "
      f"{totals['train_tokens']} train tokens. Train with --config.data.source=prepared."
  )


def _sweep(config, workdir):
  """train the --sweep/--sweep_file runs of --config in sub-workdirs of --workdir, tabulated"""
  finetune = FLAGS.sweep_finetune
  finetune = finetune and sweep.load_finetune_config(finetune, FLAGS.sweep_finetune_override)
  runs = (FLAGS.sweep, FLAGS.sweep_file, finetune or None)
  result = sweep.run_sweep(config, workdir, *runs, take_over_workdir=FLAGS.take_over_workdir)
  print(workdir_files.read_text(workdir_files.path(workdir, "results.md")))
  curves = workdir_files.exists(workdir_files.path(workdir, "curves.png"))
  print(f"Tables: {workdir}/results.md, {workdir}/results.csv", end="")
  print(f"  Curves: {workdir}/curves.png" if curves else "")
  if result["preempted"]:
    print("The sweep stopped at a SIGTERM or SIGHUP; the same command goes on where it stopped.")
  if result["failed"]:
    sys.exit(
        f"electra-jax: {len(result['failed'])} sweep run(s) failed: {', '.join(result['failed'])} "
        "(see the log; re-run the same command to retry them)."
    )


def _sweep_report(config, workdir):
  """rewrite a sweep folder's results.csv/results.md without training"""
  sweep.write_report(workdir)
  print(f"Wrote {workdir}/results.md and {workdir}/results.csv")


def _plot(config, workdir):
  """curves of --workdir=W1,W2,... (sweep folders expand to their runs) into --out (PNG)"""
  plots.plot_curves(workdir.split(","), FLAGS.out, FLAGS.plot_metrics)
  print(f"Wrote {FLAGS.out}")


@dataclasses.dataclass(frozen=True)
class Mode:
  run: Callable  # (config, workdir) -> None; its docstring is its line of --help
  needs: tuple[str, ...] = ()  # flags beyond --workdir ("a b": either will do)
  recipe: str | None = "pretraining"  # the kind of --config it reads: also "finetuning", or None
  one_process: bool = False  # refused as one process of several
  local: bool = False  # no --workdir, no multi-process job: JAX computes on this machine's CPU


MODES = {
    "train": Mode(_train),
    "eval": Mode(_eval),
    "compile": Mode(_compile, ("config", "topology"), local=True),
    "finetune": Mode(_finetune, ("config",), recipe="finetuning", one_process=True),
    "export_hf": Mode(_export_hf, ("out",), one_process=True),
    "import_hf": Mode(_import_hf, ("config", "hf_discriminator", "hf_generator"), one_process=True),
    "import_tf": Mode(_import_tf, ("config", "tf_checkpoint"), one_process=True),
    "train_tokenizer": Mode(_train_tokenizer, ("config", "out"), local=True),
    "prepare_data": Mode(_prepare_data, ("config",), local=True),
    "sweep": Mode(_sweep, ("config", "sweep sweep_file")),
    "sweep_report": Mode(_sweep_report, recipe=None),
    "plot": Mode(_plot, ("out",), recipe=None),
}
_RECIPES = {  # the kinds of --config a mode reads: (what it is, what to do with it in another mode)
    "pretraining": (
        "a pre-training recipe (configs/demo.py, configs/electra_small.py, ...)",
        "give one whose init_from is the pre-training workdir",
    ),
    "finetuning": ("a fine-tuning recipe (configs/finetune/)", "add --mode=finetune"),
}
_MODE_LINES = "\n".join(f"  {name:<16}{mode.run.__doc__}" for name, mode in MODES.items())
USAGE = f"""electra-jax: ELECTRA pre-training and fine-tuning in JAX.

  electra-jax [--mode=MODE] --config=RECIPE --workdir=DIR [--config.group.key=value ...]
  electra-jax --config=configs/demo.py --workdir=workdirs/demo    # the demo, on a CPU

Modes:
{_MODE_LINES}

Recipes: configs/*.py (configs/base.py lists every key); docs/ has the manual.
--helpfull lists every flag, those of the libraries too."""
flags.DEFINE_enum("mode", "train", list(MODES), "What to do; one of the modes above.")


def _quiet_libraries(record) -> bool:
  # orbax logs every save at INFO through absl; JAX says at INFO that it found no TPU.
  return record.levelno >= std_logging.WARNING or (
      "orbax" not in record.pathname and "Unable to initialize backend" not in record.getMessage()
  )


def _check_flags(name: str, mode: Mode, config) -> None:
  """The flags `mode` needs, and a recipe of its kind (fine-tuning ones have init_from)."""
  kind = config is not None and ("finetuning" if "init_from" in config else "pretraining")
  if kind and mode.recipe not in (None, kind):
    (seen, fix), (taken, _) = _RECIPES[kind], _RECIPES[mode.recipe]
    raise ConfigError(f"--config is {seen}, but --mode={name} takes {taken}: {fix}.")
  if mode.one_process and jax.process_count() > 1:
    raise ConfigError(
        f"--mode={name} runs in one process, but this is process {jax.process_index()} of "
        f"{jax.process_count()}: start it once, without multi-process flags, ELECTRA_JAX_* or srun."
    )
  if not mode.local and FLAGS.workdir is None:
    raise ConfigError(f"--mode={name} needs --workdir.")
  for names in mode.needs:  # the flag's help, less the modes that read it, says what it takes
    if all(FLAGS[flag].value in (None, "", []) for flag in names.split()):
      what = FLAGS[names.split()[0]].help.splitlines()[0].split(": ", 1)[-1].rstrip(".;")
      what = _RECIPES[mode.recipe][0] if names == "config" else what
      raise ConfigError(f"--mode={name} needs --{' or --'.join(names.split())}: {what}.")


def _ctrl_c(signum, frame):
  """SIGINT as KeyboardInterrupt. What the interrupted work prints from its threads next (orbax's
  and tensorstore's, a read cut short) is not news: stderr goes to /dev/null; main() says why."""
  if not _terminal:
    sys.stderr.flush()
    _terminal.append(os.dup(2))
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    threading.Thread(target=_until_unwinding, daemon=True).start()
  raise KeyboardInterrupt


def _until_unwinding():
  # A KeyboardInterrupt can be lost: Python drops one raised in a gc callback (JAX runs one at
  # each collection) or a finalizer, and a library's bare `except` takes one. It is raised again
  # every 0.2 s until the main thread is seen unwinding with one (a cleanup it runs meanwhile may
  # handle exceptions of its own: theirs have the KeyboardInterrupt in their context).
  main = threading.main_thread().ident
  while True:
    time.sleep(0.2)
    exc = sys._current_exceptions().get(main)  # (type, value, traceback) before Python 3.12
    exc = exc[1] if isinstance(exc, tuple) else exc
    while exc is not None and not isinstance(exc, KeyboardInterrupt):
      exc = exc.__context__
    if exc is None:
      _thread.interrupt_main()


@contextlib.contextmanager
def _ctrl_c_stops():
  """A Ctrl-C stops the command in one line, exit code 130; training's loop takes it itself."""
  try:
    previous = signal.signal(signal.SIGINT, _ctrl_c)
  except ValueError:  # not the main thread (a notebook runner's): Python's own handling
    yield
    return
  try:
    yield
  except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one is enough
    _stopped()  # every `finally` ran
  finally:
    if signal.getsignal(signal.SIGINT) is _ctrl_c:  # not stopping: the caller's handler again
      signal.signal(signal.SIGINT, previous)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if FLAGS.version:
    print(f"electra-jax {electra_jax.__version__} (jax {jax.__version__}, flax {flax.__version__})")
    return
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_quiet_libraries)
  if os.environ.get("GLIBC_TUNABLES") == xla_flags.HUGE_PAGES:
    logging.info(
        f"CPU: glibc puts large allocations on huge pages (GLIBC_TUNABLES={xla_flags.HUGE_PAGES}, "
        "set at start; ELECTRA_JAX_XLA_DEFAULTS=0 leaves malloc alone)."
    )
  mode = MODES[FLAGS.mode]
  try:
    with _ctrl_c_stops():
      if mode.local:  # before JAX starts a backend: no accelerator here is taken, nor a job joined
        jax.config.update("jax_platforms", "cpu")
      else:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
      _check_flags(FLAGS.mode, mode, FLAGS.config)
      # A full disk met by any writer, named; out of memory outside a step that names its batch.
      where, fix = f"in --mode={FLAGS.mode}", "use a smaller model or batch, or more devices"
      with workdir_files.out_of_space_named(), memory.out_of_memory_named(where, fix):
        mode.run(FLAGS.config, FLAGS.workdir)
  except (ConfigError, FloatingPointError) as error:  # a mistake, or a diverged run
    sys.exit(f"electra-jax: error: {error}")


def run():
  """The console script: the CPU settings that must precede JAX's start, then absl."""
  xla_flags.apply_cpu_defaults()  # restarts at most once: the process it starts has them set
  jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS"))  # read at import, before
  sys.modules["__main__"].__doc__ = USAGE  # what absl's --help prints first
  for name in ("mode", "config", "workdir", "out", "step", "take_over_workdir", "version"):
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])  # what --help shows
  try:
    app.run(main, flags_parser=config_lib.flags_parser("electra-jax"))
  except SystemExit as stop:  # a message is the last word: what the work it cut short prints as
    if isinstance(stop.code, str):  # its threads end (orbax's reads of a damaged step) is not news
      print(stop.code, file=sys.stderr, flush=True)
      os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
      raise SystemExit(1) from None
    raise


if __name__ == "__main__":
  run()
