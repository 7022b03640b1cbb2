"""data.source="hf_datasets": a local Hugging Face dataset (save_to_disk's folder, or data files
load_dataset reads) becomes documents, shards and a training run like every other source."""

import json

import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import train
from electra_jax.data import load_pretraining_data, prepare
from electra_jax.data.sources import HfDatasetCorpus, SourceStats
from electra_jax.errors import ConfigError

WORDS = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()


def _rows(n, seed=0):
  rng = np.random.default_rng(seed)
  texts = [
      f"Record {i} begins here.\n"
      + " ".join(rng.choice(WORDS, 12))
      + ".\n\n"
      + " ".join(rng.choice(WORDS, 9))
      for i in range(n)
  ]
  texts[3] = "   \n"  # no document
  return {"text": texts, "id": list(range(n))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = tmp_path_factory.mktemp("hf") / "saved"
  import datasets  # noqa: PLC0415 (pyarrow: kept out of collection, see conftest._NativePeerWatch)

  datasets.DatasetDict(
      {
          "train": datasets.Dataset.from_dict(_rows(150)),
          "test": datasets.Dataset.from_dict(_rows(5, 1)),
      }
  ).save_to_disk(str(path))
  return str(path)


def test_rows_become_documents_of_lines(saved):
  stats = SourceStats()
  documents = list(HfDatasetCorpus(saved, "train", "text").iter_documents(stats))
  rows = _rows(150)["text"]
  expected = [[line.strip() for line in text.split("\n") if line.strip()] for text in rows]
  assert documents == [d for d in expected if d] and len(documents) == 149 == stats.num_documents
  assert (
      HfDatasetCorpus(saved, "test", "text").fingerprint
      != HfDatasetCorpus(saved, "train", "text").fingerprint
  )


@pytest.mark.fault
def test_choices_that_do_not_exist_are_named(saved, tmp_path):
  with pytest.raises(
      ConfigError, match=r"data.hf_split='validation' is not a split of .*\['test', 'train'\]"
  ):
    HfDatasetCorpus(saved, "validation", "text")
  with pytest.raises(
      ConfigError, match=r"data.text_field='body' is not a column .*\['text', 'id'\]"
  ):
    HfDatasetCorpus(saved, "train", "body")
  with pytest.raises(ConfigError, match="is not a directory"):
    HfDatasetCorpus(str(tmp_path / "missing"), "train", "text")
  (tmp_path / "junk").mkdir()
  (tmp_path / "junk" / "dataset_info.json").write_text("{not json")  # a damaged save_to_disk
  with pytest.raises(
      ConfigError, match=r"data.hf_path='.*junk' is not a dataset datasets can read"
  ):
    HfDatasetCorpus(str(tmp_path / "junk"), "train", "text")
  with pytest.raises(ConfigError, match="needs data.hf_path"):
    load_pretraining_data(tiny_config(**{"data.source": "hf_datasets"}).data)


def test_a_local_dataset_prepares_like_in_memory_and_trains(saved, tmp_path):
  """Data files read by load_dataset (JSON lines here) train; a save_to_disk folder prepares
  into the same shards the in-memory path reads."""
  files = tmp_path / "files"
  files.mkdir()
  rows = _rows(150, seed=2)
  (files / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows["text"]))
  config = tiny_config(
      **{
          "data.source": "hf_datasets",
          "data.hf_path": str(files),
          "data.spm_vocab_size": 60,
          "train.steps": 2,
          "checkpoint.every_steps": 2,
          "eval.every_steps": 2,
      }
  )
  metrics = train.train_and_evaluate(config, str(tmp_path / "work"))
  assert metrics["step"] == 2 and np.isfinite(metrics["loss"])

  data_config = tiny_config(
      **{
          "data.source": "hf_datasets",
          "data.hf_path": saved,
          "data.spm_vocab_size": 60,
          "data.max_documents": 0,
      }
  ).data
  data_config.cache_dir = str(tmp_path / "cache")
  in_memory = load_pretraining_data(data_config, "train")
  assert any(
      "Record 1 begins here." in in_memory.tokenizer.decode(row) for row in in_memory.input_ids
  )
  data_config.prepared_dir = str(tmp_path / "prepared")
  manifest = prepare.prepare_data(data_config, num_workers=0)
  assert manifest["source"]["source"] == "hf_datasets" and manifest["totals"]["documents"] == 149
  data_config.source = "prepared"
  prepared = load_pretraining_data(data_config, "train")
  np.testing.assert_array_equal(np.asarray(prepared.input_ids), in_memory.input_ids)


@pytest.mark.fault
def test_a_column_of_numbers_named_as_the_text_is_refused_with_its_counts(saved, tmp_path):
  stats = SourceStats()
  assert list(HfDatasetCorpus(saved, "train", "id").iter_documents(stats)) == []
  assert stats.problems == {"skipped_lines": 150}
  assert stats.first_problems["skipped_lines"].endswith("[train][0]: 'id' is not text")
  config = tiny_config(
      **{"data.source": "hf_datasets", "data.hf_path": saved, "data.text_field": "id"}
  ).data
  config.cache_dir = str(tmp_path / "cache")
  with pytest.raises(
      ConfigError, match=r"gave no usable text in field 'id' \(.*'skipped_lines': 150"
  ):
    load_pretraining_data(config)
