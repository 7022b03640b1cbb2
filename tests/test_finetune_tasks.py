"""Task readers on tiny fixture files written here: GLUE's TSV layout, TFDS's real `glue`
builder prepared (array_record) from those same files, custom TSV/CSV/JSONL; the bad-input
errors; BERT-style features; GLUE submission files."""

import json
import os
from unittest import mock

import ml_collections
import numpy as np
import pytest

from electra_jax import api
from electra_jax.errors import ConfigError
from electra_jax.data import WordPieceTokenizer, tfds_source
from electra_jax.finetune import tasks

WORDS = "the a dog cat sat barked ran on mat big small red blue is not and".split()


@pytest.fixture
def tokenizer(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
  return WordPieceTokenizer(str(path))


def _write(path, lines):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write("".join(line + "\n" for line in lines))


def write_glue(root):
  """Tiny files in GLUE's layout: CoLA (no header in train/dev), STS-B, MNLI, MRPC."""
  _write(
      f"{root}/CoLA/train.tsv",
      ["gj04\t1\t\tThe dog barked.", 'gj04\t0\t*\tDog the "barked.', "cj99\t1\t\tA cat sat."],
  )
  _write(f"{root}/CoLA/dev.tsv", ["gj04\t0\t*\tSat cat a.", "gj04\t1\t\tThe cat sat."])
  _write(f"{root}/CoLA/test.tsv", ["index\tsentence", "0\tThe big dog.", "1\tDog big the."])
  sts_header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
  _write(
      f"{root}/STS-B/train.tsv",
      [
          sts_header + "\tscore",
          "0\tmain\tf\t2012\t1\tnone\tnone\tA dog ran.\tThe dog ran.\t4.500",
          "1\tmain\tf\t2012\t2\tnone\tnone\tA cat.\tA mat.\t0.750",
      ],
  )
  _write(
      f"{root}/STS-B/dev.tsv",
      [sts_header + "\tscore", "0\tmain\tf\t2012\t1\tnone\tnone\tRed cat.\tBlue cat.\t2.000"],
  )
  mnli_header = (
      "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
      "sentence1_parse\tsentence2_parse\tsentence1\tsentence2"
  )
  parses = "\t(x)\t(y)\t(X)\t(Y)\t"
  _write(
      f"{root}/MNLI/train.tsv",
      [
          mnli_header + "\tlabel1\tgold_label",
          "0\t1\t1n\tfiction" + parses + "The dog sat.\tA dog is on a mat.\tneutral\tneutral",
          "1\t2\t2e\tfiction" + parses + "The cat sat.\tA cat sat.\tentailment\tentailment",
          "2\t3\t3c\tfiction" + parses + "The cat ran.\tThe cat sat.\tcontradiction\tcontradiction",
      ],
  )
  dev_header = mnli_header + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
  _write(
      f"{root}/MNLI/dev_matched.tsv",
      [
          dev_header,
          "0\t1\t1e\tfiction"
          + parses
          + "A dog.\tA dog.\tentailment"
          + "\tentailment" * 4
          + "\tentailment",
      ],
  )
  _write(
      f"{root}/MNLI/dev_mismatched.tsv",
      [
          dev_header,
          "0\t1\t1c\tletters"
          + parses
          + "A dog.\tA cat.\tcontradiction"
          + "\tcontradiction" * 4
          + "\tcontradiction",
      ],
  )
  _write(
      f"{root}/MNLI/test_matched.tsv",
      [mnli_header, "0\t1\t1\tfiction" + parses + "Cats sat.\tCats ran."],
  )
  mrpc_header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
  _write(
      f"{root}/MRPC/train.tsv",
      [mrpc_header, "1\t1\t2\tThe dog sat.\tA dog sat.", "0\t3\t4\tThe cat.\tThe mat."],
  )
  _write(f"{root}/MRPC/dev.tsv", [mrpc_header, "1\t5\t6\tA red cat.\tThe red cat."])


def glue_config(task, data_dir, **kwargs):
  fields = dict(
      task=task,
      source="dir",
      data_dir=str(data_dir),
      tfds_data_dir="",
      double_unordered=False,
      custom={},
  )
  return ml_collections.ConfigDict({**fields, **kwargs})


def test_glue_dir_layouts(tmp_path):
  write_glue(tmp_path)
  cola = tasks.load_task(glue_config("CoLA", tmp_path))
  assert cola.kind == "classification" and cola.metric_names == ("mcc",)
  assert [(e.text_a, e.label) for e in cola.train] == [
      ("The dog barked.", "1"),
      ('Dog the "barked.', "0"),
      ("A cat sat.", "1"),
  ]  # quotes are text
  assert [e.label for e in cola.dev["cola"]] == ["0", "1"]
  assert [(e.index, e.text_a, e.label) for e in cola.test["CoLA"]] == [
      (0, "The big dog.", None),
      (1, "Dog big the.", None),
  ]

  sts = tasks.load_task(glue_config("sts-b", tmp_path))
  assert sts.kind == "regression" and sts.metric_names == ("pearson", "spearman")
  assert [(e.text_a, e.text_b, e.label) for e in sts.train] == [
      ("A dog ran.", "The dog ran.", 4.5),
      ("A cat.", "A mat.", 0.75),
  ]
  assert sts.test == {}  # test files are optional

  mnli = tasks.load_task(glue_config("mnli", tmp_path))
  assert [e.label for e in mnli.train] == ["neutral", "entailment", "contradiction"]
  assert (
      mnli.dev["mnli-m"][0].label == "entailment"
      and mnli.dev["mnli-mm"][0].label == "contradiction"
  )
  assert mnli.dev["mnli-mm"][0].text_b == "A cat."
  assert list(mnli.test) == ["MNLI-m"] and mnli.test["MNLI-m"][0].text_b == "Cats ran."

  # MRPC: official double_unordered adds both sentence orders to training only.
  mrpc = tasks.load_task(glue_config("mrpc", tmp_path / "MRPC", double_unordered=True))
  assert [(e.text_a, e.text_b) for e in mrpc.train] == [
      ("The dog sat.", "A dog sat."),
      ("The cat.", "The mat."),
      ("A dog sat.", "The dog sat."),
      ("The mat.", "The cat."),
  ]
  assert len(mrpc.dev["mrpc"]) == 1


def test_glue_tfds_reader_matches_dir_reader(tmp_path):
  """TFDS's own glue builder prepares array_record files from the fixture TSVs (its download
  replaced by the fixture directory); our tfds.data_source reader must see the dir reader's
  examples, labels mapped from TFDS's class order back to GLUE's strings."""
  tfds = tfds_source.import_tfds()  # with its glue and squad builders registered

  write_glue(tmp_path / "glue")
  tfds_dir = tmp_path / "tfds"
  (tmp_path / "glue" / "MNLI" / "test_mismatched.tsv").write_text(
      (tmp_path / "glue" / "MNLI" / "test_matched.tsv").read_text()
  )
  with mock.patch.object(
      tfds.download.DownloadManager,
      "download_and_extract",
      lambda self, url: str(tmp_path / "glue"),
  ):
    for name in ("cola", "mnli"):
      builder = tfds.builder(f"glue/{name}", data_dir=str(tfds_dir), file_format="array_record")
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(
              compute_stats=tfds.download.ComputeStatsMode.SKIP
          )
      )
  for name in ("cola", "mnli"):
    from_tfds = tasks.load_task(glue_config(name, "", source="tfds", tfds_data_dir=str(tfds_dir)))
    from_dir = tasks.load_task(glue_config(name, tmp_path / "glue"))
    key = lambda e: (e.text_a, e.text_b, e.label)
    assert sorted(map(key, from_tfds.train)) == sorted(map(key, from_dir.train))
    for dev_name in from_dir.dev:
      assert list(map(key, from_tfds.dev[dev_name])) == list(map(key, from_dir.dev[dev_name]))
    for submission, examples in from_dir.test.items():
      assert [(e.index, e.text_a) for e in from_tfds.test[submission]] == [
          (e.index, e.text_a) for e in examples
      ]
  with pytest.raises(ConfigError, match="glue/rte"):
    tasks.load_task(glue_config("rte", "", source="tfds", tfds_data_dir=str(tfds_dir)))


