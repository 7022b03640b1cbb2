"""`run_finetune(config, workdir)`: per seed, train from the backbone and score dev each epoch,
keep the last (or best) epoch's checkpoint and test predictions, and tabulate the seeds."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

import electra_jax
from electra_jax import checkpointing, config_lib, memory, preemption, tensorboard_log, workdir_files
from electra_jax import workdir_lease
from electra_jax.errors import ConfigError
from electra_jax.finetune import model as model_lib
from electra_jax.finetune import optim, squad, tasks

# The official epochs by task when config.epochs = 0 (any other task: 3).
OFFICIAL_EPOCHS = {"rte": 10, "stsb": 10, "squad": 2}
# Keys a finished seed's results do not depend on: a re-run that differs only in them keeps it.
_NOT_SEED_KEYS = ("seed", "num_seeds", "log_every")
_BASE_RECIPE = os.path.join(config_lib.RECIPES_DIR, "finetune", "base.py")  # every key, defaults


def _is_squad(config) -> bool:
  return str(config.task).lower().startswith("squad")


def validate(config) -> None:
  """Refuses a fine-tuning config whose values cannot run, before anything is read or compiled."""
  config_lib.check_finite(config, "config.")
  counts = dict(batch_size=1, num_seeds=1, log_every=1, max_seq_len=3, epochs=0, eval_batch_size=0)
  counts.update({"min_steps": 0, "reinit_layers": 0, "select.folds": 1})  # dotted: the group's
  for key, least in counts.items():
    if type(config[key]) is not int or config[key] < least:  # not a bool either: True is no count
      raise ConfigError(f"config.{key}={config[key]!r} must be an int >= {least}.")
  rates = ("dropout_rate", "attention_dropout_rate", "head_dropout_rate")
  config_lib.check_rates(config, rates, "config")
  optim.check(config.optimizer)
  for key, allowed in (
      ("dtype", config_lib.DTYPES),
      ("source", ("dir", "tfds")),  # GLUE's TSVs or SQuAD's JSON, or TFDS's
      ("custom.kind", ("classification", "regression")),
      ("keep_epoch", ("last", "best")),
      ("head.pooling", model_lib.POOLINGS),
      ("optimizer.layerwise_lr_decay_rule", optim.LAYERWISE_RULES),
  ):
    if config[key] not in allowed:  # a dotted key reads the group's value
      raise ConfigError(f"config.{key}={config[key]!r}: use one of {list(allowed)}.")
  select_rates(config)
  if _is_squad(config):
    squad.squad_settings(config)


def select_rates(config) -> list[float]:
  """config.select.learning_rates as floats ([] when off), refused by name when unreadable."""
  text, select = str(config.select.learning_rates).strip(), config.select
  try:
    rates = [float(part) for part in text.split(",")] if text else []
  except ValueError:
    rates = [-1.0]  # refused below
  if any(not (math.isfinite(rate) and rate > 0) for rate in rates) or len(set(rates)) != len(rates):
    raise ConfigError(
        f"config.select.learning_rates={text!r}: give distinct positive rates, comma-separated "
        "(e.g. '3e-4,1e-3,3e-3'), or '' to train at optimizer.learning_rate."
    )
  if rates and _is_squad(config):
    raise ConfigError(
        f"config.select.learning_rates={text!r}: SQuAD's windows cannot be split by rows; set it to ''."
    )
  if rates and not 0.0 < select.fraction < 1.0:
    raise ConfigError(f"config.select.fraction={select.fraction} must be in (0, 1).")
  return rates


def resolve_epochs(config, num_train: int) -> tuple[int, int]:
  """(epochs, steps): config.epochs (0: the task's official count), raised to reach
  config.min_steps steps, of batch_size rows each."""
  task = str(config.task).lower().replace("-", "").replace("_", "")
  epochs = config.epochs or OFFICIAL_EPOCHS.get("squad" if _is_squad(config) else task, 3)
  steps_per_epoch = math.ceil(num_train / config.batch_size)
  if config.min_steps and steps_per_epoch and epochs * steps_per_epoch < config.min_steps:
    raised = math.ceil(config.min_steps / steps_per_epoch)
    line = "%d epochs give %d steps, fewer than min_steps=%d: training %d epochs."
    logging.info(line, epochs, epochs * steps_per_epoch, config.min_steps, raised)
    epochs = raised
  return epochs, epochs * steps_per_epoch


def _saved_config(saved: dict) -> ml_collections.ConfigDict:
  """A config our files hold, completed by configs/finetune/base.py and checked as a run's."""
  config = config_lib.with_defaults(saved, _BASE_RECIPE)
  try:
    validate(config)
  except ConfigError as error:
    raise ValueError(error) from None  # read_json names the file
  return config


def read_results(task_dir: str) -> dict | None:
  """<task_dir>/results.json (None if absent), seeds sorted; an edited one is refused by key."""
  path = os.path.join(task_dir, "results.json")
  if not os.path.exists(path):
    return None

  def parse(results: dict) -> dict:
    head = results["head"]
    field = {"classification": "labels", "regression": "target_range", "span": "answerable"}
    if field.get(head["kind"]) not in head:
      raise ValueError(f"head {head} is not a classification, regression or span head")
    seeds = sorted(int(seed) for seed in results["seeds"])
    return dict(results, config=_saved_config(results["config"]), seeds=seeds)

  return workdir_files.read_json(path, parse)


def _seed_result(result: dict) -> dict:
  """A finished seed's metrics.json as the summary reads it."""
  if missing := {"config", "kept_epoch", "dev", "test_predictions"} - set(result):
    raise KeyError(f"it lacks {sorted(missing)}")
  if not all(type(v) in (int, float) for m in result["dev"].values() for v in m.values()):
    raise ValueError(f"its dev metrics {result['dev']} are not all numbers")
  return dict(result, config=_saved_config(result["config"]))


def _refuse_another_config(path: str, saved, config) -> None:
  """A finished seed or results table is another config's unless only _NOT_SEED_KEYS differ."""
  changes = config_lib.changed_keys(config_lib.as_saved(saved), config_lib.as_saved(config))
  if changes := [c for c in changes if c.partition(":")[0] not in _NOT_SEED_KEYS]:
    raise ConfigError(
        f"{path} holds the results of another config ({'; '.join(changes[:5])}); use a new "
        "--workdir, or that config to go on with more seeds. Nothing was written."
    )


def _finished_seeds(config, task_dir: str, seeds: list[int]) -> dict[int, dict]:
  """The seeds this config finished here (seed_<s>/metrics.json); another config's are refused."""
  finished = {}
  for seed in seeds:
    path = os.path.join(task_dir, f"seed_{seed}", "metrics.json")
    if os.path.exists(path):
      finished[seed] = workdir_files.read_json(path, _seed_result)
      _refuse_another_config(path, finished[seed]["config"], config)
  return finished


def batches(features: dict[str, np.ndarray], batch_size: int, order: np.ndarray | None = None):
  """Fixed-size batches (one compiled shape): the last is padded with row 0 at weight 0."""
  n = len(features["input_ids"])
  order = np.arange(n) if order is None else order
  for start in range(0, n, batch_size):
    rows = order[start : start + batch_size]
    weights = (np.arange(batch_size) < len(rows)).astype(np.float32)
    rows = np.concatenate([rows, np.full(batch_size - len(rows), rows[0])])
    batch = {name: array[rows] for name, array in features.items() if name != "index"}
    yield dict(batch, weights=weights)


def _compiled_steps(config, adapter, backbone):
  """(train_step, predict_step), compiled once for every seed and learning-rate trial of a run."""

  def apply(params, batch, deterministic, rng=None):
    inputs = (batch[key] for key in tasks.MODEL_INPUTS)
    rngs = None if deterministic else {"dropout": rng}
    return adapter.model.apply({"params": params}, *inputs, deterministic=deterministic, rngs=rngs)

  def train_step(params, opt_state, batch, seed_key, step, schedule):
    rng = jax.random.fold_in(seed_key, step)  # here, not eagerly: one host dispatch per step
    tx = optim.make_optimizer(config, params, backbone.model.config.num_layers)

    def loss(p):
      per_example = adapter.loss_fn(apply(p, batch, False, rng), batch)
      return jnp.sum(per_example * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params, schedule=schedule)
    return optax.apply_updates(params, updates), opt_state, value

  predict_step = jax.jit(lambda params, batch: apply(params, batch, True))
  return jax.jit(train_step, donate_argnums=(0, 1)), predict_step


def _predictor(predict_step, params, batch_size: int):
  """features -> the model's outputs for their rows; all batches dispatched before any is read."""
  return lambda features: np.concatenate(
      jax.device_get([predict_step(params, batch) for batch in batches(features, batch_size)])
  )[: len(features["input_ids"])]


def _run_seed(config, adapter, backbone, steps, seed, task_dir, rate=None, seeds_after=0):
  """Trains `seed` at `rate` (None: optimizer.learning_rate) with _compiled_steps's `steps` and the
  run's signals; returns seed_<seed>/metrics.json. The ETA counts `seeds_after` more seeds."""
  train_step, predict_step, signals = steps
  seed_dir = os.path.join(task_dir, f"seed_{seed}")
  eval_batch_size = config.eval_batch_size or config.batch_size
  num_train = len(adapter.train_features["input_ids"])
  epochs, total_steps = resolve_epochs(config, num_train)
  schedule = optim.schedule(config, total_steps, rate)
  seed_key = jax.random.key(seed)  # draws the head and, folded with each step, its dropout
  params = model_lib.init_params(
      backbone, adapter.model, seed_key, config.max_seq_len, config.reinit_layers
  )
  tx = optim.make_optimizer(config, params, backbone.model.config.num_layers)
  opt_state = tx.init(params)
  # A seed whose earlier run was cut short starts over: its checkpoints and events may be later.
  for stale in ("checkpoints", tensorboard_log.SUBDIR):
    shutil.rmtree(os.path.join(seed_dir, stale), ignore_errors=True)
  checkpointer = checkpointing.Checkpointer(seed_dir, keep=1)
  events = tensorboard_log.ScalarWriter(os.path.join(seed_dir, tensorboard_log.SUBDIR))
  kept, history, step = None, [], 0
  sizes = f"with batch_size={config.batch_size} (eval_batch_size {eval_batch_size})"
  fix = "lower batch_size (or eval_batch_size); the seeds finished are kept"
  out_of_memory = memory.out_of_memory_named(sizes, fix)
  # Closing waits for saves.
  with contextlib.closing(checkpointer), contextlib.closing(events), out_of_memory:
    for epoch in range(epochs):
      order = np.random.default_rng([seed, epoch]).permutation(num_train)
      losses = []
      for batch in batches(adapter.train_features, config.batch_size, order):
        if signals.requested:  # the seed in progress starts over when the run goes on
          raise SystemExit(
              f"Fine-tuning stopped by {signals.signal_name}: the seeds finished are kept in "
              f"{task_dir}, the lease is released; run the same command to train the others."
          )
        params, opt_state, loss = train_step(params, opt_state, batch, seed_key, step, schedule)
        losses.append(loss)
        step += 1
        if step == 1:
          started = time.perf_counter()  # compiling is not speed
        elif step % config.log_every == 0 or step == total_steps:
          speed = (step - 1) / (time.perf_counter() - started)
          eta = config_lib.format_duration((total_steps * (1 + seeds_after) - step) / speed)
          where = f"seed {seed} | epoch {epoch + 1}/{epochs} | step {step}/{total_steps}"
          recent = float(np.mean(jax.device_get(losses[-config.log_every :])))
          line = "%s | loss %.4f | lr %.3g | %.1f steps/s | ETA %s"
          logging.info(line, where, recent, float(schedule(step - 1)), speed, eta)
      train_loss = float(np.mean(jax.device_get(losses)))
      if not math.isfinite(train_loss):
        raise FloatingPointError(
            f"Seed {seed}: the training loss became {train_loss} in epoch {epoch + 1}; lower "
            "optimizer.learning_rate or use dtype=float32."
        )
      dev = adapter.evaluate(_predictor(predict_step, params, eval_batch_size))
      score = float(np.mean([m["score"] for m in dev.values()]))
      history.append(dict(epoch=epoch + 1, step=step, train_loss=train_loss, dev=dev, score=score))
      scalars = {f"{name}/{k}": v for name, metrics in dev.items() for k, v in metrics.items()}
      events.write({"step": step, "train_loss": train_loss, **scalars})
      dev_text = " ".join(f"{k}={v:.4f}" for k, v in scalars.items())
      line = "seed %d epoch %d/%d | train loss %.4f | dev %s"
      logging.info(line, seed, epoch + 1, epochs, train_loss, dev_text)
      if config.keep_epoch == "last" or kept is None or score > kept["score"]:
        kept = dict(history[-1], params=jax.device_get(params))
    # Saved once: a seed cut short starts over, so no epoch before the kept one is ever read.
    metadata = {"epoch": kept["epoch"], "dev": kept["dev"], "seed": seed}
    checkpointer.save(kept["step"], {"params": kept["params"]}, metadata)

  predict = _predictor(predict_step, kept["params"], eval_batch_size)
  written = adapter.write_test(predict, os.path.join(seed_dir, "predictions"))
  result = dict(
      seed=seed,
      epochs=epochs,
      steps=step,
      kept_epoch=kept["epoch"],
      kept_step=kept["step"],
      dev=kept["dev"],
      history=history,
      test_predictions=written,
      config=config_lib.as_saved(config),
  )
  workdir_files.write_json(os.path.join(seed_dir, "metrics.json"), result)
  return result


def _select_learning_rate(config, adapter, backbone, steps, task_dir: str) -> dict | None:
  """Trains seed config.seed at each rate on the rest of train, scored on the held-out share (mean
  over select.folds), trials in <task_dir>/select/: {"learning_rate", "held_out_scores"} or None."""
  if not (rates := select_rates(config)):  # finished trials are read back, not trained again
    return None
  folds, seed, scores = config.select.folds, config.seed, {}
  fits = adapter.split(config.select.fraction, seed, folds)
  for rate in rates:
    trial = config.copy_and_resolve_references()
    trial.optimizer.learning_rate, trial.select.learning_rates, trial.keep_epoch = rate, "", "last"
    fold_scores = []
    for k, fit in enumerate(fits):
      name = f"lr_{rate:g}" if folds == 1 else f"lr_{rate:g}_fold{k + 1}of{folds}"
      directory = os.path.join(task_dir, "select", name)
      result = _finished_seeds(trial, directory, [seed]).get(seed)
      if result is None:
        num_fit = len(fit.train_features["input_ids"])
        logging.info("Choosing the learning rate on train: %s on %d examples.", name, num_fit)
        result = _run_seed(trial, fit, backbone, steps, seed, directory)
      fold_scores.append(result["dev"]["held_out"]["score"])
    scores[f"{rate:g}"] = float(np.mean(fold_scores))
  # The first of equals: rates in the order given.
  best = max(rates, key=lambda rate: scores[f"{rate:g}"])
  logging.info("Held-out scores by learning rate %s: training every seed at %g.", scores, best)
  return dict(learning_rate=best, held_out_scores=scores)


def summarize(per_seed: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
  """{eval name: {metric: {mean, median, best, n}}} over the seeds' kept-epoch dev metrics."""

  def stats(values):
    return dict(mean=np.mean(values), median=np.median(values), best=np.max(values), n=len(values))

  return {
      name: {metric: stats([run["dev"][name][metric] for run in per_seed]) for metric in first}
      for name, first in per_seed[0]["dev"].items()
  }


def format_table(summary) -> str:
  # A one-metric task's score is that metric; SQuAD 2.0's null-odds cuts are not fractions.
  rows = [("task", "metric", "mean", "median", "best", "seeds")] + [
      (name, metric, *(f"{100 * s[key]:.2f}" for key in ("mean", "median", "best")), str(s["n"]))
      for name, by_metric in summary.items()
      for metric, s in by_metric.items()
      if not (metric == "score" and len(by_metric) == 2) and not metric.endswith("_thresh")
  ]
  task_w, metric_w = (max(len(row[column]) for row in rows) for column in (0, 1))
  return "\n".join(
      f"{task:<{task_w}} {metric:<{metric_w}} {mean:>8} {median:>8} {best:>8} {seeds:>5}"
      for task, metric, mean, median, best, seeds in rows
  )


def run_finetune(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Fine-tunes config.task for config.num_seeds seeds in <workdir>/<task>/, every input checked
  first; returns <task>/results.json: the config, each seed's kept dev metrics and their summary."""
  validate(config)
  workdir_files.check_usable(workdir)  # before the data and the backbone load
  backbone = model_lib.load_backbone(config)
  adapter = (squad if _is_squad(config) else tasks).make_adapter(config, backbone)
  num_train = len(adapter.train_features["input_ids"])
  epochs, steps_per_seed = resolve_epochs(config, num_train)
  task_dir = os.path.join(workdir, adapter.name)
  seeds = [config.seed + i for i in range(config.num_seeds)]
  finished = _finished_seeds(config, task_dir, seeds)
  if results := read_results(task_dir):
    _refuse_another_config(os.path.join(task_dir, "results.json"), results["config"], config)
  # One run per task folder: each seed starts by deleting its checkpoints, under another run's feet.
  with preemption.Preemption() as signals, workdir_lease.held(task_dir, take_over=False):
    signals.start_loop()  # SIGTERM, SIGHUP or a first Ctrl-C: noted, and the next step stops
    steps = (*_compiled_steps(config, adapter, backbone), signals)
    selection = _select_learning_rate(config, adapter, backbone, steps, task_dir)
    line = "Fine-tuning %s from %s, seeds %s: %d examples, %d epochs, %d steps each."
    logging.info(line, adapter.name, backbone.source, seeds, num_train, epochs, steps_per_seed)
    if finished:
      logging.info("Seeds %s finished earlier with this config: kept.", sorted(finished))
    pending = [seed for seed in seeds if seed not in finished]
    rate = selection and selection["learning_rate"]
    for i, seed in enumerate(pending):
      args = (steps, seed, task_dir, rate, len(pending) - 1 - i)
      finished[seed] = _run_seed(config, adapter, backbone, *args)
    per_seed = [finished[seed] for seed in seeds]
    kept = ("kept_epoch", "dev", "test_predictions")  # of each seed, in results.json
    results = dict(
        task=adapter.name,
        init=backbone.source,
        epochs=epochs,  # after min_steps, what each seed trained (config.epochs: what was asked)
        steps_per_seed=steps_per_seed,
        head=adapter.head,
        selection=selection,
        electra_jax_version=electra_jax.__version__,
        config=config_lib.as_saved(config),
        seeds={str(run["seed"]): {k: run[k] for k in kept} for run in per_seed},
        summary=summarize(per_seed),
    )
    path = os.path.join(task_dir, "results.json")
    workdir_files.write_json(path, results)
    logging.info("Results over %d seed(s) in %s; the table:", len(seeds), path)
    print(format_table(results["summary"]))
    return results
