"""Sentence(-pair) classification and regression: the nine GLUE tasks (GLUE's TSVs or TFDS `glue/<config>`) and
custom TSV/CSV/JSONL files, their checks, features and GLUE submission files."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import logging

from electra_jax import workdir_files
from electra_jax.errors import ConfigError
from electra_jax.data import tfds_source
from electra_jax.finetune import metrics as metrics_lib

csv.field_size_limit(sys.maxsize)  # QQP's longest fields pass csv's default limit


@dataclasses.dataclass
class TaskAdapter:
  """What the loop needs from a task. Features: numpy arrays with a leading example axis, holding at least the
  trainer's MODEL_INPUTS, which `model.apply` takes in that order."""

  name: str
  model: Any  # a flax.linen.Module
  train_features: dict[str, np.ndarray]
  loss_fn: Callable[[Any, dict], Any]  # (outputs, batch) -> per-example losses [batch]
  # predict (features -> numpy outputs) -> {eval name: {metric: value}}, each with a "score".
  evaluate: Callable[[Callable[[dict], np.ndarray]], dict[str, dict[str, float]]]
  write_test: Callable[
      [Callable[[dict], np.ndarray], str], list[str]
  ]  # (predict, directory) -> paths written
  head: dict  # for exports: {"kind": "classification"|"regression"|"span", and "labels"|"target_range"|"answerable"}
  # (fraction, seed, folds) -> per held-out share (trainer.held_out_rows) this adapter on the rest of train,
  # scoring the share as "held_out"; None: cannot be split.
  split: Callable[[float, int, int], list["TaskAdapter"]] | None = None


@dataclasses.dataclass(frozen=True)
class Example:
  text_a: str
  text_b: str | None
  label: str | float | None  # None in unlabelled (test) splits
  index: int  # the row's id: GLUE submissions list predictions by it
  group: str | None = None  # custom.group_column's value (train only)


@dataclasses.dataclass
class TaskData:
  """A task's examples and what they mean, checked by `check_task_data`."""

  name: str
  kind: str  # "classification" or "regression" ("span" tasks come from squad.py)
  label_list: tuple[str, ...] | None  # classification: label id i is label_list[i]
  metric_names: tuple[str, ...]
  train: list[Example]
  dev: dict[str, list[Example]]  # evaluation name (e.g. "mnli-m") -> examples
  test: dict[str, list[Example]]  # submission name (e.g. "MNLI-m") -> unlabelled examples
  target_range: tuple[float, float] | None = (
      None  # regression: the model learns (label - lo) / hi; None: raw
  )


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """Where one GLUE task's data lives, in GLUE's TSVs and in TFDS."""

  directory: str  # GLUE's folder, e.g. "CoLA"
  label_list: (
      tuple[str, ...] | None
  )  # label strings as GLUE's TSVs and submissions write them; None: regression
  text_columns: tuple[str, str | None]  # header names of text_a, text_b
  label_column: str = "label"
  tfds_text: tuple[str, str | None] | None = None  # TFDS's feature names; None: text_columns
  tfds_labels: tuple[str, ...] | None = None  # TFDS's class index -> label string; None: label_list
  # Evaluation / submission name -> file stem; None: {<task>: "dev"} and {<directory>: "test"}.
  dev_files: dict[str, str] | None = None
  test_files: dict[str, str] | None = None
  symmetric: bool = (
      False  # sentence order carries no meaning: the official code trains on both orders
  )
  headerless_columns: tuple[int, int] | None = (
      None  # CoLA's train and dev: (text, label) column by position
  )
  target_range: tuple[float, float] | None = (
      None  # regression: the official label range (TaskData.target_range)
  )


_BINARY = ("0", "1")
_ENTAILMENT = ("entailment", "not_entailment")
_PAIR = ("sentence1", "sentence2")
GLUE_TASKS = {
    "cola": GlueTask("CoLA", _BINARY, ("sentence", None), headerless_columns=(3, 1)),
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
    "wnli": GlueTask(
        "WNLI", _BINARY, _PAIR
    ),  # GLUE writes its labels 0/1 (1 = entailment), as TFDS
}
TASK_NAMES = tuple(GLUE_TASKS) + ("custom",)


