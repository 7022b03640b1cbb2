"""SQuAD 2.0 (or --config.task=squad1.1) with ELECTRA's official settings: seq 512, doc stride
128, max query 64, 2 epochs, answerability classifier:

  python -m electra_jax.main --mode=finetune --config=configs/finetune/squad.py \
      --config.data_dir=/data/squad --config.init_from=workdirs/small --workdir=workdirs/small_squad
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.task = "squad2.0"
  config.max_seq_len = 512
  config.epochs = 2
  return config
