"""Resolving a run (resolve.py): every mistake refused before the data is built or anything is
compiled or written; train.time_budget fixes train.steps in the resolved config."""

import json
import os

from electra_jax.errors import ConfigError
import pytest

from conftest import tiny_config
from electra_jax import (
    optimizer,
    preemption,
    resolve,
    train,
    train_state,
)
from run_helpers import REQUIRED_METRICS, _metrics  # noqa: F401


@pytest.mark.fault
@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"model.hidden_size": 33}, "model.hidden_size=33"),
        ({"data.max_seq_len": 128}, "data.max_seq_len=128"),
        ({"model.generator_fraction": 0.0}, "model.generator_fraction=0.0"),
        ({"model.generator_fraction": 1.5}, "model.generator_fraction=1.5"),
        ({"mesh.data": 2}, "mesh.data=2"),
        ({"train.grad_accum_steps": 3}, "train.grad_accum_steps=3"),
        ({"model.vocab_size": 100}, "model.vocab_size=100"),
        (
            {"train.batch_size": 100_000},
            "train.batch_size=100000 is more than the 3187 training rows",
        ),
    ],
)
def test_bad_config_is_refused_before_any_work(tmp_path, overrides, named):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=named.replace(".", r"\.")):
    train.train_and_evaluate(tiny_config(**overrides), str(workdir))
  assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


@pytest.mark.fault
@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"checkpoint.keep": 0}, "checkpoint.keep=0 must be >= 1"),
        (
            {"data.eval_fraction": 0.0, "eval.every_steps": 3},
            "data.eval_fraction=0 holds out no documents.*eval.every_steps=0",
        ),
        ({"optimizer.learning_rate": -1.0}, "optimizer.learning_rate=-1.0 must be > 0"),
        (
            {"data.files": "corpus.txt"},
            "data.files='corpus.txt' is set, but data.source='builtin'.*source='text'",
        ),
        (
            {"data.prepared_dir": "/data/p"},
            "data.prepared_dir='/data/p' is set.*data.source='prepared'",
        ),
        ({"data.tfds_name": "wikipedia"}, "data.tfds_name='wikipedia' is set.*data.source='tfds'"),
        (
            {
                "model.attention_impl": "splash",
                "data.max_seq_len": 100,
                "model.max_position_embeddings": 128,
            },
            "data.max_seq_len=100 is not a multiple of 128: choose e.g. 128, or",
        ),
        (
            {"train.batch_size": -1, "train.grad_accum_steps": 0},
            "train.grad_accum_steps=0 must be >= 1",
        ),
        (
            {"objective.name": "electric", "model.generator_fraction": 1.0, "data.pack_rows": True},
            "cannot train on packed rows: set data.pack_rows=False",
        ),
        ({"model.remat": "fulll"}, "model.remat='fulll' is not one of"),
        ({"model.dropout_rate": 1.5}, r"model.dropout_rate=1.5 must be in \[0, 1\)"),
        (
            {"model.attention_dropout_rate": -0.1},
            r"model.attention_dropout_rate=-0.1 must be in \[0, 1\)",
        ),
        (
            {"objective.keep_original_prob": 2.0},
            r"objective.keep_original_prob=2.0 must be in \[0, 1\]",
        ),
        ({"optimizer.warmup_steps": -10}, "optimizer.warmup_steps=-10 must be >= 0"),
        ({"train.steps": 0}, r"train.steps=0 must be >= 1 \(optimizer steps in all\)"),
        ({"train.memory_fraction": 0.0}, r"train.memory_fraction=0.0 must be in \(0, 1\]"),
        ({"train.memory_fraction": 1.5}, r"train.memory_fraction=1.5 must be in \(0, 1\]"),
        ({"optimizer.weight_decay": -3.0}, "optimizer.weight_decay=-3.0 must be >= 0"),
        ({"optimizer.b2": 1.0}, r"optimizer.b2=1.0 must be in \[0, 1\)"),
        ({"optimizer.clip_norm": 0.0}, "optimizer.clip_norm=0.0 must be > 0"),
        ({"eval.num_batches": 0}, r"eval.num_batches=0 must be >= 1 \(batches of held-out data"),
        # Sizes of zero or below were a ZeroDivisionError, or a traceback from inside the model's init.
        ({"model.num_heads": 0}, "model.num_heads=0 must be >= 1"),
        ({"model.hidden_size": 0}, "model.hidden_size=0 must be >= 1"),
        ({"model.num_heads": -2}, "model.num_heads=-2 must be >= 1"),
        ({"model.intermediate_size": 0}, "model.intermediate_size=0 must be >= 1"),
        ({"model.embedding_size": 0}, "model.embedding_size=0 must be >= 1"),
        # The temperature check let NaN through (nan <= 0 is False).
        (
            {"objective.temperature": float("nan")},
            "objective.temperature=nan must be finite and > 0",
        ),
        (
            {"objective.initial_temperature": float("inf")},
            "objective.initial_temperature=inf must be finite and > 0",
        ),
        (
            {"objective.initial_temperature": 0.0},
            "objective.initial_temperature=0.0 must be finite and > 0",
        ),
        # Every other float too: inf passed "> 0" checks and NaN the keys with no range check.
        (
            {"optimizer.learning_rate": float("inf")},
            "optimizer.learning_rate=inf is not a finite number",
        ),
        ({"model.layer_norm_eps": float("nan")}, "model.layer_norm_eps=nan is not a finite number"),
        (
            {"objective.temperature_decay_fraction": 1.5},
            r"objective.temperature_decay_fraction=1.5 must be in \[0, 1\]",
        ),
        ({"optimizer.warmup_fraction": 1.0}, r"optimizer.warmup_fraction=1.0 must be in \[0, 1\)"),
        ({"train.time_budget": "12"}, "train.time_budget='12' is not a duration: .*\"1h30m\""),
        ({"train.time_budget": "30m2h"}, "train.time_budget='30m2h' is not a duration"),
        ({"train.time_budget": "0m"}, "train.time_budget='0m' is no time at all"),
    ],
)
def test_mistakes_are_refused_before_the_data_is_built(tmp_path, monkeypatch, overrides, named):
  monkeypatch.setattr(
      train.data, "load_pretraining_data", lambda *a, **k: pytest.fail("data was built")
  )
  with pytest.raises(ConfigError, match=named):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.fault
