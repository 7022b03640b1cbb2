"""What several training tests read from a run's workdir."""

import json
import os

REQUIRED_METRICS = {
    "step",
    "loss",
    "masked_lm_accuracy",
    "masked_lm_loss",
    "sampled_masked_lm_accuracy",
    "disc_loss",
    "disc_auc",
    "disc_accuracy",
    "disc_precision",
    "disc_recall",
    "learning_rate",
    "tokens_per_sec",
    "steps_per_sec",
}


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]
