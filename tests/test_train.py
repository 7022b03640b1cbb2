"""The training loop (train.py) end to end: its outputs, logs and summary, a run killed before
its first checkpoint, non-finite values, several steps a call, resumes with other settings and
refusing another model's workdir."""

import json
import shutil
import os

import jax
import jax.numpy as jnp
import numpy as np
from electra_jax.errors import ConfigError
import pytest

import electra_jax
from conftest import cli, cli_args, logged_messages, run_cli, tiny_config
from electra_jax import (
    checkpointing,
    config_lib,
    data,
    flops,
    models,
    objectives,
    resolve,
    train,
    train_state,
)
from run_helpers import REQUIRED_METRICS, _metrics  # noqa: F401


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """One in-process run of the tiny config for 3 steps (a checkpoint at 3) and the messages it
  logged, for the tests that look at a finished run or resume one (each on a copy)."""
  workdir = tmp_path_factory.mktemp("three_steps") / "run"
  with logged_messages() as messages:
    train.train_and_evaluate(tiny_config(**{"train.steps": 3}), str(workdir))
  return workdir, "\n".join(messages)


def _copy_of(three_steps, tmp_path):
  shutil.copytree(three_steps[0], tmp_path / "run")
  return tmp_path / "run"


def test_cli_writes_config_metrics_and_checkpoints(tmp_path):
  workdir = tmp_path / "run"
  result = run_cli(cli_args(workdir))
  assert result.returncode == 0, result.stderr[-3000:]
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["hidden_size"] == 32 and config["train"]["steps"] == 6
  assert config.pop(config_lib.VERSION_KEY) == electra_jax.__version__  # and readers leave it out:
  assert config_lib.saved_config(str(workdir)) == config_lib.as_saved(
      config_lib.with_defaults(config)
  )
  lines = _metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
  for m in lines:
    assert REQUIRED_METRICS <= set(m), REQUIRED_METRICS - set(m)
    assert np.isfinite(m["loss"]) and 0 <= m["disc_auc"] <= 1
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
  assert "step 6/6" in result.stderr and "ETA" in result.stderr and "tokens/s" in result.stderr
  # No lines that are not news on a CPU: JAX's search for a TPU; our glibc setting is said once.
  assert (
      "Unable to initialize backend" not in result.stderr
      and result.stderr.count("GLIBC_TUNABLES") <= 1
  )
  # The end: steps, tokens, then the last train window and the last held-out evaluation, as logged.
  done, header, train_row, held_out_row, files = result.stdout.splitlines()[-5:]
  tokens = 6 * config["train"]["batch_size"] * config["data"]["max_seq_len"]
  assert done.startswith(f"Done: step 6 of 6, {tokens:,} tokens") and files.startswith(
      f"Files: {workdir}/checkpoints"
  )
  assert header.split() == [
      "loss",
      "masked_lm_accuracy",
      "disc_auc",
      "disc_precision",
      "disc_recall",
  ]
  held_out = [
      json.loads(line) for line in (workdir / "eval_metrics.jsonl").read_text().splitlines()
  ][-1]
  assert train_row.startswith("train") and held_out_row.startswith(
      f"held-out (step {held_out['step']})"
  )
  assert train_row.split()[-5:] == [f"{lines[-1][key]:.4f}" for key in header.split()]
  assert held_out_row.split()[-5:] == [f"{held_out[key]:.4f}" for key in header.split()]
  # Running again finds the run complete and trains nothing more.
  again = cli(cli_args(workdir))
  assert again.returncode == 0 and len(_metrics(workdir)) == 6


