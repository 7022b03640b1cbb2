"""electra-jax: ELECTRA pre-training (replaced-token detection) in JAX and Flax."""

__version__ = "0.1.0"
