"""Pre-training data: every source (corpus.py, sources.py, tfds_source.py) is tokenized and packed
(prepare.py) into shards (shards.py), offline by prepare_data or into the cache on first use; training
reads the shards, memory-mapped or by ranged reads from a bucket (pipeline.py). config.py checks the
data config group."""

from electra_jax.data.corpus import builtin_documents
from electra_jax.data.pipeline import PretrainingData, batch_keys, get_batch, get_rows, prefetch
from electra_jax.data.pipeline import load_pretraining_data, load_tokenizer, workdir_tokenizer
from electra_jax.data.prepare import prepare_data, train_tokenizer
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer, WordPieceTokenizer
from electra_jax.data.tokenizer import keep_tokenizer, train_sentencepiece
