"""Your own sentence(-pair) classification or regression data, no code needed: TSV/CSV files
with a header row, or JSONL, and the column names, e.g.

  python -m electra_jax.main --mode=finetune --config=configs/finetune/custom.py \
      --config.custom.train_file=data/train.tsv --config.custom.dev_file=data/dev.tsv \
      --config.custom.text_a_column=review --config.custom.label_column=stars \
      --config.init_from=workdirs/demo --workdir=workdirs/demo_reviews

Pairs: --config.custom.text_b_column=...; regression: --config.custom.kind=regression.
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.task = "custom"
  config.epochs = 3
  # Small labelled sets get too few steps from 3 epochs: 2,000 examples at batch 32 give 189,
  # measured to end near chance even from random weights. They train at least 1000 steps
  # instead (2,000 examples: 16 epochs); large sets keep their 3 epochs.
  config.min_steps = 1000
  # The official fine-tuning rate of ELECTRA-Small, the size a custom task on a small budget
  # most likely starts from (base.py's 1e-4 is Base's).
  config.optimizer.learning_rate = 3e-4
  # ...but a pre-trained encoder may want another rate than random init does: each of these
  # trains on 80% of train and is scored on the rest, and the best trains the seeds (dev is not
  # read). On Debian synopses it lifted 12-minute encoders by 2 to 5 points
  # (benchmarks/SMALL_BUDGET_RESULTS.md). It trains about 2.4 more runs' worth: set it to "" for
  # large training sets.
  config.select.learning_rates = "3e-4,1e-3,3e-3"
  # Replaced-token detection labels [CLS] "original" in every example, so a first-token head
  # starts from a vector pre-training barely trained; the mean over the tokens does not.
  config.head.pooling = "mean"
  return config
