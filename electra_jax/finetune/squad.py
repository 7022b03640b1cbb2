"""SQuAD 1.1 and 2.0 as the official code runs them: reading (JSON or TFDS), windowed features, the
span head and its loss, n-best decoding, the official EM/F1, and the trainer's adapter."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import os
import re
import string
import unicodedata
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from electra_jax import workdir_files
from electra_jax.data.tokenizer import WordPieceTokenizer
from electra_jax.errors import ConfigError
from electra_jax.finetune import tasks
from electra_jax.finetune.model import EncoderWithHead, head_dense

FEATURE_KEYS = (*tasks.MODEL_INPUTS, "start_positions", "end_positions", "is_impossible")
# The logit of positions that cannot start or end an answer (question, padding): no softmax mass.
_MASKED_LOGIT = -10000.0


@dataclasses.dataclass(frozen=True)
class SquadExample:
  """`answers`: (text, character offset in `context`); training uses the first, scoring the best."""

  qas_id: str
  question: str
  context: str
  answers: list[tuple[str, int]]
  is_impossible: bool = False


def _checked_examples(rows, version: str, where: str) -> list[SquadExample]:
  """SquadExamples of (id, question, context, [(text, answer_start)], is_impossible) rows, each
  refused by its id where a field is missing or an answer is not at its offset."""
  examples = []
  for qas_id, question, context, answers, is_impossible in rows:
    if not (qas_id and all(isinstance(value, str) for value in (qas_id, question, context))):
      raise ConfigError(f"{where}: question {qas_id!r} needs string 'id', 'question', 'context'.")
    for text, start in answers:
      valid = isinstance(text, str) and type(start) is int and start >= 0
      if not valid or (found := context[start : start + len(text)]) != text:
        raise ConfigError(
            f"{where}: question {qas_id!r}: answer_start={start!r} does not point at the answer "
            f"text {text!r} (the context there reads {found if valid else None!r}); give a string "
            "'text' at its integer 'answer_start'."
        )
    problems = (
        type(is_impossible) is not bool and f"has is_impossible={is_impossible!r}, not true/false",
        version == "1.1" and is_impossible and "is marked is_impossible, which only SQuAD 2.0 has",
        is_impossible and answers and f"is marked is_impossible but has answers {answers}",
        not (is_impossible or answers) and "has no answers and is not marked is_impossible",
    )
    if why := next(filter(None, problems), None):
      raise ConfigError(f"{where}: question {qas_id!r} {why}.")
    examples.append(SquadExample(qas_id, question, context, answers, is_impossible))
  if not examples:
    raise ConfigError(f"{where} holds no SQuAD questions; give a non-empty file or split.")
  repeated = [qid for qid, n in collections.Counter(e.qas_id for e in examples).items() if n > 1]
  if repeated:
    raise ConfigError(f"{where}: ids {repeated[:5]} occur more than once; give each its own.")
  return examples


def read_squad_json(path: str, version: str) -> list[SquadExample]:
  """Questions of an official SQuAD JSON file of `version` (`plausible_answers` are ignored)."""
  tasks.require_file(path, "set config.data_dir to the folder of SQuAD's files, or source=tfds")
  try:
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is not text)
      data = json.load(f)["data"]
    qas = [(p["context"], qa) for article in data for p in article["paragraphs"] for qa in p["qas"]]
    rows = []
    for context, qa in qas:
      answers = [(a["text"], a["answer_start"]) for a in qa["answers"]]
      rows.append((qa["id"], qa["question"], context, answers, qa.get("is_impossible", False)))
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError(
        f"{path!r} is not an official SQuAD JSON file ({type(e).__name__}: {e}); it needs "
        '{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers"}]}]}]}.'
    ) from e
  return _checked_examples(rows, version, repr(path))


def read_squad_tfds(version: str, split: str, data_dir: str | None = None) -> list[SquadExample]:
  """Questions of a prepared TFDS squad/v<version> (array_record), split "train" or "validation"."""
  name, rows = f"squad/v{version}", []
  for record in tasks.open_tfds_split(name, split, data_dir):
    answers = record["answers"]
    pairs = [(t.decode(), int(s)) for t, s in zip(answers["text"], answers["answer_start"])]
    fields = [record[key].decode() for key in ("id", "question", "context")]  # (TFDS's bytes)
    rows.append((*fields, pairs, bool(record.get("is_impossible", False))))
  return _checked_examples(rows, version, f"TFDS {name} {split}")


def _fold(text: str) -> str:
  """Lowercased, NFKD, without accents: what tokenizers normalize to, to match pieces to words."""
  decomposed = unicodedata.normalize("NFKD", text.lower())
  return "".join(c for c in decomposed if not unicodedata.combining(c))


def _context_tokenizer(tokenizer):
  """context -> (token ids, int32 [n, 2] [start, end) characters of each), word by word (cached);
  a word whose pieces do not align through _fold (an [UNK]) gives each the whole word."""
  hashes = "##" if isinstance(tokenizer, WordPieceTokenizer) else ""  # its continuation pieces

  @functools.cache
  def word_tokens(word: str):
    ids = list(tokenizer.encode(word))
    # Folded char -> word char, and past the end: where a zero-width piece (a lone "▁") sits.
    owner = [i for i, char in enumerate(word) for _ in _fold(char)] + [len(word)]
    # Each piece's text without wordpiece's "##" and sentencepiece's word-boundary "▁".
    pieces = [tokenizer.id_to_piece(t).removeprefix(hashes).replace("\u2581", "") for t in ids]
    folded = [_fold(piece) for piece in pieces]
    if tokenizer.unk_id in ids or "".join(folded) != "".join(_fold(char) for char in word):
      return ids, [(0, len(word))] * len(ids)
    ends = itertools.accumulate(map(len, folded))  # of each piece in the folded word
    return ids, [
        (owner[end - len(piece)], owner[end - 1] + 1 if piece else owner[end])
        for piece, end in zip(folded, ends)
    ]

  @functools.cache
  def tokenize(context: str):
    ids, spans = [], []
    for match in re.finditer(r"\S+", context):
      word_ids, word_spans = word_tokens(match.group())
      ids.extend(word_ids)
      spans.extend((match.start() + s, match.start() + e) for s, e in word_spans)
    return ids, np.asarray(spans, dtype=np.int32).reshape(-1, 2)

  return tokenize


def max_context_owner(windows: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
  """For each context token, the window giving it the most context: the largest min(left, right) +
  0.01 * length, the first on ties (the official rule); an answer may only start in its owner."""
  starts, lengths = np.asarray(windows).reshape(-1, 2).T[..., None]  # [windows, 1] each
  left = np.arange(num_tokens) - starts  # each token's context left and right in each window
  right = lengths - 1 - left
  score = np.minimum(left, right) + 0.01 * lengths
  return np.where((left >= 0) & (right >= 0), score, -np.inf).argmax(0).astype(np.int32)


@dataclasses.dataclass
class SquadMetadata:
  """What decoding needs besides the logits: per row its example, window start and length, first
  context position and bool [seq_len] max-context flags; per example int32 [n, 2] token spans."""

  example_index: np.ndarray
  window_start: np.ndarray
  window_length: np.ndarray
  context_offset: np.ndarray
  token_char_spans: list[np.ndarray]
  max_context: np.ndarray


def make_features(
    examples, tokenizer, max_seq_len: int, doc_stride: int, max_query_len: int, *, is_training: bool
) -> tuple[dict[str, np.ndarray], SquadMetadata]:
  """(int32 FEATURE_KEYS, SquadMetadata): per window a row [CLS] question [SEP] window [SEP], at the
  first answer's tokens or 0 ([CLS]) if it misses it; training drops answers covering no token."""
  tokenize_context = _context_tokenizer(tokenizer)
  rows, meta, token_char_spans, max_context, skipped = [], [], [], [], 0
  for index, example in enumerate(examples):
    context_ids, spans = tokenize_context(example.context)
    token_char_spans.append(spans)
    answer = None
    if example.answers and not example.is_impossible:
      text, char_start = example.answers[0]  # the first and last context token it overlaps
      overlaps = np.flatnonzero((spans[:, 1] > char_start) & (spans[:, 0] < char_start + len(text)))
      answer = (int(overlaps[0]), int(overlaps[-1])) if overlaps.size else None
      if answer is None and is_training:
        skipped += 1
        continue
    query_ids = list(tokenizer.encode(example.question))[:max_query_len]
    offset = len(query_ids) + 2
    # (start, length) of each window, min(max_tokens, doc_stride) apart, the last reaching the end.
    max_tokens, num_tokens = max_seq_len - len(query_ids) - 3, len(context_ids)
    step = min(max_tokens, doc_stride)
    starts = range(0, max(num_tokens - max_tokens, 0) + step, step)
    windows = [(start, min(num_tokens - start, max_tokens)) for start in starts]
    owner = max_context_owner(windows, num_tokens)
    for window, (start, length) in enumerate(windows):
      inside = answer is not None and start <= answer[0] and answer[1] < start + length
      window_ids = context_ids[start : start + length]
      packed = tasks.pack_pair(tokenizer, query_ids, window_ids, max_seq_len)
      positions = (answer[0] - start + offset, answer[1] - start + offset) if inside else (0, 0)
      rows.append((*packed, *positions, int(example.is_impossible or not example.answers)))
      meta.append((index, start, length, offset))
      max_context.append(np.zeros(max_seq_len, bool))
      max_context[-1][offset : offset + length] = owner[start : start + length] == window
    if (index + 1) % 5000 == 0:
      logging.info("SQuAD features: %d of %d questions.", index + 1, len(examples))
  if skipped:
    logging.warning("Left out %d training questions whose answer covers no token.", skipped)
  if not rows:  # np.stack would fail with a traceback
    raise ConfigError(f"None of the {len(examples)} SQuAD questions gave a row; check the file.")
  logging.info("%d SQuAD questions -> %d rows of features.", len(examples), len(rows))
  features = {key: np.asarray(column, np.int32) for key, column in zip(FEATURE_KEYS, zip(*rows))}
  columns = (np.asarray(column, np.int32) for column in zip(*meta))
  return features, SquadMetadata(*columns, token_char_spans, np.stack(max_context))


