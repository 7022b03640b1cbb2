"""Pre-training on a budget of minutes to hours (a CPU or one GPU): the run stops on time, and a
learning-rate schedule that ends exactly at the budget. Train your own vocabulary and encoder on
your text, then fine-tune it:

  electra-jax --config=configs/quick.py --config.train.time_budget=12m --workdir=W \
      --config.data.source=text --config.data.files=corpus.txt

--config.objective.name=mlm on the same recipe is the MLM baseline with the same budget.
What differs from the paper's recipes, and why, with the measurements: docs/small_budget.md.
"""

from electra_jax import config_lib

base = config_lib.sibling(__file__, "base")


def get_config():
  config = base.get_config()
  config.model.update(
      hidden_size=128,
      num_layers=4,
      num_heads=2,
      intermediate_size=512,
      embedding_size=128,
      vocab_size=8192,
      generator_fraction=0.25,
      max_position_embeddings=128,
      # A short run sees each example about once: dropout only slows it down (Cramming).
      dropout_rate=0.0,
      attention_dropout_rate=0.0,
      # Pre-LayerNorm trains stably at a higher learning rate; gated FFN and no biases as in
      # Cramming and ModernBERT. Not exportable to Hugging Face's ElectraModel.
      norm="pre",
      ffn="geglu",
      use_bias=False,
      # Each position sees its neighbours from the first step, before attention has learned to
      # find them: without it neither tower gets past word frequencies in minutes (Primer).
      attention_conv=3,
  )
  # Easy replacements first: the generator samples hot (rare, obviously wrong tokens) while the
  # discriminator is young, then cools to the paper's temperature 1.
  config.objective.update(initial_temperature=3.0, temperature=1.0, temperature_decay_fraction=1.0)
  # The discriminator also predicts the masked originals from its corrupted row: a better
  # encoder at an hour, no loss at minutes. MLM ignores the key, so objective.name=mlm stays
  # the recipe's plain baseline.
  config.objective.disc_mlm_weight = 1.0
  # Several documents per row: short documents would otherwise fill most of a row with padding.
  config.data.update(max_seq_len=128, spm_vocab_size=8192, pack_rows=True)
  config.train.update(time_budget="12m", steps=1_000_000, batch_size=64, log_every=50)
  config.optimizer.update(learning_rate=1e-3, warmup_fraction=0.1, bias_correction=True)
  config.checkpoint.update(every_steps=500, keep=2)
  config.eval.update(every_steps=500, num_batches=20)
  return config
