"""Memory per training step from XLA's analysis, the largest batch that fits, and
train.batch_size=-1 resolving to it before anything is written."""

import numpy as np
import pytest

from conftest import tiny_config
from electra_jax import config_lib, memory, partitioning, train
from electra_jax.config_lib import ConfigError

SPECIAL = dict(pad=0, cls=2, sep=3, mask=4)


@pytest.fixture(scope="module")
def tiny_setup():
  config = tiny_config()
  mesh = partitioning.make_mesh(config.mesh)
  return config, mesh, train.build_setup(config, mesh, SPECIAL)


def test_step_memory_grows_linearly_with_the_batch(tiny_setup):
  config, mesh, setup = tiny_setup
  b8, b16, b32 = (memory.step_memory(config, setup, mesh, b).bytes_per_device for b in (8, 16, 32))
  assert b8 < b16 < b32
  assert (b32 - b16) == pytest.approx(2 * (b16 - b8), rel=0.1)  # activations, per example
  # The fixed part holds at least the train state (parameters and Adam's two moments, float32).
  params = sum(int(np.prod(s)) for s in setup.param_shapes.values())
  assert b8 - (b16 - b8) > 3 * 4 * params


def test_largest_batch_is_the_last_that_fits(tiny_setup):
  config, mesh, setup = tiny_setup
  limit = memory.step_memory(config, setup, mesh, 44).bytes_per_device  # between 40 and 48
  batch, measured = memory.largest_batch(config, setup, mesh, limit, quantum=8)
  assert batch == 40
  fits = {m.batch_size: m.bytes_per_device <= limit for m in measured}
  assert fits[40] and not fits[48]  # both were compiled on the way: 40 is the last that fits
  with pytest.raises(ConfigError, match="Even a batch of 8 needs"):
    memory.largest_batch(config, setup, mesh, limit_bytes=1000, quantum=8)


def test_batch_size_minus_one_resolves_before_training(tiny_setup, monkeypatch):
  config, mesh, setup = tiny_setup
  allowed = memory.step_memory(config, setup, mesh, 28).bytes_per_device
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: allowed)
  auto = tiny_config(**{"train.batch_size": -1, "train.memory_fraction": 1.0})
  train.prepare(auto)
  batch = auto.train.batch_size  # resolved in place, so config.json records the number
  assert 24 <= batch < 40
  assert memory.step_memory(config, setup, mesh, batch).bytes_per_device <= allowed
  assert memory.step_memory(config, setup, mesh, batch + 1).bytes_per_device > allowed


def test_non_positive_batch_sizes_are_refused():
  with pytest.raises(ConfigError, match="train.batch_size=0: give a positive global batch size, or -1"):
    config_lib.validate(tiny_config(**{"train.batch_size": 0}))
