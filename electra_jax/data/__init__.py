"""Pre-training data: every source (corpus.py, sources.py, tfds_source.py) is tokenized and packed
(prepare.py) into shards (shards.py), offline by prepare_data or into the cache on first use; training
reads the shards, memory-mapped or by ranged reads from a bucket (pipeline.py)."""

from electra_jax.data.corpus import builtin_corpus_fingerprint, builtin_documents
from electra_jax.data.packing import pack_documents
from electra_jax.data.pipeline import (
    Prefetcher,
    PretrainingData,
    batch_keys,
    get_batch,
    get_rows,
    keep_tokenizer,
    load_pretraining_data,
    load_tokenizer,
    workdir_tokenizer,
)
from electra_jax.data.prepare import prepare_data, train_tokenizer
from electra_jax.data.sources import SourceStats, read_documents, resolve_files
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer, train_sentencepiece
from electra_jax.data.wordpiece import WordPieceTokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "Prefetcher",
    "PretrainingData",
    "SentencePieceTokenizer",
    "SourceStats",
    "WordPieceTokenizer",
    "builtin_corpus_fingerprint",
    "builtin_documents",
    "batch_keys",
    "get_batch",
    "get_rows",
    "keep_tokenizer",
    "load_pretraining_data",
    "load_tokenizer",
    "pack_documents",
    "prepare_data",
    "read_documents",
    "resolve_files",
    "train_sentencepiece",
    "train_tokenizer",
    "workdir_tokenizer",
]
