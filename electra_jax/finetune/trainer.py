"""`run_finetune(config, workdir)`: per seed, train from the backbone, evaluate on dev each epoch, keep the last
(or best) epoch's checkpoint, write metrics and test predictions, and tabulate the seeds."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
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
from electra_jax import checkpointing, config_lib, tensorboard_log, workdir_files, workdir_lease
from electra_jax.errors import ConfigError
from electra_jax.finetune import metrics as metrics_lib
from electra_jax.finetune import model as model_lib
from electra_jax.finetune import optim, squad, tasks

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
# The official epochs by task when config.epochs = 0 (any other task: 3).
OFFICIAL_EPOCHS = {"rte": 10, "stsb": 10, "squad": 2}
# Which epoch a seed keeps: "last" (the official code), or "best" on dev (chosen on dev itself: optimistic).
KEEP_EPOCH = ("last", "best")
# Keys a finished seed's results do not depend on: a re-run that differs only in them keeps it.
_NOT_SEED_KEYS = ("seed", "num_seeds", "log_every")
# Keys added after runs had been finished, with the values that reproduce those runs: a saved config without
# them reads as having these, so its finished seeds still match. A dotted name: a key added inside a group.
_ADDED_KEYS = {
    "min_steps": 0,
    "head": {"pooling": "cls"},
    "select": {"learning_rates": "", "fraction": 0.2, "folds": 1},
    "custom.group_column": "",
    "reinit_layers": 0,
    "select.folds": 1,
}


def _added_key_slots(settings: dict):
  """(its holder dict, name, value when added) for each of _ADDED_KEYS whose group `settings` has."""
  for name, value in _ADDED_KEYS.items():
    group, _, key = name.rpartition(".")
    holder = settings.get(group) if group else settings
    if isinstance(holder, dict):
      yield holder, key, value


def classification_adapter(
    config, data: tasks.TaskData, backbone: model_lib.Backbone
) -> tasks.TaskAdapter:
  encode = lambda examples: tasks.encode_examples(
      examples, backbone.tokenizer, config.max_seq_len, data
  )
  start = time.time()
  train_features = encode(data.train)
  dev_features = {name: encode(examples) for name, examples in data.dev.items()}
  test_features = {name: encode(examples) for name, examples in data.test.items()}
  logging.info(
      "Tokenized %s: %d train, %s dev, %s test examples in %.1f s.",
      data.name,
      len(data.train),
      {k: len(v) for k, v in data.dev.items()},
      {k: len(v) for k, v in data.test.items()},
      time.time() - start,
  )
  is_regression = data.kind == "regression"
  model = backbone.classifier(1 if is_regression else len(data.label_list), config)
  lo, hi = data.target_range or (
      0.0,
      1.0,
  )  # regression learns (label - lo) / hi, as the official RegressionTask

  def loss_fn(outputs, batch):
    if is_regression:
      return jnp.square(outputs[:, 0] - (batch["labels"] - lo) / hi)
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["labels"])

  def to_predictions(outputs):
    return outputs[:, 0] * hi + lo if is_regression else outputs.argmax(-1)

  def score(predict, features):
    return metrics_lib.compute_metrics(
        data.metric_names, features["labels"], to_predictions(predict(features))
    )

  def write_test(predict, directory):
    return [
        tasks.write_predictions(
            os.path.join(directory, f"{name}.tsv"),
            features["index"],
            tasks.prediction_strings(data, to_predictions(predict(features))),
        )
        for name, features in test_features.items()
    ]

  head = (
      dict(kind="regression", target_range=data.target_range and list(data.target_range))
      if is_regression
      else dict(kind="classification", labels=list(data.label_list))
  )

  def split(held, fit):
    held_out = {name: array[held] for name, array in train_features.items()}
    return tasks.TaskAdapter(
        data.name,
        model,
        {name: array[fit] for name, array in train_features.items()},
        loss_fn,
        lambda predict: {"held_out": score(predict, held_out)},
        lambda predict, directory: [],
        head,
    )

  evaluate = lambda predict: {
      name: score(predict, features) for name, features in dev_features.items()
  }
  return tasks.TaskAdapter(
      data.name,
      model,
      train_features,
      loss_fn,
      evaluate,
      write_test,
      head,
      lambda fraction, seed, folds: [
          split(*rows)
          for rows in held_out_rows(
              [example.group for example in data.train], fraction, seed, folds
          )
      ],
  )


def held_out_rows(
    groups: list, fraction: float, seed: int, folds: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
  """[(held-out rows, the rest)]: folds=1, one random share of about `fraction` of the rows (at least one);
  folds=K, K disjoint shares of about 1/K. With groups (none None) each share takes whole groups."""
  rng = np.random.default_rng([seed, 7])
  grouped = all(group is not None for group in groups)
  if grouped:
    _, group_of_row = np.unique(np.array(groups, dtype=str), return_inverse=True)
    sizes = np.bincount(group_of_row)
  else:
    sizes = np.ones(len(groups), int)
  order = rng.permutation(len(sizes))  # the units (groups, or rows) in random order
  ends = np.cumsum(sizes[order])  # rows in the first 1, 2, ... units
  if folds == 1:  # units until `fraction` of the rows are held out, the one reaching it included
    share = (
        np.arange(len(order)) > np.searchsorted(ends, max(1, round(fraction * len(groups))))
    ).astype(int)
  else:  # each unit to the share its rows' midpoint falls in
    share = np.minimum(((ends - sizes[order] / 2) * folds / len(groups)).astype(int), folds - 1)
  units = "groups of config.custom.group_column" if grouped else "rows"
  if folds == 1 and (share == 0).all():
    raise ConfigError(
        f"config.select.fraction={fraction} holds out all {len(order)} {units}; lower it, or give "
        "the training set more."
    )
  if len(np.unique(share)) < folds:
    raise ConfigError(
        f"config.select.folds={folds} leaves a held-out share empty: the training set has "
        f"{len(order)} {units}; lower it, or give the training set more."
    )
  held_units = [order[share == k] for k in range(folds)]
  if not grouped:  # rows in the order drawn
    return [(held, order[share != k]) for k, held in enumerate(held_units)]
  return [
      (np.flatnonzero(held), np.flatnonzero(~held))
      for held in (np.isin(group_of_row, u) for u in held_units)
  ]


def _is_squad(config) -> bool:
  return str(config.task).lower().startswith("squad")


def _num_examples(features) -> int:
  return len(features["input_ids"])


def _steps_per_seed(config, features, epochs: int) -> int:
  return math.ceil(_num_examples(features) / config.batch_size) * epochs


def batches(features: dict[str, np.ndarray], batch_size: int, order: np.ndarray | None = None):
  """Fixed-size batches (one compiled shape): the last is padded with row 0 at weight 0."""
  n = _num_examples(features)
  order = np.arange(n) if order is None else order
  for start in range(0, n, batch_size):
    rows = order[start : start + batch_size]
    weights = (np.arange(batch_size) < len(rows)).astype(np.float32)
    rows = np.concatenate([rows, np.full(batch_size - len(rows), rows[0])])
    yield dict(
        {name: array[rows] for name, array in features.items() if name != "index"}, weights=weights
    )


def _compiled_steps(config, adapter, backbone):
  """(train_step(params, opt_state, batch, seed_key, step, optim.schedule_args), predict_step), compiled once
  for every seed and learning-rate trial of a run."""
  num_layers = backbone.encoder_config.num_layers

  def apply(params, batch, deterministic, rng=None):
    rngs = None if deterministic else {"dropout": rng}
    return adapter.model.apply(
        {"params": params},
        *(batch[k] for k in MODEL_INPUTS),
        deterministic=deterministic,
        rngs=rngs,
    )

  def train_step(params, opt_state, batch, seed_key, step, args):
    rng = jax.random.fold_in(
        seed_key, step
    )  # here, not eagerly: one host dispatch per step instead of two
    tx, _ = optim.make_optimizer(config, params, num_layers, args)

    def loss(p):
      per_example = adapter.loss_fn(apply(p, batch, False, rng), batch)
      return jnp.sum(per_example * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  predict_step = jax.jit(lambda params, batch: apply(params, batch, True))
  return jax.jit(train_step, donate_argnums=(0, 1)), predict_step


def _predictor(predict_step, params, batch_size: int):
  """features -> the model's outputs for their rows; every batch is dispatched before any is read back."""
  return lambda features: np.concatenate(
      jax.device_get([predict_step(params, batch) for batch in batches(features, batch_size)])
  )[: _num_examples(features)]


