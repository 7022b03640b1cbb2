"""BERT WordPiece tokenization from a `vocab.txt` (BERT's has [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102,
[MASK]=103), with BERT's normalization, built on the Hugging Face `tokenizers` library."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from electra_jax.errors import ConfigError
from electra_jax.data.tokenizer import SPECIAL_TOKENS

# As BERT's: longer "words" (usually junk such as URLs or base64) become one [UNK].
_MAX_INPUT_CHARS_PER_WORD = 100


class WordPieceTokenizer:
  """A BERT vocabulary with BERT's basic tokenization; the interface of SentencePieceTokenizer.
  `strip_accents` None strips accents when lowercasing, as BERT does."""

  kind = "wordpiece"

  def __init__(self, vocab_file: str, lowercase: bool = True, strip_accents: bool | None = None):
    self.vocab_file = vocab_file
    self.lowercase = bool(lowercase)
    self.strip_accents = None if strip_accents is None else bool(strip_accents)
    try:
      with open(vocab_file, "rb") as f:
        vocab_bytes = f.read()
    except OSError as e:
      raise ConfigError(
          f"Cannot read the WordPiece vocabulary data.vocab_file={vocab_file!r} ({e}); give the "
          f"path of a BERT vocab.txt (one token per line)."
      ) from e
    try:
      # -sig: a BOM would hide [PAD]; the final newline ends the last line, it does not start an empty token.
      tokens = [
          token.rstrip("\r")
          for token in vocab_bytes.decode("utf-8-sig").removesuffix("\n").split("\n")
      ]
    except UnicodeDecodeError as e:
      raise ConfigError(
          f"data.vocab_file={vocab_file!r} is not UTF-8 text ({e}); give a BERT vocab.txt."
      ) from e
    # As BERT reads it: the token on line i has id i (a repeated token keeps its last line).
    self._vocab = {token: index for index, token in enumerate(tokens)}
    self.vocab_size = len(tokens)
    for token in SPECIAL_TOKENS:
      if token not in self._vocab:
        raise ConfigError(
            f"WordPiece vocabulary {vocab_file} lacks the special token {token}; ELECTRA needs all of "
            f"{list(SPECIAL_TOKENS)}. Add the missing line(s) to the vocab (BERT's vocab.txt has them)."
        )
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        self._vocab[t] for t in SPECIAL_TOKENS
    )
    # pad_text=1: "[PAD]" in the text is tokenized as text, unlike in a tokenizer that made it the padding id.
    settings = (
        f"lowercase={self.lowercase}|strip_accents={self.strip_accents}|pad_text=1\n".encode()
    )
    self.fingerprint = hashlib.sha256(settings + vocab_bytes).hexdigest()[:16]

    tokenizer = Tokenizer(
        models.WordPiece(
            self._vocab, unk_token="[UNK]", max_input_chars_per_word=_MAX_INPUT_CHARS_PER_WORD
        )
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=self.strip_accents,
        lowercase=self.lowercase,
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    # The special tokens written in the text stay one token, as in BERT's transformers tokenizer,
    # except "[PAD]": its id mid-example would be read as padding, so it is tokenized as text.
    tokenizer.add_special_tokens([token for token in SPECIAL_TOKENS if token != "[PAD]"])
    self.backend = tokenizer
    self._id_to_token = {index: token for token, index in self._vocab.items()}

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
    return self._id_to_token.get(int(i), "[UNK]")

  def __repr__(self) -> str:
    return (
        f"WordPieceTokenizer({self.vocab_file!r}, lowercase={self.lowercase}, strip_accents={self.strip_accents}, "
        f"vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"
    )
