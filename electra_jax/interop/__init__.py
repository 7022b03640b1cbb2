"""Checkpoint interop: Hugging Face ELECTRA directories in and out, official TF1 checkpoints in, a
pre-training workdir's export, and a released discriminator + generator pair imported as a
workdir's first checkpoint."""

from electra_jax.interop.export import export_workdir
from electra_jax.interop.hf import load_hf, save_hf
from electra_jax.interop.pretraining import pair_from_hf, pair_from_tf, write_pretraining_workdir

__all__ = [
    "export_workdir",
    "load_hf",
    "pair_from_hf",
    "pair_from_tf",
    "save_hf",
    "write_pretraining_workdir",
]