def custom_config(tmp_path, fmt, rows_train, rows_dev, **custom):
  def write(name, rows):
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "jsonl":
      path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
      sep = "\t" if fmt == "tsv" else ","
      columns = list(rows[0])
      path.write_text(
          sep.join(columns)
          + "\n"
          + "".join(sep.join(str(r[c]) for c in columns) + "\n" for r in rows)
      )
    return str(path)

  # configs/finetune/base.py's custom block, so that a key added there is here too.
  fields = api.load_config("finetune/base").custom.to_dict()
  fields.update(
      train_file=write("train", rows_train), dev_file=write("dev", rows_dev), text_a_column="text"
  )
  fields.update(custom)
  return ml_collections.ConfigDict(dict(task="custom", source="dir", data_dir="", custom=fields))


@pytest.mark.parametrize("fmt", ["tsv", "csv", "jsonl"])
def test_custom_formats(tmp_path, fmt):
  train = [
      {"text": "the dog", "other": "a cat", "label": "pos"},
      {"text": "a cat", "other": "the dog", "label": "neg"},
  ]
  dev = [{"text": "big dog", "other": "red cat", "label": "neg"}]
  config = custom_config(tmp_path, fmt, train, dev, text_b_column="other")
  data = tasks.load_task(config)
  assert data.label_list == ("neg", "pos") and data.metric_names == ("accuracy",)
  assert [(e.text_a, e.text_b, e.label) for e in data.train] == [
      ("the dog", "a cat", "pos"),
      ("a cat", "the dog", "neg"),
  ]
  assert data.dev["custom"][0].label == "neg"