def _require_file(path: str, what: str) -> None:
  if not os.path.isfile(path):
    raise ConfigError(f"{what}: {path} does not exist. Check config.data_dir and the task name.")


def _glue_examples(task: GlueTask, path: str, labelled: bool) -> list[Example]:
  """The examples of a GLUE TSV, by its header's column names (CoLA's train and dev: by position)."""
  with open(path, encoding="utf-8-sig", newline="") as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  if labelled and task.headerless_columns is not None:
    text_at, label_at = task.headerless_columns
    return [
        Example(row[text_at], None, row[label_at], i)
        for i, row in enumerate(rows)
        if len(row) > max(text_at, label_at)
    ]
  if not rows:
    raise ConfigError(f"{path} is empty; GLUE files start with a header line.")
  header = rows[0]
  wanted = [
      c for c in (*task.text_columns, task.label_column if labelled else None) if c is not None
  ]
  missing = [c for c in wanted if c not in header]
  if missing:
    raise ConfigError(
        f"{path} has no column {missing[0]!r} (its header: {header}); is it the right GLUE file?"
    )
  where = {name: header.index(name) for name in wanted}
  index_position = (
      header.index("index") if "index" in header else header.index("id") if "id" in header else None
  )
  (text_a, text_b), examples, skipped = task.text_columns, [], 0
  for row_number, row in enumerate(rows[1:]):
    if len(row) < len(header):
      skipped += 1  # QQP's train.tsv has a few broken lines; TFDS and the official code skip them
      continue
    index = (
        int(row[index_position])
        if index_position is not None and row[index_position].isdigit()
        else row_number
    )
    label = row[where[task.label_column]] if labelled else None
    if labelled and task.label_list is None:
      label = _regression_label(label, path)
    examples.append(
        Example(row[where[text_a]], row[where[text_b]] if text_b else None, label, index)
    )
  if skipped:
    logging.warning("Skipped %d malformed line(s) of %s.", skipped, path)
  return examples


def _regression_label(raw, where: str) -> float:
  try:
    return float(raw)
  except (TypeError, ValueError):
    raise ConfigError(f"{where}: regression label {raw!r} is not a number.") from None


def _glue_task_data(name: str, read) -> TaskData:
  """GLUE task `name` from `read(file stem, what for errors, labelled)` -> examples (None: no test split)."""
  task = GLUE_TASKS[name]
  train = read("train", f"GLUE {name} train split", True)
  dev = {
      dev_name: read(stem, f"GLUE {name} dev split {dev_name}", True)
      for dev_name, stem in (task.dev_files or {name: "dev"}).items()
  }
  test = {
      submission: read(stem, f"GLUE {name} test split {submission}", False)
      for submission, stem in (task.test_files or {task.directory: "test"}).items()
  }
  kind = "regression" if task.label_list is None else "classification"
  return TaskData(
      name,
      kind,
      task.label_list,
      metrics_lib.GLUE_METRICS[name],
      train,
      dev,
      {submission: examples for submission, examples in test.items() if examples is not None},
      target_range=task.target_range,
  )


def load_glue_from_dir(name: str, data_dir: str) -> TaskData:
  """GLUE as its download script lays it out: <data_dir>/<Task>/{train,dev,test}.tsv (MNLI: dev_matched, ...);
  test files are optional."""
  task = GLUE_TASKS[name]
  if not data_dir:
    raise ConfigError(
        "config.data_dir is empty: give GLUE's directory (holding CoLA/, ...), or use source=tfds."
    )
  task_dir = os.path.join(data_dir, task.directory)
  if not os.path.isdir(task_dir):
    if not os.path.isfile(os.path.join(data_dir, "train.tsv")):
      raise ConfigError(
          f"config.data_dir={data_dir!r} has neither a {task.directory}/ folder nor a train.tsv; give "
          "GLUE's root directory or the task's own folder."
      )
    task_dir = data_dir  # the task's own folder works as well as GLUE's root

  def read(stem: str, what: str, labelled: bool):
    path = os.path.join(task_dir, stem + ".tsv")
    if labelled:
      _require_file(path, what)
    return _glue_examples(task, path, labelled) if os.path.isfile(path) else None

  return _glue_task_data(name, read)


