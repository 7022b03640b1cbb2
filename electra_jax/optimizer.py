"""The pre-training optimizer: global-norm clipping, then AdamW (optax's, or the official one without
bias correction), scaled by the official schedule; the `Schedule` is an argument of the compiled step,
so runs that differ only in their length or rates share one program."""

import functools
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from electra_jax import objectives


class OfficialAdamState(NamedTuple):
  mu: Any
  nu: Any


def scale_by_adam_without_bias_correction(b1: float, b2: float, eps: float):
  """Adam's direction m / (sqrt(v) + eps) without bias correction, as ELECTRA's AdamWeightDecayOptimizer."""

  def init(params):
    return OfficialAdamState(*(jax.tree.map(jnp.zeros_like, params) for _ in range(2)))

  def update(updates, state, params=None):
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return direction, OfficialAdamState(mu, nu)

  return optax.GradientTransformation(init, update)


@flax.struct.dataclass
class Schedule:
  """The official rate peak * min(1, step / warmup) * max(0, 1 - step / total), the temperature's
  decay steps and two_stage's switch, as float32 arrays the compiled step takes as an argument."""

  peak: jax.Array
  warmup: jax.Array  # 0: none (the official `if warmup_steps`)
  total: jax.Array
  temperature_decay: jax.Array  # 0: no temperature schedule
  switch: jax.Array  # objective.two_stage_switch: the first step of two_stage's second stage

  def __call__(self, step):
    step = jnp.asarray(step, jnp.float32)
    # Divided by the counts: 427 * float32(1 / 427) is below 1, leaving a rate at the last step.
    decay = jnp.maximum(0.0, self.total - step) / self.total
    warmup = jnp.where(self.warmup > 0, step / jnp.maximum(self.warmup, 1.0), 1.0)
    return self.peak * jnp.minimum(1.0, warmup) * decay


def learning_rate_schedule(
    peak: float, warmup_steps: int, total_steps: int, temperature_decay_steps=0, switch=0
) -> Schedule:
  values = (peak, warmup_steps, total_steps, temperature_decay_steps, switch)
  return Schedule(*(jnp.float32(value) for value in values))


def scale_by_schedule_argument() -> optax.GradientTransformationExtraArgs:
  """optax.scale_by_learning_rate with the Schedule passed to update (`schedule=`) instead of built in."""

  def update(updates, state, params=None, *, schedule: Schedule, **extra):
    del params, extra
    step_size = -1 * schedule(state.count)
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(
      lambda params: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)), update
  )


def _decays(path, _) -> bool:
  # Weight decay on matrices and embedding tables only, never on LayerNorm or any bias.
  return getattr(path[-1], "key", None) in ("kernel", "embedding")


def warmup_steps(config: ml_collections.ConfigDict) -> int:
  """optimizer.warmup_steps, or round(optimizer.warmup_fraction * train.steps) when that is > 0."""
  o = config.optimizer
  return round(o.warmup_fraction * config.train.steps) if o.warmup_fraction > 0 else o.warmup_steps


def warmup_note(config: ml_collections.ConfigDict) -> str | None:
  """A warning when the warmup does not end before the run (None when it does)."""
  warmup, steps = warmup_steps(config), config.train.steps
  if warmup < steps:
    return None
  return (
      f"optimizer.warmup_steps={warmup} is not shorter than train.steps={steps}: the learning rate "
      f"reaches at most {100 * steps / (4 * warmup):.1f}% of optimizer.learning_rate="
      f"{config.optimizer.learning_rate:g}. Lower optimizer.warmup_steps, or set "
      "optimizer.warmup_fraction (e.g. 0.1) to tie it to the run's length."
  )


def make_optimizer(o: ml_collections.ConfigDict) -> optax.GradientTransformationExtraArgs:
  """The optimizer of the `optimizer` group; its update takes the Schedule as `schedule=`."""
  return _optimizer(o.bias_correction, o.b1, o.b2, o.eps, o.clip_norm, o.weight_decay)


def make_schedule(config: ml_collections.ConfigDict) -> Schedule:
  """The schedule of a resolved config (train.steps and objective.two_stage_switch final)."""
  return learning_rate_schedule(
      config.optimizer.learning_rate,
      warmup_steps(config),
      config.train.steps,
      objectives.temperature_decay_steps(config),
      config.objective.two_stage_switch,
  )


@functools.cache
def _optimizer(bias_correction, b1, b2, eps, clip_norm, weight_decay):
  # One tx per setting: a static field of TrainState, so an equal config trained again in this process
  # has an equal state structure and jax reuses the traced and compiled steps.
  if bias_correction:
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  else:
    adam = scale_by_adam_without_bias_correction(b1, b2, eps)
  decay_mask = functools.partial(
      jax.tree_util.tree_map_with_path, _decays, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      adam,
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      scale_by_schedule_argument(),
  )
