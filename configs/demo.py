"""A tiny ELECTRA on the built-in corpus that trains in a few minutes on two CPU cores and
visibly learns (disc_auc well above 0.5, masked_lm_accuracy rising). The quick start's run:

  python -m electra_jax.main --config=configs/demo.py --workdir=workdirs/demo

Two departures from the paper, both for a model this small and a run this short: no dropout,
and replacements sampled at temperature 2. At temperature 1 the generator learns word
frequencies within ~100 steps, after which only context tells a replacement apart, and a
2-layer discriminator then needs far more than 600 steps to learn it from attention (measured:
disc_auc stays near 0.55 up to step 750; --config.objective.temperature=1.0 shows it).

  electra-jax --config=configs/demo.py:t1 --workdir=workdirs/demo_t1

is the demo at the paper's temperature 1 with the encoder that learned most there in 600 steps:
Primer's attention convolution (model.attention_conv=3), pre-LayerNorm, GEGLU, no biases
(held-out disc_auc 0.746, recall 0.13; no Hugging Face export; docs/small_budget.md).
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config(variant=""):
  config = base.get_config()
  config.model.update(
      hidden_size=128,
      num_layers=2,
      num_heads=2,
      intermediate_size=512,
      embedding_size=128,
      vocab_size=8192,
      generator_fraction=0.25,
      max_position_embeddings=128,
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
  )
  config.objective.temperature = 2.0
  config.data.update(max_seq_len=128, spm_vocab_size=8192)
  config.train.update(steps=600, batch_size=32, log_every=50)
  config.optimizer.update(learning_rate=1e-3, warmup_steps=60)
  config.checkpoint.update(every_steps=200, keep=2)
  config.eval.every_steps = 200
  if variant == "t1":
    config.objective.temperature = 1.0
    config.model.update(
        norm="pre",
        ffn="geglu",
        use_bias=False,
        attention_conv=3,
    )
  elif variant:
    raise config_lib.ConfigError(
        f"configs/demo.py has no variant {variant!r}: use configs/demo.py or "
        "configs/demo.py:t1 (the demo at sampling temperature 1)."
    )
  return config
