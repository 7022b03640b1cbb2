"""One GLUE task with ELECTRA's official fine-tuning hyperparameters (see base.py), e.g. RTE
from a pre-training workdir, three seeds, GLUE's TSV files under /data/glue:

  python -m electra_jax.main --mode=finetune --config=configs/finetune/glue.py \
      --config.task=rte --config.data_dir=/data/glue --config.init_from=workdirs/small \
      --config.num_seeds=3 --workdir=workdirs/small_glue

From TFDS instead (glue/rte prepared with file_format=array_record):
--config.source=tfds [--config.tfds_data_dir=...]. ELECTRA-Large: --config.optimizer.learning_rate=5e-5
--config.optimizer.layerwise_lr_decay=0.9.
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  # The official recipe, pinned here whatever base.py's defaults become: its epochs alone, and
  # the [CLS] head.
  config.min_steps = 0
  config.head.pooling = "cls"
  return config
