"""Fine-tuning metrics in numpy as GLUE's scorer computes them, and those each GLUE task reports.
Undefined correlations (a constant side) are 0, not NaN, so the best-epoch choice still works."""

from collections.abc import Sequence

import numpy as np


def accuracy(labels: Sequence, predictions: Sequence) -> float:
  return float(np.mean(np.asarray(labels) == np.asarray(predictions)))


def f1(labels: Sequence[int], predictions: Sequence[int], positive: int = 1) -> float:
  """Binary F1 of class `positive`; 0 when neither side has one (scikit-learn's zero_division=0)."""
  labels, predictions = np.asarray(labels), np.asarray(predictions)
  true_positives = np.sum((predictions == positive) & (labels == positive))
  denominator = np.sum(predictions == positive) + np.sum(labels == positive)
  return float(2 * true_positives / denominator) if denominator else 0.0


def matthews_corrcoef(labels: Sequence[int], predictions: Sequence[int]) -> float:
  """Gorodkin's multi-class MCC: Pearson's r of column-centered one-hot matrices (one class: 0)."""
  classes = np.union1d(labels, predictions)
  one_hot = [np.asarray(side)[:, None] == classes for side in (labels, predictions)]
  return pearson(*[(matrix - matrix.mean(0)).ravel() for matrix in one_hot])


def pearson(targets: Sequence[float], predictions: Sequence[float]) -> float:
  """Pearson's r; 0 when either side is constant."""
  targets, predictions = np.asarray(targets, np.float64), np.asarray(predictions, np.float64)
  centered_t, centered_p = targets - targets.mean(), predictions - predictions.mean()
  norm = np.sqrt(np.dot(centered_t, centered_t) * np.dot(centered_p, centered_p))
  return float(np.dot(centered_t, centered_p) / norm) if norm > 0 else 0.0


def spearman(targets: Sequence[float], predictions: Sequence[float]) -> float:
  """Spearman's rho: Pearson's r of the ranks, tied values sharing their mean rank."""
  from scipy import stats  # noqa: PLC0415 (a jax dependency, 2 s to import: only when used)

  return pearson(stats.rankdata(targets), stats.rankdata(predictions))


METRIC_FNS = {
    "accuracy": accuracy,
    "f1": f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}

# What GLUE's leaderboard reports for each task (MNLI: on matched and mismatched alike).
GLUE_METRICS = {
    "cola": ("mcc",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def compute_metrics(names: Sequence[str], labels, predictions) -> dict[str, float]:
  """{name: value} for each of METRIC_FNS in `names`, plus "score", their mean (GLUE's number)."""
  results = {name: METRIC_FNS[name](labels, predictions) for name in names}
  results["score"] = float(np.mean([results[name] for name in names]))
  return results