def answer_mask(token_type_ids, attention_mask):
  """bool [batch, seq]: where an answer may start or end: the context (segment 1) and [CLS]."""
  return jnp.asarray(token_type_ids * attention_mask).astype(bool).at[:, 0].set(True)


class SpanHead(nn.Module):
  """ELECTRA's span head: float32 start, end logits [B, T] (_MASKED_LOGIT outside answer_mask) and
  the answerability logit [B]: dense([CLS] ++ start-prob-weighted hidden) -> GELU -> dense, or 0."""

  answerable: bool = False
  answerable_hidden_size: int = 512
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, hidden, token_type_ids, attention_mask):
    mask = answer_mask(token_type_ids, attention_mask)
    # One kernel for the official two dense(H -> 1) layers, each column initialized as one.
    logits = head_dense(2, self.dtype, "span_logits", fan_out=1)(hidden).astype(jnp.float32)
    start_logits = jnp.where(mask, logits[..., 0], _MASKED_LOGIT)  # [B, T]
    end_logits = jnp.where(mask, logits[..., 1], _MASKED_LOGIT)
    if not self.answerable:
      return start_logits, end_logits, jnp.zeros(start_logits.shape[:1], jnp.float32)
    start_probs = jax.nn.softmax(start_logits, axis=-1).astype(hidden.dtype)
    start_summary = jnp.einsum("bt,bth->bh", start_probs, hidden)
    summary = jnp.concatenate([hidden[:, 0], start_summary], axis=-1)  # [B, 2H]
    summary = head_dense(self.answerable_hidden_size, self.dtype, "answerable_hidden")(summary)
    answerable_logits = head_dense(1, self.dtype, "answerable_logit")(nn.gelu(summary, False))
    return start_logits, end_logits, answerable_logits[..., 0].astype(jnp.float32)


