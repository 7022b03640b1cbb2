"""Uniform and Gumbel draws equal to jax.random's bit for bit, and Dropout on them: Threefry-2x32
as uint32 arithmetic that fuses with its consumer (XLA:CPU's is an unfused loop)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Threefry-2x32's rotations (Salmon et al., SC 2011), in groups of four rounds, alternating.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_PARITY = np.uint32(0x1BD11BDA)


def threefry2x32(k1, k2, x1, x2):
  """Threefry-2x32 (20 rounds) of counters (x1, x2) under key (k1, k2), elementwise on uint32."""
  ks = (k1, k2, k1 ^ k2 ^ _KEY_PARITY)
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x1 = x1 + x2
      x2 = ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r))) ^ x1
    x1 = x1 + ks[(group + 1) % 3]
    x2 = x2 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x1, x2


def _is_fast_path(key) -> bool:
  """True when jax.random would draw with partitionable threefry2x32, whose bits we reproduce."""
  name = str(jax.random.key_impl(key))  # our keys are typed (jax.random.key)
  return "threefry2x32" in name and bool(jax.config.jax_threefry_partitionable)


def random_bits(key, shape) -> jax.Array:
  """uint32 bits of `shape`, equal to jax.random.bits(key, shape, jnp.uint32)."""
  shape = tuple(shape)
  if not _is_fast_path(key) or math.prod(shape) >= 2**32:
    return jax.random.bits(key, shape, jnp.uint32)
  data = jax.random.key_data(key)
  # jax.random's per-element counter: the row-major index (its high word is 0 below 2**32 elements).
  counters, stride = jnp.zeros(shape, jnp.uint32), 1
  for dim in reversed(range(len(shape))):
    counters = counters + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
    stride *= shape[dim]
  bits1, bits2 = threefry2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32), counters)
  return bits1 ^ bits2


def uniform(key, shape, minval: float = 0.0, maxval: float = 1.0) -> jax.Array:
  """float32 in [minval, maxval), equal to jax.random.uniform(key, shape, jnp.float32, ...)."""
  if not _is_fast_path(key):
    return jax.random.uniform(key, shape, jnp.float32, minval, maxval)
  # 23 random mantissa bits under the exponent of 1.0 give [1, 2); shift down to [0, 1).
  one = np.array(1.0, np.float32).view(np.uint32)
  mantissa_bits = (random_bits(key, shape) >> np.uint32(9)) | one
  floats = lax.bitcast_convert_type(mantissa_bits, jnp.float32) - np.float32(1.0)
  lo, hi = np.float32(minval), np.float32(maxval)
  return lax.max(lo, floats * (hi - lo) + lo)


def gumbel(key, shape) -> jax.Array:
  """Standard Gumbel float32 draws, equal to jax.random.gumbel(key, shape, jnp.float32)."""
  if not _is_fast_path(key) or jax.config.jax_high_dynamic_range_gumbel:
    return jax.random.gumbel(key, shape, jnp.float32)
  return -jnp.log(-jnp.log(uniform(key, shape, minval=np.finfo(np.float32).tiny, maxval=1.0)))


class Dropout(nn.Module):
  """flax.linen.Dropout by these draws: the same masks from the same keys, cheaper on a CPU."""

  rate: float

  @nn.compact
  def __call__(self, inputs, deterministic: bool):
    if self.rate == 0.0 or deterministic:
      return inputs
    keep_prob = 1.0 - self.rate
    # jax.random.bernoulli's draw: a uniform below the probability.
    keep = uniform(self.make_rng("dropout"), inputs.shape) < np.float32(keep_prob)
    return lax.select(keep, inputs / keep_prob, jnp.zeros_like(inputs))
