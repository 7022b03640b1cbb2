"""The fine-tuning optimizer: clipping, AdamW (no decay on LayerNorm or biases), linear warmup and
decay, and layer-wise learning rates (smaller steps nearer the input)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from electra_jax import config_lib
from electra_jax.errors import ConfigError
from electra_jax.optimizer import _decays, scale_by_adam_without_bias_correction

LAYERWISE_RULES = ("correct", "official")


def check(o) -> None:
  """Refuses config.optimizer's values that cannot train (its layer-wise rule: trainer.validate)."""
  config_lib.check_optimizer(o, "the official 1e-4 for Small and Base, 5e-5 for Large")
  if not 0.0 < o.layerwise_lr_decay <= 1.0:
    raise ConfigError(f"optimizer.layerwise_lr_decay={o.layerwise_lr_decay} must be in (0, 1].")
  if not 0.0 <= o.warmup_fraction < 1.0:
    raise ConfigError(f"optimizer.warmup_fraction={o.warmup_fraction} must be in [0, 1).")


def layerwise_lr_scales(params, num_layers: int, decay: float, rule: str = "correct"):
  """A tree like `params` of learning-rate multipliers: the head 1, depth d (embeddings 0, the final
  LayerNorm L) decay ** (L + 1 - d); "official" (`_get_layer_lrs`) one more below the head."""
  head_depth = num_layers + 1
  top = head_depth + (1 if rule == "official" else 0)

  def scale(path, _):
    path = tuple(getattr(key, "key", str(key)) for key in path)
    match = re.match(r"layer_(\d+)$", path[1]) if path[0] == "encoder" else None
    if path[0] == "embeddings" or path[:2] == ("encoder", "embeddings_project"):
      depth = 0
    elif path[:2] == ("encoder", "final_layer_norm"):
      depth = num_layers
    else:
      depth = int(match.group(1)) + 1 if match else head_depth
    return 1.0 if depth == head_depth else float(decay ** (top - depth))

  return jax.tree_util.tree_map_with_path(scale, params)


def linear_warmup_decay(base_lr, warmup_steps, total_steps):
  """base_lr * min(1, step / warmup) * max(0, 1 - step / total) (warmup 0: none); args traceable."""

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warmup = jnp.where(warmup_steps > 0, jnp.minimum(1.0, step / jnp.maximum(warmup_steps, 1)), 1.0)
    return base_lr * warmup * jnp.maximum(0.0, 1.0 - step / jnp.maximum(total_steps, 1))

  return schedule


def schedule_args(config, total_steps: int, learning_rate: float | None = None) -> np.ndarray:
  """float32 [peak (None: optimizer.learning_rate), warmup steps, total steps]: the step's input."""
  o = config.optimizer
  peak = o.learning_rate if learning_rate is None else learning_rate
  return np.array([peak, round(o.warmup_fraction * total_steps), total_steps], np.float32)


def make_optimizer(config, params, num_layers: int, args):
  """(tx, schedule): clip, Adam, decoupled weight decay, layer-wise scales, `args`' schedule."""
  o = config.optimizer
  schedule = linear_warmup_decay(args[0], args[1], args[2])
  adam = optax.scale_by_adam if o.bias_correction else scale_by_adam_without_bias_correction
  scales = layerwise_lr_scales(params, num_layers, o.layerwise_lr_decay, o.layerwise_lr_decay_rule)
  tx = optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      adam(o.b1, o.b2, o.eps),
      optax.add_decayed_weights(
          o.weight_decay, mask=lambda p: jax.tree_util.tree_map_with_path(_decays, p)
      ),
      optax.stateless(
          lambda updates, _: jax.tree.map(lambda u, s: u * jnp.asarray(s, u.dtype), updates, scales)
      ),
      optax.scale_by_learning_rate(schedule),
  )
  return tx, schedule
