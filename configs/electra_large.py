"""ELECTRA-Large with the paper's hyperparameters (335M-parameter discriminator, generator
1/4, mask probability 0.25; the released model trained 1.75M steps, the paper's 400k).

  python -m electra_jax.main --config=configs/electra_large.py --workdir=gs://bucket/large
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.model.update(
      hidden_size=1024,
      num_layers=24,
      num_heads=16,
      intermediate_size=4096,
      embedding_size=1024,
      generator_fraction=0.25,
  )
  config.objective.mask_prob = 0.25
  config.data.max_seq_len = 512
  config.train.update(steps=400_000, batch_size=2048)
  config.optimizer.update(learning_rate=2e-4, warmup_steps=10_000, bias_correction=False)
  return config
