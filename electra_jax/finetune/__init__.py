"""Fine-tuning the discriminator on downstream tasks: metrics, task readers (GLUE, custom
files), the classifier head, the layer-wise learning-rate optimizer and the training loop."""
