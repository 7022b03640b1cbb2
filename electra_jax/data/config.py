"""The `data` config group: its one check (its keys and defaults are configs/base.py's, which
complete every config) and its read into the checked, absolute values the data package takes."""

from __future__ import annotations

import os

from etils import epath

from electra_jax import workdir_files
from electra_jax.data import sources
from electra_jax.data.packing import MIN_SEQ_LEN
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SPM_MODEL_TYPES, TOKENIZER_FILES
from electra_jax.errors import ConfigError

_CHOICES = (  # (key, the values it may take; configs/base.py says what they mean)
    ("source", (*sources.DOCUMENT_SOURCES, "prepared")),
    ("tokenizer", tuple(TOKENIZER_FILES)),
    ("spm_model_type", SPM_MODEL_TYPES),
    ("strip_accents", (None, True, False)),
    ("pack_rows", (False, True)),
)
_NEEDS = (  # (source, a key it reads, what to give there)
    ("text", "files", "comma-separated paths or globs, e.g. --config.data.files='corpus/*.txt'"),
    ("jsonl", "files", "comma-separated paths or globs, e.g. --config.data.files='c/*.jsonl'"),
    ("jsonl", "text_field", "the JSON field holding each document's text"),
    ("tfds", "tfds_name", "a prepared TFDS dataset, e.g. wikipedia/20230601.en"),
    ("hf_datasets", "hf_path", "a local dataset's folder (save_to_disk's, or load_dataset's)"),
    ("hf_datasets", "text_field", "the column holding each document's text"),
    ("prepared", "prepared_dir", "the directory --mode=prepare_data wrote"),
)
_BOUNDS = (  # (key, its bound as the message states it, the bound's test)
    ("max_seq_len", f">= {MIN_SEQ_LEN} (to fit [CLS] A [SEP] B [SEP])", lambda v: v >= MIN_SEQ_LEN),
    ("spm_vocab_size", "> 5 (the special tokens, and more)", lambda v: v > len(SPECIAL_TOKENS)),
    ("shard_documents", ">= 1", lambda v: v >= 1),
    ("max_documents", ">= 0 (0 means all)", lambda v: v >= 0),
    ("eval_fraction", "in [0, 1) (0.02 holds out 2% of the documents)", lambda v: 0 <= v < 1),
)


def check_config(data, eval_every_steps: int | None = None) -> None:
  """Refuses the first bad value of the data group `data`, naming it and the fix; reads no file.
  `eval_every_steps`: a training run's eval.every_steps, None for prepare_data."""
  for key, allowed in _CHOICES:  # (by repr: 1 is not True)
    if repr(data[key]) not in map(repr, allowed):
      raise ConfigError(f"data.{key}={data[key]!r} is not one of {list(allowed)}.")
  for key, bound, within in _BOUNDS:
    if not within(data[key]):
      raise ConfigError(f"data.{key}={data[key]} must be {bound}.")
  for needer, key, what in _NEEDS:  # (a list of only commas and spaces is none)
    if data.source == needer and not data[key].strip(" ,"):
      raise ConfigError(f"data.source={needer!r} needs data.{key}: {what}.")
  source, tokenizer, training = data.source, data.tokenizer, eval_every_steps is not None
  # A key only other sources read, set with the built-in corpus: a forgotten data.source.
  for key in dict.fromkeys(key for _, key, _ in _NEEDS if key != "text_field"):
    if source == "builtin" and data[key] and (training or key != "prepared_dir"):
      wanted = " or ".join(f"--config.data.source='{s}'" for s, k, _ in _NEEDS if k == key)
      raise ConfigError(
          f"data.{key}={data[key]!r} is set, but data.source='builtin' does not read it; add "
          f"{wanted} to use it, or drop data.{key}."
      )
  # (Prepared shards carry their vocab.txt.)
  if tokenizer == "wordpiece" and not data.vocab_file and source != "prepared":
    raise ConfigError(
        "data.tokenizer='wordpiece' needs data.vocab_file, the path of a BERT vocab.txt (one "
        "token per line), e.g. --config.data.vocab_file=uncased_L-12_H-768_A-12/vocab.txt."
    )
  if data.spm_model_file and tokenizer != "sentencepiece":
    raise ConfigError(
        f"data.spm_model_file={data.spm_model_file!r} is set but data.tokenizer={tokenizer!r}; "
        "set data.tokenizer='sentencepiece' to use that model, or clear data.spm_model_file."
    )
  if data.eval_fraction == 0 and training and eval_every_steps > 0 and source != "prepared":
    raise ConfigError(
        f"data.eval_fraction=0 holds out no documents, but eval.every_steps={eval_every_steps} "
        "evaluates on them; set --config.eval.every_steps=0, or data.eval_fraction > 0."
    )


def read_config(data) -> dict:
  """The data group `data`, checked, as a dict: paths absolute (a bucket's as given), data.files
  resolved, the cache directory found; a tokenizer file it names must exist."""
  check_config(data)
  config = data.to_dict()
  for key in ("vocab_file", "spm_model_file", "prepared_dir"):
    if workdir_files.is_remote(config[key]):
      config[key] = config[key].rstrip("/")
    elif config[key]:
      config[key] = os.path.abspath(os.path.expanduser(config[key]))
  for key, what in (
      ("vocab_file", "the path of a BERT vocab.txt"),
      ("spm_model_file", "a model --mode=train_tokenizer wrote, or clear it to train one"),
  ):
    if config[key] and not epath.Path(config[key]).is_file():
      raise ConfigError(f"data.{key}={config[key]!r} is not a file; give {what}.")
  from_env = not config["cache_dir"] and os.environ.get("ELECTRA_JAX_CACHE")
  cache_dir = os.path.expanduser(config["cache_dir"] or from_env or "~/.cache/electra_jax")
  if not workdir_files.is_remote(cache_dir):
    workdir_files.check_usable(cache_dir, "ELECTRA_JAX_CACHE" if from_env else "data.cache_dir")
  config["cache_dir"] = cache_dir
  files = config["source"] in sources.FILE_SOURCES
  config["files"] = sources.resolve_files(config["files"]) if files else []
  return config