def validate(config) -> None:
  for key in ("batch_size", "num_seeds", "log_every"):
    if config[key] < 1:
      raise ConfigError(f"config.{key}={config[key]} must be >= 1.")
  if config.epochs < 0 or config.eval_batch_size < 0:
    raise ConfigError(
        f"config.epochs={config.epochs}, eval_batch_size={config.eval_batch_size}: use >= 0 (0: default)"
    )
  config_lib.check_rates(
      config, ("dropout_rate", "attention_dropout_rate", "head_dropout_rate"), "config"
  )
  config_lib.check_optimizer(
      config.optimizer, "the official 1e-4 for Small and Base, 5e-5 for Large"
  )
  choices = (
      ("dtype", config.dtype, config_lib.DTYPES),
      ("keep_epoch", config.keep_epoch, KEEP_EPOCH),
      ("head.pooling", config.head.pooling, model_lib.POOLINGS),
  )
  for key, value, allowed in choices:
    if value not in allowed:
      raise ConfigError(f"config.{key}={value!r}: use one of {list(allowed)}.")
  for key, zero in (
      ("min_steps", "train the epochs alone"),
      ("reinit_layers", "keep every pre-trained layer"),
  ):
    if type(config[key]) is not int or config[key] < 0:  # not a bool either: True is no count
      raise ConfigError(f"config.{key}={config[key]!r} must be an int >= 0 (0 = {zero}).")
  if config.head.pooling != "cls" and _is_squad(config):
    raise ConfigError(
        f"config.head.pooling={config.head.pooling!r} with task {config.task!r}: SQuAD's span head "
        "pools nothing; use head.pooling='cls'."
    )
  select_rates(config)
  config_lib.check_finite(config, "config.")
  optim.check_layerwise(
      config.optimizer.layerwise_lr_decay, config.optimizer.layerwise_lr_decay_rule
  )


