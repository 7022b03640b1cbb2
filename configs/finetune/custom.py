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
  return config