def test_custom_regression(tmp_path):
  config = custom_config(
      tmp_path,
      "jsonl",
      [{"text": "a", "label": 1.5}, {"text": "b", "label": 3}],
      [{"text": "c", "label": 0.25}],
      kind="regression",
  )
  data = tasks.load_task(config)
  assert (
      data.kind == "regression"
      and data.label_list is None
      and data.metric_names == ("pearson", "spearman")
  )
  assert [e.label for e in data.train] == [1.5, 3.0]


@pytest.mark.fault
def test_custom_files_are_read_as_written_or_refused_by_row(tmp_path):
  # A quote that opens a TSV field is text: CSV's rules would merge the rows up to the next quote.
  train = [
      {"text": '"quoted" start', "label": "pos"},
      {"text": "plain", "label": "neg"},
      {"text": 'an "inner" one', "label": "pos"},
  ]
  data = tasks.load_task(custom_config(tmp_path, "tsv", train, train))
  assert [(e.text_a, e.label) for e in data.train] == [(r["text"], r["label"]) for r in train]
  with pytest.raises(ConfigError, match=r"row 2 has 3 fields, its header 2: a tab inside a text"):
    tasks.load_task(
        custom_config(tmp_path, "tsv", [train[0], {"text": "a\tb", "label": "neg"}], train)
    )
  with pytest.raises(ConfigError, match=r"train.csv: row 2: the label \('label'\) is empty"):
    tasks.load_task(custom_config(tmp_path, "csv", [train[0], {"text": "x", "label": " "}], train))
  for bad in ("nan", "inf", "-Infinity"):
    rows = [{"text": "a", "label": 1.0}, {"text": "b", "label": bad}]
    with pytest.raises(
        ConfigError, match=f"row 2: regression label '{bad}' is not a finite number"
    ):
      tasks.load_task(custom_config(tmp_path, "tsv", rows, rows[:1], kind="regression"))


TRAIN = [{"text": "the dog", "label": "pos"}, {"text": "a cat", "label": "neg"}]
GOOD_JSONL = "".join(json.dumps(row) + "\n" for row in TRAIN)
GOOD_TSV = "text\tlabel\nthe dog\tpos\na cat\tneg\n"


def _custom_files(tmp_path, fmt, train_text, dev_text=None, **custom):
  """A custom task's config whose train (and dev) files hold these texts as written."""
  config = custom_config(tmp_path, fmt, TRAIN, TRAIN, **custom)
  (tmp_path / f"train.{fmt}").write_text(train_text)
  if dev_text is not None:
    (tmp_path / f"dev.{fmt}").write_text(dev_text)
  return config