def test_a_workdir_that_cannot_be_made_is_refused_before_the_data_is_built(tmp_path, monkeypatch):
  monkeypatch.setattr(
      train.data, "load_pretraining_data", lambda *a, **k: pytest.fail("data was built")
  )
  (tmp_path / "a_file").write_text("not a directory")
  with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file"):
    train.train_and_evaluate(tiny_config(), str(tmp_path / "a_file" / "run"))


@pytest.mark.fault
def test_cudnn_attention_off_a_gpu_is_refused_before_any_data(tmp_path, monkeypatch):
  config = tiny_config(
      **{
          "model.attention_impl": "cudnn",
          "train.dtype": "bfloat16",
          "model.attention_dropout_rate": 0.0,
      }
  )
  monkeypatch.setattr(
      train.data, "load_pretraining_data", lambda *a, **k: pytest.fail("data was built")
  )
  with pytest.raises(
      ConfigError,
      match="attention_impl='cudnn' is NVIDIA's fused attention, but the devices here are cpu",
  ):
    resolve.run(config)


@pytest.mark.fault
def test_steps_per_call_below_one_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="steps_per_call=0"):
    train.train_and_evaluate(tiny_config(**{"train.steps_per_call": 0}), str(tmp_path))


# ---------------------------------------------------------------------------------------
# train.time_budget
# ---------------------------------------------------------------------------------------
_FAKE_TIMING = (0.5, 0.0, 0.0)  # seconds: a step, compiling, an evaluation


def _fake_budget_clock(monkeypatch, measured=None):
  """A budget clock standing still and a step timing of 0.5 s, so the step count is known:
  floor(budget * 0.97 / 0.5). `measured`, a list, records each timing the run asks for."""
  real = train_state.measure_step_time

  def measure(*args):
    if measured is None:
      pytest.fail("a resume with the same time budget timed the step again")
    measured.append(real(*args))  # the real timing runs too; its figures are not used
    return _FAKE_TIMING

  monkeypatch.setattr(resolve, "_budget_clock", lambda: 0.0)
  monkeypatch.setattr(train_state, "measure_step_time", measure)


# A fresh run's budget is timed (the step, compiling, a held-out evaluation: eval.every_steps is
# on); the temperature decays and the warmup is a fraction, so both follow the steps it fixes.
_BUDGET = {
    "train.time_budget": "5s",
    "checkpoint.every_steps": 100,
    "objective.initial_temperature": 2.0,
    "objective.temperature_decay_fraction": 0.5,
    "optimizer.warmup_fraction": 0.2,
}


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
  """A run under train.time_budget with the fake clock (no checkpoint before its end), and the
  timings it measured."""
  workdir = tmp_path_factory.mktemp("budget") / "reference"
  measured = []
  with pytest.MonkeyPatch.context() as monkeypatch:
    _fake_budget_clock(monkeypatch, measured)
    train.train_and_evaluate(tiny_config(**_BUDGET), str(workdir))
  return workdir, measured


def test_the_time_budget_fixes_train_steps_so_the_schedule_ends_with_it(budget_run):
  workdir, measured = budget_run
  assert tiny_config().train.steps != 9 and tiny_config().eval.every_steps > 0
  assert len(measured) == 1 and min(measured[0]) > 0  # a step, compiling, an evaluation
  saved = json.loads((workdir / "config.json").read_text())
  assert (
      saved["train"]["steps"] == 9 and saved["train"]["time_budget"] == "5s"
  )  # floor(5 * 0.97 / 0.5)
  lines = _metrics(workdir)
  assert lines[-1]["step"] == 9
  # The last update (from step 8) takes lr / 9; the schedule reaches 0 at step 9.
  assert lines[-1]["learning_rate"] == pytest.approx(1e-3 / 9, rel=1e-5)
  assert float(optimizer.learning_rate_schedule(1e-3, 2, saved["train"]["steps"])(9)) == 0.0


