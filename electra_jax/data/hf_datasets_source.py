"""data.source="hf_datasets": a local Hugging Face dataset as documents: data.hf_path is a directory
`save_to_disk` wrote, or one `load_dataset` reads locally; nothing is downloaded (the hf_datasets extra)."""

from __future__ import annotations

import os

from electra_jax.errors import ConfigError
from electra_jax.data.sources import SourceStats, record_documents

_READ_BLOCK = 1024  # rows fetched per column read
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


class HfDatasetCorpus:
  """One split of a local Hugging Face dataset, each row's `text_field` a document."""

  def __init__(self, path: str, split: str, text_field: str):
    if not path:
      raise ConfigError("data.source='hf_datasets' needs data.hf_path, a local dataset directory "
                        "(save_to_disk's output, or data files load_dataset reads).")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
      raise ConfigError(f"data.hf_path={path!r} is not a directory; give a local dataset's folder.")
    try:
      import datasets  # noqa: PLC0415 (optional: the hf_datasets extra)
    except ImportError as error:
      raise ConfigError(f"data.source='hf_datasets' needs the datasets package ({error}); "
                        "pip install 'electra-jax[hf_datasets]'.") from None
    try:
      if any(os.path.exists(os.path.join(path, marker)) for marker in _SAVED_MARKERS):
        loaded = datasets.load_from_disk(path)
      else:
        loaded = datasets.load_dataset(path, split=split)
    except Exception as error:  # noqa: BLE001 -- whatever datasets raises on a folder it cannot read
      raise ConfigError(f"data.hf_path={path!r} is not a dataset datasets can read locally "
                        f"({type(error).__name__}: {str(error)[:300]}).") from None
    if isinstance(loaded, datasets.DatasetDict):
      if split not in loaded:
        raise ConfigError(f"data.hf_split={split!r} is not a split of {path}; it has {sorted(loaded)}.")
      loaded = loaded[split]
    if text_field not in loaded.column_names:
      raise ConfigError(f"data.text_field={text_field!r} is not a column of {path}; its columns are "
                        f"{loaded.column_names}. Name the one holding the document text.")
    self._dataset, self.path, self.split, self.text_field = loaded, path, split, text_field
    self.description = {"source": "hf_datasets", "hf_path": path, "hf_split": split, "text_field": text_field,
                        "num_rows": loaded.num_rows}
    # datasets' own hash of the rows (new data, new key), with the split and column read.
    self.fingerprint = f"{loaded._fingerprint}|{split}|{text_field}|{loaded.num_rows}"

  def iter_documents(self, stats: SourceStats):
    yield from record_documents(f"{self.path}[{self.split}]", self._dataset.num_rows,
                                lambda start, stop: self._dataset[start:stop][self.text_field], self.text_field,
                                stats, _READ_BLOCK)
