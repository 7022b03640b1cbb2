"""Sweeps (docs/training.md): a grid or list of overrides trained in sub-workdirs of a sweep folder,
whose sweep.json records the base config and the runs, then results.csv, results.md and curves."""

import contextlib
import copy
import csv
import glob
import hashlib
import io
import itertools
import json
import math
import os
import pathlib
import re
import shlex
import signal
import time
from typing import NamedTuple, Sequence

import ml_collections
from absl import flags as absl_flags
from absl import logging
from ml_collections import config_flags
from ml_collections.config_flags import config_path

from electra_jax import checkpointing, config_lib, flops, models, objectives, plots, preemption, train, workdir_files, workdir_lease
from electra_jax.data import sources
from electra_jax.errors import ConfigError

ERROR_FILE = "sweep_error.txt"
Override = tuple[str, str]  # (config key, the value as the user wrote it)

# The tables' metric columns: these first (and only these in results.md), then the others sorted.
HEADLINE_METRICS = (*plots.DEFAULT_METRICS, "disc_accuracy", "main_mlm_accuracy", "cloze_loss")
NOT_IN_TABLE = "step steps_per_sec tokens_per_sec mfu learning_rate sampling_temperature".split()
FIXED_COLUMNS = ("run", "overrides", "status", "steps", "train_tokens", "train_flops")
DOWNSTREAM = ("downstream_task", "downstream_score", "downstream_seeds")  # with --sweep_finetune


class Run(NamedTuple):
  name: str
  overrides: list[Override]


def _label(overrides: Sequence[Override]) -> str:
  return " ".join(f"{k}={v}" for k, v in overrides) or "(recipe)"


def _split_override(text: str, where: str) -> Override:
  key, sep, value = text.partition("=")
  key = key.strip().removeprefix("--").removeprefix("config.")
  if not sep or not key:
    raise ConfigError(f"{where}: {text!r} is not key=value (e.g. objective.name=mlm).")
  return key, value.strip()


