"""Fine-tuning the discriminator on downstream tasks (GLUE, SQuAD, custom files)."""