def test_the_budget_counts_the_steps_and_their_evaluations_not_compiling(monkeypatch):
  # 20 s spent before the count: (100 - 20) * 0.97 = 77.6 s left. Compiling (10 s) is not
  # counted; a step takes 1 s and, every 10 steps, an evaluation 4 s (one more at the end).
  clock = iter([0.0, 20.0] * 3)
  monkeypatch.setattr(resolve, "_budget_clock", lambda: next(clock))
  timing = (1.0, 10.0, 4.0)  # seconds: a step, compiling, an evaluation
  monkeypatch.setattr(train_state, "measure_step_time", lambda *args: timing)
  for budget, every, steps in (("100s", 10, 52), ("100s", 0, 77), ("10s", 0, 1)):
    config = tiny_config(**{"train.time_budget": budget, "eval.every_steps": every})
    assert resolve.run(config).config.train.steps == steps, (budget, every)  # (77.6 - 4) / 1.4


def test_the_time_budget_fixes_train_steps_in_the_resolved_run_without_compiling_again(
    tmp_path, monkeypatch
):
  """The schedule (rate, temperature, two_stage's switch) is an argument of the compiled step, so
  fixing train.steps reuses the step timed, for two_stage too; the steps go into the resolved
  config, and the config given stays as it was."""
  monkeypatch.setattr(
      train_state,
      "measure_step_time",
      lambda *args: (0.5, 2.0, 0.0),  # seconds: a step, compiling, an evaluation
  )
  monkeypatch.setattr(resolve, "_budget_clock", lambda: 0.0)  # no time passes: the count is known
  for overrides in ({}, {"objective.name": "two_stage", "model.generator_fraction": 1.0}):
    config = tiny_config(**_BUDGET, **overrides)
    given = config.train.steps
    run = resolve.run(config, str(tmp_path))
    assert run.config.train.steps == 9, overrides  # floor(5 * 0.97 / 0.5): no compile counted
    assert config.train.steps == given
    assert not (tmp_path / "config.json").exists()  # resolving writes nothing
  assert run.config.objective.two_stage_switch == 4  # half the resolved steps
  assert float(run.schedule.switch) == 4.0


def test_a_resume_with_the_same_time_budget_keeps_its_steps_and_is_bit_exact(
    tmp_path, monkeypatch, budget_run
):
  # 9 steps (floor(4.85 / 0.5)); the temperature falls over round(4.5) = 4 of them.
  want = _metrics(budget_run[0])
  assert [m["step"] for m in want] == list(range(1, 10))
  assert [m["sampling_temperature"] for m in want] == [
      2.0,
      1.75,
      1.5,
      1.25,
      1.0,
      1.0,
      1.0,
      1.0,
      1.0,
  ]
  assert want[1]["learning_rate"] == pytest.approx(
      1e-3 * 0.5 * (1 - 1 / 9), rel=1e-5
  )  # warmup round(1.8) = 2

  # Preempted after its fifth step (a checkpoint there), then resumed without a new timing.
  _fake_budget_clock(monkeypatch, [])
  monkeypatch.setattr(preemption.Preemption, "stop_after", lambda self, call: call == 4)
  train.train_and_evaluate(tiny_config(**_BUDGET), str(tmp_path / "interrupted"))
  assert os.listdir(tmp_path / "interrupted" / "checkpoints") == ["5"]
  monkeypatch.undo()
  _fake_budget_clock(monkeypatch, None)
  train.train_and_evaluate(tiny_config(**_BUDGET), str(tmp_path / "interrupted"))
  got = _metrics(tmp_path / "interrupted")
  assert [m["step"] for m in got] == list(range(1, 10))
  for a, b in zip(want, got):
    for name in REQUIRED_METRICS - {"tokens_per_sec", "steps_per_sec"} | {"sampling_temperature"}:
      assert a[name] == b[name], (a["step"], name, a[name], b[name])  # to the last bit


def test_a_warmup_as_long_as_the_run_is_named_with_the_peak_it_leaves(
    tmp_path, monkeypatch, caplog
):
  config = tiny_config(
      **{"train.steps": 30, "optimizer.warmup_steps": 60, "optimizer.learning_rate": 1e-3}
  )
  note = optimizer.warmup_note(config)
  # The schedule's own highest value over the run, against the share the note states.
  schedule = optimizer.learning_rate_schedule(1.0, 60, 30)
  assert f"at most {100 * max(float(schedule(s)) for s in range(31)):.1f}% of" in note
  assert "optimizer.warmup_steps=60 is not shorter than train.steps=30" in note and "12.5%" in note
  assert (
      optimizer.warmup_note(tiny_config(**{"train.steps": 30, "optimizer.warmup_steps": 29}))
      is None
  )
  assert (
      optimizer.warmup_note(tiny_config(**{"train.steps": 30, "optimizer.warmup_fraction": 0.1}))
      is None
  )
  # The run logs it while it is resolved, before anything trains.
  with caplog.at_level("WARNING"):
    resolve.run(config, str(tmp_path / "run"))
  assert note in caplog.text
