"""random_ops draws the very numbers jax.random draws (same keys, same bits), only cheaper on
CPU; the model's dropout and the Gumbel sampling depend on it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from electra_jax import objectives, random_ops

SHAPES = [(7,), (3, 5), (4, 19, 1000), (2, 3, 4, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_bits_and_uniform_equal_jax_random(shape):
  for seed in (0, 1234567):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(
        random_ops.random_bits(key, shape), jax.random.bits(key, shape, jnp.uint32)
    )
    np.testing.assert_array_equal(random_ops.uniform(key, shape), jax.random.uniform(key, shape))
    np.testing.assert_array_equal(
        random_ops.uniform(key, shape, 2.0, 5.0),
        jax.random.uniform(key, shape, minval=2.0, maxval=5.0),
    )


def test_threefry_matches_the_published_known_answers():
  # Random123's known-answer vectors for Threefry-2x32 with 20 rounds.
  cases = [
      ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
      ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
      ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
  ]
  for (k1, k2), (x1, x2), want in cases:
    got = random_ops.threefry2x32(*(jnp.uint32(v) for v in (k1, k2, x1, x2)))
    assert tuple(int(g) for g in got) == want


def test_gumbel_equals_jax_random_under_vmap_and_jit():
  keys = jax.random.split(jax.random.key(3), 4)
  shape = (19, 3000)
  ours = jax.jit(jax.vmap(lambda k: random_ops.gumbel(k, shape)))(keys)
  theirs = jax.jit(jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32)))(keys)
  # Same uniforms; the two logarithms may round differently in the last bit depending on how
  # XLA vectorizes them, never more.
  np.testing.assert_allclose(ours, theirs, rtol=2e-7, atol=2e-7)
  assert np.mean(np.asarray(ours) == np.asarray(theirs)) > 0.99
  # So Gumbel-max sampling picks the same tokens.
  logits = jax.random.normal(jax.random.key(4), (4, *shape))
  sampled = objectives.sample_tokens(keys, logits, 1.0)
  want = jnp.argmax(logits + theirs, axis=-1)
  np.testing.assert_array_equal(sampled, want)


def test_other_prng_implementations_fall_back_to_jax_random():
  key = jax.random.key(5, impl="rbg")
  np.testing.assert_array_equal(random_ops.uniform(key, (3, 4)), jax.random.uniform(key, (3, 4)))
  x, rngs = jnp.ones((64,)), {"dropout": key}
  np.testing.assert_array_equal(
      random_ops.Dropout(0.5).apply({}, x, deterministic=False, rngs=rngs),
      nn.Dropout(0.5).apply({}, x, deterministic=False, rngs=rngs),
  )


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_equals_flax_dropout(rate):
  x = jax.random.normal(jax.random.key(6), (4, 16, 32))
  rngs = {"dropout": jax.random.key(7)}
  ours = random_ops.Dropout(rate).apply({}, x, deterministic=False, rngs=rngs)
  theirs = nn.Dropout(rate).apply({}, x, deterministic=False, rngs=rngs)
  np.testing.assert_array_equal(ours, theirs)
  kept = np.asarray(ours != 0)
  assert abs(kept.mean() - (1 - rate)) < 0.05
  np.testing.assert_allclose(np.asarray(ours)[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
  np.testing.assert_array_equal(random_ops.Dropout(rate).apply({}, x, deterministic=True), x)
