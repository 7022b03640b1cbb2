"""Pre-training data for electra-jax: corpora, tokenizers, example packing and batching.

The training code should only need `load_pretraining_data` and `get_batch`; the other names
are exported for tools and tests.
"""

from electra_jax.data.corpus import builtin_corpus_fingerprint, builtin_documents
from electra_jax.data.packing import pack_documents
from electra_jax.data.pipeline import PretrainingData, get_batch, load_pretraining_data, load_tokenizer
from electra_jax.data.sources import SourceStats, read_documents, resolve_files
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer, train_sentencepiece
from electra_jax.data.wordpiece import WordPieceTokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "PretrainingData",
    "SentencePieceTokenizer",
    "SourceStats",
    "WordPieceTokenizer",
    "builtin_corpus_fingerprint",
    "builtin_documents",
    "get_batch",
    "load_pretraining_data",
    "load_tokenizer",
    "pack_documents",
    "read_documents",
    "resolve_files",
    "train_sentencepiece",
]