# (name, config(tmp_path), what the refusal says): each a bad input a user can give fine-tuning.
BAD_TASK_INPUTS = [
    (
        "dev label never in train",
        lambda t: custom_config(t, "tsv", TRAIN, [{"text": "x", "label": "neutral"}]),
        "never occur in the train split",
    ),
    (
        "dev label outside custom.labels",
        lambda t: custom_config(
            t, "tsv", TRAIN, [{"text": "x", "label": "maybe"}], labels="pos,neg"
        ),
        r"dev split custom has label\(s\) \['maybe'\]",
    ),
    (
        "no such column",
        lambda t: custom_config(t, "csv", TRAIN, TRAIN, text_a_column="sentence"),
        "no column 'sentence'",
    ),
    (
        "empty jsonl dev file",
        lambda t: _custom_files(t, "jsonl", GOOD_JSONL, ""),
        "dev .*no examples",
    ),
    ("empty tsv dev file", lambda t: _custom_files(t, "tsv", GOOD_TSV, ""), "dev .*no examples"),
    (
        "header-only csv dev file",
        lambda t: _custom_files(t, "csv", "text,label\na,pos\nb,neg\n", "text,label\n"),
        "dev .*no examples",
    ),
    ("unknown task", lambda t: glue_config("glu", t), "Unknown task 'glu'"),
    (
        "unknown metric",
        lambda t: custom_config(t, "tsv", TRAIN, TRAIN, metrics="accuracy, auc"),
        r"config.custom.metrics has unknown \['auc'\]; use \[",
    ),
    (
        "class labels in a regression",
        lambda t: custom_config(t, "tsv", TRAIN, TRAIN, kind="regression"),
        "regression label .pos. is not a finite number",
    ),
    (
        "a row short of its header",
        lambda t: _custom_files(t, "tsv", "text\tlabel\nthe dog\tpos\na cat\n"),
        r"train.tsv: row 2 has 1 fields, its header 2: give each column a value",
    ),
    (
        "a csv row short of its header",
        lambda t: _custom_files(t, "csv", "text,label,other\na,pos,x\nb,neg\n"),
        r"train.csv: row 2 has 2 fields, its header 3",
    ),
    (
        "a label named twice in custom.labels",
        lambda t: custom_config(t, "tsv", TRAIN, TRAIN, labels="pos,neg,pos"),
        r"config.custom.labels='pos,neg,pos' names a label twice or an empty one",
    ),
    (
        "an empty label in custom.labels",
        lambda t: custom_config(t, "tsv", TRAIN, TRAIN, labels="pos,,neg"),
        r"config.custom.labels='pos,,neg' names a label twice or an empty one",
    ),
    (
        "a JSON object as a text",
        lambda t: _custom_files(t, "jsonl", '{"text": {"x": 1}, "label": "pos"}\n'),
        r"train.jsonl: row 1: column 'text' holds \{'x': 1\}; give a string or a number",
    ),
    (
        "a JSON list as a label",
        lambda t: _custom_files(t, "jsonl", '{"text": "a", "label": ["pos"]}\n'),
        r"row 1: column 'label' holds \['pos'\]; give a string or a number",
    ),
    (
        "a JSON null as a label",
        lambda t: _custom_files(
            t, "jsonl", '{"text": "a", "label": "pos"}\n{"text": "b", "label": null}\n'
        ),
        r"row 2: column 'label' holds None; give a string or a number",
    ),
    (
        "a JSON true as a regression target",
        lambda t: _custom_files(
            t,
            "jsonl",
            '{"text": "a", "label": true}\n{"text": "b", "label": 2.0}\n',
            kind="regression",
        ),
        "row 1: regression label True is not a finite number",
    ),
    (
        "a directory as the dev file",
        lambda t: custom_config(t, "tsv", TRAIN, TRAIN, dev_file=str(t)),
        r"is a directory; check config.custom.dev_file",
    ),
    (
        "a JSONL line that is no object",
        lambda t: _custom_files(t, "jsonl", '["a", "pos"]\n'),
        r"train.jsonl:1 is not a JSON object",
    ),
]


