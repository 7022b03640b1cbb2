"""The fine-tuning optimizer: pre-training's (clipping, AdamW with no decay on LayerNorm or biases,
the official warmup and decay) with layer-wise learning rates (smaller steps nearer the input)."""

import re

import jax
import jax.numpy as jnp
import optax

from electra_jax import config_lib, optimizer
from electra_jax.errors import ConfigError

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


def schedule(config, total_steps: int, learning_rate: float | None = None) -> optimizer.Schedule:
  """The official warmup to `learning_rate` (None: the config's), then linear decay to `total_steps`."""
  o = config.optimizer
  peak = o.learning_rate if learning_rate is None else learning_rate
  return optimizer.learning_rate_schedule(peak, round(o.warmup_fraction * total_steps), total_steps)


def make_optimizer(config, params, num_layers: int):
  """Pre-training's optimizer, then the layer-wise scales; its update takes a `schedule=`."""
  o = config.optimizer
  scales = layerwise_lr_scales(params, num_layers, o.layerwise_lr_decay, o.layerwise_lr_decay_rule)
  return optax.chain(
      optimizer.make_optimizer(o),
      optax.stateless(
          lambda updates, _: jax.tree.map(lambda u, s: u * jnp.asarray(s, u.dtype), updates, scales)
      ),
  )