def epochs_for(config) -> int:
  """config.epochs, or the task's official count when it is 0 (before min_steps)."""
  task = (
      "squad" if _is_squad(config) else str(config.task).lower().replace("-", "").replace("_", "")
  )
  return config.epochs or OFFICIAL_EPOCHS.get(task, 3)


def resolve_epochs(config, num_train: int) -> int:
  """epochs_for(config), raised to ceil(min_steps / steps per epoch) where it gives fewer than config.min_steps."""
  epochs = epochs_for(config)
  steps_per_epoch = math.ceil(num_train / config.batch_size)
  if config.min_steps and steps_per_epoch and epochs * steps_per_epoch < config.min_steps:
    raised = math.ceil(config.min_steps / steps_per_epoch)
    logging.info(
        "%d epochs give %d optimizer steps (%d train examples, batch %d), fewer than min_steps=%d: "
        "training %d epochs (%d steps).",
        epochs,
        epochs * steps_per_epoch,
        num_train,
        config.batch_size,
        config.min_steps,
        raised,
        raised * steps_per_epoch,
    )
    return raised
  return epochs


def _seed_settings(settings: dict) -> dict:
  """What a seed's results depend on: a saved config less _NOT_SEED_KEYS, with _ADDED_KEYS' defaults."""
  settings = copy.deepcopy(
      {key: value for key, value in settings.items() if key not in _NOT_SEED_KEYS}
  )
  for holder, key, value in _added_key_slots(settings):
    holder.setdefault(key, copy.deepcopy(value))
  return settings


def seed_fingerprint(config) -> str:
  """_seed_settings as a short hash, leaving out added keys at their _ADDED_KEYS values (as before they existed)."""
  settings = _seed_settings(config_lib.as_saved(config))
  for holder, key, value in list(_added_key_slots(settings)):
    if holder[key] == value:
      del holder[key]
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _check_results_of_same_config(config, task_dir: str) -> None:
  """<task>/results.json holds one config's table: another config would replace it with its own."""
  path = os.path.join(task_dir, "results.json")
  if not os.path.exists(path):
    return
  saved = _seed_settings(workdir_files.read_json(path).get("config") or {})
  changes = config_lib.changed_keys(saved, _seed_settings(config_lib.as_saved(config)))
  if changes:
    raise ConfigError(
        f"{path} holds the results of another config ({'; '.join(changes[:5])}); use a new --workdir, "
        "or that config to go on with more seeds. Nothing was written."
    )


