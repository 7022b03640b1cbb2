"""Checkpoint interop: Hugging Face ELECTRA directories in and out, official TF1 checkpoints in, a
pre-training workdir's export, and a released discriminator + generator pair imported as a
workdir's first checkpoint."""

# The names callers use as interop.<name>.
from electra_jax.interop.export import export_workdir  # noqa: F401
from electra_jax.interop.hf import load_hf, save_hf  # noqa: F401
from electra_jax.interop.pretraining import pair_from_hf, pair_from_tf, write_pretraining_workdir  # noqa: F401