class SquadModel(EncoderWithHead):
  """Parameters {embeddings, encoder, span_head}. [B, T] -> float32 [B, T, 3]: start, end and the
  answerability logit along T (zeros without it), one array to batch (see split_outputs)."""

  answerable: bool = False

  def setup(self):
    super().setup()
    self.span_head = SpanHead(self.answerable, dtype=self.dtype)

  def head(self, hidden, token_type_ids, attention_mask, deterministic):
    start, end, answerable = self.span_head(hidden, token_type_ids, attention_mask)
    return jnp.stack([start, end, jnp.broadcast_to(answerable[:, None], start.shape)], axis=-1)


def split_outputs(outputs):
  """SquadModel's [B, T, 3] -> (start_logits [B, T], end_logits [B, T], answerable_logits [B])."""
  return outputs[..., 0], outputs[..., 1], outputs[:, 0, 2]


def span_losses(outputs, batch: dict, answerable_weight: float = 0.0):
  """Per row [B] of SquadModel's outputs: (CE(start) + CE(end)) / 2 + answerable_weight times the
  sigmoid cross-entropy of the answerability logit against 1 - is_impossible."""
  start, end, answerable = split_outputs(outputs)
  cross_entropy = optax.softmax_cross_entropy_with_integer_labels
  has_answer = 1.0 - jnp.asarray(batch["is_impossible"], jnp.float32)
  return 0.5 * (
      cross_entropy(start, batch["start_positions"]) + cross_entropy(end, batch["end_positions"])
  ) + answerable_weight * optax.sigmoid_binary_cross_entropy(answerable, has_answer)