@pytest.mark.fault
def test_a_run_killed_before_its_first_checkpoint_leaves_no_lines_behind(tmp_path):
  """The steps a dead run logged past its last checkpoint are dropped on resume; with no
  checkpoint at all that is every line, or the new run's steps would follow the old ones."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  dead = "".join(json.dumps({"step": step, "loss": 99.0}) + "\n" for step in (5, 10, 15, 20, 25))
  (workdir / "metrics.jsonl").write_text(dead)
  (workdir / "eval_metrics.jsonl").write_text(dead)
  train.train_and_evaluate(
      tiny_config(**{"train.steps": 4, "train.log_every": 2, "eval.every_steps": 4}), str(workdir)
  )
  assert [m["step"] for m in _metrics(workdir)] == [2, 4]
  assert [
      json.loads(line)["step"] for line in (workdir / "eval_metrics.jsonl").read_text().splitlines()
  ] == [4]


@pytest.mark.fault
def test_workdir_of_another_model_is_refused_and_left_intact(tmp_path, three_steps):
  workdir = _copy_of(three_steps, tmp_path)  # what `cli_args(workdir, train.steps=3)` trains
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()}
  config_before = (workdir / "config.json").read_text()
  result = cli(cli_args(workdir, **{"train.steps": 3, "model.intermediate_size": 96}))
  assert result.returncode != 0
  assert (
      "different model" in result.stderr
      and "intermediate/bias" in result.stderr
      and "Traceback" not in result.stderr
  )
  assert "differ from its config.json: model.intermediate_size: 64 -> 96." in result.stderr
  assert (workdir / "config.json").read_text() == config_before
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*") if p.is_file()} == before


@pytest.mark.fault
def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  # An absurd learning rate drives the parameters to inf within a few steps.
  config = tiny_config(
      **{"optimizer.learning_rate": 1e30, "checkpoint.every_steps": 2, "train.log_every": 3}
  )
  # Step 3's loss, computed from step 2's parameters, is NaN: the error says that checkpoint
  # is already diverged (and, as the run is float32, does not suggest float32).
  with pytest.raises(
      FloatingPointError,
      match=r"The last checkpoint is step 2\. Its parameters are finite but "
      r"already gave step 3 a non-finite loss.*warmup_steps\.$",
  ):
    train.train_and_evaluate(config, str(tmp_path))
  # Step 2's save was still in flight when the NaN appeared: it must have been completed.
  assert os.listdir(tmp_path / "checkpoints") == ["2"]
  meta = train.checkpointing.Checkpointer(str(tmp_path), keep=3).read_meta(2)
  assert "param_shapes" in meta
  # The check before every save: parameters that overflowed are never written.
  assert bool(train._params_finite({"a": jnp.ones(3), "b": {"c": jnp.zeros((2, 2))}}))
  assert not bool(train._params_finite({"a": jnp.ones(3), "b": {"c": jnp.array([[0.0, jnp.inf]])}}))
  # Diverged before any checkpoint: said so, not "step None".
  config = tiny_config(
      **{"optimizer.learning_rate": 1e30, "checkpoint.every_steps": 100, "train.log_every": 3}
  )
  with pytest.raises(
      FloatingPointError, match="No checkpoint was saved yet: the next start begins from scratch"
  ):
    train.train_and_evaluate(config, str(tmp_path / "fresh"))


def test_a_nan_step_shows_in_the_logged_window_mean():
  # disc_auc skips NaN steps (a step whose tokens are all one class has none); the loss and
  # everything else must not, or a window holding a diverged step would log a finite loss.
  window = [
      {"loss": np.float32(2.0), "disc_auc": np.float32(np.nan)},
      {"loss": np.array([np.nan, 4.0], np.float32), "disc_auc": np.array([0.5, 0.7], np.float32)},
  ]
  means = train._mean_metrics(window)
  assert np.isnan(means["loss"]) and means["disc_auc"] == pytest.approx(0.6)
  assert train._first_non_finite_step(window, last_step=12) == 11


def test_steps_per_call_trains_exactly_like_single_steps(tmp_path):
  # 7 steps, logging every 3 and checkpointing every 5, 2 steps per call: calls never cross a
  # boundary, so some steps run alone; the metrics and the final parameters must equal a run
  # of single steps (dropout on: the per-step keys must match too).
  overrides = {
      "train.steps": 7,
      "train.log_every": 3,
      "checkpoint.every_steps": 5,
      "eval.every_steps": 0,
  }
  single = train.train_and_evaluate(tiny_config(**overrides), str(tmp_path / "single"))
  multi = train.train_and_evaluate(
      tiny_config(**overrides, **{"train.steps_per_call": 2}), str(tmp_path / "multi")
  )
  logged = [(m["step"], m["loss"], m["disc_auc"]) for m in _metrics(tmp_path / "single")]
  assert [m["step"] for m in _metrics(tmp_path / "multi")] == [3, 6, 7]
  for (step, loss, auc), m in zip(logged, _metrics(tmp_path / "multi")):
    assert m["loss"] == pytest.approx(loss, rel=1e-5) and m["disc_auc"] == pytest.approx(
        auc, rel=1e-5
    ), step
  assert multi["loss"] == pytest.approx(single["loss"], rel=1e-5)
  run = resolve.run(tiny_config(**overrides))
  mesh, corpus, setup = run.mesh, run.corpus, run.setup
  _, single_state = resolve.restore_checkpoint(str(tmp_path / "single"), setup, mesh, None, corpus)
  _, multi_state = resolve.restore_checkpoint(str(tmp_path / "multi"), setup, mesh, None, corpus)
  for a, b in zip(jax.tree.leaves(single_state.params), jax.tree.leaves(multi_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_steps_per_call_that_leaves_single_steps_is_named(caplog):
  config = tiny_config(
      **{"train.log_every": 100, "checkpoint.every_steps": 1000, "eval.every_steps": 0}
  )
  with caplog.at_level("WARNING"):
    train._periods(config, 50)  # divides both: no warning
    assert not caplog.records
    train._periods(config, 64)
  assert (
      "train.steps_per_call=64 does not divide train.log_every=100, checkpoint.every_steps=1000"
      in caplog.text
  )


def test_resuming_with_other_settings_names_them_and_keeps_the_old_config(
    tmp_path, caplog, three_steps
):
  workdir = _copy_of(three_steps, tmp_path)  # trained with tiny_config(train.steps=3)
  first = json.loads((workdir / "config.json").read_text())
  train.train_and_evaluate(
      tiny_config(**{"train.steps": 3}), str(workdir)
  )  # the same: nothing kept
  assert sorted(p.name for p in workdir.glob("config*.json")) == ["config.json"]
  caplog.set_level("WARNING")
  train.train_and_evaluate(
      tiny_config(**{"train.steps": 6, "optimizer.learning_rate": 5e-4}), str(workdir)
  )
  assert json.loads((workdir / "config.step3.json").read_text()) == first
  now = json.loads((workdir / "config.json").read_text())
  assert now["train"]["steps"] == 6 and now["optimizer"]["learning_rate"] == 5e-4
  warning = [
      r.getMessage()
      for r in caplog.records
      if "differ from the workdir's config.json" in r.getMessage()
  ]
  assert (
      warning and "optimizer.learning_rate: 0.001 -> 0.0005; train.steps: 3 -> 6" in warning[0]
  ), warning
  # That run dies before it saves (its checkpoints past 3 gone); a third start from step 3 with
  # yet other settings keeps the record of what trained step 3, not the dead run's settings.
  for step in os.listdir(workdir / "checkpoints"):
    if step != "3":
      shutil.rmtree(workdir / "checkpoints" / step)
  train.train_and_evaluate(
      tiny_config(**{"train.steps": 4, "optimizer.learning_rate": 2e-4}), str(workdir)
  )
  assert json.loads((workdir / "config.step3.json").read_text()) == first


def test_a_resume_with_another_batch_size_goes_on_where_the_data_stream_stopped(
    tmp_path, monkeypatch
):
  """Batch `step` read stream positions [step * B, (step + 1) * B), so a run resumed with
  another batch size (train.batch_size=-1 resolves it again on every start) jumped in the
  stream: from 3 steps of 8 to batches of 16 it read rows 48.. next, skipping 24..47. The
  checkpoint now records its stream position and the resumed run goes on from there."""
  from electra_jax import data  # noqa: PLC0415

  read = []
  real = data.get_batch

  def recording(
      corpus, step, global_batch_size, seed, process_index=0, process_count=1, stream_offset=0
  ):
    start = stream_offset + step * global_batch_size
    read.extend(range(start, start + global_batch_size))
    return real(corpus, step, global_batch_size, seed, process_index, process_count, stream_offset)

  monkeypatch.setattr(data, "get_batch", recording)
  workdir = str(tmp_path / "run")
  small = {
      "train.steps": 3,
      "train.batch_size": 8,
      "checkpoint.every_steps": 3,
      "eval.every_steps": 0,
  }
  train.train_and_evaluate(tiny_config(**small), workdir)
  train.train_and_evaluate(
      tiny_config(**dict(small, **{"train.steps": 5, "train.batch_size": 16})), workdir
  )
  assert read == list(range(3 * 8 + 2 * 16))  # every position once, in order
  checkpointer = train.checkpointing.Checkpointer(workdir, keep=2)
  try:
    assert [checkpointer.read_meta(s)["stream_position"] for s in (3, 5)] == [24, 56]
  finally:
    checkpointer.close()
  # The same batch size resumes as before: stream positions step * B.
  read.clear()
  train.train_and_evaluate(
      tiny_config(**dict(small, **{"train.steps": 6, "train.batch_size": 16})), workdir
  )
  assert read == list(range(56, 72))


def test_a_run_starts_with_a_summary_of_what_it_trains(tmp_path, three_steps):
  config = tiny_config(**{"train.steps": 3})  # the run three_steps logged
  workdir, logged = _copy_of(three_steps, tmp_path), three_steps[1]
  assert "Compiled the train step in " in logged
  summary = next(line for line in logged.splitlines() if "Training electra: parameters" in line)
  # Against the saved state and the FLOP counter, not against the summary's own arithmetic.
  checkpointer = checkpointing.Checkpointer(str(workdir), keep=1)
  params = checkpointer.read_meta(3)["param_shapes"]
  checkpointer.close()
  total = sum(int(np.prod(shape)) for shape in params.values())
  assert f"({total / 1e6:.2f}M in all)" in summary
  for tower in ("discriminator", "generator", "embeddings"):
    assert f"{tower} " in summary
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(
      config, train_state.special_ids(data.load_tokenizer(config.data))
  )
  per_token = flops.objective_flops_per_token(model, objective, config.data.max_seq_len)
  assert f"{per_token / 1e6:.1f} model MFLOPs per token" in summary
  assert f"{config.train.batch_size * config.data.max_seq_len:,} tokens per step" in summary


@pytest.mark.fault
def test_a_resume_whose_optimizer_state_differs_is_refused_before_anything_is_written(
    tmp_path, three_steps
):
  """optimizer.bias_correction changes the optimizer state's structure (optax's Adam keeps a
  count, the official one does not): orbax's restore fails on it. That was a traceback after
  config.json had taken the refused settings; it is a ConfigError before anything is written."""
  workdir = _copy_of(three_steps, tmp_path)  # trained with tiny_config(train.steps=3)
  before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and "lease" not in p.name}
  with pytest.raises(ConfigError, match=r"optimizer state.*optimizer\.bias_correction"):
    train.train_and_evaluate(
        tiny_config(**{"train.steps": 6, "optimizer.bias_correction": False}), str(workdir)
    )
  after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and "lease" not in p.name}
  assert after == before


@pytest.mark.fault
def test_a_resume_with_fewer_steps_than_done_changes_nothing(tmp_path, three_steps, caplog):
  """It compiled, then wrote config.json with the smaller count; now it says so and stops there."""
  workdir = _copy_of(three_steps, tmp_path)
  before = (workdir / "config.json").read_text()
  with caplog.at_level("INFO"):
    assert train.train_and_evaluate(tiny_config(**{"train.steps": 2}), str(workdir)) == {}
  assert "Nothing to do: the checkpoint at step 3 reached train.steps=2" in caplog.text
  assert "Compiled the train step" not in caplog.text
  assert (workdir / "config.json").read_text() == before