def decode_text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def open_tfds_split(name: str, split: str, data_dir: str | None, other_source: str, **kwargs):
  """`tfds.data_source` over a prepared split; a ConfigError suggesting `other_source` when it cannot be opened."""
  tfds = tfds_source.import_tfds()  # a heavy import, only when this source is used
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False, **kwargs)
  except Exception as error:  # tfds raises several types for "not prepared here" / "no such split"
    raise ConfigError(
        f"Cannot open TFDS {name!r} split {split!r} in {data_dir or 'the default data dir'} "
        f"({type(error).__name__}: {error}); run `tfds build --file_format=array_record {name}`, set "
        f"config.tfds_data_dir, or {other_source}."
    ) from error


def load_glue_from_tfds(name: str, tfds_data_dir: str = "") -> TaskData:
  """GLUE from a prepared TFDS `glue/<name>` (array_record); labels become GLUE's label strings."""
  task = GLUE_TASKS[name]
  text_a, text_b = task.tfds_text or task.text_columns
  labels = task.tfds_labels or task.label_list

  def read(stem: str, what: str, labelled: bool):
    source = open_tfds_split(
        f"glue/{name}",
        stem.replace("dev", "validation"),
        tfds_data_dir,
        "use --config.source=dir with GLUE's TSV files",
    )
    examples = []
    for record in (source[i] for i in range(len(source))):
      label = (
          None
          if not labelled
          else float(record["label"])
          if labels is None
          else labels[int(record["label"])]
      )
      examples.append(
          Example(
              decode_text(record[text_a]),
              decode_text(record[text_b]) if text_b else None,
              label,
              int(record["idx"]),
          )
      )
    return sorted(examples, key=lambda example: example.index)  # TFDS shuffles; idx is GLUE's row

  return _glue_task_data(name, read)


CUSTOM_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


def _custom_records(path: str, file_format: str) -> list[dict]:
  if file_format == "jsonl":
    records = []
    with open(path, encoding="utf-8") as f:
      for line_number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as error:
          raise ConfigError(f"{path}:{line_number} is not JSON ({error}).") from None
        if not isinstance(records[-1], dict):
          raise ConfigError(f"{path}:{line_number} is not a JSON object.")
    return records
  with open(path, encoding="utf-8-sig", newline="") as f:
    # TSV has no quoting: a '"' opening a field is text (as in GLUE's), not the start of a multi-row field.
    tsv = file_format == "tsv"
    reader = csv.DictReader(
        f, delimiter="\t" if tsv else ",", quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL
    )
    records = list(reader)
    for row_number, record in enumerate(records, 1):
      if None in record:  # DictReader's key for fields past the header's
        raise ConfigError(
            f"{path}: row {row_number} has {len(reader.fieldnames) + len(record[None])} fields, its "
            f"header {len(reader.fieldnames)}: a {'tab' if tsv else 'comma'} inside a text? "
            f"{'Remove it, or use CSV or JSONL' if tsv else 'Quote that field'}."
        )
    return records


def _custom_split(custom, path: str, split: str, labelled: bool) -> list[Example]:
  file_format = custom.format or CUSTOM_FORMATS.get(os.path.splitext(path)[1].lower())
  if file_format not in CUSTOM_FORMATS.values():
    raise ConfigError(
        f"Cannot tell the format of {path}: set config.custom.format to tsv, csv or jsonl."
    )
  _require_file(path, f"custom task {split} split")
  grouped = split == "train" and bool(custom.group_column)
  columns = [
      custom.text_a_column,
      custom.text_b_column,
      labelled and custom.label_column,
      grouped and custom.group_column,
  ]
  examples = []
  for row_number, record in enumerate(_custom_records(path, file_format), 1):
    where = f"{path}: row {row_number}"
    for column in filter(None, columns):
      if record.get(column) is None:
        raise ConfigError(
            f"{where} has no column {column!r} (it has {sorted(record)}); set config.custom.*_column."
        )
    label, raw = None, record.get(custom.label_column)
    if labelled and custom.kind == "regression":
      label = _regression_label(raw, where)
      if not math.isfinite(label):
        raise ConfigError(f"{where}: regression label {raw!r} is not a finite number.")
    elif labelled:
      label = str(raw).lower() if isinstance(raw, bool) else str(raw)
      if not label.strip():
        raise ConfigError(
            f"{where}: the label ({custom.label_column!r}) is empty; give it or leave the row out."
        )
    text_b = str(record[custom.text_b_column]) if custom.text_b_column else None
    group = str(record[custom.group_column]) if grouped else None
    examples.append(
        Example(str(record[custom.text_a_column]), text_b, label, row_number - 1, group)
    )
  return examples


