"""configs/quick.py, the small-budget recipe, run from the CLI (its own file, so the test
workers share the load: each run takes its whole time budget)."""

import json
import sys

import numpy as np
import pytest

from conftest import REPO, cli
from electra_jax import config_lib, optimizer


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective", ["electra", "mlm"])
def test_the_quick_recipe_trains_to_its_time_budget(tmp_path, objective):
  """configs/quick.py from the CLI, shrunk to the test corpus: its encoder options, packed rows
  and temperature schedule train, train.steps is what the budget gave (recorded in config.json),
  and the schedule ends at that step. `objective.name=mlm` is the same recipe's baseline."""
  workdir = tmp_path / objective
  shrink = {
      "model.hidden_size": 32,
      "model.num_layers": 1,
      "model.num_heads": 2,
      "model.intermediate_size": 64,
      "model.embedding_size": 16,
      "model.vocab_size": 512,
      "model.max_position_embeddings": 64,
      "data.max_seq_len": 32,
      "data.spm_vocab_size": 500,
      "data.max_documents": 120,
      "train.batch_size": 8,
      "train.time_budget": "4s",
      "train.log_every": 1,
      "eval.every_steps": 0,
      "objective.name": objective,
  }
  args = [
      sys.executable,
      "-m",
      "electra_jax.main",
      f"--config={REPO}/configs/quick.py",
      f"--workdir={workdir}",
  ]
  result = cli(args + [f"--config.{k}={v}" for k, v in shrink.items()])
  assert result.returncode == 0, result.stderr[-3000:]
  saved = json.loads((workdir / "config.json").read_text())
  steps = saved["train"]["steps"]
  assert 1 <= steps < 1_000_000 and f"training {steps} steps" in result.stderr
  model = saved["model"]
  assert (model["norm"], model["ffn"], model["use_bias"], saved["data"]["pack_rows"]) == (
      "pre",
      "geglu",
      False,
      True,
  )
  lines = _metrics(workdir)
  assert lines[-1]["step"] == steps and all(np.isfinite(m["loss"]) for m in lines)
  warmup = optimizer.warmup_steps(config_lib.load_workdir_config(str(workdir)))
  assert warmup == round(0.1 * steps)
  assert float(optimizer.learning_rate_schedule(1e-3, warmup, steps)(steps)) == 0.0
  if objective == "electra":
    # The temperature falls linearly from 3 at the first step to 1 at train.steps, whatever the
    # budget gave (the last step, index steps - 1, samples at 3 - 2 (steps - 1) / steps).
    assert lines[0]["sampling_temperature"] == 3.0
    assert lines[-1]["sampling_temperature"] == pytest.approx(
        3.0 - 2.0 * (steps - 1) / steps, rel=1e-6
    )
    # The discriminator's own MLM trains beside replaced-token detection; MLM ignores the key.
    assert np.isfinite(lines[-1]["main_mlm_loss"]) and lines[-1]["main_mlm_loss"] > 0
  else:
    assert saved["objective"]["disc_mlm_weight"] == 1.0 and "main_mlm_loss" not in lines[-1]
