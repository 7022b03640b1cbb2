"""Fine-tuning metrics against hand-computed values and the scikit-learn / scipy oracles."""

import numpy as np
import pytest

from electra_jax.finetune import metrics


def test_hand_computed_binary_values():
  labels = [1, 1, 1, 0, 0, 0, 0, 1]
  predictions = [1, 1, 0, 0, 0, 1, 0, 1]
  # TP=3, FN=1, FP=1, TN=3.
  assert metrics.accuracy(labels, predictions) == pytest.approx(6 / 8)
  assert metrics.f1(labels, predictions) == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
  assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(
      (3 * 3 - 1 * 1) / np.sqrt(4 * 4 * 4 * 4)
  )


def test_constant_predictions_give_zero_not_nan():
  labels = [0, 1, 1, 0, 1]
  assert metrics.matthews_corrcoef(labels, [1] * 5) == 0.0
  assert metrics.matthews_corrcoef([1] * 5, [0, 1, 0, 1, 1]) == 0.0
  assert metrics.pearson([0.5, 1.0, 2.0], [3.0, 3.0, 3.0]) == 0.0
  assert metrics.spearman([0.5, 1.0, 2.0], [3.0, 3.0, 3.0]) == 0.0
  # No positive anywhere: F1 is 0 by convention, as sklearn's zero_division=0.
  assert metrics.f1([0, 0, 0], [0, 0, 0]) == 0.0


def test_perfect_and_inverted():
  labels = [0, 1, 0, 1, 1]
  assert metrics.matthews_corrcoef(labels, labels) == pytest.approx(1.0)
  assert metrics.matthews_corrcoef(labels, [1 - x for x in labels]) == pytest.approx(-1.0)
  assert metrics.spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)


def test_spearman_ties_share_their_mean_rank():
  ranks = [1.5, 4, 1.5, 6, 4, 4]  # of [10, 20, 10, 30, 20, 20]
  assert metrics.spearman([10, 20, 10, 30, 20, 20], range(6)) == pytest.approx(
      np.corrcoef(ranks, range(6))[0, 1]
  )


@pytest.mark.parametrize("seed", range(5))
def test_against_sklearn_and_scipy(seed):
  import scipy.stats  # noqa: PLC0415 (sklearn loads pyarrow: kept out of collection, see conftest._NativePeerWatch)
  import sklearn.metrics  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  n = int(rng.integers(5, 60))
  labels = rng.integers(0, 2, n)
  predictions = np.where(rng.random(n) < 0.7, labels, 1 - labels)
  assert metrics.accuracy(labels, predictions) == pytest.approx(
      sklearn.metrics.accuracy_score(labels, predictions)
  )
  assert metrics.f1(labels, predictions) == pytest.approx(
      sklearn.metrics.f1_score(labels, predictions, zero_division=0)
  )
  assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(
      sklearn.metrics.matthews_corrcoef(labels, predictions)
  )
  three_class_labels = rng.integers(0, 3, n)
  three_class_predictions = rng.integers(0, 3, n)
  assert metrics.matthews_corrcoef(three_class_labels, three_class_predictions) == pytest.approx(
      sklearn.metrics.matthews_corrcoef(three_class_labels, three_class_predictions)
  )
  # STS-B-like scores on a 0..5 grid of halves: many ties.
  targets = rng.integers(0, 11, n) / 2.0
  scores = np.round(targets + rng.normal(0, 1.0, n))
  assert metrics.pearson(targets, scores) == pytest.approx(scipy.stats.pearsonr(targets, scores)[0])
  assert metrics.spearman(targets, scores) == pytest.approx(
      scipy.stats.spearmanr(targets, scores)[0]
  )


def test_glue_table_and_score():
  assert metrics.GLUE_METRICS["cola"] == ("mcc",)
  assert metrics.GLUE_METRICS["stsb"] == ("pearson", "spearman")
  assert set(metrics.GLUE_METRICS["mrpc"]) == set(metrics.GLUE_METRICS["qqp"]) == {"accuracy", "f1"}
  for task in ("sst2", "qnli", "rte", "wnli", "mnli"):
    assert metrics.GLUE_METRICS[task] == ("accuracy",)
  results = metrics.compute_metrics(("accuracy", "f1"), [1, 0, 1, 1], [1, 0, 0, 1])
  assert results["accuracy"] == pytest.approx(0.75)
  assert results["f1"] == pytest.approx(0.8)
  assert results["score"] == pytest.approx((0.75 + 0.8) / 2)


def test_results_table_columns_line_up_for_long_metric_names():
  from electra_jax.finetune.trainer import format_table  # noqa: PLC0415

  stats = dict(mean=0.5, median=0.5, best=0.625, n=3)
  table = format_table(
      {
          "squad2.0": {"exact_match": stats, "HasAns_exact_match": stats, "score": stats},
          "rte": {"accuracy": dict(stats, mean=0.7), "score": dict(stats, mean=0.7)},
      }
  )
  lines = table.splitlines()
  assert len({len(line) for line in lines}) == 1, table  # every row as wide as the header
  assert [line.split()[:2] for line in lines[1:]] == [
      ["squad2.0", "exact_match"],
      ["squad2.0", "HasAns_exact_match"],
      ["squad2.0", "score"],
      ["rte", "accuracy"],
  ]
  assert lines[4].split()[2:] == ["70.00", "50.00", "62.50", "3"]
