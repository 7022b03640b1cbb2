"""Pre-training data: each source (corpus.py, sources.py, tfds_source.py) is tokenized and packed
(prepare.py) into shards (shards.py), by prepare_data or into the cache; training reads them
(pipeline.py). config.py checks the data group. Below: what callers use as data.<name>."""

from electra_jax.data.corpus import builtin_documents  # noqa: F401
from electra_jax.data.pipeline import PretrainingData, batch_keys, get_batch, get_rows  # noqa: F401
from electra_jax.data.pipeline import load_pretraining_data, load_tokenizer, prefetch  # noqa: F401
from electra_jax.data.pipeline import workdir_tokenizer  # noqa: F401
from electra_jax.data.prepare import prepare_data, train_tokenizer  # noqa: F401
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer  # noqa: F401
from electra_jax.data.tokenizer import WordPieceTokenizer, keep_tokenizer  # noqa: F401
from electra_jax.data.tokenizer import train_sentencepiece  # noqa: F401
