"""Replaced-token detection, the paper's objective: gen_weight * L_MLM + disc_weight * L_Disc over
every token ("electra"), over the masked positions only ("electra_15"), or with replacements drawn
uniformly from the vocabulary and no generator ("uniform")."""

import functools

from electra_jax.models import Towers
from electra_jax.objectives.pieces import Objective, Pass, detect


def _electra(p: Pass, only_masked: bool = False):
  """gen_weight * L_MLM + disc_weight * L_Disc (+ the tower's MLM under disc_mlm_weight); with
  `only_masked`, L_Disc and its metrics only where the generator could have replaced a token."""
  s, _, disc_loss, main_loss, per_token = detect(p, only_masked)
  loss = s.gen_loss + disc_loss
  return (loss if main_loss is None else loss + main_loss), per_token


ENTRIES = {
    "electra": Objective(_electra, disc_mlm=True),
    "electra_15": Objective(functools.partial(_electra, only_masked=True), disc_mlm=True),
    "uniform": Objective(_electra, towers=Towers(has_generator=False)),
}
