"""Sentence(-pair) classification and regression: the nine GLUE tasks (GLUE's TSVs or TFDS
`glue/<config>`) and custom TSV/CSV/JSONL files, their checks and features, and their adapter."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from electra_jax import workdir_files
from electra_jax.data import sources, tfds_source
from electra_jax.errors import ConfigError
from electra_jax.finetune import metrics as metrics_lib

csv.field_size_limit(sys.maxsize)  # QQP's longest fields pass csv's default limit
MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")  # a task model's, in order
# Rows are padded to a multiple of this (one compiled shape per split, even lengths for kernels).
PAD_MULTIPLE = 8


@dataclasses.dataclass
class TaskAdapter:
  """What the trainer needs from a task. Features: numpy [examples, ...], MODEL_INPUTS included."""

  name: str
  model: Any  # a flax.linen.Module
  train_features: dict[str, np.ndarray]
  loss_fn: Callable  # (outputs, batch) -> per-example losses [batch]
  evaluate: Callable  # predict (features -> outputs) -> {eval name: {metric: value, "score": ..}}
  write_test: Callable  # (predict, directory) -> paths written
  head: dict  # for exports: its "kind" and "labels", "target_range" or "answerable"
  # (fraction, seed, folds) -> per held_out_rows share, this adapter fit on the rest, scoring it.
  split: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Example:
  text_a: str
  text_b: str | None
  label: str | float | None  # None in unlabelled (test) splits
  index: int  # the row's id: GLUE submissions list predictions by it
  group: str | None = None  # custom.group_column's value (train only)


@dataclasses.dataclass
class TaskData:
  """A task's examples and what they mean, checked by `load_task`."""

  name: str
  kind: str  # "classification" or "regression" ("span" tasks come from squad.py)
  label_list: tuple[str, ...] | None  # classification: label id i is label_list[i]
  metric_names: tuple[str, ...]
  train: list[Example]
  dev: dict[str, list[Example]]  # evaluation name (e.g. "mnli-m") -> examples
  test: dict[str, list[Example]]  # submission name (e.g. "MNLI-m") -> unlabelled examples
  target_range: tuple[float, float] | None = None  # regression: learns (label - lo) / hi
  train_file: str = ""  # where the train split was read, as errors name it


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """A GLUE task: labels as GLUE writes them (None: regression), TFDS's names and class order where
  they differ, {eval or submission name: file stem}, symmetric: trained on both sentence orders."""

  directory: str
  label_list: tuple[str, ...] | None
  text_columns: tuple[str, str | None]
  label_column: str = "label"
  tfds_text: tuple[str, str | None] | None = None
  tfds_labels: tuple[str, ...] | None = None
  dev_files: dict[str, str] | None = None
  test_files: dict[str, str] | None = None
  symmetric: bool = False
  header: tuple[str, ...] | None = None  # of labelled files without one (CoLA's train and dev)
  target_range: tuple[float, float] | None = None


_BINARY = ("0", "1")  # WNLI's too: GLUE writes its labels 0/1 (1 = entailment), as TFDS
_ENTAILMENT = ("entailment", "not_entailment")
_PAIR = ("sentence1", "sentence2")
GLUE_TASKS = {
    "cola": GlueTask(
        "CoLA", _BINARY, ("sentence", None), header=("source", "label", "mark", "sentence")
    ),
    "sst2": GlueTask("SST-2", _BINARY, ("sentence", None)),
    "mrpc": GlueTask("MRPC", _BINARY, ("#1 String", "#2 String"), "Quality", _PAIR, symmetric=True),
    "stsb": GlueTask("STS-B", None, _PAIR, "score", symmetric=True, target_range=(0.0, 5.0)),
    "qqp": GlueTask("QQP", _BINARY, ("question1", "question2"), "is_duplicate"),
    "mnli": GlueTask(
        "MNLI",
        ("contradiction", "entailment", "neutral"),
        _PAIR,
        "gold_label",
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        {"mnli-m": "dev_matched", "mnli-mm": "dev_mismatched"},
        {"MNLI-m": "test_matched", "MNLI-mm": "test_mismatched"},
    ),
    "qnli": GlueTask("QNLI", _ENTAILMENT, ("question", "sentence")),
    "rte": GlueTask("RTE", _ENTAILMENT, _PAIR),
    "wnli": GlueTask("WNLI", _BINARY, _PAIR),
}
TASK_NAMES = tuple(GLUE_TASKS) + ("custom",)


