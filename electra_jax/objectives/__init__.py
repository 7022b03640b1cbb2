"""Pre-training objectives as pure functions. REGISTRY maps objective.name to an `Objective`: its
forward pass, its metrics, the towers it needs, its config check and, for two_stage, its hooks.
pieces.py holds what they share; each other file is one objective (or a family) that reads alone."""

from electra_jax import models
from electra_jax.errors import ConfigError
from electra_jax.objectives import adversarial, electra, electric, mlm, pieces, two_stage

# The names the train step, evaluation and the optimizer use as objectives.<name>.
from electra_jax.objectives.pieces import (  # noqa: F401
    BINNED_METRICS,
    ElectraObjective,
    Normalizers,
    Objective,
    Pass,
    candidate_mask,
    mask_tokens,
    official_max_predictions,
    sample_tokens,
    sampling_temperature,
    temperature_decay_steps,
    temperature_falls,
)

_FILES = (electra, mlm, two_stage, adversarial, electric)
REGISTRY: dict[str, Objective] = {name: e for f in _FILES for name, e in f.ENTRIES.items()}


def electra_forward(*pass_fields, **named_pass_fields):
  """The registered objective's forward on one (micro-)batch, given a `pieces.Pass`'s fields:
  (loss, (stats, per_token)): stats the additive counts, per_token the arrays `summarize` reads."""
  p = Pass(*pass_fields, **named_pass_fields)
  loss, per_token = REGISTRY[p.objective.name].forward(p)
  return loss, (p.stats, per_token)


def summarize(stats, per_token_arrays, objective: ElectraObjective) -> dict:
  """The official metrics (pieces.official_metrics), then the objective's loss and its own keys."""
  metrics = pieces.official_metrics(stats, per_token_arrays)
  REGISTRY[objective.name].metrics(metrics, stats, objective, per_token_arrays)
  return metrics


def towers(config) -> models.Towers:
  """The towers config.objective needs built (models.build_model's second argument)."""
  entry_towers = REGISTRY[config.objective.name].towers
  mlm_head = entry_towers.mlm_head or config.objective.disc_mlm_weight > 0
  return entry_towers._replace(mlm_head=mlm_head)


def check_config(config) -> None:
  """objective.name and the keys whose meaning depends on it, refused by name (config_lib.validate
  has refused every value that is not finite)."""
  o, seq_len = config.objective, config.data.max_seq_len
  for key in ("gen_weight", "disc_weight", "disc_mlm_weight", "adversarial_mlm_weight"):
    if o[key] < 0:
      raise ConfigError(f"objective.{key}={o[key]} must be >= 0: a negative weight trains to lose.")
  if o.name not in REGISTRY:
    raise ConfigError(f"objective.name={o.name!r} is not one of {list(REGISTRY)}.")
  if official_max_predictions(o.mask_prob, seq_len) < 1:
    raise ConfigError(
        f"objective.mask_prob={o.mask_prob} masks no position of a row of data.max_seq_len="
        f"{seq_len} (int((mask_prob + 0.005) * max_seq_len) slots): raise either."
    )
  # mlm trains the tower by MLM alone and ignores the key: the MLM baseline of a recipe that sets it
  # is one override away.
  if o.disc_mlm_weight > 0 and not REGISTRY[o.name].disc_mlm and o.name != "mlm":
    with_it = " or ".join(repr(n) for n, e in REGISTRY.items() if e.disc_mlm)
    raise ConfigError(
        f"objective.disc_mlm_weight={o.disc_mlm_weight} adds an MLM loss to the discriminator of "
        f"objective.name {with_it}, not {o.name!r}: set it to 0 or change the objective."
    )
  towers = REGISTRY[o.name].towers
  if config.model.tie == "all" and (towers.cloze or not towers.has_generator):
    raise ConfigError(
        f"objective.name={o.name!r} has no generator tower to share an encoder with: use "
        "model.tie='embeddings' (or 'none', 'gdes')."
    )
  REGISTRY[o.name].check(config)


def objective_from_config(config, special_ids: dict[str, int]) -> ElectraObjective:
  """`special_ids` maps pad/cls/sep/mask (and vocab_size) to the tokenizer's. Nothing here (so nor
  the step) depends on train.steps or on a setting the objective does not read."""
  o, entry = config.objective, REGISTRY[config.objective.name]
  keep_original_prob, random_token_prob = entry.masking or (o.keep_original_prob, 0.0)
  same = "name mask_prob gen_weight disc_weight temperature disallow_correct adversarial_mlm_weight"
  return ElectraObjective(
      **{key: o[key] for key in (*same.split(), "disc_mlm_weight")},
      **{f"{token}_id": special_ids[token] for token in ("mask", "pad", "cls", "sep")},
      max_predictions=official_max_predictions(o.mask_prob, config.data.max_seq_len),
      keep_original_prob=keep_original_prob,
      random_token_prob=random_token_prob,
      vocab_size=special_ids.get("vocab_size", config.model.vocab_size),
      initial_temperature=o.initial_temperature if temperature_falls(o) else None,
  )
