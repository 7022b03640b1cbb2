"""Tests for data.source = "tfds": a tiny array_record dataset is built in the test (no network)
and read back through tfds' random-access data source, without TensorFlow."""

import os
import random

import numpy as np
import pytest

from conftest import base
from electra_jax.errors import ConfigError
from electra_jax.data import load_pretraining_data, prepare_data, train_tokenizer
from electra_jax.data.sources import SourceStats
from electra_jax.data.tfds_source import TfdsCorpus, import_tfds

tfds = import_tfds()

_WORDS = "river stone bridge lantern orchard harbor meadow violin ember cedar quiet bright".split()


def _article(i):
  rng = random.Random(i)
  paragraphs = [
      " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
      for _ in range(rng.randint(1, 5))
  ]
  # Blank lines and surrounding spaces, as real articles have; one record has no text at all.
  return "" if i == 7 else f"Article {i}.\n\n" + "\n  ".join(paragraphs) + "\n"


class TinyElectraCorpus(tfds.core.GeneratorBasedBuilder):
  """40 articles with a "text" and a "title" feature, in one "train" split."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "title": tfds.features.Text()}
        ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i in range(40):
      yield i, {"text": _article(i), "title": f"Title {i}"}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  TinyElectraCorpus(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return data_dir


def _config(tmp_path, tfds_dir, **overrides):
  """configs/base.py's data group (every config is completed with it) for the tiny TFDS corpus."""
  config = base.get_config().data
  config.update(source="tfds", tfds_name="tiny_electra_corpus", tfds_data_dir=tfds_dir)
  config.update(max_seq_len=32, cache_dir=str(tmp_path / "cache"), spm_vocab_size=45)
  config.update(max_documents=0, eval_fraction=0.1, prepared_dir=str(tmp_path / "prepared"))
  config.update(shard_documents=8)
  config.update(overrides)
  return config


def test_tfds_records_become_documents_of_lines(tfds_dir):
  corpus = TfdsCorpus("tiny_electra_corpus", "train", "text", tfds_dir)
  stats = SourceStats()
  documents = list(corpus.iter_documents(stats))
  # The reference: the same records read straight from the data source, split by hand.
  source = tfds.data_source("tiny_electra_corpus", split="train", data_dir=tfds_dir, download=False)
  expected = []
  for i in range(len(source)):
    lines = [line.strip() for line in source[i]["text"].decode("utf-8").split("\n")]
    if any(lines):
      expected.append([line for line in lines if line])
  assert documents == expected
  assert len(documents) == 39 and stats.num_documents == 39  # the empty article is no document
  assert sorted(int(d[0].split()[1].rstrip(".")) for d in documents) == [
      i for i in range(40) if i != 7
  ]
  assert corpus.description["num_records"] == 40


def test_tfds_source_trains_packs_and_prepares_identically(tmp_path, tfds_dir):
  model = str(tmp_path / "spm.model")
  train_tokenizer(_config(tmp_path, tfds_dir), model, num_threads=1)
  config = _config(tmp_path, tfds_dir, spm_model_file=model)
  in_memory = load_pretraining_data(config, "train")
  text = " ".join(in_memory.tokenizer.decode(row) for row in in_memory.input_ids[:20])
  assert "Article" in text and any(word in text for word in _WORDS)
  manifest = prepare_data(config, num_workers=0)
  assert manifest["source"]["tfds_name"] == "tiny_electra_corpus/1.0.0"
  assert manifest["totals"]["documents"] == 39 and len(manifest["shards"]) == 5
  prepared = load_pretraining_data(
      _config(tmp_path, tfds_dir, spm_model_file=model, source="prepared"), "train"
  )
  np.testing.assert_array_equal(np.asarray(prepared.input_ids), in_memory.input_ids)
  np.testing.assert_array_equal(np.asarray(prepared.token_type_ids), in_memory.token_type_ids)
  assert prepared.fingerprint == in_memory.fingerprint


@pytest.mark.fault
@pytest.mark.parametrize(
    "tfds_name, refusal",
    [
        (None, r"'tiny_electra_corpus' is not prepared in .*download_and_prepare.*array_record"),
        ("wikipedia/20230601.en", r"'wikipedia/20230601.en' is not prepared.*tfds build wikipedia"),
        ("no_such_corpus_xyz", "'no_such_corpus_xyz' is not a TFDS dataset"),
        ("", "needs data.tfds_name"),
    ],
)
def test_tfds_dataset_not_prepared_says_how_to_prepare_it(tmp_path, tfds_name, refusal):
  named = {} if tfds_name is None else {"tfds_name": tfds_name}
  config = _config(tmp_path, str(tmp_path / "nothing_here"), **named)
  with pytest.raises(ConfigError, match=refusal):
    load_pretraining_data(config)
  assert not os.path.exists(tmp_path / "cache" / "tfds")
  # --mode=train_tokenizer (the README's first TFDS command) says the same, not "no usable text".
  with pytest.raises(ConfigError, match=refusal):
    train_tokenizer(config, str(tmp_path / "spm.model"), num_threads=1)
  assert not os.path.exists(tmp_path / "spm.model")


@pytest.mark.fault
@pytest.mark.parametrize(
    "key, value, refusal",
    [
        ("tfds_split", "test", r"tfds_split='test' is not a split.*\['train'\]"),
        (
            "tfds_text_field",
            "body",
            r"tfds_text_field='body' is not a feature.*\['text', 'title'\]",
        ),
    ],
)
def test_tfds_wrong_split_or_field_names_the_choices(tmp_path, tfds_dir, key, value, refusal):
  with pytest.raises(ConfigError, match=refusal):
    load_pretraining_data(_config(tmp_path, tfds_dir, **{key: value}))
