"""Pre-training data for electra-jax: corpus, tokenizer, example packing and batching.

The training code should only need `load_pretraining_data` and `get_batch`; the other names
are exported for tools and tests.
"""

from electra_jax.data.corpus import builtin_corpus_fingerprint, builtin_documents
from electra_jax.data.packing import pack_documents
from electra_jax.data.pipeline import PretrainingData, get_batch, load_pretraining_data
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer, train_sentencepiece

__all__ = [
    "SPECIAL_TOKENS",
    "PretrainingData",
    "SentencePieceTokenizer",
    "builtin_corpus_fingerprint",
    "builtin_documents",
    "get_batch",
    "load_pretraining_data",
    "pack_documents",
    "train_sentencepiece",
]
