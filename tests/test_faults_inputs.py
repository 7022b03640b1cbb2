"""Inputs that are not what they claim, across pre-training and fine-tuning: a device or a FIFO
where a corpus or task file goes is refused by name before it is opened; a bucket corpus without
the gcs extra, or matching nothing, and a JSONL record naming its key twice are refused by name."""

import contextlib
import os
import re
import socket
import sys
import threading
import time

import ml_collections
import pytest

from conftest import base, cli, cli_args
from electra_jax import api
from electra_jax.data import load_pretraining_data, sources
from electra_jax.data.config import read_config
from electra_jax.errors import ConfigError
from electra_jax.finetune import squad, tasks


@contextlib.contextmanager
def fifo(path):
  """A FIFO at `path`. A reader that opens it anyway is not left waiting: a writer opens it and
  closes it at once, so the reader sees an empty file (and the test fails instead of hanging)."""
  os.mkfifo(path)
  stop = threading.Event()

  def unblock():
    while not stop.is_set():
      try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
      except OSError:
        time.sleep(0.02)

  thread = threading.Thread(target=unblock, daemon=True)
  thread.start()
  try:
    yield str(path)
  finally:
    stop.set()
    thread.join()


def _corpus_config(tmp_path, files):
  config = base.get_config().data
  config.update(source="text", files=files, max_seq_len=32, cache_dir=str(tmp_path / "cache"))
  config.update(spm_vocab_size=60, eval_fraction=0.0)
  return config


def _custom_config(tmp_path, train_file):
  dev = tmp_path / "dev.tsv"
  dev.write_text("text\tlabel\na dog\tpos\na cat\tneg\n")
  fields = api.load_config("finetune/base").custom.to_dict()
  fields.update(train_file=train_file, dev_file=str(dev), text_a_column="text", format="tsv")
  return ml_collections.ConfigDict(dict(task="custom", source="dir", data_dir="", custom=fields))


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["device", "FIFO", "socket", "dangling link"])
def test_a_corpus_file_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind):
  # (Read, /dev/zero would fill the memory: the config's read, which opens no file, refuses it.)
  with contextlib.ExitStack() as stack:
    path = str(tmp_path / "corpus")
    if kind == "device":
      path = "/dev/zero"
    elif kind == "FIFO":
      stack.enter_context(fifo(path))
    elif kind == "socket":
      stack.enter_context(socket.socket(socket.AF_UNIX)).bind(path)
    else:
      os.symlink(tmp_path / "moved_away.txt", path)
    read = read_config if kind == "device" else load_pretraining_data
    problem = "does not exist" if kind == "dangling link" else f"is a {kind}"
    with pytest.raises(ConfigError, match=rf"data.files .* matches '{path}', which {problem}"):
      read(_corpus_config(tmp_path, path))
  assert not os.path.exists(tmp_path / "cache")  # nothing prepared


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["device", "FIFO"])
def test_a_task_file_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind):
  with contextlib.ExitStack() as stack:
    path = "/dev/zero" if kind == "device" else stack.enter_context(fifo(tmp_path / "train.tsv"))
    with pytest.raises(ConfigError, match=rf"{path} is a {kind}, not a regular file"):
      tasks.load_task(_custom_config(tmp_path, path))
    if kind == "FIFO":  # GLUE's optional test file, and SQuAD's JSON
      rte = tmp_path / "RTE"
      rte.mkdir()
      for split in ("train", "dev"):
        (rte / f"{split}.tsv").write_text(
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
        )
      test = stack.enter_context(fifo(rte / "test.tsv"))
      config = ml_collections.ConfigDict(
          dict(task="rte", source="dir", data_dir=str(tmp_path), double_unordered=False)
      )
      with pytest.raises(ConfigError, match=rf"{test} is a FIFO, not a regular file"):
        tasks.load_task(config)
      squad_file = stack.enter_context(fifo(tmp_path / "train-v1.1.json"))
      with pytest.raises(
          ConfigError, match=rf"{squad_file} is a FIFO, not a regular file; set config.data_dir"
      ):
        squad.read_squad_json(squad_file, "1.1")