def require_file(path: str, fix: str) -> None:
  """Refuses, before it is opened, a `path` that is not a regular file."""
  if problem := sources.not_a_regular_file(path):
    raise ConfigError(f"{path} {problem}; {fix}.")


def _regression_label(raw, where: str) -> float:
  with contextlib.suppress(TypeError, ValueError):
    if not isinstance(raw, bool) and math.isfinite(label := float(raw)):  # JSON's true is no target
      return label
  raise ConfigError(f"{where}: regression label {raw!r} is not a finite number.")


def _glue_tsv(task: GlueTask, path: str, labelled: bool) -> list[Example]:
  """The examples of a GLUE TSV by its header's column names."""
  with open(path, encoding="utf-8-sig", newline="") as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  if labelled and task.header:
    rows.insert(0, list(task.header))
  if not rows:
    raise ConfigError(f"{path} is empty; GLUE files start with a header line.")
  header, (text_a, text_b) = rows[0], task.text_columns
  sources.refuse_repeated(path, header)
  wanted = [c for c in (text_a, text_b, task.label_column if labelled else None) if c is not None]
  if missing := [c for c in wanted if c not in header]:
    raise ConfigError(f"{path} has no column {missing[0]!r} (its header: {header}); wrong file?")
  at = {name: header.index(name) for name in wanted}
  index_at = next((header.index(name) for name in ("index", "id") if name in header), None)
  examples, skipped = [], 0
  for row_number, row in enumerate(rows[1:]):
    if len(row) < len(header):
      skipped += 1  # QQP's train.tsv has a few broken lines; TFDS and the official code skip them
      continue
    index = int(row[index_at]) if index_at is not None and row[index_at].isdigit() else row_number
    label = row[at[task.label_column]] if labelled else None
    if labelled and task.label_list is None:
      label = _regression_label(label, path)
    examples.append(Example(row[at[text_a]], row[at[text_b]] if text_b else None, label, index))
  if skipped:
    logging.warning("Skipped %d malformed line(s) of %s.", skipped, path)
  return examples


def open_tfds_split(name: str, split: str, data_dir: str | None):
  """The records of a prepared TFDS split, or a ConfigError saying how to prepare it."""
  tfds = tfds_source.import_tfds()  # a heavy import, only when this source is used
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as error:  # tfds raises several types for "not prepared here" / "no such split"
    raise ConfigError(
        f"Cannot open TFDS {name!r} split {split!r} in {data_dir or 'the default data dir'} "
        f"({type(error).__name__}: {error}); run `tfds build --file_format=array_record {name}`, "
        "set config.tfds_data_dir, or use config.source=dir."
    ) from error
  return [source[i] for i in range(len(source))]


