"""ELECTRA-Small with the paper's hyperparameters (14M-parameter discriminator, generator 1/4).

python -m electra_jax.main --config=configs/electra_small.py --workdir=gs://bucket/small
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.model.update(
      hidden_size=256,
      num_layers=12,
      num_heads=4,
      intermediate_size=1024,
      embedding_size=128,
      generator_fraction=0.25,
  )
  config.objective.mask_prob = 0.15
  config.data.max_seq_len = 128
  config.train.update(steps=1_000_000, batch_size=128)
  config.optimizer.update(learning_rate=5e-4, warmup_steps=10_000, bias_correction=False)
  return config