def expand(grid: Sequence[str] = (), sweep_file: str | None = None) -> list[list[Override]]:
  """The runs: each line of `sweep_file` (key=value overrides, shell quoting, # comments) crossed
  with the product of the --sweep=KEY=V1,V2 `grid` (either alone works too)."""
  lines = [[]]
  if sweep_file:
    if why := sources.not_a_regular_file(sweep_file):  # a FIFO would wait forever
      raise ConfigError(f"--sweep_file={sweep_file} {why}: give a text file, one run per line.")
    try:
      text = pathlib.Path(sweep_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
      raise ConfigError(f"--sweep_file={sweep_file} is not UTF-8 text ({error}).") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
      try:
        words = shlex.split(line, comments=True)
      except ValueError as error:
        raise ConfigError(f"{sweep_file}:{number}: {error}") from None
      if words:
        lines.append([_split_override(word, f"{sweep_file}:{number}") for word in words])
    if not lines:
      raise ConfigError(f"--sweep_file={sweep_file} lists no runs (one line of overrides per run).")
  axes = []
  for spec in grid:
    key, values = _split_override(spec, f"--sweep={spec}")
    axes.append([(key, v.strip()) for v in values.split(",")])
    if not all(v for _, v in axes[-1]):
      raise ConfigError(f"--sweep={spec}: an empty value; put a value with commas in --sweep_file.")
  runs = [line + list(combo) for line in lines for combo in itertools.product(*axes)]
  for overrides in runs:
    keys = [k for k, _ in overrides]
    if duplicate := next((k for k in keys if keys.count(k) > 1), None):
      raise ConfigError(f"A run sets {duplicate} twice ({_label(overrides)}).")
  return runs


def apply_overrides(
    base: ml_collections.ConfigDict, overrides: Sequence[Override], what: str = "Sweep"
) -> ml_collections.ConfigDict:
  """A copy of `base` with `overrides` applied by ml_collections' own --config.KEY=VALUE parser; a
  bad key or value is a ConfigError starting with `what`."""
  for key, _ in overrides:
    if found := config_lib.unknown_key(base, key):  # (the missing part, a close match or "")
      raise ConfigError(
          f"{what} key {key!r} is not a config key (no {found[0]!r} there; configs/base.py lists "
          f"every key). {found[1]}".strip()
      )
  argv = ["sweep", *(f"--config.{key}={raw}" for key, raw in overrides)]
  flag_values = absl_flags.FlagValues()
  try:
    config_flags.DEFINE_config_dict(
        "config", copy.deepcopy(base), flag_values=flag_values, lock_config=False, sys_argv=argv
    )
    flag_values(argv)
  except absl_flags.Error as error:  # it names the flag and the value
    raise ConfigError(
        f"{what} override refused ({error}); give a value of the key's type, as "
        "--config.KEY=VALUE takes it."
    ) from None
  return flag_values.config


def identity(base: ml_collections.ConfigDict, overrides: Sequence[Override]) -> str:
  """What makes runs the same: the values the overrides give over `base`, in key order (`b=.5
  a=1e-3` is `a=0.001 b=0.5`); a bad key or value is apply_overrides' ConfigError."""
  config = apply_overrides(base, overrides)
  values = [(key, repr(config_path.get_value(key, config))) for key, _ in overrides]
  return json.dumps(sorted(values))


def name_runs(
    override_lists, existing: Sequence[Run], base: ml_collections.ConfigDict
) -> list[Run]:
  """Runs for `override_lists`: the recorded one with the same overrides (by `identity`), else a
  new readable name: the keys' last parts (whole keys where two are alike) and values."""
  by_identity = {identity(base, r.overrides): r for r in existing}
  runs = []
  for overrides in override_lists:
    if (key := identity(base, overrides)) not in by_identity:
      leaves = [k.rsplit(".", 1)[-1] for k, _ in overrides]
      parts = [
          (leaf if leaves.count(leaf) == 1 else k) + "=" + v
          for leaf, (k, v) in zip(leaves, overrides)
      ]
      stem = re.sub(r"[^A-Za-z0-9._=,+-]+", "-", ",".join(parts) or "recipe").strip("-.")
      if len(stem) > 100:
        digest = hashlib.sha1(json.dumps(overrides).encode()).hexdigest()[:8]
        stem = stem[:90].rstrip("-.,=") + "-" + digest
      taken = {r.name for r in by_identity.values()}
      names = itertools.chain([stem], (f"{stem}-{i}" for i in itertools.count(2)))
      by_identity[key] = Run(next(n for n in names if n not in taken), overrides)
    runs.append(by_identity[key])
  return runs


def read_record(sweep_dir: str) -> dict | None:
  """SWEEP_DIR/sweep.json with its runs as Runs; None for a folder that is no sweep's."""
  record = workdir_files.read_sweep(sweep_dir, config_lib.with_defaults)
  return record and dict(record, runs=[Run(*run) for run in record["runs"]])


def load_finetune_config(recipe: str, overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """--sweep_finetune's recipe with --sweep_finetune_override's key=value overrides, checked."""
  from electra_jax.finetune import trainer as finetune  # noqa: PLC0415

  pairs = [_split_override(o, f"--sweep_finetune_override={o}") for o in overrides]
  config = config_lib.load_recipe(recipe, "--sweep_finetune")
  if "init_from" not in config:  # what every fine-tuning recipe has
    raise ConfigError(f"--sweep_finetune={recipe} is no fine-tuning recipe (configs/finetune/).")
  finetune.validate(config := apply_overrides(config, pairs))
  return config


def _latest_checkpoint(workdir: str) -> int | None:
  if not workdir_files.exists(checkpointing.checkpoints_directory(workdir)):
    return None
  with contextlib.closing(checkpointing.Checkpointer(workdir, keep=1)) as checkpointer:
    return checkpointer.latest_step()


def _finetune_columns(results: dict) -> dict:
  """The table's downstream columns of a fine-tuning results.json."""
  summary = results["summary"]
  score = (summary.get(results["task"]) or next(iter(summary.values())))["score"]
  return dict(zip(DOWNSTREAM, (str(results["task"]), 100 * float(score["mean"]), int(score["n"]))))


def _finetune_results(workdir: str) -> dict | None:
  found = sorted(glob.glob(os.path.join(workdir, "finetune", "*", "results.json")))
  return workdir_files.read_json(found[0], _finetune_columns) if found else None


def run_sweep(
    base_config: ml_collections.ConfigDict,
    sweep_dir: str,
    grid: Sequence[str] = (),
    sweep_file: str | None = None,
    finetune_config: ml_collections.ConfigDict | None = None,
    plot: bool = True,
    take_over_workdir: bool = False,
) -> dict:
  """Trains every unfinished run (all checked before anything is written), fine-tunes each with
  load_finetune_config's config if given, writes the tables and curves."""
  override_lists = expand(grid, sweep_file)
  workdir_files.check_usable(sweep_dir)
  record = read_record(sweep_dir)
  existing, saved = record["runs"] if record else [], config_lib.as_saved(base_config)
  if record and (changes := config_lib.changed_keys(record["base_config"], saved)):
    raise ConfigError(
        f"{sweep_dir}/sweep.json was written for another base config ({'; '.join(changes)}): "
        "one table must not mix recipes. Use the same --config and flags, or a new --workdir."
    )
  # A run listed twice (or recorded already) is one run.
  runs = list({run.name: run for run in name_runs(override_lists, existing, base_config)}.values())
  configs = [apply_overrides(base_config, run.overrides) for run in runs]
  for run, config in zip(runs, configs):
    try:
      config_lib.validate(config)
    except ConfigError as error:
      raise ConfigError(f"Sweep run {_label(run.overrides)}: {error}") from None
  # Two sweeps on one folder would each rewrite sweep.json and fail the runs the other trains.
  with contextlib.ExitStack() as stack:
    lease = stack.enter_context(
        workdir_lease.held(sweep_dir, take_over_workdir, "The sweep folder")
    )
    all_runs = list(existing) + [r for r in runs if r not in existing]
    record = dict(base_config=saved, runs=[r._asdict() for r in all_runs])
    workdir_files.write_json(workdir_files.path(sweep_dir, workdir_files.SWEEP_FILE), record)
    logging.info("Sweep of %d runs in %s (%d recorded).", len(runs), sweep_dir, len(all_runs))
    # A SIGTERM (or SIGHUP) stops the sweep: a run saves and returns (its own handler); between
    # runs it is noted here. One an earlier run in this process (a notebook) took is not this one's.
    preemption.clear_sigterm()
    for signum in (signal.SIGTERM, signal.SIGHUP):
      with contextlib.suppress(ValueError):  # not the main thread: no handler
        stack.callback(signal.signal, signum, signal.signal(signum, preemption.note_sigterm))
    failed, preempted = _train_runs(
        runs, configs, sweep_dir, finetune_config, lease, take_over_workdir
    )
    workdir_lease.hold(lease)  # the tables and curves are the holder's to write
    rows = write_report(sweep_dir)
    if plot:
      try:
        plots.plot_curves([sweep_dir], os.path.join(sweep_dir, "curves.png"))
      except ConfigError as error:  # no matplotlib, or no run logged anything yet
        logging.warning("No curves.png: %s", error)
    if failed:
      logging.error("Sweep finished with %d failed run(s): %s", len(failed), ", ".join(failed))
    return dict(runs=[r.name for r in runs], failed=failed, rows=rows, preempted=preempted)


def _train_runs(runs, configs, sweep_dir, finetune_config, lease, take_over):
  """Trains, resumes or skips each run, then fine-tunes it if asked; (failed names, preempted)."""
  failed, durations = [], []
  latest_steps = [_latest_checkpoint(os.path.join(sweep_dir, r.name)) for r in runs]
  to_train = [(latest or 0) < c.train.steps for latest, c in zip(latest_steps, configs)]
  for index, (run, config, latest) in enumerate(zip(runs, configs, latest_steps)):
    where = f"run {index + 1}/{len(runs)} {run.name}"
    if preemption.sigterm_received():
      logging.warning("SIGTERM/SIGHUP: the sweep stops before %s; the same command goes on.", where)
      return failed, True
    workdir_lease.hold(lease)  # every process stops if another sweep took the folder
    workdir, started = os.fspath(workdir_files.path(sweep_dir, run.name)), time.perf_counter()
    eta = "ETA after the first trained run"
    if durations:
      left = sum(to_train[index:]) * sum(durations) / len(durations)
      eta = f"ETA {config_lib.format_duration(left)}"
    logging.info("Sweep %s (%s) | %s", where, _label(run.overrides), eta)
    error_file = workdir_files.path(workdir, ERROR_FILE)
    if not to_train[index]:
      logging.info("Run %s is finished (checkpoint %d): skipped.", run.name, latest)
    else:  # training logs a resume itself
      try:
        train.train_and_evaluate(config, workdir, take_over_workdir=take_over)
      except Exception as error:  # noqa: BLE001 (the sweep goes on; the error is kept and reported)
        workdir_lease.hold(lease)  # a sweep that took the folder over owns this run: stop
        traceback = not isinstance(error, ConfigError)  # the user's input: its message says all
        logging.error("Sweep run %s failed (%s); going on.", run.name, error, exc_info=traceback)
        failed.append(run.name)
        workdir_files.write_text(error_file, f"{type(error).__name__}: {error}\n")
        continue
      reached = _latest_checkpoint(workdir) or 0
      if reached < config.train.steps or preemption.sigterm_received():
        message = "Run %s stopped at step %d (a signal): the sweep stops; the same command goes on."
        logging.warning(message, run.name, reached)
        return failed, True
    error_file.unlink(missing_ok=True)
    if finetune_config is not None and _finetune_results(workdir) is not None:
      logging.info("Run %s is already fine-tuned: skipped.", run.name)
    elif finetune_config is not None:
      from electra_jax.finetune import trainer as finetune  # noqa: PLC0415

      run_finetune_config = apply_overrides(finetune_config, [("init_from", workdir)])
      try:
        finetune.run_finetune(run_finetune_config, os.path.join(workdir, "finetune"))
      except Exception:  # noqa: BLE001
        logging.exception("Fine-tuning run %s failed; going on with the next one.", run.name)
        failed.append(run.name)
    if to_train[index]:  # training (and fine-tuning) time of the runs trained here
      durations.append(time.perf_counter() - started)
  return failed, False


def train_flops_per_token(config: ml_collections.ConfigDict) -> float:
  """The figure train.py uses for MFU, from a run's config alone (no data, no devices)."""
  special_ids = dict(pad=0, cls=1, sep=2, mask=3, vocab_size=config.model.vocab_size)
  objective = objectives.objective_from_config(config, special_ids)
  model = models.build_model(config, objectives.towers(config))
  return flops.objective_flops_per_token(model, objective, config.data.max_seq_len)


def collect_rows(sweep_dir: str) -> tuple[list[str], list[dict]]:
  """(columns, rows): a row per recorded run, from its workdir's files."""
  if (record := read_record(sweep_dir)) is None:
    raise ConfigError(f"{sweep_dir} has no sweep.json: no sweep folder; run --mode=sweep first.")
  override_keys = list(dict.fromkeys(k for r in record["runs"] for k, _ in r.overrides))
  rows, logged = [], {"train": set(), "eval": set()}
  for run in record["runs"]:
    workdir = os.path.join(sweep_dir, run.name)
    row = {"run": run.name, "overrides": _label(run.overrides)}
    row.update((k, dict(run.overrides).get(k, "")) for k in override_keys)
    last = {
        split: workdir_files.last_record(workdir_files.path(workdir, file))
        for split, file in (("train", "metrics.jsonl"), ("eval", "eval_metrics.jsonl"))
    }
    steps = int(last["train"].get("step", 0))
    if workdir_files.exists(workdir_files.path(workdir, ERROR_FILE)):
      row["status"] = "failed"
    elif not workdir_files.exists(workdir_files.path(workdir, "config.json")):
      row["status"] = "not started"
    else:
      config = config_lib.load_workdir_config(workdir)
      # Done once the last step is saved: one killed between logging and saving it resumes.
      done = min(steps, _latest_checkpoint(workdir) or 0) >= config.train.steps
      tokens = steps * config.train.batch_size * config.data.max_seq_len
      row.update(status="done" if done else "incomplete", steps=steps, train_tokens=tokens)
      row["train_flops"] = tokens * train_flops_per_token(config)
    for split, log in last.items():
      names = [name for name in log if name not in NOT_IN_TABLE]
      row.update((f"{split}_{name}", log[name]) for name in names)
      logged[split].update(names)
    row.update(_finetune_results(workdir) or {})
    rows.append(row)
  columns = [*FIXED_COLUMNS[:2], *override_keys, *FIXED_COLUMNS[2:]]
  for split, names in logged.items():
    ordered = [n for n in HEADLINE_METRICS if n in names] + sorted(names - set(HEADLINE_METRICS))
    columns += [f"{split}_{n}" for n in ordered]
  if any("downstream_task" in row for row in rows):
    columns += DOWNSTREAM
  return columns, rows


def _markdown_cell(column: str, value) -> str:
  if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
    return "–"
  if column == "train_flops":
    return f"{value:.3g}"
  if isinstance(value, float):
    return f"{value:.2f}" if column == "downstream_score" else f"{value:.4g}"
  if isinstance(value, int) and column == "train_tokens":
    return f"{value:,}"
  return str(value).replace("|", "\\|")


def write_report(sweep_dir: str) -> list[dict]:
  """Rewrites results.csv (every column) and results.md (the headline metrics); the rows."""
  columns, rows = collect_rows(sweep_dir)
  out = io.StringIO()
  writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
  writer.writeheader()
  for row in rows:
    writer.writerow({c: repr(v) if isinstance(v := row.get(c, ""), float) else v for c in columns})
  workdir_files.write_text(workdir_files.path(sweep_dir, "results.csv"), out.getvalue())
  metrics = [c for c in columns if c.startswith(("train_", "eval_")) and c not in FIXED_COLUMNS]
  hidden = ["overrides", *(c for c in metrics if c.split("_", 1)[1] not in HEADLINE_METRICS)]
  shown = [c for c in columns if c not in hidden]
  lines = ["| " + " | ".join(shown) + " |", "|" + "|".join("---" for _ in shown) + "|"]
  lines += ["| " + " | ".join(_markdown_cell(c, row.get(c)) for c in shown) + " |" for row in rows]
  workdir_files.write_text(workdir_files.path(sweep_dir, "results.md"), "\n".join(lines) + "\n")
  logging.info("Wrote %s/results.md and results.csv (%d runs).", sweep_dir, len(rows))
  return rows