def load_glue(name: str, config) -> TaskData:
  """GLUE task `name` from config.source: "dir", GLUE's layout (<data_dir>/<Task>/{train,dev,test}
  .tsv, test optional), or "tfds", a prepared glue/<name>, its labels turned into GLUE's."""
  task, task_dir = GLUE_TASKS[name], os.path.join(config.data_dir, GLUE_TASKS[name].directory)
  if not os.path.isdir(task_dir):  # the task's own folder works as well as GLUE's root
    task_dir = config.data_dir

  def read(stem: str, labelled: bool) -> list[Example] | None:
    if config.source == "dir":
      path = os.path.join(task_dir, stem + ".tsv")
      if not labelled and not os.path.lexists(path):
        return None  # (a test split is optional)
      require_file(path, f"give GLUE's {task.directory}/{stem}.tsv in config.data_dir")
      return _glue_tsv(task, path, labelled)
    split = stem.replace("dev", "validation")
    text_a, text_b = task.tfds_text or task.text_columns
    labels = task.tfds_labels or task.label_list
    examples = []
    for record in open_tfds_split(f"glue/{name}", split, config.tfds_data_dir):
      label = record["label"] if labelled else None
      label = label if label is None else float(label) if labels is None else labels[int(label)]
      text = record[text_b].decode() if text_b else None  # (TFDS's texts are bytes)
      examples.append(Example(record[text_a].decode(), text, label, int(record["idx"])))
    return sorted(examples, key=lambda example: example.index)  # TFDS shuffles; idx is GLUE's row

  test_stems = task.test_files or {task.directory: "test"}
  return TaskData(
      name,
      "regression" if task.label_list is None else "classification",
      task.label_list,
      metrics_lib.GLUE_METRICS[name],
      read("train", True),
      {dev_name: read(stem, True) for dev_name, stem in (task.dev_files or {name: "dev"}).items()},
      {key: test for key, stem in test_stems.items() if (test := read(stem, False)) is not None},
      task.target_range,
      os.path.join(task_dir, "train.tsv") if config.source == "dir" else f"TFDS glue/{name}",
  )


CUSTOM_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


def _custom_records(path: str, file_format: str) -> list[dict]:
  if file_format == "jsonl":
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is not text)
      lines = [(f"{path}:{number}", line) for number, line in enumerate(f, 1) if line.strip()]
    records = []
    for where, line in lines:
      try:
        records.append(json.loads(line, object_pairs_hook=sources.unique_object(where)))
      except json.JSONDecodeError as error:
        raise ConfigError(f"{where} is not JSON ({error}).") from None
      if not isinstance(records[-1], dict):
        raise ConfigError(f"{where} is not a JSON object.")
    return records
  with open(path, encoding="utf-8-sig", newline="") as f:
    # TSV has no quoting: a '"' opening a field is text (as in GLUE's), not a multi-row field.
    dialect = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if file_format == "tsv" else {}
    reader = csv.DictReader(f, **dialect)
    sources.refuse_repeated(path, reader.fieldnames or [])
    records = list(reader)
  for row_number, record in enumerate(records, 1):
    # DictReader keeps fields past the header's under None, and gives missing ones None.
    extra, missing = len(record.get(None, [])), list(record.values()).count(None)
    if extra or missing:
      hint = "a comma inside a text? Quote that field" if extra else "give each column a value"
      if extra and file_format == "tsv":
        hint = "a tab inside a text? Remove it, or use CSV or JSONL"
      raise ConfigError(
          f"{path}: row {row_number} has {len(reader.fieldnames) + extra - missing} fields, its "
          f"header {len(reader.fieldnames)}: {hint}."
      )
  return records


def _custom_split(custom, path: str, split: str, labelled: bool) -> list[Example]:
  require_file(path, f"check config.custom.{split}_file")
  file_format = custom.format or CUSTOM_FORMATS.get(os.path.splitext(path)[1].lower())
  if file_format not in CUSTOM_FORMATS.values():
    raise ConfigError(f"Unknown format of {path}: set config.custom.format (tsv, csv, jsonl).")
  grouped = split == "train" and bool(custom.group_column)
  columns = [custom.text_a_column, custom.text_b_column, labelled and custom.label_column]
  columns += [custom.group_column] if grouped else []
  examples = []
  for index, record in enumerate(_custom_records(path, file_format)):
    where = f"{path}: row {index + 1}"
    for column in filter(None, columns):
      if column not in record:
        raise ConfigError(
            f"{where} has no column {column!r}, only {sorted(record)}; set config.custom.*_column."
        )
      if not isinstance(record[column], (str, int, float)):  # JSON's null, objects and lists
        raise ConfigError(
            f"{where}: column {column!r} holds {record[column]!r}; give a string or a number."
        )
    label, raw = None, record.get(custom.label_column)
    if labelled and custom.kind == "regression":
      label = _regression_label(raw, where)
    elif labelled:
      label = str(raw).lower() if isinstance(raw, bool) else str(raw)
      if not label.strip():
        raise ConfigError(
            f"{where}: the label ({custom.label_column!r}) is empty; give it or leave the row out."
        )
    text_b = str(record[custom.text_b_column]) if custom.text_b_column else None
    group = str(record[custom.group_column]) if grouped else None
    examples.append(Example(str(record[custom.text_a_column]), text_b, label, index, group))
  return examples