def load_custom(custom) -> TaskData:
  """A task from config.custom: its files (test_file optional), column names, kind, metrics and label order."""
  if custom.kind not in ("classification", "regression"):
    raise ConfigError(f"config.custom.kind={custom.kind!r}: use 'classification' or 'regression'.")
  for key in ("train_file", "dev_file"):
    if not custom[key]:
      raise ConfigError(f"config.custom.{key} is empty: custom tasks need a train and a dev file.")
  train = _custom_split(custom, custom.train_file, "train", True)
  dev = {"custom": _custom_split(custom, custom.dev_file, "dev", True)}
  test = (
      {"custom_test": _custom_split(custom, custom.test_file, "test", False)}
      if custom.test_file
      else {}
  )
  label_list = None
  if custom.kind == "classification":
    label_list = (
        tuple(label.strip() for label in custom.labels.split(","))
        if custom.labels
        else tuple(sorted({example.label for example in train}))
    )
  default_metrics = "accuracy" if custom.kind == "classification" else "pearson,spearman"
  metric_names = tuple(m.strip() for m in (custom.metrics or default_metrics).split(","))
  unknown = [m for m in metric_names if m not in metrics_lib.METRIC_FNS]
  if unknown:
    raise ConfigError(
        f"config.custom.metrics has unknown {unknown}; use {sorted(metrics_lib.METRIC_FNS)}."
    )
  if "f1" in metric_names and (label_list is None or len(label_list) != 2):
    raise ConfigError(
        "config.custom.metrics has f1, which needs a classification task with two labels."
    )
  if "f1" in metric_names:
    logging.info(
        "F1 counts %r as the positive class (the second of config.custom.labels%s).",
        label_list[1],
        "" if custom.labels else ", here the sorted labels seen in train; set it to choose",
    )
  return TaskData("custom", custom.kind, label_list, metric_names, train, dev, test)


def check_task_data(data: TaskData) -> None:
  """Refuses an empty split and a label outside the task's labels or never seen in training."""
  splits = {
      "train": data.train,
      **{f"dev ({k})": v for k, v in data.dev.items()},
      **{f"test ({k})": v for k, v in data.test.items()},
  }
  for split_name, examples in splits.items():
    if not examples:
      raise ConfigError(
          f"Task {data.name}: the {split_name} split has no examples; check its file."
      )
  if data.kind != "classification":
    return
  train_labels = {example.label for example in data.train}
  outside = sorted(train_labels - set(data.label_list))
  if outside:
    raise ConfigError(
        f"Task {data.name}: training label(s) {outside} are not among the task's labels "
        f"{list(data.label_list)}; fix the data or config.custom.labels."
    )
  for dev_name, examples in data.dev.items():
    unseen = sorted({example.label for example in examples} - train_labels)
    if unseen:
      raise ConfigError(
          f"Task {data.name}: dev split {dev_name} has label(s) {unseen} that never occur in the train "
          f"split (train labels: {sorted(train_labels)}); fix the label column or the split."
      )


def load_task(config) -> TaskData:
  """The fine-tuning config's task ('SST-2', 'sst_2' ... name GLUE's sst2), read from its source and checked."""
  name = str(config.task).lower().replace("-", "").replace("_", "")
  if name not in TASK_NAMES:
    raise ConfigError(
        f"Unknown task {config.task!r}. Use one of {list(TASK_NAMES)} or squad1.1, squad2.0."
    )
  if name == "custom":
    data = load_custom(config.custom)
  elif config.source == "tfds":
    data = load_glue_from_tfds(name, config.tfds_data_dir)
  elif config.source == "dir":
    data = load_glue_from_dir(name, config.data_dir)
  else:
    raise ConfigError(f"config.source={config.source!r}: use 'dir' (GLUE's TSV files) or 'tfds'.")
  check_task_data(data)
  if config.get("double_unordered", False) and name in GLUE_TASKS and GLUE_TASKS[name].symmetric:
    # Both sentence orders, as the official code trains MRPC and STS-B.
    data.train = data.train + [
        dataclasses.replace(e, text_a=e.text_b, text_b=e.text_a) for e in data.train
    ]
  return data


