"""A custom task with a 2-layer model small enough for tests and CPU demos."""

from electra_jax import config_lib

custom = config_lib.sibling(__file__, "custom")


def get_config():
  config = custom.get_config()
  config.model.update(
      hidden_size=32,
      num_layers=2,
      num_heads=2,
      intermediate_size=64,
      embedding_size=32,
      max_position_embeddings=64,
  )
  config.max_seq_len = 32
  config.batch_size = 16
  config.epochs = 4
  config.min_steps = 0  # tests and demos train exactly the epochs they set
  config.select.learning_rates = ""  # ... at the rate they set
  config.head.pooling = (
      "cls"  # the official head, which Hugging Face export and the tests compare against
  )
  config.log_every = 10
  config.optimizer.update(learning_rate=3e-3)
  return config