def load_custom(custom) -> TaskData:
  """A task from config.custom: its files (test_file optional), columns, kind, metrics, labels."""
  for key in ("train_file", "dev_file"):
    if not custom[key]:
      raise ConfigError(f"config.custom.{key} is empty: custom tasks need a train and a dev file.")
  train = _custom_split(custom, custom.train_file, "train", True)
  dev = {"custom": _custom_split(custom, custom.dev_file, "dev", True)}
  test = {}
  if custom.test_file:
    test["custom_test"] = _custom_split(custom, custom.test_file, "test", False)
  label_list = None
  if custom.kind == "classification" and custom.labels:
    label_list = tuple(label.strip() for label in custom.labels.split(","))
    if "" in label_list or len(set(label_list)) < len(label_list):
      raise ConfigError(
          f"config.custom.labels={custom.labels!r} names a label twice or an empty one; list each "
          "label once, comma-separated."
      )
  elif custom.kind == "classification":
    label_list = tuple(sorted({example.label for example in train}))
  default_metrics = "accuracy" if custom.kind == "classification" else "pearson,spearman"
  metric_names = tuple(m.strip() for m in (custom.metrics or default_metrics).split(","))
  if unknown := [m for m in metric_names if m not in metrics_lib.METRIC_FNS]:
    raise ConfigError(
        f"config.custom.metrics has unknown {unknown}; use {sorted(metrics_lib.METRIC_FNS)}."
    )
  if "f1" in metric_names:
    if label_list is None or len(label_list) != 2:
      raise ConfigError("config.custom.metrics has f1: it needs a classification with two labels.")
    line = "F1's positive class: %r, the second of config.custom.labels (or of the labels seen)."
    logging.info(line, label_list[1])
  return TaskData(
      "custom", custom.kind, label_list, metric_names, train, dev, test, None, custom.train_file
  )


def load_task(config) -> TaskData:
  """config.task's data ('SST-2', 'sst_2' ... name GLUE's sst2) from its source, checked."""
  name = str(config.task).lower().replace("-", "").replace("_", "")
  if name not in TASK_NAMES:
    raise ConfigError(
        f"Unknown task {config.task!r}. Use one of {list(TASK_NAMES)} or squad1.1, squad2.0."
    )
  data = load_custom(config.custom) if name == "custom" else load_glue(name, config)
  # Refused: an empty split, and a label outside the task's labels or never seen in training.
  splits = {
      "train": data.train,
      **{f"dev ({k})": v for k, v in data.dev.items()},
      **{f"test ({k})": v for k, v in data.test.items()},
  }
  if empty := [split_name for split_name, examples in splits.items() if not examples]:
    raise ConfigError(f"Task {data.name}: the {empty[0]} split has no examples; check its file.")
  train_labels = {example.label for example in data.train}
  if data.kind == "classification" and (outside := sorted(train_labels - set(data.label_list))):
    raise ConfigError(
        f"Task {data.name}: training label(s) {outside} are not among the task's labels "
        f"{list(data.label_list)}; fix the data or config.custom.labels."
    )
  for dev_name, examples in data.dev.items() if data.kind == "classification" else ():
    if unseen := sorted({example.label for example in examples} - train_labels):
      raise ConfigError(
          f"Task {data.name}: dev split {dev_name} has label(s) {unseen} that never occur in the "
          f"train split (train labels: {sorted(train_labels)}); fix the label column or the split."
      )
  if data.kind == "classification" and len(train_labels) == 1:
    raise ConfigError(
        f"{data.train_file}: every training example has the label {data.train[0].label!r}, and a "
        "classifier of one class learns nothing; check the label column, or add other labels."
    )
  if name != "custom" and GLUE_TASKS[name].symmetric and config.double_unordered:
    # Both sentence orders, as the official code trains MRPC and STS-B.
    data.train += [dataclasses.replace(e, text_a=e.text_b, text_b=e.text_a) for e in data.train]
  return data