def _finished_seeds(config, task_dir: str, task: str, seeds: list[int]) -> dict[int, dict]:
  """The seeds this config already finished here (seed_<s>/metrics.json); another config's are refused."""
  finished, fingerprint = {}, seed_fingerprint(config)
  for seed in seeds:
    path = os.path.join(task_dir, f"seed_{seed}", "metrics.json")
    if not os.path.exists(path):
      continue
    result = workdir_files.read_json(path)
    if result.get("config_fingerprint") != fingerprint:
      raise ConfigError(
          f"{path} exists: this workdir already holds a finished {task} run for seed {seed}, fine-tuned "
          "with another config; use a new --workdir, or that config."
      )
    finished[seed] = result
  return finished


def summarize(per_seed: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
  """{eval name: {metric: {mean, median, best, n}}} over the seeds' kept-epoch dev metrics."""

  def stats(values):
    values = np.array(values)
    return dict(
        mean=float(values.mean()),
        median=float(np.median(values)),
        best=float(values.max()),
        n=len(values),
    )

  return {
      eval_name: {
          metric: stats([run["dev"][eval_name][metric] for run in per_seed]) for metric in first
      }
      for eval_name, first in per_seed[0]["dev"].items()
  }


def format_table(summary) -> str:
  # A one-metric task's score is that metric; thresholds (SQuAD 2.0's null-odds cuts) are not fractions.
  rows = [("task", "metric", "mean", "median", "best", "seeds")] + [
      (
          eval_name,
          metric,
          *(f"{100 * s[key]:.2f}" for key in ("mean", "median", "best")),
          str(s["n"]),
      )
      for eval_name, by_metric in summary.items()
      for metric, s in by_metric.items()
      if not (metric == "score" and len(by_metric) == 2) and not metric.endswith("_thresh")
  ]
  task_w, metric_w = (max(len(row[column]) for row in rows) for column in (0, 1))
  return "\n".join(
      f"{task:<{task_w}} {metric:<{metric_w}} {mean:>8} {median:>8} {best:>8} {seeds:>5}"
      for task, metric, mean, median, best, seeds in rows
  )


def _run_seed(
    config,
    adapter,
    backbone,
    seed: int,
    task_dir: str,
    epochs: int,
    steps,
    progress,
    learning_rate: float | None = None,
) -> dict:
  train_step, predict_step = steps
  seed_dir = os.path.join(task_dir, f"seed_{seed}")
  eval_batch_size = config.eval_batch_size or config.batch_size
  num_train = _num_examples(adapter.train_features)
  total_steps = _steps_per_seed(config, adapter.train_features, epochs)
  args = optim.schedule_args(config, total_steps, learning_rate)

  seed_key = jax.random.key(seed)  # draws the head and, folded with each step, its dropout
  params = model_lib.init_params(
      backbone, adapter.model, seed_key, config.max_seq_len, config.reinit_layers
  )
  tx, schedule = optim.make_optimizer(config, params, backbone.encoder_config.num_layers, args)
  opt_state = tx.init(params)

  # A seed whose earlier run was cut short starts over; its checkpoints and events may be from later steps.
  for stale in ("checkpoints", tensorboard_log.SUBDIR):
    shutil.rmtree(os.path.join(seed_dir, stale), ignore_errors=True)
  checkpointer = checkpointing.Checkpointer(seed_dir, keep=1)
  events = tensorboard_log.ScalarWriter(
      os.path.join(seed_dir, tensorboard_log.SUBDIR)
  )  # each epoch's figures
  kept, history, step = None, [], 0
  with contextlib.closing(checkpointer), contextlib.closing(
      events
  ):  # the checkpointer's close waits for its saves
    for epoch in range(epochs):
      order = np.random.default_rng([seed, epoch]).permutation(num_train)
      losses = []
      for batch in batches(adapter.train_features, config.batch_size, order):
        params, opt_state, loss = train_step(params, opt_state, batch, seed_key, step, args)
        losses.append(loss)
        step += 1
        progress(seed, epoch, step, total_steps, losses, schedule)
      train_loss = float(np.mean(jax.device_get(losses)))
      if not math.isfinite(train_loss):
        raise FloatingPointError(
            f"Seed {seed}: the training loss became {train_loss} in epoch {epoch + 1}; lower "
            "optimizer.learning_rate or use dtype=float32."
        )
      dev = adapter.evaluate(_predictor(predict_step, params, eval_batch_size))
      score = float(np.mean([m["score"] for m in dev.values()]))
      history.append(dict(epoch=epoch + 1, step=step, train_loss=train_loss, dev=dev, score=score))
      events.write(
          {
              "step": step,
              "train_loss": train_loss,
              **{
                  f"{name}/{metric}": value
                  for name, by_metric in dev.items()
                  for metric, value in by_metric.items()
              },
          }
      )
      logging.info(
          "seed %d epoch %d/%d | train loss %.4f | dev %s",
          seed,
          epoch + 1,
          epochs,
          train_loss,
          " ".join(
              f"{name}: " + ", ".join(f"{k}={v:.4f}" for k, v in m.items())
              for name, m in dev.items()
          ),
      )
      if config.keep_epoch == "last" or kept is None or score > kept["score"]:
        kept = dict(history[-1], params=jax.device_get(params))
    # Saved once: a seed cut short starts over, so no epoch before the kept one is ever read.
    checkpointer.save(
        kept["step"],
        {"params": kept["params"]},
        {"epoch": kept["epoch"], "dev": kept["dev"], "seed": seed},
    )

  prediction_files = adapter.write_test(
      _predictor(predict_step, kept["params"], eval_batch_size),
      os.path.join(seed_dir, "predictions"),
  )
  result = dict(
      seed=seed,
      epochs=epochs,
      steps=step,
      keep_epoch=config.keep_epoch,
      kept_epoch=kept["epoch"],
      kept_step=kept["step"],
      dev=kept["dev"],
      history=history,
      checkpoint=os.path.join(checkpointer.directory, str(kept["step"])),
      test_predictions=prediction_files,
      config_fingerprint=seed_fingerprint(config),
  )
  workdir_files.write_json(os.path.join(seed_dir, "metrics.json"), result)
  return result


def run_finetune(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Fine-tunes config.task for config.num_seeds seeds under <workdir>/<task>/, every input checked first; returns
  (and writes to <task>/results.json) the config, each seed's kept-epoch dev metrics and their summary.
  """
  validate(config)
  workdir_files.check_usable(workdir)  # before the data and the backbone load
  backbone = model_lib.load_backbone(config)
  if config.reinit_layers > backbone.encoder_config.num_layers:
    raise ConfigError(
        f"config.reinit_layers={config.reinit_layers} exceeds the encoder's "
        f"{backbone.encoder_config.num_layers} layers; use at most that many."
    )
  if _is_squad(config):
    adapter = squad.make_adapter(config, backbone)
  else:
    adapter = classification_adapter(config, tasks.load_task(config), backbone)
  epochs = resolve_epochs(config, _num_examples(adapter.train_features))
  task_dir = os.path.join(workdir, adapter.name)
  seeds = [config.seed + i for i in range(config.num_seeds)]
  finished = _finished_seeds(config, task_dir, adapter.name, seeds)
  _check_results_of_same_config(config, task_dir)
  os.makedirs(task_dir, exist_ok=True)
  # One run per task folder: each seed starts by deleting its checkpoints, under another run's feet otherwise.
  lease = workdir_lease.WorkdirLease(task_dir)
  lease.acquire()
  try:
    rates = select_rates(config)  # finished trials are read back, not trained again
    steps = _compiled_steps(config, adapter, backbone)
    selection = (
        _select_learning_rate(config, adapter, backbone, task_dir, rates, steps) if rates else None
    )
    steps_per_seed = _steps_per_seed(config, adapter.train_features, epochs)
    logging.info(
        "Fine-tuning %s from %s: %d train examples, %d epochs, %d steps per seed, seeds %s.",
        adapter.name,
        backbone.source,
        _num_examples(adapter.train_features),
        epochs,
        steps_per_seed,
        seeds,
    )
    if finished:
      logging.info(
          "Seeds %s finished in an earlier run with this config: their results are kept.",
          sorted(finished),
      )
    progress = _progress_logger(config, epochs, [seed for seed in seeds if seed not in finished])
    rate = selection and selection["learning_rate"]
    per_seed = [
        finished[seed]
        if seed in finished
        else _run_seed(config, adapter, backbone, seed, task_dir, epochs, steps, progress, rate)
        for seed in seeds
    ]
    summary = summarize(per_seed)
    config_json = config_lib.to_json(config)
    results = dict(
        # epochs: after min_steps, what each seed trained (config.epochs holds what was asked).
        task=adapter.name,
        init=backbone.source,
        epochs=epochs,
        steps_per_seed=steps_per_seed,
        head=adapter.head,
        selection=selection,
        electra_jax_version=electra_jax.__version__,
        config=json.loads(config_json),
        config_fingerprint=hashlib.sha256(config_json.encode()).hexdigest()[:16],
        seeds={
            str(run["seed"]): {k: run[k] for k in ("kept_epoch", "dev", "test_predictions")}
            for run in per_seed
        },
        summary=summary,
    )
    workdir_files.write_json(os.path.join(task_dir, "results.json"), results)
    logging.info(
        "Results over %d seed(s) in %s; the table:",
        len(seeds),
        os.path.join(task_dir, "results.json"),
    )
    print(format_table(summary))
    return results
  finally:
    lease.release()


def _progress_logger(config, epochs: int, pending: list[int]):
  """progress(seed, epoch, step, total, losses, schedule): a line every log_every steps with the learning rate,
  the speed from the second step on (compiling is not speed) and the ETA over the `pending` seeds.
  """
  clock = dict(start=None, done=0)

  def progress(seed, epoch, step, total, losses, schedule):
    if clock["start"] is None:
      clock["start"] = time.perf_counter()
      return
    clock["done"] += 1
    if step % config.log_every and step != total:
      return
    rate = clock["done"] / (time.perf_counter() - clock["start"])
    remaining = (total - step) + total * (len(pending) - 1 - pending.index(seed))
    loss = float(np.mean(jax.device_get(losses[-config.log_every :])))
    logging.info(
        "seed %d | epoch %d/%d | step %d/%d | loss %.4f | lr %.3g | %.1f steps/s | ETA %s",
        seed,
        epoch + 1,
        epochs,
        step,
        total,
        loss,
        float(schedule(step - 1)),
        rate,
        config_lib.format_duration(remaining / max(rate, 1e-9)),
    )

  return progress


def select_rates(config) -> list[float]:
  """config.select.learning_rates as floats ([] when off), refused by name when unreadable."""
  text = str(config.select.learning_rates).strip()
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
        f"config.select.learning_rates={text!r} with task {config.task!r}: SQuAD's windows cannot be "
        "split by rows; set it to ''."
    )
  if rates and not 0.0 < config.select.fraction < 1.0:
    raise ConfigError(
        f"config.select.fraction={config.select.fraction} must be in (0, 1): the share held out."
    )
  if rates and (not isinstance(config.select.folds, int) or config.select.folds < 1):
    raise ConfigError(
        f"config.select.folds={config.select.folds!r} must be a whole number >= 1 (the shares held out)."
    )
  return rates


def _select_learning_rate(
    config, adapter, backbone, task_dir: str, rates: list[float], steps
) -> dict:
  """Fine-tunes seed config.seed at each rate on the rest of train, scored on the held-out share (the mean over
  select.folds shares), trials kept under <task_dir>/select/: {"learning_rate", "held_out_scores": {rate: score}}.
  """
  folds, seed, scores = config.select.folds, config.seed, {}
  splits = [
      (fit, resolve_epochs(config, _num_examples(fit.train_features)))  # per held-out share
      for fit in adapter.split(config.select.fraction, seed, folds)
  ]
  for rate in rates:
    trial = copy.deepcopy(config)
    trial.optimizer.learning_rate, trial.select.learning_rates, trial.keep_epoch = rate, "", "last"
    fold_scores = []
    for k, (fit, epochs) in enumerate(splits):
      name = f"lr_{rate:g}" if folds == 1 else f"lr_{rate:g}_fold{k + 1}of{folds}"
      directory = os.path.join(task_dir, "select", name)
      result = _finished_seeds(trial, directory, adapter.name, [seed]).get(seed)
      if result is None:
        num_fit = _num_examples(fit.train_features)
        logging.info(
            "Choosing the learning rate on train: %g, on %d examples (%d held out%s).",
            rate,
            num_fit,
            _num_examples(adapter.train_features) - num_fit,
            f", share {k + 1} of {folds}" * (folds > 1),
        )
        result = _run_seed(
            trial,
            fit,
            backbone,
            seed,
            directory,
            epochs,
            steps,
            _progress_logger(trial, epochs, [seed]),
        )
      fold_scores.append(result["dev"]["held_out"]["score"])
    scores[f"{rate:g}"] = float(np.mean(fold_scores))
  best = max(
      rates, key=lambda rate: scores[f"{rate:g}"]
  )  # the first of equals: rates in the given order
  logging.info("Held-out scores by learning rate %s: training every seed at %g.", scores, best)
  return dict(learning_rate=best, held_out_scores=scores)
