"""Held-out evaluation: fixed masks per example (figures independent of batching and repeat
calls), padding rows without weight, and eval_metrics.jsonl written during training."""

import json

import numpy as np
import pytest

from conftest import cli_args, logged_messages, run_cli, tiny_config, with_devices
from run_helpers import REQUIRED_METRICS
from electra_jax import data, evaluation, optimizer, partitioning, train, train_state


def _setup_and_state(**overrides):
  config = tiny_config(**overrides)
  mesh = partitioning.make_mesh(config.mesh)
  tok = data.load_pretraining_data(config.data).tokenizer
  setup = train_state.build_setup(
      config, mesh, dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  )
  state = train_state.fresh_state(setup, 0)
  return setup, mesh, state


def _evaluator(setup, mesh, batch_size, num_batches=10_000):
  config = tiny_config(**{"eval.batch_size": batch_size, "eval.num_batches": num_batches})
  return evaluation.HeldOutEvaluator(config, setup, mesh, optimizer.make_schedule(config))


def test_held_out_figures_are_fixed_and_independent_of_eval_batch_size():
  setup, mesh, state = _setup_and_state()
  by_4 = _evaluator(setup, mesh, 4)  # num_batches large enough to cover the held-out split
  odd_size = next(b for b in (5, 6, 7, 9, 11) if by_4.num_examples % b)  # leaves padding rows
  by_odd = _evaluator(setup, mesh, odd_size)
  assert by_4.num_examples == by_odd.num_examples > odd_size
  first, again, other = by_4(state), by_4(state), by_odd(state)
  np.testing.assert_equal(first, again)  # NaN (an empty likelihood bin) equals NaN here
  for name, value in first.items():
    assert other[name] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), name


def test_held_out_figures_sample_at_the_final_temperature():
  """A temperature schedule changes training's samples, not evaluation's: it samples at
  objective.temperature at every step, so figures compare across checkpoints."""
  setup, mesh, state = _setup_and_state()
  scheduled, _, scheduled_state = _setup_and_state(
      **{"objective.initial_temperature": 5.0, "objective.temperature_decay_fraction": 1.0}
  )
  hot_config = {"objective.initial_temperature": 5.0, "objective.temperature_decay_fraction": 1.0}
  decay = optimizer.make_schedule(tiny_config(**hot_config))
  assert scheduled.objective.initial_temperature == 5.0 and float(decay.temperature_decay) == 6
  plain, hot = _evaluator(setup, mesh, 4, 2)(state), _evaluator(scheduled, mesh, 4, 2)(
      scheduled_state
  )
  assert plain == pytest.approx(hot, nan_ok=True)
  assert {
      "disc_auc_unlikely",
      "disc_auc_plausible",
      "disc_auc_likely",
      "replaced_share_likely",
  } <= set(plain)


def test_eval_num_batches_limits_the_examples():
  setup, mesh, _ = _setup_and_state()
  assert _evaluator(setup, mesh, 4, num_batches=2).num_examples == 8


def test_training_writes_held_out_metrics(tmp_path):
  workdir = tmp_path / "run"
  with logged_messages() as logged:
    train.train_and_evaluate(
        tiny_config(**{"eval.every_steps": 2, "data.eval_fraction": 0.1}), str(workdir)
    )
  lines = [json.loads(line) for line in (workdir / "eval_metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [2, 4, 6]
  official = REQUIRED_METRICS - {"step", "loss", "learning_rate", "tokens_per_sec", "steps_per_sec"}
  assert all(official <= set(m) for m in lines)
  assert any(message.startswith("eval step 6 (") for message in logged)

  # Evaluating the saved checkpoint later reproduces the figures logged during training.
  from_checkpoint = train.evaluate_checkpoint(
      tiny_config(**{"eval.every_steps": 2, "data.eval_fraction": 0.1}), str(workdir)
  )
  assert from_checkpoint["step"] == 6
  for name in official:
    assert from_checkpoint[name] == pytest.approx(lines[-1][name], rel=1e-6), name
  assert (
      json.loads((workdir / "eval_step_6.json").read_text())["disc_auc"]
      == from_checkpoint["disc_auc"]
  )
  # A step with no checkpoint is named with the ones there are (checkpoint.every_steps=3).
  with pytest.raises(
      ValueError, match=r"no checkpoint of step 5; its checkpoints are of steps \[3, 6\]"
  ):
    train.evaluate_checkpoint(
        tiny_config(**{"eval.every_steps": 2, "data.eval_fraction": 0.1}), str(workdir), step=5
    )
  # Another model's recipe is refused naming a parameter; nothing compared it with config.json.
  wider = {"eval.every_steps": 2, "data.eval_fraction": 0.1, "model.intermediate_size": 96}
  with pytest.raises(ValueError, match=r"a different model: parameter .* here\. Use a new"):
    train.evaluate_checkpoint(tiny_config(**wider), str(workdir))


@pytest.mark.fault
def test_evaluating_an_empty_workdir_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="holds no checkpoint"):
    train.evaluate_checkpoint(tiny_config(), str(tmp_path))


@pytest.mark.fault
def test_an_eval_batch_the_devices_cannot_split_is_refused_before_anything_is_written(tmp_path):
  # It was refused after the step compiled and config.json recorded the run.
  workdir = tmp_path / "run"
  overrides = {"eval.every_steps": 3, "eval.batch_size": 6, "mesh.data": 8}
  result = run_cli(cli_args(workdir, **overrides), env_extra=with_devices(8))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "eval.batch_size=6 is not divisible by the 8 batch shards" in result.stderr
  assert "Compiled the train step" not in result.stderr and not (workdir / "config.json").exists()