def apply_null_threshold(predictions: dict, null_odds: dict, null_threshold: float) -> dict:
  """Final answers: "" (no answer) where null_odds > null_threshold, else the span text."""
  return {
      qid: "" if null_odds.get(qid, -np.inf) > null_threshold else text
      for qid, text in predictions.items()
  }


def postprocess(
    examples: Sequence[SquadExample], metadata: SquadMetadata, outputs, settings
) -> tuple[dict[str, str], dict[str, float]]:
  """({qas_id: text}, 2.0's {qas_id: null odds}): the best valid span of the rows' n_best starts
  and ends; null odds: min -answerable_logit over rows, or min(start + end at [CLS]) - best's."""
  start_logits, end_logits, answerable_logits = split_outputs(np.asarray(outputs, np.float32))
  predictions, null_odds = {}, {}
  for index, example in enumerate(examples):
    rows, spans = np.flatnonzero(metadata.example_index == index), metadata.token_char_spans[index]
    cls_scores = start_logits[rows, 0] + end_logits[rows, 0]
    score_null = float(np.min(-answerable_logits[rows] if settings.answerable else cls_scores))
    candidates = []  # (score, text) of each valid span
    for row in rows:
      start, length = int(metadata.window_start[row]), int(metadata.window_length[row])
      offset, owned = int(metadata.context_offset[row]), metadata.max_context[row]
      row_start, row_end = start_logits[row], end_logits[row]
      # As official: the n_best over the whole row (ties to the lower position), then the invalid
      # dropped: [CLS], question, padding, last [SEP], starts owned by another window.
      starts = np.argsort(-row_start, kind="stable")[: settings.n_best]
      starts = starts[owned[starts]]
      ends = np.argsort(-row_end, kind="stable")[: settings.n_best]
      ends = ends[(ends >= offset) & (ends < offset + length)]
      for s in starts:
        for e in ends[(ends >= s) & (ends - s < settings.max_answer_len)]:
          first, last = start + s - offset, start + e - offset  # context tokens
          if text := example.context[spans[first, 0] : spans[last, 1]].strip():
            candidates.append((float(row_start[s] + row_end[e]), text))
    # Of equal scores max keeps the first, as the official stable sort does.
    best_score, predictions[example.qas_id] = max(candidates, key=lambda c: c[0], default=(0.0, ""))
    if settings.version == "2.0":
      null_odds[example.qas_id] = score_null - (0.0 if settings.answerable else best_score)
  return predictions, null_odds