def truncate_pair(tokens_a: list[int], tokens_b: list[int], max_tokens: int):
  """What BERT's loop (drop the longer segment's last token, b's on ties, until both fit) gives."""
  len_a = min(len(tokens_a), max(max_tokens - len(tokens_b), (max_tokens + 1) // 2))
  return tokens_a[:len_a], tokens_b[: max_tokens - len_a]


def pack_pair(tokenizer, tokens_a: list[int], tokens_b: list[int] | None, width: int):
  """[CLS] a [SEP] (b [SEP]): int32 [width] input_ids, token_type_ids (1 from b), attention_mask."""
  ids = [tokenizer.cls_id, *tokens_a, tokenizer.sep_id]
  ids += [] if tokens_b is None else [*tokens_b, tokenizer.sep_id]
  positions = np.arange(width)
  input_ids = np.full(width, tokenizer.pad_id, np.int32)
  input_ids[: len(ids)] = ids
  token_type_ids = (positions >= len(tokens_a) + 2) & (positions < len(ids))
  return [input_ids, token_type_ids.astype(np.int32), (positions < len(ids)).astype(np.int32)]


def encode_examples(
    examples: Sequence[Example], tokenizer, max_seq_len: int, data: TaskData
) -> dict[str, np.ndarray]:
  """pack_pair's rows truncated to max_seq_len and cut to the longest (rounded up to PAD_MULTIPLE),
  labels [n] (int32 ids or float32 targets, 0 where unlabelled) and index [n]."""
  texts_b = [e.text_b for e in examples if e.text_b is not None]
  ids_b = iter(tokenizer.encode_batch(texts_b) if texts_b else [])
  rows = []
  for tokens_a, example in zip(tokenizer.encode_batch([e.text_a for e in examples]), examples):
    if example.text_b is None:
      pair = tokens_a[: max_seq_len - 2], None
    else:
      pair = truncate_pair(tokens_a, next(ids_b), max_seq_len - 3)
    rows.append(pack_pair(tokenizer, *pair, max_seq_len))
  # [n, 3, max_seq_len] -> three [n, max_seq_len] (reshape keeps the shape when there are no rows)
  inputs = np.array(rows, np.int32).reshape(-1, 3, max_seq_len).transpose(1, 0, 2)
  longest = int(inputs[2].sum(1).max(initial=1))
  width = min(max_seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
  label_to_id = {label: i for i, label in enumerate(data.label_list or ())}  # (regression: none)
  values = [0 if e.label is None else label_to_id.get(e.label, e.label) for e in examples]
  labels = np.array(values, np.int32 if data.kind == "classification" else np.float32)
  index = np.array([e.index for e in examples], np.int64)
  return dict(zip(MODEL_INPUTS, inputs[:, :, :width]), labels=labels, index=index)


def held_out_rows(groups: list, fraction: float, seed: int, folds: int = 1):
  """[(held-out rows, the rest)]: folds=1, one random share of about `fraction` of the rows (one at
  least); folds=K, K disjoint shares of about 1/K; with groups (none None), whole groups each."""
  rng = np.random.default_rng([seed, 7])
  grouped = all(group is not None for group in groups)
  keys = np.array(groups, dtype=str) if grouped else np.arange(len(groups))  # each row's unit
  _, group_of_row, sizes = np.unique(keys, return_inverse=True, return_counts=True)
  order = rng.permutation(len(sizes))  # the units (groups, or rows) in random order
  ends = np.cumsum(sizes[order])  # rows in the first 1, 2, ... units
  if folds == 1:  # units until `fraction` of the rows are held out, the one reaching it included
    cut = np.searchsorted(ends, max(1, round(fraction * len(groups))))
    share = (np.arange(len(order)) > cut).astype(int)
  else:  # each unit to the share its rows' midpoint falls in
    share = np.minimum(((ends - sizes[order] / 2) * folds / len(groups)).astype(int), folds - 1)
  units = "groups of config.custom.group_column" if grouped else "rows"
  if len(np.unique(share)) < max(folds, 2):  # a held-out share, or (folds=1) the rest, is empty
    setting = f"folds={folds}" if folds > 1 else f"fraction={fraction}"
    raise ConfigError(
        f"config.select.{setting} leaves a share of the training set's {len(order)} {units} empty; "
        "lower it, or give the training set more."
    )
  held_units = [order[share == k] for k in range(folds)]
  if not grouped:  # rows in the order drawn
    return [(held, order[share != k]) for k, held in enumerate(held_units)]
  held_rows = [np.isin(group_of_row, units) for units in held_units]
  return [(np.flatnonzero(held), np.flatnonzero(~held)) for held in held_rows]


def make_adapter(config, backbone, data: TaskData | None = None) -> TaskAdapter:
  """The trainer's TaskAdapter for `data` (None: load_task(config)): dev metrics as the task reports
  them, test predictions as GLUE submission files (`index<TAB>prediction`), splits of train."""
  data = load_task(config) if data is None else data
  start = time.time()
  encode = lambda examples: encode_examples(examples, backbone.tokenizer, config.max_seq_len, data)
  train_features = encode(data.train)
  dev_features = {name: encode(examples) for name, examples in data.dev.items()}
  test_features = {name: encode(examples) for name, examples in data.test.items()}
  logging.info("Tokenized %s in %.1f s.", data.name, time.time() - start)
  regression = data.kind == "regression"
  lo, hi = data.target_range or (0.0, 1.0)  # regression learns (label - lo) / hi, as official

  def loss_fn(outputs, batch):
    if regression:
      return jnp.square(outputs[:, 0] - (batch["labels"] - lo) / hi)
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["labels"])

  def predictions(predict, features):
    outputs = predict(features)
    return outputs[:, 0] * hi + lo if regression else outputs.argmax(-1)

  def score(predict, features):
    values = predictions(predict, features)
    return metrics_lib.compute_metrics(data.metric_names, features["labels"], values)

  def write_test(predict, directory):
    paths = []
    for name, features in test_features.items():
      values = predictions(predict, features)
      texts = [f"{v:.3f}" for v in values] if regression else [data.label_list[v] for v in values]
      lines = [f"{i}\t{text}\n" for i, text in zip(features["index"], texts)]
      paths.append(os.path.join(directory, f"{name}.tsv"))
      workdir_files.write_text(paths[-1], "".join(["index\tprediction\n", *lines]))
    return paths

  def split(fraction, seed, folds):
    take = lambda rows: {name: array[rows] for name, array in train_features.items()}
    shares = held_out_rows([example.group for example in data.train], fraction, seed, folds)
    return [
        dataclasses.replace(
            adapter,
            train_features=take(fit),
            evaluate=lambda predict, held=take(held): {"held_out": score(predict, held)},
            write_test=lambda predict, directory: [],
            split=None,
        )
        for held, fit in shares
    ]

  adapter = TaskAdapter(
      data.name,
      backbone.classifier(1 if regression else len(data.label_list), config),
      train_features,
      loss_fn,
      lambda predict: {name: score(predict, features) for name, features in dev_features.items()},
      write_test,
      (
          dict(kind="regression", target_range=data.target_range and list(data.target_range))
          if regression
          else dict(kind="classification", labels=list(data.label_list))
      ),
      split,
  )
  return adapter
