"""ELECTRA-Base with the paper's hyperparameters (110M-parameter discriminator, generator 1/3).

python -m electra_jax.main --config=configs/electra_base.py --workdir=gs://bucket/base
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.model.update(
      hidden_size=768,
      num_layers=12,
      num_heads=12,
      intermediate_size=3072,
      embedding_size=768,
      generator_fraction=1 / 3,
  )
  config.objective.mask_prob = 0.15
  config.data.max_seq_len = 512
  config.train.update(steps=766_000, batch_size=256)
  config.optimizer.update(learning_rate=2e-4, warmup_steps=10_000, bias_correction=False)
  return config
