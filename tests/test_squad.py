"""SQuAD: readers, windowed features, decoding, the span head and loss, and EM/F1 against
values computed by hand from the official scripts' rules."""

import json
import os
import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from electra_jax import config_lib
from electra_jax.errors import ConfigError
from electra_jax.data import tfds_source
from electra_jax.data.tokenizer import SPECIAL_TOKENS, SentencePieceTokenizer, WordPieceTokenizer
from electra_jax.data.tokenizer import train_sentencepiece
from electra_jax.finetune import squad

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTEXT = (
    "The tower was built by Gustave Eiffel's company (1887-1889). "
    "It stands on the Champ de Mars in Paris, France. "
    + "Many visitors climb the stairs every day and enjoy the view over the river. " * 3
    + "Its height is 330 metres, about the same as an 81-storey building. "
    "The tower was the tallest man-made structure in the world until 1930."
)
# (question, answer text): answers inside punctuated words, at both ends, spanning words.
QUESTIONS = [
    ("When did building start?", "1887"),
    ("Who built it?", "Gustave Eiffel"),
    ("Which city?", "Paris"),
    ("How tall is it?", "330 metres"),
    ("Until when was it the tallest?", "1930"),
    ("Where does it stand?", "the Champ de Mars"),
    ("What was built?", "The tower"),
]


