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


def _fake_step_memory(bytes_of):
  """Stands in for compiling: `bytes_of(batch)` per device; records the batches asked for."""
  asked = []

  def step_memory(config, setup, mesh, batch_size):
    asked.append(batch_size)
    return memory.StepMemory(batch_size, int(bytes_of(batch_size)))

  return step_memory, asked


@pytest.mark.parametrize("quantum", [1, 8])
def test_largest_batch_is_the_last_that_fits(monkeypatch, quantum):
  # Not quite linear, as XLA's buffer layout is not: the linear fit overshoots.
  bytes_of = lambda b: 50_000 + 1_000 * b + 3 * b * b  # noqa: E731
  fake, asked = _fake_step_memory(bytes_of)
  monkeypatch.setattr(memory, "step_memory", fake)
  limit = bytes_of(300) + 1
  batch, measured = memory.largest_batch(None, None, None, limit, quantum)
  assert batch == 300 // quantum * quantum  # the largest multiple of quantum that fits
  assert all(b % quantum == 0 for b in asked) and len(asked) <= 16  # a handful of compiles
  assert bytes_of(batch + quantum) > limit
  with pytest.raises(ConfigError, match=f"Even a batch of {quantum} needs"):
    memory.largest_batch(None, None, None, limit_bytes=1000, quantum=quantum)


def test_batch_size_minus_one_resolves_before_training(monkeypatch):
  fake, asked = _fake_step_memory(lambda b: 1_000_000 + 10_000 * b)
  monkeypatch.setattr(memory, "step_memory", fake)
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device=None: 1_000_000 + 10_000 * 37)
  auto = tiny_config(**{"train.batch_size": -1, "train.memory_fraction": 1.0})
  train.prepare(auto)
  assert auto.train.batch_size == 37  # resolved in place, so config.json records the number
  # Half of that memory does not hold even the fixed part: refused before anything runs.
  with pytest.raises(ConfigError, match="Even a batch of 1 needs"):
    train.prepare(tiny_config(**{"train.batch_size": -1, "train.memory_fraction": 0.5}))


def test_non_positive_batch_sizes_are_refused():
  with pytest.raises(ConfigError, match="train.batch_size=0: give a positive global batch size, or -1"):
    config_lib.validate(tiny_config(**{"train.batch_size": 0}))
