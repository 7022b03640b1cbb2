"""Checkpoint interop: Hugging Face `transformers` ELECTRA directories in and out, and the
export of a pre-training workdir's latest checkpoint to them."""

from electra_jax.interop.export import export_workdir
from electra_jax.interop.hf import load_hf, save_hf

__all__ = ["export_workdir", "load_hf", "save_hf"]