def _write_vocab(path, texts):
  words = sorted({w for t in texts for w in re.findall(r"[a-z]+", t.lower())})
  chars = list(string.ascii_lowercase + string.digits + string.punctuation)
  tokens = (
      list(SPECIAL_TOKENS)
      + words
      + chars
      + ["##" + c for c in string.ascii_lowercase + string.digits]
  )
  path.write_text("\n".join(dict.fromkeys(tokens)) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  texts = [CONTEXT] + [q for q, _ in QUESTIONS] + ["what follows the marker zz"]
  return WordPieceTokenizer(_write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt", texts))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
  # A vocabulary this small spells numbers digit by digit, so "1887" is its own tokens.
  sentences = ([CONTEXT] + [q for q, _ in QUESTIONS] + CONTEXT.split(". ")) * 5
  path = tmp_path_factory.mktemp("spm") / "spm.model"
  return SentencePieceTokenizer(train_sentencepiece(sentences, str(path), vocab_size=60))


BASE = config_lib.sibling(os.path.join(REPO, "configs", "finetune", "base.py"), "base")


def _settings(task="squad1.1", **squad_overrides):
  config = BASE.get_config()
  config.task = task
  config.squad.update(squad_overrides)
  return squad.squad_settings(config)


V1 = _settings()


def _rows_of_example(metadata):
  return {
      int(i): list(np.flatnonzero(metadata.example_index == i)) for i in set(metadata.example_index)
  }


def _outputs(start_logits, end_logits, answerable_logits=None):
  """SquadModel's [rows, T, 3] from its parts (answerable: zeros where not given)."""
  answerable = np.zeros(len(start_logits)) if answerable_logits is None else answerable_logits
  return np.stack(
      [
          start_logits,
          end_logits,
          np.broadcast_to(np.asarray(answerable)[:, None], np.shape(start_logits)),
      ],
      -1,
  )


def _examples(version="1.1"):
  examples = []
  for i, (question, answer) in enumerate(QUESTIONS):
    start = CONTEXT.index(answer)
    examples.append(squad.SquadExample(f"q{i}", question, CONTEXT, [(answer, start)]))
  if version == "2.0":
    examples.append(squad.SquadExample("impossible", "Who painted it?", CONTEXT, [], True))
  return examples


# ---------------------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------------------
def test_normalization_exact_match_and_f1_by_hand():
  assert squad.normalize_answer("  The  Eiffel-Tower, an icon! ") == "eiffeltower icon"
  assert squad.exact_match("the Eiffel Tower", "eiffel tower.") == 1
  assert squad.exact_match("Eiffel Tower", "Eiffel Towers") == 0
  # gold {quick, brown, fox}, prediction {quick, fox, jumps}: 2 shared, P = R = 2/3.
  assert squad.f1_score("the quick brown fox", "A quick fox jumps") == pytest.approx(2 / 3)
  # gold {1969}, prediction {in, 1969}: P = 1/2, R = 1, F1 = 2/3.
  assert squad.f1_score("1969", "in 1969") == pytest.approx(2 / 3)
  # repeated tokens count once per occurrence: gold {a-less: new, new, york}, pred {new, york, york}.
  assert squad.f1_score("new new york", "new york york") == pytest.approx(2 / 3)
  assert squad.f1_score("", "") == 1.0 and squad.f1_score("", "paris") == 0.0
  assert squad.f1_score("the", "") == 1.0  # the gold normalizes to nothing
  assert squad.f1_score("paris", "", version="1.1") == 0.0


def test_v1_metrics_take_the_best_gold_answer():
  examples = [
      squad.SquadExample("a", "q", "ctx", [("Denver Broncos", 0), ("the Broncos", 0)]),
      squad.SquadExample("b", "q", "ctx", [("Santa Clara, California", 0)]),
      squad.SquadExample("c", "q", "ctx", [("Gold", 0)]),
  ]
  predictions = {"a": "Broncos!", "b": "Santa Clara", "c": "silver"}
  # a: EM 1 via "the Broncos"; b: 2 of 3 gold tokens, P = 1, R = 2/3, F1 = 0.8; c: 0.
  metrics = squad.squad_metrics(examples, predictions, "1.1")
  assert metrics["exact"] == pytest.approx(100 / 3)
  assert metrics["f1"] == pytest.approx(100 * (1 + 0.8) / 3)
  assert metrics["total"] == 3 and "HasAns_exact" not in metrics
  # A missing prediction scores 0 instead of being dropped from the total.
  assert squad.squad_metrics(examples, {"a": "the Broncos"}, "1.1")["exact"] == pytest.approx(
      100 / 3
  )


def _v2_case():
  examples = [
      squad.SquadExample("q1", "q", "ctx", [("Paris", 0)]),
      squad.SquadExample("q2", "q", "ctx", [("1969", 0)]),
      squad.SquadExample("q3", "q", "ctx", [], True),
      squad.SquadExample("q4", "q", "ctx", [], True),
  ]
  predictions = {"q1": "Paris", "q2": "in 1969", "q3": "blue", "q4": "x"}
  null_odds = {"q1": -2.0, "q2": -0.5, "q3": 0.5, "q4": 2.0}
  return examples, predictions, null_odds


def test_v2_metrics_threshold_breakdown_and_best_threshold_by_hand():
  examples, predictions, null_odds = _v2_case()
  metrics = squad.squad_metrics(examples, predictions, "2.0", null_odds, null_threshold=0.0)
  # Threshold 0: q3 and q4 (odds > 0) say "no answer", right for both; q1 right; q2 F1 2/3.
  assert metrics["exact"] == pytest.approx(75.0)
  assert metrics["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 1) / 4)
  assert metrics["HasAns_exact"] == pytest.approx(50.0)
  assert metrics["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
  assert metrics["NoAns_exact"] == pytest.approx(100.0) and metrics["NoAns_total"] == 2
  # Best threshold: start at 2 (every no-answer right), answer in increasing odds:
  # EM 2 -> 3 (q1, odds -2) -> 3 (q2) -> 2 -> 1: best 75 at -2.
  # F1 2 -> 3 -> 3.667 (q2, odds -0.5) -> 2.667 -> 1.667: best 91.67 at -0.5.
  assert metrics["best_exact"] == pytest.approx(75.0) and metrics["best_exact_thresh"] == -2.0
  assert metrics["best_f1"] == pytest.approx(100 * 3.6666667 / 4, rel=1e-6)
  assert metrics["best_f1_thresh"] == -0.5

  # Wrong both ways at threshold 1.0: q3 is answered ("blue", scores 0) though impossible.
  metrics = squad.squad_metrics(examples, predictions, "2.0", null_odds, null_threshold=1.0)
  assert metrics["exact"] == pytest.approx(50.0)
  assert metrics["NoAns_exact"] == pytest.approx(50.0)
  # ... and at -1.0 the answerable q2 says "no answer" (scores 0).
  metrics = squad.squad_metrics(examples, predictions, "2.0", null_odds, null_threshold=-1.0)
  assert metrics["HasAns_exact"] == pytest.approx(50.0) and metrics["HasAns_f1"] == pytest.approx(
      50.0
  )

  # The v2 script drops gold answers that normalize to nothing, so "" cannot match "the";
  # the v1 script keeps them.
  article = [squad.SquadExample("g", "q", "the Paris", [("the", 0), ("Paris", 4)])]
  assert squad.squad_metrics(article, {"g": ""}, "2.0")["exact"] == 0.0
  assert squad.squad_metrics(article, {"g": ""}, "1.1")["exact"] == 100.0

  # Final predictions with "" for no answer score the same as applying the threshold.
  final = squad.apply_null_threshold(predictions, null_odds, 0.0)
  assert final == {"q1": "Paris", "q2": "in 1969", "q3": "", "q4": ""}
  plain = squad.squad_metrics(examples, final, "2.0")
  assert plain["exact"] == pytest.approx(75.0) and "best_f1" not in plain


# ---------------------------------------------------------------------------------------
# Readers.
# ---------------------------------------------------------------------------------------
def _squad_json(qas, context="Paris is the capital of France."):
  return {
      "version": "v2.0",
      "data": [{"title": "T", "paragraphs": [{"context": context, "qas": qas}]}],
  }


V2_QAS = [
    {
        "id": "a",
        "question": "Capital?",
        "answers": [{"text": "Paris", "answer_start": 0}, {"text": "Paris is", "answer_start": 0}],
        "is_impossible": False,
    },
    {
        "id": "b",
        "question": "Of what?",
        "answers": [{"text": "France", "answer_start": 24}],
        "is_impossible": False,
    },
    {
        "id": "c",
        "question": "Who?",
        "answers": [],
        "is_impossible": True,
        "plausible_answers": [{"text": "capital", "answer_start": 13}],
    },
]


def test_read_squad_json(tmp_path):
  path = tmp_path / "dev.json"
  path.write_text(json.dumps(_squad_json(V2_QAS)))
  examples = squad.read_squad_json(str(path), "2.0")
  assert [e.qas_id for e in examples] == ["a", "b", "c"]
  assert examples[0].answers == [("Paris", 0), ("Paris is", 0)]
  assert examples[1].context[24:30] == "France" and not examples[1].is_impossible
  assert examples[2].is_impossible and examples[2].answers == []
  with pytest.raises(ConfigError, match="only SQuAD 2.0"):
    squad.read_squad_json(str(path), "1.1")


@pytest.mark.fault
@pytest.mark.parametrize(
    "content, message",
    [
        ("", "not an official SQuAD JSON"),
        ("{not json", "not an official SQuAD JSON"),
        (json.dumps({"data": [{"title": "T"}]}), "paragraphs"),
        (
            json.dumps(
                _squad_json(
                    [
                        {
                            "id": "x",
                            "question": "q",
                            "answers": [{"text": "France", "answer_start": 3}],
                        }
                    ]
                )
            ),
            r"answer_start=3 does not point at the answer text 'France'",
        ),
        (
            json.dumps(_squad_json([{"id": "x", "question": "q", "answers": []}])),
            "has no answers and is not marked is_impossible",
        ),
        (
            json.dumps(_squad_json([{"id": "x", "answers": []}])),
            "not an official SQuAD JSON file .KeyError: 'question'",
        ),
        (json.dumps(_squad_json([V2_QAS[0], V2_QAS[0]])), "more than once"),
        (json.dumps({"data": []}), "holds no SQuAD questions"),
        (json.dumps([{"data": []}]), "not an official SQuAD JSON file .TypeError"),
        (json.dumps({"data": {"paragraphs": []}}), "not an official SQuAD JSON file .TypeError"),
        (
            json.dumps(_squad_json([dict(V2_QAS[0], answers={"text": "Paris"})])),
            "not an official SQuAD JSON file",
        ),
        (
            json.dumps(_squad_json([dict(V2_QAS[2], is_impossible="false")])),
            "question 'c' has is_impossible='false', not true/false",
        ),
        (
            json.dumps(
                _squad_json([dict(V2_QAS[0], answers=[{"text": "Paris", "answer_start": 0.0}])])
            ),
            r"answer_start=0.0 does not point at the answer text 'Paris'",
        ),
        (json.dumps(_squad_json([dict(V2_QAS[0], id=7)])), "question 7 needs string 'id'"),
    ],
)
def test_bad_squad_json_gives_config_error(tmp_path, content, message):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(ConfigError, match=message):
    squad.read_squad_json(str(path), "2.0")


@pytest.mark.fault
def test_a_squad_file_with_a_byte_order_mark_is_read_as_without(tmp_path):
  """Editors on Windows save JSON with a byte-order mark; GLUE's and custom readers skip it."""
  plain, marked = tmp_path / "plain.json", tmp_path / "marked.json"
  plain.write_text(json.dumps(_squad_json(V2_QAS)))
  marked.write_text(json.dumps(_squad_json(V2_QAS)), encoding="utf-8-sig")
  assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
  assert squad.read_squad_json(str(marked), "2.0") == squad.read_squad_json(str(plain), "2.0")


def test_read_squad_tfds_from_array_record(tmp_path, monkeypatch):
  """Prepares the real TFDS squad builders from tiny local JSON files (the download is
  replaced by those files), then reads them back through read_squad_tfds."""
  import ml_collections

  tfds = tfds_source.import_tfds()  # with its glue and squad builders registered
  v1_qas = [{k: v for k, v in qa.items() if k != "is_impossible"} for qa in V2_QAS[:2]]
  files = {}
  for name, qas in (("v1", v1_qas), ("v2", V2_QAS)):
    for split in ("train", "dev"):
      path = tmp_path / f"{name}-{split}.json"
      path.write_text(json.dumps(_squad_json(qas)))
      files[name, split] = str(path)

  for version, name in (("1.1", "v1"), ("2.0", "v2")):
    monkeypatch.setattr(
        tfds.download.DownloadManager,
        "download_and_extract",
        lambda self, urls, name=name: {split: files[name, split] for split in urls},
    )
    builder = tfds.builder(
        f"squad/v{version}", data_dir=str(tmp_path / "tfds"), file_format="array_record"
    )
    builder.download_and_prepare()
    from_tfds = squad.read_squad_tfds(version, "validation", data_dir=str(tmp_path / "tfds"))
    from_json = squad.read_squad_json(files[name, "dev"], version)
    assert sorted(from_tfds, key=lambda e: e.qas_id) == from_json
    config = ml_collections.ConfigDict(dict(source="tfds", tfds_data_dir=str(tmp_path / "tfds")))
    train, dev = squad.load_squad(config, version)
    assert len(train) == len(dev) == len(from_json)

  with pytest.raises(ConfigError, match="Cannot open TFDS"):
    squad.read_squad_tfds("1.1", "validation", data_dir=str(tmp_path / "nothing"))


# ---------------------------------------------------------------------------------------
# Features and decoding.
# ---------------------------------------------------------------------------------------
def test_max_context_owner_by_hand():
  # Windows of 5 tokens at 0, 3, 6 over 11 tokens. Token 3: window 0 gives min(3, 1) = 1,
  # window 1 min(0, 4) = 0 -> 0. Token 4: min(4, 0) = 0 vs min(1, 3) = 1 -> 1. Token 6:
  # min(3, 1) = 1 vs min(0, 4) = 0 -> 1. Token 7: min(4, 0) vs min(1, 3) -> 2.
  owner = squad.max_context_owner([(0, 5), (3, 5), (6, 5)], 11)
  np.testing.assert_array_equal(owner, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])


def test_features_slide_windows_and_mark_answers(tokenizer):
  examples = _examples()
  max_seq_len, stride, max_query = 40, 10, 8
  features, metadata = squad.make_features(
      examples, tokenizer, max_seq_len, stride, max_query, is_training=True
  )
  context_ids = [t for w in CONTEXT.split() for t in tokenizer.encode(w)]
  rows = _rows_of_example(metadata)
  assert len(rows[0]) >= 4  # the context needs several windows
  for index, example in enumerate(examples):
    question_ids = tokenizer.encode(example.question)[:max_query]
    offset = len(question_ids) + 2
    window_len = max_seq_len - len(question_ids) - 3
    starts = [int(metadata.window_start[r]) for r in rows[index]]
    assert starts == list(range(0, len(context_ids) - window_len + stride, stride))[: len(starts)]
    assert starts[-1] + int(metadata.window_length[rows[index][-1]]) == len(context_ids)
    answer_ids = tokenizer.encode(example.answers[0][0])
    found = 0
    for row in rows[index]:
      ids, types, mask = (
          features[k][row] for k in ("input_ids", "token_type_ids", "attention_mask")
      )
      start, length = int(metadata.window_start[row]), int(metadata.window_length[row])
      assert list(ids[:offset]) == [tokenizer.cls_id, *question_ids, tokenizer.sep_id]
      assert list(ids[offset : offset + length]) == context_ids[start : start + length]
      assert ids[offset + length] == tokenizer.sep_id and mask.sum() == offset + length + 1
      assert list(types[: offset + length + 1]) == [0] * offset + [1] * (length + 1)
      s, e = int(features["start_positions"][row]), int(features["end_positions"][row])
      assert features["is_impossible"][row] == 0  # the question's label, in every window
      if s == 0:
        assert e == 0
        continue
      found += 1
      assert list(ids[s : e + 1]) == answer_ids  # "1887" inside "(1887-1889)." is exact
    assert found >= 1


def test_answer_positions_by_hand(tokenizer):
  context = "many visitors climb the stairs every day and enjoy the view over the river"
  example = squad.SquadExample("x", "Who?", context, [("day and", context.index("day and"))])
  # 14 one-token words; "who ?" leaves 12 - 2 - 3 = 7 context tokens per window, windows
  # start at 0, 3, 6, 9. The answer is tokens 6..7: window 0 (0..6) cuts it, windows 1
  # (3..9) and 2 (6..12) hold it at sequence positions 4 + 3..4 and 4 + 0..1, window 3 misses it.
  features, metadata = squad.make_features([example], tokenizer, 12, 3, 8, is_training=True)
  assert list(metadata.window_start) == [0, 3, 6, 9] and list(metadata.window_length) == [
      7,
      7,
      7,
      5,
  ]
  assert list(features["start_positions"]) == [0, 7, 4, 0]
  assert list(features["end_positions"]) == [0, 8, 5, 0]
  assert list(features["is_impossible"]) == [0, 0, 0, 0]  # per question, as the official code
  impossible = squad.SquadExample("y", "Who?", context, [], is_impossible=True)
  features, _ = squad.make_features([example, impossible], tokenizer, 12, 3, 8, is_training=True)
  assert list(features["is_impossible"]) == [0, 0, 0, 0, 1, 1, 1, 1]
  assert list(features["start_positions"]) == [0, 7, 4, 0, 0, 0, 0, 0]


@pytest.mark.fault
def test_questions_that_give_no_row_are_refused_in_one_line(tokenizer):
  # Every answer covering no token (a blank): np.stack failed with a traceback.
  context = "many visitors climb the stairs"
  blank = squad.SquadExample("x", "Who?", context, [(" ", context.index(" "))])
  with pytest.raises(ConfigError, match="None of the 1 SQuAD questions gave a row"):
    squad.make_features([blank], tokenizer, 12, 3, 8, is_training=True)


def _oracle_logits(features):
  start_logits = np.zeros(features["input_ids"].shape, np.float32)
  end_logits = np.zeros_like(start_logits)
  rows = np.flatnonzero(features["start_positions"] > 0)
  start_logits[rows, features["start_positions"][rows]] = 10.0
  end_logits[rows, features["end_positions"][rows]] = 10.0
  return start_logits, end_logits


@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece"])
def test_postprocess_on_oracle_logits_recovers_the_exact_answer_text(kind, request):
  tokenizer = request.getfixturevalue("tokenizer" if kind == "wordpiece" else kind)
  examples = _examples()
  features, metadata = squad.make_features(examples, tokenizer, 40, 10, 8, is_training=False)
  start_logits, end_logits = _oracle_logits(features)
  predictions, null_odds = squad.postprocess(
      examples, metadata, _outputs(start_logits, end_logits), V1
  )
  # Exact strings from the context: the original case, "1887" without "(...-1889).",
  # "Gustave Eiffel" without "'s company".
  assert predictions == {e.qas_id: e.answers[0][0] for e in examples} and null_odds == {}
  assert squad.squad_metrics(examples, predictions, "1.1")["exact"] == 100.0

  # The max-context rule: for each token exactly one row of its example flags it.
  for index, example_rows in _rows_of_example(metadata).items():
    flags = np.zeros(len(metadata.token_char_spans[index]), int)
    for row in example_rows:
      start, offset = int(metadata.window_start[row]), int(metadata.context_offset[row])
      flagged = np.flatnonzero(metadata.max_context[row]) - offset + start
      flags[flagged] += 1
    assert (flags == 1).all()

  # A stronger one-token span at a position whose max-context window is another row is
  # ignored; the same logits at a position this row owns win.
  row = _rows_of_example(metadata)[2][1]
  owned = metadata.max_context[row]
  context = np.flatnonzero(features["token_type_ids"][row] * features["attention_mask"][row])[:-1]
  spans = metadata.token_char_spans[2]
  doc = np.arange(len(owned)) - metadata.context_offset[row] + metadata.window_start[row]
  has_text = [owned[p] and spans[doc[p], 1] > spans[doc[p], 0] for p in range(len(owned))]
  for position, wins in ((context[0], False), (np.flatnonzero(has_text)[0], True)):
    assert owned[position] == wins
    biased_start, biased_end = start_logits.copy(), end_logits.copy()
    biased_start[row, position] = biased_end[row, position] = 12.0
    biased, _ = squad.postprocess(examples, metadata, _outputs(biased_start, biased_end), V1)
    assert (biased["q2"] != "Paris") == wins

  # max_answer_len counts tokens: one less than "the Champ de Mars" needs drops only the
  # answers at least that long.
  labelled = np.flatnonzero(features["start_positions"] > 0)
  lengths = {
      examples[metadata.example_index[r]].qas_id: features["end_positions"][r]
      - features["start_positions"][r]
      + 1
      for r in labelled
  }
  limit = int(lengths["q5"] - 1)
  short, _ = squad.postprocess(
      examples,
      metadata,
      _outputs(start_logits, end_logits),
      _settings(max_answer_len=limit),
  )
  assert short["q5"] != "the Champ de Mars"
  assert all((short[q] == predictions[q]) == (n <= limit) for q, n in lengths.items())


def test_postprocess_v2_no_answer_scores(tokenizer):
  examples = _examples("2.0")
  features, metadata = squad.make_features(examples, tokenizer, 40, 10, 8, is_training=False)
  start_logits, end_logits = _oracle_logits(features)
  impossible = metadata.example_index == len(examples) - 1
  # With the classifier: null odds = min over windows of -answerable_logit.
  answerable = np.where(features["is_impossible"] == 1, -3.0, 4.0).astype(np.float32)
  answerable[np.flatnonzero(impossible)[1]] = -1.0
  predictions, null_odds = squad.postprocess(
      examples, metadata, _outputs(start_logits, end_logits, answerable), _settings("squad2.0")
  )
  answers = squad.apply_null_threshold(predictions, null_odds, -2.75)
  assert null_odds["impossible"] == 1.0 and answers["impossible"] == ""
  assert null_odds["q0"] == -4.0 and answers["q0"] == predictions["q0"] == "1887"
  assert predictions["impossible"] != ""  # the best span, left for the threshold search

  # Without it: min over windows of start[CLS] + end[CLS], minus the best span's score.
  rows = np.flatnonzero(metadata.example_index == 0)
  start_logits[rows, 0], end_logits[rows, 0] = 3.0, 3.0
  start_logits[rows[1], 0], end_logits[rows[1], 0] = 1.0, 1.0
  without = _settings("squad2.0", answerable_classifier=False)
  _, null_odds = squad.postprocess(
      examples, metadata, _outputs(start_logits, end_logits, answerable), without
  )
  assert null_odds["q0"] == pytest.approx(2.0 - 20.0)


@pytest.mark.fault
def test_settings_reject_sizes_without_room_for_context():
  config = BASE.get_config()
  config.update(task="squad", max_seq_len=16)
  config.squad.max_query_len = 14
  with pytest.raises(ConfigError, match="max_seq_len=16 leaves no room"):
    squad.squad_settings(config)
  config.max_seq_len = 18
  assert squad.squad_settings(config).max_query_len == 14


# ---------------------------------------------------------------------------------------
# Head and loss.
# ---------------------------------------------------------------------------------------
def test_span_head_masks_and_loss_by_hand():
  token_type_ids = jnp.array([[0, 0, 0, 1, 1, 1, 0, 0]])
  attention_mask = jnp.array([[1, 1, 1, 1, 1, 1, 0, 0]])
  hidden = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 16))
  head = squad.SpanHead(answerable=True, answerable_hidden_size=8)
  params = head.init(jax.random.PRNGKey(1), hidden, token_type_ids, attention_mask)
  start, end, answerable = head.apply(params, hidden, token_type_ids, attention_mask)
  allowed = np.array([True, False, False, True, True, True, False, False])
  assert (np.asarray(start)[0, ~allowed] == -10000.0).all() and (
      np.asarray(end)[0, ~allowed] == -10000.0
  ).all()
  assert (np.asarray(start)[0, allowed] > -100).all() and answerable.shape == (1,)

  start_logits = jnp.array([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
  end_logits = jnp.array([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0]])
  answerable_logits = jnp.array([1.5, -0.5])

  def ce(logits, label):
    return np.log(np.exp(logits).sum()) - logits[label]

  row0 = 0.5 * (ce(np.array([2.0, 0, 1]), 2) + ce(np.array([0, 3.0, 0]), 1)) + 0.5 * np.log1p(
      np.exp(-1.5)
  )
  row1 = 0.5 * (ce(np.zeros(3), 0) + ce(np.array([1.0, 0, 0]), 0)) + 0.5 * np.log1p(np.exp(-0.5))
  batch = dict(
      start_positions=jnp.array([2, 0]), end_positions=jnp.array([1, 0]), is_impossible=[0, 1]
  )
  outputs = _outputs(start_logits, end_logits, answerable_logits)
  np.testing.assert_allclose(squad.span_losses(outputs, batch, 0.5), [row0, row1], rtol=1e-5)
  without = 0.5 * np.log1p(np.exp(-1.5)), 0.5 * np.log1p(np.exp(-0.5))
  np.testing.assert_allclose(
      squad.span_losses(outputs, batch), [row0 - without[0], row1 - without[1]], rtol=1e-5
  )


def test_span_head_learns_a_synthetic_span_task(tokenizer):
  """The answer is the word after the marker "zz" in a random context: SquadModel with a
  1-layer encoder must find it far above chance (1 in ~14 words)."""
  from electra_jax.models import EncoderConfig

  rng = np.random.default_rng(0)
  words = sorted(set(re.findall(r"[a-z]{4,}", CONTEXT.lower())))

  def make(n, prefix):
    examples = []
    for i in range(n):
      context_words = list(rng.choice(words, size=14))
      where = int(rng.integers(0, 13))
      context_words[where] = "zz"
      context = " ".join(context_words)
      answer_start = len(" ".join(context_words[: where + 1])) + 1
      answer = context_words[where + 1]
      examples.append(
          squad.SquadExample(
              f"{prefix}{i}", "what follows the marker zz", context, [(answer, answer_start)]
          )
      )
    return examples

  train_examples, dev_examples = make(384, "t"), make(64, "d")
  train, _ = squad.make_features(train_examples, tokenizer, 64, 16, 8, is_training=True)
  dev, dev_meta = squad.make_features(dev_examples, tokenizer, 64, 16, 8, is_training=False)
  assert len(train["input_ids"]) == 384  # one window each: every answer is learnable

  model = squad.SquadModel(
      vocab_size=tokenizer.vocab_size,
      embedding_size=32,
      max_position_embeddings=64,
      type_vocab_size=2,
      config=EncoderConfig(32, 1, 2, 64, 0.0, 0.0),
  )
  inputs = ("input_ids", "token_type_ids", "attention_mask")
  params = model.init(jax.random.PRNGKey(0), *(train[k][:2] for k in inputs))
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(p):
      return squad.span_losses(model.apply(p, *(batch[k] for k in inputs)), batch).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  for i in range(400):
    rows = rng.choice(len(train["input_ids"]), 32, replace=False)
    params, opt_state, loss = step(params, opt_state, {k: v[rows] for k, v in train.items()})
  outputs = jax.jit(model.apply)(params, *(dev[k] for k in inputs))
  predictions, _ = squad.postprocess(dev_examples, dev_meta, outputs, V1)
  metrics = squad.squad_metrics(dev_examples, predictions, "1.1")
  assert metrics["exact"] > 60.0, (metrics, float(loss))


# ---------------------------------------------------------------------------------------
# The fine-tuning adapter, run by the real trainer.
# ---------------------------------------------------------------------------------------
def _marker_squad_json(n, prefix, rng, impossible_every=0):
  """Contexts of random words; the answer follows the marker "zz"; every impossible_every-th
  question (2.0) has no marker and no answer."""
  words = sorted(set(re.findall(r"[a-z]{4,}", CONTEXT.lower())))
  paragraphs = []
  for i in range(n):
    context_words = list(rng.choice(words, size=14))
    qa = {"id": f"{prefix}{i}", "question": "what follows the marker zz"}
    if impossible_every and i % impossible_every == 0:
      qa.update(answers=[], is_impossible=True)
    else:
      where = int(rng.integers(0, 13))
      context_words[where] = "zz"
      start = len(" ".join(context_words[: where + 1])) + 1
      qa.update(
          answers=[{"text": context_words[where + 1], "answer_start": start}], is_impossible=False
      )
    paragraphs.append({"context": " ".join(context_words), "qas": [qa]})
  return {"data": [{"title": "synthetic", "paragraphs": paragraphs}]}


def test_adapter_through_the_trainer_writes_predictions_that_score_as_reported(tokenizer, tmp_path):
  from electra_jax.finetune import trainer

  rng = np.random.default_rng(0)
  for split, n in (("train", 48), ("dev", 24)):
    (tmp_path / f"{split}-v2.0.json").write_text(json.dumps(_marker_squad_json(n, split, rng, 3)))
  base = config_lib.sibling(os.path.join(REPO, "configs", "finetune", "base.py"), "base")
  config = base.get_config()
  config.task, config.data_dir, config.tokenizer = "squad2.0", str(tmp_path), tokenizer.vocab_file
  config.model.update(
      hidden_size=32,
      num_layers=1,
      num_heads=2,
      intermediate_size=64,
      embedding_size=32,
      max_position_embeddings=64,
  )
  config.squad.update(max_query_len=8, doc_stride=16, null_threshold=0.5)
  config.update(max_seq_len=64, batch_size=16, epochs=1, log_every=100)
  results = trainer.run_finetune(config, str(tmp_path / "work"))

  dev = results["seeds"]["0"]["dev"]["squad2.0"]
  assert set(dev) == {
      "exact",
      "f1",
      "HasAns_exact",
      "HasAns_f1",
      "NoAns_exact",
      "NoAns_f1",
      "best_exact",
      "best_f1",
      "best_exact_thresh",
      "best_f1_thresh",
      "score",
  }
  assert dev["score"] == dev["f1"] and all(
      0.0 <= v <= 1.0 for k, v in dev.items() if not k.endswith("_thresh")
  )
  predictions_path, null_odds_path = results["seeds"]["0"]["test_predictions"]
  with open(predictions_path) as f:
    predictions = json.load(f)
  with open(null_odds_path) as f:
    null_odds = json.load(f)
  examples = squad.read_squad_json(str(tmp_path / "dev-v2.0.json"), "2.0")
  assert set(predictions) == set(null_odds) == {e.qas_id for e in examples}
  # The written answers ("" where null_odds > 0.5) score exactly what the run reported.
  assert all((predictions[q] == "") or null_odds[q] <= 0.5 for q in predictions)
  rescored = squad.squad_metrics(examples, predictions, "2.0")
  assert rescored["exact"] / 100 == pytest.approx(dev["exact"])
  assert rescored["f1"] / 100 == pytest.approx(dev["f1"])
  # The cuts reaching best_exact / best_f1 are null-odds values as they are, not fractions.
  for key in ("best_exact_thresh", "best_f1_thresh"):
    assert dev[key] in set(null_odds.values()) | {0.0}
  assert "_thresh" not in trainer.format_table(results["summary"])

  # Exported as ElectraForQuestionAnswering: the same start and end logits where an answer may
  # be (the answerability head has no Hugging Face form and stays behind).
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from electra_jax.finetune import export  # noqa: PLC0415

  work = str(tmp_path / "work")
  hf_dir = export.export_hf(work, str(tmp_path / "hf"))["squad2.0/seed_0"]
  hf_model = transformers.AutoModelForQuestionAnswering.from_pretrained(hf_dir).eval()
  _, _, model, _ = export.load_task_model(work, "squad2.0")
  params = export.restore_seed(work, "squad2.0", 0, model)
  ids = rng.integers(5, tokenizer.vocab_size, (3, 64)).astype(np.int32)
  types = (np.arange(64) >= 12).astype(np.int32)[None].repeat(3, 0)
  mask = (np.arange(64) < np.array([[64], [40], [20]])).astype(np.int32)
  start, end, _ = squad.split_outputs(np.asarray(model.apply({"params": params}, ids, types, mask)))
  with torch.no_grad():
    theirs = hf_model(
        input_ids=torch.tensor(ids),
        token_type_ids=torch.tensor(types),
        attention_mask=torch.tensor(mask),
    )
  where = np.asarray(squad.answer_mask(types, mask))
  assert where.sum() > 50
  np.testing.assert_allclose(theirs.start_logits.numpy()[where], start[where], atol=1e-4)
  np.testing.assert_allclose(theirs.end_logits.numpy()[where], end[where], atol=1e-4)


@pytest.mark.fault
def test_squad_settings_and_missing_files(tmp_path):
  config = BASE.get_config()
  config.update(task="squad", data_dir=str(tmp_path))
  settings = squad.squad_settings(config)
  assert (settings.version, settings.answerable) == ("2.0", True)
  config.task = "squad_v1.1"
  settings = squad.squad_settings(config)
  assert (settings.version, settings.answerable, settings.doc_stride) == ("1.1", False, 128)
  assert "version" not in config.squad  # the config stays as it was checked
  config.squad.doc_stride = 0
  with pytest.raises(ConfigError, match="doc_stride=0"):
    squad.squad_settings(config)
  with pytest.raises(ConfigError, match="train-v1.1.json does not exist; set config.data_dir"):
    squad.load_squad(config, "1.1")


def test_squad2_dev_scores_use_the_official_null_threshold():
  """The official run scores SQuAD 2.0 dev with the v2 script's --na-prob-thresh set to
  config.qa_na_threshold = -2.75 (squad_official_eval.set_opts), the same cut it writes test
  predictions with: a question whose null odds exceed -2.75 is answered ""."""
  from electra_jax import config_lib

  recipe = config_lib.sibling(
      os.path.join(os.path.dirname(__file__), "..", "configs", "finetune", "squad.py"), "squad"
  )
  assert squad.squad_settings(recipe.get_config()).null_threshold == -2.75
  assert _settings("squad2.0").null_threshold == -2.75


def test_postprocess_takes_the_n_best_over_the_whole_row_before_filtering(tokenizer):
  """The official decoding ranks a row's n_best start and end logits over every position and
  only then drops the invalid ones ([CLS], outside the context, not max-context): an invalid
  position that ranks high uses up one of the n_best slots."""
  context = "It stands on the Champ de Mars in Paris"
  example = squad.SquadExample("q", "Which city?", context, [("Paris", context.index("Paris"))])
  features, metadata = squad.make_features([example], tokenizer, 40, 10, 8, is_training=False)
  assert len(metadata.example_index) == 1
  offset = int(metadata.context_offset[0])
  p = lambda i: offset + i  # sequence position of context token i
  mask = np.asarray(squad.answer_mask(features["token_type_ids"], features["attention_mask"]))[0]
  start = np.where(mask, -5.0, -10000.0).astype(np.float32)[None]
  end = start.copy()
  start[0, 0], start[0, p(4)], start[0, p(0)] = 10.0, 5.0, 4.0  # [CLS] takes a start slot
  end[0, p(1)], end[0, p(5)] = 8.0, 1.0
  # n_best=2 -> starts {[CLS], "Champ"} and ends {"stands", "de"}: the only valid pair is
  # "Champ de" (6.0); "It stands" (12.0) starts at the third-ranked start, outside the n-best.
  outputs = _outputs(start, end)
  predictions, _ = squad.postprocess([example], metadata, outputs, _settings(n_best=2))
  assert predictions == {"q": "Champ de"}
  predictions, _ = squad.postprocess([example], metadata, outputs, _settings(n_best=3))
  assert predictions == {"q": "It stands"}
