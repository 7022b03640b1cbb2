"""TFDS corpora (data.source = "tfds"): Wikipedia, C4, BookCorpus, ... read without TensorFlow, through
a prepared dataset's random-access data source (array_record or parquet files), as documents."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

from electra_jax.errors import ConfigError
from electra_jax.data.sources import RecordCorpus

_RANDOM_ACCESS_FORMATS = ("array_record", "parquet")


# TFDS registers its builder groups in one loop that stops at the first missing an optional
# dependency (h5py), leaving later ones (`text`: glue, wikipedia, c4) unregistered; import_tfds
# imports the groups that hold text datasets itself.
_TEXT_GROUPS = ("question_answering", "summarization", "text", "text_simplification", "translate")


@functools.cache
def import_tfds():
  """The tensorflow_datasets module with its text builder groups registered."""
  import tensorflow_datasets as tfds  # noqa: PLC0415  (heavy; only TFDS sources need it)

  for group in _TEXT_GROUPS:
    with contextlib.suppress(ImportError):
      importlib.import_module(f"tensorflow_datasets.{group}")
  return tfds


class TfdsCorpus(RecordCorpus):
  """One split of a prepared TFDS dataset, as documents of sentences."""

  def __init__(self, name: str, split: str, text_field: str, data_dir: str = ""):
    try:
      tfds = import_tfds()
    except ImportError as e:
      raise ConfigError(
          f"data.source='tfds' needs tensorflow-datasets ({e}); `pip install tensorflow-datasets` "
          f"(TensorFlow itself is not needed)."
      ) from e
    self.name, self.split, self.text_field = f"{name}[{split}]", split, text_field
    data_dir = os.path.expanduser(data_dir) if data_dir else None
    try:
      builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ConfigError(
          f"data.tfds_name={name!r} is not a TFDS dataset ({str(e).splitlines()[0]}); see "
          "https://www.tensorflow.org/datasets/catalog for names such as 'wikipedia/20230601.en'."
      ) from e
    if not builder.is_prepared():
      at = f" --data_dir={data_dir}" if data_dir else ""
      raise ConfigError(
          f"TFDS dataset {name!r} is not prepared in {builder.data_dir} (training downloads "
          f"nothing); prepare it once where the internet is reachable, with `tfds build {name} "
          f"--file_format=array_record{at}` or download_and_prepare(file_format='array_record') "
          "(docs/data.md), and set data.tfds_data_dir to that directory."
      )
    file_format = str(getattr(builder.info.file_format, "value", builder.info.file_format))
    if file_format not in _RANDOM_ACCESS_FORMATS:
      raise ConfigError(
          f"TFDS dataset {name!r} in {builder.data_dir} is {file_format}, which only TensorFlow "
          f"reads; prepare it again with `tfds build {name} --file_format=array_record` (or "
          "parquet; docs/data.md) and set data.tfds_data_dir to that directory."
      )
    if split not in builder.info.splits:
      raise ConfigError(
          f"data.tfds_split={split!r} is not a split of {name!r}; it has "
          f"{list(builder.info.splits.keys())}."
      )
    features = list(builder.info.features.keys()) if hasattr(builder.info.features, "keys") else []
    if text_field not in features:
      raise ConfigError(
          f"data.tfds_text_field={text_field!r} is not a feature of {name!r}; its features are "
          f"{features}. Name the one holding the document text."
      )
    self._builder, split_info = builder, builder.info.splits[split]
    self.num_records = int(split_info.num_examples)
    self.description = {
        "source": "tfds",
        "tfds_name": builder.info.full_name,
        "tfds_split": split,
        "tfds_text_field": text_field,
        "tfds_data_dir": str(builder.data_dir),
        "num_records": self.num_records,
        "num_bytes": int(split_info.num_bytes),
    }
    self.fingerprint = "|".join(  # (where the dataset lies is not what it holds)
        str(self.description[key])
        for key in ("tfds_name", "tfds_split", "tfds_text_field", "num_records", "num_bytes")
    )

  @functools.cached_property
  def _source(self):
    return self._builder.as_data_source(split=self.split)

  def read_texts(self, start: int, stop: int) -> list:
    records = self._source.__getitems__(list(range(start, stop)))
    return [record[self.text_field] for record in records]
