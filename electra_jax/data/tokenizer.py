"""The tokenizers ELECTRA trains with: SentencePiece models trained here (ids 0..4 are [PAD] [UNK]
[CLS] [SEP] [MASK]) and BERT's WordPiece vocab.txt; and the tokenizer a data config names."""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import random
import textwrap
from collections.abc import Iterable, Sequence

import sentencepiece as spm
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from electra_jax import workdir_files
from electra_jax.errors import ConfigError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))

SPM_MODEL_TYPES = ("unigram", "bpe")
TOKENIZER_FILES = {"sentencepiece": "spm.model", "wordpiece": "vocab.txt"}
_MAX_TRAINING_SENTENCES = 1_000_000  # at most this many sentences train a model
# The model depends on the trainer's thread count: a fixed one makes it a function of the config.
TRAINING_THREADS = 2
# Sentencepiece silently skips longer sentences: ours are cut into pieces within it.
_MAX_SENTENCE_BYTES = 16384


def _within_limit(sentence: str, limit: int = _MAX_SENTENCE_BYTES) -> list[str]:
  """`sentence`, or pieces of it of at most `limit` UTF-8 bytes, cut at spaces where it has any."""
  if len(sentence) * 4 <= limit or len(sentence.encode("utf-8")) <= limit:
    return [sentence]
  return textwrap.wrap(sentence, limit // 4)  # (at most 4 bytes a character)


def _sample_sentences(sentences: Iterable[str], k: int) -> list[str]:
  """`k` of `sentences` (all if fewer) by a reservoir sampler of fixed seed: sentencepiece's own is
  seeded at random, so each host would train another model."""
  rng, reservoir = random.Random(f"electra-spm-sample:{k}"), []
  for count, sentence in enumerate(sentences):
    if count < k:
      reservoir.append(sentence)
    elif (slot := rng.randrange(count + 1)) < k:
      reservoir[slot] = sentence
  return reservoir


class NoSentencesError(ConfigError):
  """train_sentencepiece was given no text (callers name their source)."""


def train_sentencepiece(
    sentences: Iterable[str],
    out_path: str,
    vocab_size: int,
    model_type: str = "unigram",
    num_threads: int = TRAINING_THREADS,
) -> str:
  """Train a sentencepiece model on `sentences` into `out_path` (returned), atomically: ids 0..4 are
  SPECIAL_TOKENS, and there are no BOS/EOS pieces."""
  model_bytes = io.BytesIO()
  sample = _sample_sentences(
      (piece for sentence in sentences for piece in _within_limit(sentence)),
      _MAX_TRAINING_SENTENCES,
  )
  if not sample:
    raise NoSentencesError(
        "train_sentencepiece got no sentences to train on; pass a non-empty iterable of strings."
    )
  try:
    spm.SentencePieceTrainer.train(  # minloglevel=2: errors only (the trainer logs every EM step to stderr)
        sentence_iterator=iter(sample),
        model_writer=model_bytes,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        pad_piece="[PAD]",
        unk_id=UNK_ID,
        unk_piece="[UNK]",
        bos_id=-1,
        eos_id=-1,
        user_defined_symbols=list(SPECIAL_TOKENS[CLS_ID:]),
        num_threads=num_threads,
        input_sentence_size=_MAX_TRAINING_SENTENCES,
        shuffle_input_sentence=True,
        max_sentence_length=_MAX_SENTENCE_BYTES,
        minloglevel=2,
    )
  except RuntimeError as e:  # what sentencepiece says: too little text, or too many characters
    raise ConfigError(
        f"sentencepiece cannot train a vocabulary of {vocab_size} pieces on this text ({e}). Lower "
        "the vocab size (data.spm_vocab_size) for a small text, or raise it above its characters."
    ) from e
  workdir_files.write_bytes(out_path, model_bytes.getvalue())
  return out_path


class SentencePieceTokenizer:
  """A trained sentencepiece model whose ids 0..4 are SPECIAL_TOKENS."""

  pad_id, unk_id, cls_id, sep_id, mask_id = PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID

  def __init__(self, model_path: str):
    self.model_path = model_path
    model_bytes = pathlib.Path(model_path).read_bytes()
    # The bytes loaded are the bytes hashed, even if the file is replaced meanwhile.
    self.fingerprint = hashlib.sha256(model_bytes).hexdigest()[:16]
    try:
      self._processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    except RuntimeError as e:
      raise ConfigError(
          f"{model_path} is not a valid sentencepiece model ({e}). Delete it and "
          f"train a new one with train_sentencepiece."
      ) from e
    self.vocab_size = self._processor.get_piece_size()
    pieces = [self.id_to_piece(i) for i in range(min(len(SPECIAL_TOKENS), self.vocab_size))]
    if pieces != list(SPECIAL_TOKENS):
      raise ConfigError(
          f"Sentencepiece model {model_path} has {pieces} at ids 0..4, but ELECTRA needs "
          f"{list(SPECIAL_TOKENS)} there; train one with --mode=train_tokenizer."
      )

  def encode(self, text: str) -> list[int]:
    return self._processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
    return self._processor.encode(list(texts), out_type=int, num_threads=num_threads)

  def decode(self, ids: Iterable[int]) -> str:
    # Sentencepiece rejects numpy integers, which is what array rows contain.
    return self._processor.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._processor.id_to_piece(int(i))

  def __repr__(self) -> str:  # (the fingerprint tells models apart; the size follows from it)
    return f"SentencePieceTokenizer({self.model_path!r}, fingerprint={self.fingerprint!r})"


class WordPieceTokenizer:
  """A BERT vocabulary with BERT's normalization (`strip_accents` None: when lowercasing)."""

  def __init__(self, vocab_file: str, lowercase: bool = True, strip_accents: bool | None = None):
    self.vocab_file, self.lowercase, self.strip_accents = vocab_file, lowercase, strip_accents
    vocab_bytes = pathlib.Path(vocab_file).read_bytes()
    try:
      text = vocab_bytes.decode("utf-8-sig")  # (-sig: a byte-order mark would hide [PAD])
    except UnicodeDecodeError as e:
      raise ConfigError(
          f"data.vocab_file={vocab_file!r} is not UTF-8 text ({e}); give a BERT vocab.txt."
      ) from e
    # The final newline ends the last line, it does not start an empty token.
    tokens = [token.rstrip("\r") for token in text.removesuffix("\n").split("\n")]
    # As BERT reads it: the token on line i has id i (a repeated token keeps its last line).
    self._vocab = {token: index for index, token in enumerate(tokens)}
    self.vocab_size = len(tokens)
    if missing := [token for token in SPECIAL_TOKENS if token not in self._vocab]:
      raise ConfigError(
          f"WordPiece vocabulary {vocab_file} lacks the special token {missing[0]}; ELECTRA needs "
          f"all of {list(SPECIAL_TOKENS)}: add the missing lines (BERT's vocab.txt has them)."
      )
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        self._vocab[t] for t in SPECIAL_TOKENS
    )
    # pad_text=1: "[PAD]" in the text is tokenized as text, unlike in a tokenizer that made it the padding id.
    settings = f"lowercase={lowercase}|strip_accents={strip_accents}|pad_text=1\n".encode()
    self.fingerprint = hashlib.sha256(settings + vocab_bytes).hexdigest()[:16]

    # (its default, as BERT's: a "word" over 100 characters, junk such as base64, is one [UNK])
    tokenizer = Tokenizer(models.WordPiece(self._vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(
        strip_accents=self.strip_accents, lowercase=self.lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    # The special tokens written in the text stay one token, as in BERT's transformers tokenizer,
    # except "[PAD]": its id mid-example would be read as padding, so it is tokenized as text.
    tokenizer.add_special_tokens([token for token in SPECIAL_TOKENS if token != "[PAD]"])
    self.backend = tokenizer

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
    del num_threads  # `tokenizers` has its own pool: RAYON_NUM_THREADS bounds it
    encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
    return [encoding.ids for encoding in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` with "##" pieces joined; [PAD] is dropped, other special tokens kept."""
    return self.backend.decode(
        [int(i) for i in ids if int(i) != self.pad_id], skip_special_tokens=False
    )

  def id_to_piece(self, i: int) -> str:
    return self.backend.id_to_token(int(i)) or "[UNK]"

  def __repr__(self) -> str:
    return (
        f"WordPieceTokenizer({self.vocab_file!r}, lowercase={self.lowercase}, strip_accents={self.strip_accents}, "
        f"vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"
    )


def open_tokenizer(path: str, config):
  """The tokenizer in file `path` (a bucket's through a local copy) of the config's kind."""
  local = workdir_files.local_copy(path, config["cache_dir"])
  if config["tokenizer"] == "wordpiece":
    return WordPieceTokenizer(local, config["lowercase"], config["strip_accents"])
  return SentencePieceTokenizer(local)


def configured_tokenizer(config, directory: str = ""):
  """The tokenizer a read config names (data.vocab_file or data.spm_model_file), else the copy
  in `directory`; None while there is none."""
  path = config["vocab_file" if config["tokenizer"] == "wordpiece" else "spm_model_file"]
  if not path and directory:
    path = os.path.join(directory, TOKENIZER_FILES[config["tokenizer"]])
  return open_tokenizer(path, config) if path and workdir_files.exists(path) else None


def keep_tokenizer(tokenizer, directory) -> None:
  """Copies `tokenizer`'s file into `directory` (a workdir, prepared shards): its readers need
  neither the corpus nor the path that gave it."""
  wordpiece = isinstance(tokenizer, WordPieceTokenizer)
  name = TOKENIZER_FILES["wordpiece" if wordpiece else "sentencepiece"]
  kept = pathlib.Path(tokenizer.vocab_file if wordpiece else tokenizer.model_path).read_bytes()
  workdir_files.write_bytes(workdir_files.path(directory, name), kept)