@pytest.mark.fault
@pytest.mark.parametrize(
    "make_config, named",
    [case[1:] for case in BAD_TASK_INPUTS],
    ids=[c[0] for c in BAD_TASK_INPUTS],
)
def test_a_bad_task_input_is_refused_by_name(tmp_path, make_config, named):
  with pytest.raises(ConfigError, match=named):
    tasks.load_task(make_config(tmp_path))


@pytest.mark.fault
def test_bad_glue_files_are_refused_by_name(tmp_path):
  write_glue(tmp_path / "glue")
  _write(
      f"{tmp_path}/glue/RTE/train.tsv",
      ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tentailment"],
  )
  _write(
      f"{tmp_path}/glue/RTE/dev.tsv",
      ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tnot_entailment"],
  )
  with pytest.raises(ConfigError, match="never occur in the train split"):
    tasks.load_task(glue_config("rte", tmp_path / "glue"))
  _write(f"{tmp_path}/glue/RTE/train.tsv", ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tmaybe"])
  with pytest.raises(ConfigError, match="'maybe'.* not among"):
    tasks.load_task(glue_config("rte", tmp_path / "glue"))
  with pytest.raises(ConfigError, match="QNLI"):
    tasks.load_task(glue_config("qnli", tmp_path / "glue"))
  _write(f"{tmp_path}/glue/RTE/train.tsv", [])
  with pytest.raises(ConfigError, match="RTE/train.tsv is empty; GLUE files start with a header"):
    tasks.load_task(glue_config("rte", tmp_path / "glue"))


def test_truncation_drops_from_the_longer_segment():
  a, b = tasks.truncate_pair(list(range(10)), list(range(100, 104)), 8)
  assert a == [0, 1, 2, 3] and b == [100, 101, 102, 103]
  a, b = tasks.truncate_pair(list(range(5)), list(range(100, 106)), 7)
  # 5+6: b is longer -> 5+5; a tie cuts b -> 5+4; a is longer -> 4+4; a tie cuts b -> 4+3.
  assert a == [0, 1, 2, 3] and b == [100, 101, 102]


def test_encode_examples(tokenizer):
  data = tasks.TaskData("custom", "classification", ("neg", "pos"), ("accuracy",), [], {}, {})
  examples = [
      tasks.Example("the dog sat", "a cat", "pos", 7),
      tasks.Example("big red dog ran on the mat", None, "neg", 8),
  ]
  features = tasks.encode_examples(examples, tokenizer, 8, data)
  ids = {w: tokenizer.encode(w)[0] for w in WORDS}
  cls, sep, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id
  np.testing.assert_array_equal(
      features["input_ids"],
      [
          [cls, ids["the"], ids["dog"], ids["sat"], sep, ids["a"], ids["cat"], sep],
          [cls, ids["big"], ids["red"], ids["dog"], ids["ran"], ids["on"], ids["the"], sep],
      ],
  )
  np.testing.assert_array_equal(features["token_type_ids"], [[0, 0, 0, 0, 0, 1, 1, 1], [0] * 8])
  np.testing.assert_array_equal(features["attention_mask"], [[1] * 8, [1] * 8])
  np.testing.assert_array_equal(features["labels"], [1, 0])
  np.testing.assert_array_equal(features["index"], [7, 8])
  short = tasks.encode_examples([tasks.Example("dog", "cat", "pos", 0)], tokenizer, 8, data)
  np.testing.assert_array_equal(
      short["input_ids"][0], [cls, ids["dog"], sep, ids["cat"], sep, pad, pad, pad]
  )
  np.testing.assert_array_equal(short["token_type_ids"][0], [0, 0, 0, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(short["attention_mask"][0], [1, 1, 1, 1, 1, 0, 0, 0])
  # A longer max_seq_len pads only to the longest row, rounded up to a multiple of 8.
  wide = tasks.encode_examples(examples, tokenizer, 64, data)  # the second row's 9 tokens: 16
  assert wide["input_ids"].shape == wide["attention_mask"].shape == (2, 16)
  np.testing.assert_array_equal(wide["input_ids"][0, :8], features["input_ids"][0])
  assert wide["attention_mask"].sum(1).tolist() == [8, 9]
  long = tasks.encode_examples(
      [tasks.Example(" ".join(WORDS[:4] * 3), None, "pos", 0)], tokenizer, 64, data
  )
  assert long["input_ids"].shape == (1, 16) and long["attention_mask"].sum() == 14


def test_glue_submission_file(tmp_path, tokenizer):
  """Test predictions as the GLUE server reads them: `index<TAB>prediction` after a header, by
  each row's own index; labels as GLUE writes them, regression scores to three decimals."""
  from electra_jax.finetune import model as model_lib  # noqa: PLC0415

  config = api.load_config("finetune/tiny", {"tokenizer": tokenizer.vocab_file})
  backbone = model_lib.load_backbone(config)
  rows = [tasks.Example("a dog", "a cat", None, index) for index in (4, 0, 9)]
  labels = ("contradiction", "entailment", "neutral")
  mnli = tasks.TaskData("mnli", "classification", labels, ("accuracy",), [], {}, {"MNLI-m": rows})
  adapter = tasks.make_adapter(config, backbone, mnli)
  [path] = adapter.write_test(lambda features: np.eye(3)[[2, 0, 1]], str(tmp_path / "a"))
  assert open(path).read() == "index\tprediction\n4\tneutral\n0\tcontradiction\n9\tentailment\n"
  sts = tasks.TaskData("stsb", "regression", None, ("pearson",), [], {}, {"STS-B": rows[:2]})
  adapter = tasks.make_adapter(config, backbone, sts)
  [path] = adapter.write_test(lambda features: np.array([[1.23456], [4.0]]), str(tmp_path / "b"))
  assert open(path).read().splitlines()[1:] == ["4\t1.235", "0\t4.000"]


@pytest.mark.fault
@pytest.mark.parametrize("fmt", ["tsv", "csv", "jsonl", "glue"])
def test_a_column_named_twice_is_refused_naming_the_file_and_the_name(tmp_path, fmt):
  rows = [("a dog", "pos", "a cat"), ("a mat", "neg", "the mat")]
  if fmt == "jsonl":  # a JSON object with a key twice: json.loads keeps the last
    lines = ['{"text": "%s", "label": "%s", "text": "%s"}' % row for row in rows]
  else:
    sep = "," if fmt == "csv" else "\t"
    lines = [sep.join(("text", "label", "text"))] + [sep.join(row) for row in rows]
  if fmt == "glue":  # GLUE's header names its columns too
    lines = ["index\tsentence1\tsentence2\tsentence1\tlabel"]
    lines += [f"{i}\ta\tb\tc\t{label}" for i, label in enumerate(("entailment", "not_entailment"))]
    path, config = tmp_path / "RTE" / "train.tsv", glue_config("rte", tmp_path)
    _write(path, lines)
    _write(tmp_path / "RTE" / "dev.tsv", lines)
    name, where = "sentence1", path
  else:
    config = custom_config(
        tmp_path, fmt, [{"text": "x", "label": "pos"}] * 2, [{"text": "y", "label": "pos"}]
    )
    path, name = config.custom.train_file, "text"
    _write(path, lines)
    where = f"{path}:1" if fmt == "jsonl" else path
  with pytest.raises(ConfigError, match=rf"{where}: column '{name}' appears more than once"):
    tasks.load_task(config)


@pytest.mark.fault
def test_a_classification_whose_training_rows_have_one_label_is_refused(tmp_path):
  train = [{"text": "the dog", "label": "pos"}]
  config = custom_config(tmp_path, "tsv", train, train, labels="pos,neg")
  with pytest.raises(
      ConfigError, match=rf"{config.custom.train_file}: every training example has the label 'pos'"
  ):
    tasks.load_task(config)
  # A regression has no classes: one row is a (small) task.
  rows = [{"text": "the dog", "label": 0.5}]
  assert len(tasks.load_task(custom_config(tmp_path, "tsv", rows, rows, kind="regression")).train)