_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
  """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace."""
  text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(gold: str, prediction: str) -> int:
  return int(normalize_answer(gold) == normalize_answer(prediction))


def f1_score(gold: str, prediction: str, version="2.0") -> float:
  """Token F1 of the normalized texts; 2.0 (not 1.1) scores an empty side 1 if both are, else 0."""
  gold_tokens, pred_tokens = normalize_answer(gold).split(), normalize_answer(prediction).split()
  if version == "2.0" and (not gold_tokens or not pred_tokens):
    return float(gold_tokens == pred_tokens)
  shared = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
  return 2 * shared / (len(gold_tokens) + len(pred_tokens)) if shared else 0.0  # 2PR / (P + R)


def squad_metrics(
    examples: Sequence[SquadExample],
    predictions: dict[str, str],
    version: str,
    null_odds: dict | None = None,
    null_threshold: float = -2.75,
) -> dict[str, float]:
  """EM and F1 in percent over each question's best gold answer, as the official script of `version`
  (2.0's with --na-prob-thresh: also HasAns_*, NoAns_*, and best_* given null_odds)."""
  if missing := [e.qas_id for e in examples if e.qas_id not in predictions]:
    line = "%d questions have no prediction (scored 0), e.g. %s"
    logging.warning(line, len(missing), missing[:3])
  exact, f1, has_answer, odds = {}, {}, {}, null_odds or {}
  for example in examples:
    qid, golds = example.qas_id, [text for text, _ in example.answers]
    if version == "2.0":  # the v2 script drops gold answers that normalize to nothing
      golds = [g for g in golds if normalize_answer(g)] or [""]
    has_answer[qid], prediction = not example.is_impossible, predictions.get(qid)
    golds = [] if prediction is None else golds  # scored 0
    exact[qid] = max((float(exact_match(g, prediction)) for g in golds), default=0.0)
    f1[qid] = max((f1_score(g, prediction, version) for g in golds), default=0.0)
  scores = {"exact": exact, "f1": f1}
  if version == "2.0":  # null odds past the threshold answer "": right where there is no answer
    blank = {q: float(not has_answer[q]) for q in exact if odds.get(q, -np.inf) > null_threshold}
    scores = {name: {**by_question, **blank} for name, by_question in scores.items()}

  def summary(qids, prefix=""):
    means = {prefix + name: 100.0 * np.mean([s[q] for q in qids]) for name, s in scores.items()}
    return {**means, prefix + "total": len(qids)}

  result = summary(list(exact))
  if version == "1.1":
    return result
  for prefix, answerable in (("HasAns_", True), ("NoAns_", False)):
    if qids := [q for q in exact if has_answer[q] == answerable]:
      result.update(summary(qids, prefix))
  # The official search of the best cut: answer in increasing null odds, keep the best total.
  order = sorted(odds, key=odds.get)
  for name, by_question in (("exact", exact), ("f1", f1)) if null_odds is not None else ():
    gains = [by_question[q] if has_answer[q] else -1.0 if predictions.get(q) else 0 for q in order]
    totals = np.cumsum([len(exact) - sum(has_answer.values()), *gains])  # all said "no answer"
    best = int(np.argmax(totals))  # the first of equal totals, as the official strict ">"
    result[f"best_{name}"] = 100.0 * totals[best] / len(exact)
    result[f"best_{name}_thresh"] = float(odds[order[best - 1]]) if best else 0.0
  return result