@pytest.mark.fault
def test_a_byte_order_mark_is_not_part_of_the_first_record_in_any_reader(tmp_path):
  bom = "\ufeff"
  jsonl, text = tmp_path / "corpus.jsonl", tmp_path / "corpus.txt"
  jsonl.write_text(bom + '{"text": "First one."}\n{"text": "Second one."}\n', encoding="utf-8")
  text.write_text(bom + "First one.\n\nSecond one.\n", encoding="utf-8")
  for source, path in (("jsonl", jsonl), ("text", text)):
    stats = sources.SourceStats()
    documents = list(sources.iter_documents(source, [str(path)], "text", stats))
    assert documents == [["First one."], ["Second one."]] and not stats.problems, source
    assert stats.bytes_read == path.stat().st_size  # the progress counts the mark too
  # Fine-tuning's JSONL reader (its TSV and CSV readers drop the mark as well).
  train = tmp_path / "train.jsonl"
  train.write_text(bom + '{"text": "a dog", "label": "pos"}\n{"text": "a", "label": "neg"}\n')
  config = _custom_config(tmp_path, str(train))
  config.custom.format = ""  # each file's by its extension
  assert [e.text_a for e in tasks.load_task(config).train] == ["a dog", "a"]


@pytest.mark.fault
def test_a_bucket_corpus_without_the_gcs_extra_names_the_pip_command_in_one_line(
    tmp_path, monkeypatch
):
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed: its import fails
  args = cli_args(tmp_path / "run", **{"data.source": "text", "data.files": "gs://b/c/*.txt"})
  result = cli([*args, "--mode=prepare_data", f"--config.data.prepared_dir={tmp_path}/p"])
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: data.files=gs://b/c/*.txt needs gcsfs"), last
  assert "pip install 'electra-jax[gcs]'" in last and not os.path.exists(tmp_path / "p")


@pytest.mark.fault
@pytest.mark.parametrize("pattern", ["{bucket}/corpus/*.txt", "gs://no-such-bucket-here/*.txt"])
def test_a_bucket_pattern_matching_nothing_is_named(tmp_path, bucket, pattern):
  pattern = pattern.format(bucket=bucket)
  why = "the bucket gs://no-such-bucket-here does not exist" if "no-such" in pattern else ""
  with pytest.raises(
      ConfigError, match=why or re.escape(f"pattern '{pattern}' matches no file; check the path or")
  ):
    read_config(_corpus_config(tmp_path, pattern))


@pytest.mark.fault
@pytest.mark.parametrize(
    "line", ['{"text": "a", "text": "b"}', '{"text": "a", "m": {"text": 1, "text": 2}}']
)
def test_a_jsonl_record_naming_a_key_twice_is_refused_with_its_place(tmp_path, line):
  # json.loads keeps a repeated key's last value: which text was meant is a guess.
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text('{"text": "First one."}\n' + line + "\n")
  with pytest.raises(ConfigError, match=rf"{corpus}:2: column 'text' appears more than once"):
    list(sources.iter_documents("jsonl", [str(corpus)], "text", sources.SourceStats()))
  config = _corpus_config(tmp_path, str(corpus))
  config.source = "jsonl"
  with pytest.raises(ConfigError, match=rf"{corpus}:2: column 'text'"):
    load_pretraining_data(config)


@pytest.mark.fault
@pytest.mark.parametrize(
    "line", ["[" * 100_000 + "]" * 100_000, '{"text": ' + "1" * 5000 + "}"], ids=["deep", "digits"]
)
def test_a_jsonl_line_json_cannot_read_is_skipped_and_counted(tmp_path, line):
  # Nesting deeper than Python's stack (RecursionError) and an integer over Python's digit limit
  # (ValueError) are lines like any other that are not JSON.
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text('{"text": "First one."}\n' + line + '\n{"text": "Third one."}\n')
  stats = sources.SourceStats()
  documents = list(sources.iter_documents("jsonl", [str(corpus)], "text", stats))
  assert documents == [["First one."], ["Third one."]]
  assert stats.first_problems == {"skipped_lines": f"{corpus}:2: not valid JSON"}


@pytest.mark.fault
@pytest.mark.parametrize("kind", ["vocab.txt", "spm.model"])
def test_a_tokenizer_file_of_other_bytes_is_refused_by_name(tmp_path, kind):
  path = tmp_path / kind
  path.write_bytes(b"\xff\xfe not text, not a model \x00\x81")
  config = _corpus_config(tmp_path, str(tmp_path / "*.txt"))
  (tmp_path / "c.txt").write_text("Some text.\n")
  tokenizer = "wordpiece" if kind == "vocab.txt" else "sentencepiece"
  config.update(
      tokenizer=tokenizer,
      **{"vocab_file" if tokenizer == "wordpiece" else "spm_model_file": str(path)},
  )
  why = "is not UTF-8 text" if tokenizer == "wordpiece" else "is not a valid sentencepiece model"
  with pytest.raises(ConfigError, match=rf"{path}'? {why}"):
    load_pretraining_data(config)
  assert not os.path.exists(tmp_path / "cache")