def truncate_pair(
    tokens_a: list[int], tokens_b: list[int], max_tokens: int
) -> tuple[list[int], list[int]]:
  """What BERT's loop (drop the longer segment's last token, b's on ties, until both fit) ends with, in one step."""
  len_a = min(len(tokens_a), max(max_tokens - len(tokens_b), (max_tokens + 1) // 2))
  return tokens_a[:len_a], tokens_b[: max_tokens - len_a]


def pack_pair(
    tokenizer, tokens_a: list[int], tokens_b: list[int] | None, width: int
) -> list[np.ndarray]:
  """[CLS] a [SEP] (b [SEP]) as int32 [width] input_ids, token_type_ids (1 from b on) and attention_mask."""
  ids = [tokenizer.cls_id, *tokens_a, tokenizer.sep_id] + (
      [] if tokens_b is None else [*tokens_b, tokenizer.sep_id]
  )
  positions = np.arange(width)
  input_ids = np.full(width, tokenizer.pad_id, np.int32)
  input_ids[: len(ids)] = ids
  return [
      input_ids,
      ((positions >= len(tokens_a) + 2) & (positions < len(ids))).astype(np.int32),
      (positions < len(ids)).astype(np.int32),
  ]


# Rows are padded to a multiple of this (one compiled shape per split, even lengths for kernels).
PAD_MULTIPLE = 8


def encode_examples(
    examples: Sequence[Example], tokenizer, max_seq_len: int, data: TaskData
) -> dict[str, np.ndarray]:
  """pack_pair's rows truncated to max_seq_len and cut to the longest (rounded up to PAD_MULTIPLE), labels [n]
  (int32 ids or float32 targets, 0 where unlabelled) and index [n]."""
  if max_seq_len < 3:
    raise ConfigError(f"config.max_seq_len={max_seq_len} leaves no room for text; use at least 3.")
  texts_b = [e.text_b for e in examples if e.text_b is not None]
  ids_b = iter(tokenizer.encode_batch(texts_b) if texts_b else [])
  rows = []
  for tokens_a, example in zip(tokenizer.encode_batch([e.text_a for e in examples]), examples):
    if example.text_b is None:
      rows.append(pack_pair(tokenizer, tokens_a[: max_seq_len - 2], None, max_seq_len))
    else:
      rows.append(
          pack_pair(tokenizer, *truncate_pair(tokens_a, next(ids_b), max_seq_len - 3), max_seq_len)
      )
  # [n, 3, max_seq_len] -> three [n, max_seq_len] (reshape keeps the shape when there are no rows)
  input_ids, token_type_ids, attention_mask = (
      np.array(rows, np.int32).reshape(-1, 3, max_seq_len).transpose(1, 0, 2)
  )
  width = min(
      max_seq_len, -(-int(attention_mask.sum(1).max(initial=1)) // PAD_MULTIPLE) * PAD_MULTIPLE
  )
  if data.kind == "classification":
    label_to_id = {label: i for i, label in enumerate(data.label_list)}
    labels = np.array(
        [label_to_id[e.label] if e.label is not None else 0 for e in examples], np.int32
    )
  else:
    labels = np.array([e.label if e.label is not None else 0.0 for e in examples], np.float32)
  return dict(
      input_ids=input_ids[:, :width],
      token_type_ids=token_type_ids[:, :width],
      attention_mask=attention_mask[:, :width],
      labels=labels,
      index=np.array([e.index for e in examples], np.int64),
  )


def prediction_strings(data: TaskData, predictions: np.ndarray) -> list[str]:
  """Class ids -> label strings; regression scores -> '%.3f'."""
  if data.kind == "classification":
    return [data.label_list[int(p)] for p in predictions]
  return [f"{float(p):.3f}" for p in predictions]


def write_predictions(path: str, indices: Sequence[int], predictions: Sequence[str]) -> str:
  """A GLUE submission file <Task>.tsv (`index<TAB>prediction` after a header), written atomically."""
  lines = ["index\tprediction"] + [f"{int(i)}\t{p}" for i, p in zip(indices, predictions)]
  workdir_files.write_text(path, "\n".join(lines) + "\n")
  return path