def squad_settings(config) -> ml_collections.ConfigDict:
  """A checked copy of config.squad with `version` from config.task ("squad1.1", "squadv1", ...:
  1.1; "squad", "squad2.0", ...: 2.0) and `answerable` (2.0 with its answerability classifier)."""
  task = re.fullmatch(r"squad(v?(1|11|2|20))?", re.sub(r"[^a-z0-9]", "", str(config.task).lower()))
  if not task:
    raise ConfigError(f"config.task={config.task!r}: for SQuAD use 'squad1.1' or 'squad2.0'.")
  if config.head.pooling != "cls":
    raise ConfigError(
        f"config.head.pooling={config.head.pooling!r}: SQuAD's span head pools nothing; use 'cls'."
    )
  settings = ml_collections.ConfigDict(config.squad.to_dict())
  settings.version = "1.1" if (task.group(2) or "2").startswith("1") else "2.0"
  settings.answerable = settings.version == "2.0" and settings.answerable_classifier
  for key in ("doc_stride", "max_query_len", "n_best", "max_answer_len"):
    if settings[key] < 1:
      raise ConfigError(f"config.squad.{key}={settings[key]} must be >= 1.")
  if config.max_seq_len - settings.max_query_len - 3 < 1:
    raise ConfigError(
        f"config.max_seq_len={config.max_seq_len} leaves no room for the context after squad."
        f"max_query_len={settings.max_query_len} + 3; raise max_seq_len or lower max_query_len."
    )
  return settings


def load_squad(config, version: str) -> tuple[list[SquadExample], list[SquadExample]]:
  """(train, dev): {train,dev}-v<version>.json in config.data_dir, or TFDS squad/v<version>."""
  if config.source == "tfds":
    data_dir = config.tfds_data_dir or None
    return tuple(read_squad_tfds(version, split, data_dir) for split in ("train", "validation"))
  paths = [os.path.join(config.data_dir, f"{split}-v{version}.json") for split in ("train", "dev")]
  return tuple(read_squad_json(path, version) for path in paths)


def make_adapter(config, backbone) -> tasks.TaskAdapter:
  """The trainer's TaskAdapter: dev EM/F1 as fractions ("score" = F1), dev predictions as tests."""
  settings = squad_settings(config)
  version = settings.version
  train_examples, dev_examples = load_squad(config, version)
  sizes = (backbone.tokenizer, config.max_seq_len, settings.doc_stride, settings.max_query_len)
  train_features, _ = make_features(train_examples, *sizes, is_training=True)
  dev_features, dev_metadata = make_features(dev_examples, *sizes, is_training=False)
  weight = settings.answerable_weight if settings.answerable else 0.0
  decode = lambda predict: postprocess(dev_examples, dev_metadata, predict(dev_features), settings)

  def evaluate(predict):
    predictions, null_odds = decode(predict)
    scores = squad_metrics(dev_examples, predictions, version, null_odds, settings.null_threshold)
    # Percentages become fractions; the null-odds cuts (*_thresh) stay as they are; counts stay out.
    result = {
        key: value / (1.0 if key.endswith("_thresh") else 100.0)
        for key, value in scores.items()
        if not key.endswith("total")
    }
    return {f"squad{version}": dict(result, score=result["f1"])}

  def write_test(predict, directory):
    predictions, null_odds = decode(predict)
    answers = apply_null_threshold(predictions, null_odds, settings.null_threshold)
    files = {"dev_predictions.json": answers}
    if version == "2.0":
      files["dev_null_odds.json"] = null_odds  # the official v2 script's --na-prob-file
    for name, values in files.items():
      workdir_files.write_json(os.path.join(directory, name), values)
    return [os.path.join(directory, name) for name in files]

  return tasks.TaskAdapter(
      f"squad{version}",
      backbone.task_model(SquadModel, config, answerable=settings.answerable),
      train_features,
      lambda outputs, batch: span_losses(outputs, batch, weight),
      evaluate,
      write_test,
      dict(kind="span", answerable=settings.answerable),
  )
