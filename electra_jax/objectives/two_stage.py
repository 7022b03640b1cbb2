"""Two-stage training (the paper's section 3.2 ablation): the generator alone by L_MLM until
objective.two_stage_switch (0: half the run), then by L_Disc alone the discriminator, started from
the generator's encoder. The hooks copy it at the switch, hold the other tower, fix the switch."""

import jax
import jax.numpy as jnp
from absl import logging

from electra_jax.errors import ConfigError
from electra_jax.objectives.pieces import Objective, Pass, detect


def _two_stage(p: Pass):
  """gen_weight * L_MLM before the switch, disc_weight * L_Disc from it (both computed: metrics)."""
  s, _, disc_loss, _, per_token = detect(p)
  return jnp.where(p.step >= p.schedule.switch, disc_loss, s.gen_loss), per_token


def _check_two_stage(config):
  m, switch = config.model, config.objective.two_stage_switch
  if switch < 0:
    raise ConfigError(
        f"objective.two_stage_switch={switch} is no step: give the discriminator's first step, or 0 "
        "for half the run."
    )
  if m.generator_fraction != 1.0 or m.tie in ("all", "none"):
    raise ConfigError(
        "objective.name='two_stage' copies the generator's encoder into the discriminator: set "
        f"model.generator_fraction=1.0 (is {m.generator_fraction}) and model.tie='embeddings' or "
        f"'gdes' (is {m.tie!r}), for separate towers of one size over shared embeddings."
    )


def _copy_at_switch(params, step, schedule):
  """At the switch the discriminator's encoder becomes the generator's copy (not its head)."""
  now = step == schedule.switch
  gen, disc = params["generator"]["encoder"], params["discriminator"]["encoder"]
  encoder = jax.tree.map(lambda g, d: jnp.where(now, g, d), gen, disc)
  return {**params, "discriminator": {**params["discriminator"], "encoder": encoder}}


def _hold_other_tower(updates, step, schedule):
  """Only the tower of the current stage moves (weight decay included)."""
  second = step >= schedule.switch
  first = ~second
  generator = jax.tree.map(lambda u: jnp.where(first, u, 0.0), updates["generator"])
  discriminator = jax.tree.map(lambda u: jnp.where(second, u, 0.0), updates["discriminator"])
  return {**updates, "generator": generator, "discriminator": discriminator}


def _fix_switch(config, saved: dict | None, start_step: int | None) -> dict:
  """The switch, fixed at a run's first start into config.json: at 0 it is half of train.steps,
  which a resume with more steps would move. A switch moved past the checkpoint is refused."""
  recorded = None
  if saved is not None and saved["objective"]["name"] == "two_stage":
    recorded = saved["objective"]["two_stage_switch"]
  switch, steps = config.objective.two_stage_switch, config.train.steps
  if not switch:
    switch = recorded or steps // 2
    how = "as this workdir recorded" if recorded else "half of train.steps"
    logging.info("objective.two_stage_switch=%d: the discriminator's first step (%s).", switch, how)
  if not 0 < switch < steps:
    raise ConfigError(
        f"objective.two_stage_switch={switch} leaves a stage no step of train.steps={steps}: "
        f"give a step from 1 to {steps - 1} (0: half the run), or train longer."
    )
  fixed = {"objective.two_stage_switch": switch}
  if start_step is None or recorded in (None, switch) or start_step <= min(switch, recorded):
    return fixed
  harm = (
      "copy the generator's encoder over the trained discriminator again"
      if switch > recorded
      else "start the discriminator's stage without the generator's encoder"
  )
  raise ConfigError(
      f"objective.two_stage_switch={switch}, but this workdir's run switches at step {recorded} "
      f"and its checkpoint is at step {start_step}: moving the switch now would {harm}. Leave it "
      f"at {recorded} (or 0), or use a new --workdir."
  )


_HOOKS = dict(before_step=_copy_at_switch, updates=_hold_other_tower, fixed_at_start=_fix_switch)
ENTRIES = {"two_stage": Objective(_two_stage, check=_check_two_stage, **_HOOKS)}
