"""Pre-training objectives as pure functions. REGISTRY maps objective.name to an `Objective`: its
forward pass, its metrics, the towers it needs, its config check and, for two_stage, its hooks.
pieces.py holds what they share; each other file is one objective (or a family) that reads alone."""

import math

import jax
import jax.numpy as jnp

from electra_jax import models
from electra_jax.errors import ConfigError
from electra_jax.objectives import adversarial, electra, electric, mlm, pieces, two_stage

# What callers use as objectives.<name>.
from electra_jax.objectives.pieces import (  # noqa: F401
    BINNED_METRICS,
    REPLACED_BINS,
    STAT_KEYS,
    ElectraObjective,
    MaskedInputs,
    Normalizers,
    Objective,
    Pass,
    binary_auc,
    candidate_mask,
    corrupt,
    mask_tokens,
    masked_position_weights,
    official_max_predictions,
    sample_tokens,
    sampling_temperature,
    temperature_decay_steps,
    temperature_falls,
)

REGISTRY: dict[str, Objective] = {
    **electra.ENTRIES,
    **mlm.ENTRIES,
    **two_stage.ENTRIES,
    **adversarial.ENTRIES,
    **electric.ENTRIES,
}
OBJECTIVES = tuple(REGISTRY)


def electra_forward(
    model,
    params,
    batch,
    masked: MaskedInputs,
    sample_keys,
    dropout_rng,
    objective: ElectraObjective,
    normalizers: Normalizers,
    deterministic: bool = False,
    step=None,
    temperature=None,
    schedule=None,
):
  """The registered objective's forward on one (micro-)batch with its masking drawn: (loss, (stats, per_token)),
  the loss's sums divided by `normalizers`, stats the additive counts and per_token the arrays `summarize`
  reads. `sample_keys` [batch]: per-example keys; `temperature` None: objective.temperature (evaluation's).
  """
  gen_rng, disc_rng = jax.random.split(dropout_rng)
  stats = dict.fromkeys(STAT_KEYS, jnp.zeros((), jnp.float32))
  stats.update(
      num_predictions=masked.weights.sum(),
      num_tokens=batch["attention_mask"].astype(jnp.float32).sum(),
  )
  p = Pass(
      model,
      params,
      batch,
      masked,
      sample_keys,
      gen_rng,
      disc_rng,
      objective,
      normalizers,
      deterministic,
      step,
      objective.temperature if temperature is None else temperature,
      schedule,
      stats,
  )
  loss, per_token = REGISTRY[objective.name].forward(p)
  return loss, (stats, per_token)


def summarize(stats, per_token_arrays, objective: ElectraObjective) -> dict[str, jax.Array]:
  """The official metrics (pieces.official_metrics), then the objective's loss and its own keys."""
  metrics = pieces.official_metrics(stats, per_token_arrays)
  REGISTRY[objective.name].metrics(metrics, stats, objective, per_token_arrays)
  return metrics


def towers(config) -> models.Towers:
  """The towers config.objective needs built (models.build_model's second argument)."""
  entry = REGISTRY[config.objective.name]
  mlm_head = entry.mlm_head or config.objective.disc_mlm_weight > 0
  return models.Towers(entry.has_generator, mlm_head, entry.cloze)


def check_config(config) -> None:
  """objective.name and the keys whose meaning depends on it, refused by name."""
  name, disc_mlm_weight = config.objective.name, config.objective.disc_mlm_weight
  if not (math.isfinite(disc_mlm_weight) and disc_mlm_weight >= 0):
    raise ConfigError(
        f"objective.disc_mlm_weight={disc_mlm_weight} must be finite and >= 0 (0 = off)."
    )
  if name not in REGISTRY:
    raise ConfigError(f"objective.name={name!r} is not one of {list(OBJECTIVES)}.")
  entry = REGISTRY[name]
  # mlm trains the tower by MLM alone and ignores the key: the MLM baseline of a recipe that sets it
  # is one override away.
  if disc_mlm_weight > 0 and not entry.disc_mlm and name != "mlm":
    with_it = " or ".join(repr(n) for n, e in REGISTRY.items() if e.disc_mlm)
    raise ConfigError(
        f"objective.disc_mlm_weight={disc_mlm_weight} adds an MLM loss to the discriminator of "
        f"objective.name {with_it}, not {name!r}: set it to 0 or change the objective."
    )
  entry.check(config)


def objective_from_config(config, special_ids: dict[str, int]) -> ElectraObjective:
  """`special_ids` maps pad/cls/sep/mask (and vocab_size) to the tokenizer's. Nothing here depends on
  train.steps (the run's length enters through the Schedule), and a setting the objective does not
  read (an initial temperature that never falls) is left at its default, so its step does not
  depend on it."""
  o, entry = config.objective, REGISTRY[config.objective.name]
  keep_original_prob, random_token_prob = entry.masking or (o.keep_original_prob, 0.0)
  return ElectraObjective(
      mask_prob=o.mask_prob,
      max_predictions=official_max_predictions(o.mask_prob, config.data.max_seq_len),
      gen_weight=o.gen_weight,
      disc_weight=o.disc_weight,
      temperature=o.temperature,
      keep_original_prob=keep_original_prob,
      random_token_prob=random_token_prob,
      mask_id=special_ids["mask"],
      pad_id=special_ids["pad"],
      cls_id=special_ids["cls"],
      sep_id=special_ids["sep"],
      name=o.name,
      vocab_size=special_ids.get("vocab_size", config.model.vocab_size),
      adversarial_mlm_weight=o.adversarial_mlm_weight,
      disallow_correct=o.disallow_correct,
      initial_temperature=o.initial_temperature if temperature_falls(o) else None,
      disc_mlm_weight=o.disc_mlm_weight,
      uses_generator=entry.has_generator,
  )
