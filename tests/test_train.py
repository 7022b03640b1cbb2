"""Training: errors before compiling, the optimizer and schedule, gradient accumulation, and
the CLI end to end (outputs, bit-exact resume after SIGTERM, refusing another model's workdir)."""

import json
import shutil
import os
import signal
import subprocess
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from electra_jax.errors import ConfigError
import pytest

import electra_jax
from conftest import REPO, cli, cli_args, logged_messages, run_cli, tiny_config
from electra_jax import (
    checkpointing,
    config_lib,
    data,
    flops,
    models,
    objectives,
    optimizer,
    partitioning,
    preemption,
    resolve,
    train,
    train_state,
)

REQUIRED_METRICS = {
    "step",
    "loss",
    "masked_lm_accuracy",
    "masked_lm_loss",
    "sampled_masked_lm_accuracy",
    "disc_loss",
    "disc_auc",
    "disc_accuracy",
    "disc_precision",
    "disc_recall",
    "learning_rate",
    "tokens_per_sec",
    "steps_per_sec",
}


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
    ],
)
def test_bad_config_is_refused_before_any_work(tmp_path, overrides, named):
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=named.replace(".", r"\.")):
    train.train_and_evaluate(tiny_config(**overrides), str(workdir))
  assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


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


def test_a_workdir_that_cannot_be_made_is_refused_before_the_data_is_built(tmp_path, monkeypatch):
  monkeypatch.setattr(
      train.data, "load_pretraining_data", lambda *a, **k: pytest.fail("data was built")
  )
  (tmp_path / "a_file").write_text("not a directory")
  with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file"):
    train.train_and_evaluate(tiny_config(), str(tmp_path / "a_file" / "run"))


def test_learning_rate_schedule_is_the_official_one():
  schedule = optimizer.learning_rate_schedule(1e-3, warmup_steps=10, total_steps=100)
  for step, want in [
      (0, 0.0),
      (5, 1e-3 * 0.5 * 0.95),
      (10, 1e-3 * 0.9),
      (60, 1e-3 * 0.4),
      (100, 0.0),
  ]:
    assert float(schedule(step)) == pytest.approx(want, rel=1e-6, abs=1e-12)  # float32
  # The rate is exactly 0 at the last step and the peak exactly at the warmup's end, whatever the
  # counts (1 - 427 * float32(1 / 427) is 6e-8, not 0).
  for total in (49, 427, 1003, 9973):
    schedule = optimizer.learning_rate_schedule(1e-3, total // 10, total)
    assert float(schedule(total)) == 0.0 and float(schedule(total + 5)) == 0.0, total
    assert float(schedule(total // 10)) == np.float32(1e-3) * (
        (np.float32(total) - total // 10) / np.float32(total)
    )
  with pytest.raises(ValueError, match="total_steps=0"):
    optimizer.learning_rate_schedule(1e-3, 1, 0)


def test_warmup_fraction_takes_its_share_of_the_steps():
  config = tiny_config(
      **{"train.steps": 30, "optimizer.warmup_steps": 2, "optimizer.warmup_fraction": 0.25}
  )
  assert optimizer.warmup_steps(config) == 8  # round(7.5) = 8 (half to even), over warmup_steps=2
  schedule = optimizer.make_schedule(config)
  assert float(schedule(4)) == pytest.approx(1e-3 * 0.5 * (1 - 4 / 30), rel=1e-6)
  config.optimizer.warmup_fraction = 0.0
  assert optimizer.warmup_steps(config) == 2


def test_a_config_built_again_has_the_same_state_structure_so_its_traced_step_is_reused():
  """The optimizer, init and objective are static fields of the state: built again from an equal
  config (a notebook cell run twice, a resume, a sweep's runs) they compare equal, so jax reuses
  the traced and compiled step. train.steps, the warmup and the peak rate are the schedule's
  arrays, an argument of the step: changing them keeps the structure and the traced step; a
  setting that changes the step gives another structure."""
  mesh = partitioning.make_mesh(tiny_config().mesh)
  ids = dict(pad=0, cls=2, sep=3, mask=4)
  first = train_state.build_setup(tiny_config(), mesh, ids)

  def traced(setup):
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), setup.abstract_state)
    batch = {
        k: jax.ShapeDtypeStruct((8, 32), jnp.int32)
        for k in ("input_ids", "token_type_ids", "attention_mask")
    }
    with partitioning.activate(mesh):
      rng = jax.eval_shape(lambda: jax.random.key(0))
      schedule = optimizer.make_schedule(tiny_config())
      return str(jax.make_jaxpr(train_state.train_step)(state, batch, rng, schedule))

  for change in (
      {},
      {"train.steps": 7},
      {"optimizer.learning_rate": 2e-3},
      {"optimizer.warmup_steps": 5},
  ):
    again = train_state.build_setup(tiny_config(**change), mesh, ids)
    assert jax.tree.structure(again.abstract_state) == jax.tree.structure(
        first.abstract_state
    ), change
    assert again.init_fn == first.init_fn and hash(again.init_fn) == hash(first.init_fn), change
    rates = lambda config: tuple(float(optimizer.make_schedule(config)(s)) for s in (1, 6))  # noqa: E731
    assert (rates(tiny_config(**change)) != rates(tiny_config())) == bool(change), change
  assert traced(train_state.build_setup(tiny_config(**{"train.steps": 7}), mesh, ids)) == traced(
      first
  )
  for change in (
      {"optimizer.bias_correction": False},
      {"objective.initial_temperature": 2.0, "objective.temperature_decay_fraction": 0.5},
  ):
    other = train_state.build_setup(tiny_config(**change), mesh, ids)
    assert jax.tree.structure(other.abstract_state) != jax.tree.structure(
        first.abstract_state
    ), change


def test_duration_strings():
  for text, seconds in [
      ("90s", 90),
      ("12m", 720),
      ("4h", 14400),
      ("1h30m", 5400),
      ("1.5h", 5400),
      ("2m30s", 150),
  ]:
    assert train.config_lib.parse_duration(text) == seconds, text


def test_a_saved_config_gets_the_defaults_of_keys_it_predates(tmp_path):
  saved = train.config_lib.as_saved(tiny_config(**{"objective.temperature": 2.0}))
  del (
      saved["model"]["scan_layers"],
      saved["objective"]["initial_temperature"],
      saved["train"]["time_budget"],
  )
  (tmp_path / "config.json").write_text(json.dumps(saved))
  config = train.config_lib.load_workdir_config(str(tmp_path))
  assert config.objective.initial_temperature == 1.0 and config.train.time_budget == ""
  assert config.model.scan_layers is False
  assert config.objective.temperature == 2.0 and config.model.hidden_size == 32  # saved values stay


def test_official_adam_step_by_hand():
  """BERT's AdamWeightDecayOptimizer: no bias correction, decay added to the direction."""
  config = tiny_config(**{"optimizer.bias_correction": False, "optimizer.clip_norm": 1e9})
  tx, schedule = optimizer.make_optimizer(config.optimizer), optimizer.make_schedule(config)
  params = {"dense": {"kernel": jnp.array([[1.0, -2.0]]), "bias": jnp.array([0.5])}}
  grads = {"dense": {"kernel": jnp.array([[0.3, -0.1]]), "bias": jnp.array([0.2])}}
  state = tx.init(params)
  _, state = tx.update(grads, state, params, schedule=schedule)  # step 0 has learning rate 0
  updates, _ = tx.update(grads, state, params, schedule=schedule)
  lr, wd, eps = float(schedule(1)), 0.01, 1e-6

  def by_hand(g, p, decay):
    m = 0.9 * (0.1 * g) + 0.1 * g
    v = 0.999 * (0.001 * g * g) + 0.001 * g * g
    return -lr * (m / (np.sqrt(v) + eps) + (wd * p if decay else 0.0))

  np.testing.assert_allclose(
      updates["dense"]["kernel"],
      by_hand(np.array([[0.3, -0.1]]), np.array([[1.0, -2.0]]), True),
      rtol=1e-5,
  )
  np.testing.assert_allclose(
      updates["dense"]["bias"], by_hand(np.array([0.2]), np.array([0.5]), False), rtol=1e-5
  )


def test_weight_decay_skips_layer_norm_and_biases():
  config = tiny_config()
  model = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32))[
          "params"
      ]
  )
  mask = flax.traverse_util.flatten_dict(
      jax.tree_util.tree_map_with_path(optimizer._decays, params), sep="/"
  )
  decayed = {name for name, on in mask.items() if on}
  assert decayed == {name for name in mask if name.endswith(("/kernel", "/embedding"))}
  assert not any("layer_norm" in name or "bias" in name for name in decayed)
  assert "embeddings/word_embeddings/embedding" in decayed


def _state_and_batch(config):
  corpus = data.load_pretraining_data(config.data)
  tok = corpus.tokenizer
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(
      config, dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  )
  state = nn.meta.unbox(train_state.make_init_fn(config, model, objective)(jax.random.key(0)))
  batch = {
      k: jnp.asarray(v) for k, v in data.get_batch(corpus, 0, config.train.batch_size, 0).items()
  }
  return state, batch, optimizer.make_schedule(config)


def test_gradient_accumulation_equals_the_full_batch():
  no_dropout = {
      "model.dropout_rate": 0.0,
      "model.attention_dropout_rate": 0.0,
      "optimizer.warmup_steps": 1,
  }
  full_state, batch, schedule = _state_and_batch(tiny_config(**no_dropout))
  accum_state = full_state.replace(grad_accum_steps=4)
  rng = train_state.step_rng(0, 3)
  full_state, full_metrics = jax.jit(train_state.train_step)(full_state, batch, rng, schedule)
  accum_state, accum_metrics = jax.jit(train_state.train_step)(accum_state, batch, rng, schedule)
  for name in ("loss", "masked_lm_loss", "disc_loss", "disc_auc", "grad_norm"):
    assert float(accum_metrics[name]) == pytest.approx(float(full_metrics[name]), rel=1e-5), name
  for a, b in zip(jax.tree.leaves(full_state.params), jax.tree.leaves(accum_state.params)):
    np.testing.assert_allclose(a, b, atol=2e-6)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


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


def _signal_after_logged(workdir, overrides: dict, lines: int, signum):
  """(process, stdout, stderr) of a CLI run sent `signum` once metrics.jsonl has `lines` lines."""
  proc = subprocess.Popen(
      cli_args(workdir, **overrides),
      cwd=REPO,
      env=dict(os.environ),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  metrics_file = workdir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and not (
      metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= lines
  ):
    time.sleep(0.02)
  proc.send_signal(signum)
  stdout, stderr = proc.communicate(timeout=300)
  return proc, stdout, stderr


def test_sigterm_saves_and_resume_is_bit_exact(tmp_path):
  steps = 150
  overrides = {"train.steps": steps, "checkpoint.every_steps": 1000}
  reference = tmp_path / "reference"
  assert cli(cli_args(reference, **overrides)).returncode == 0  # in this process: the same numbers

  interrupted = tmp_path / "interrupted"
  proc, _, stderr = _signal_after_logged(interrupted, overrides, 5, signal.SIGTERM)
  assert proc.returncode == 0, stderr[-3000:]
  saved = [int(d) for d in os.listdir(interrupted / "checkpoints")]
  assert len(saved) == 1 and 5 <= saved[0] < steps, saved  # stopped early, saved where it stopped
  assert "SIGTERM" in stderr

  resumed = cli(cli_args(interrupted, **overrides))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resuming from the checkpoint at step" in resumed.stderr
  want, got = _metrics(reference), _metrics(interrupted)
  assert [m["step"] for m in got] == list(range(1, steps + 1))
  for a, b in zip(want, got):
    for name in REQUIRED_METRICS - {"tokens_per_sec", "steps_per_sec"}:
      assert a[name] == b[name], (a["step"], name, a[name], b[name])  # to the last bit


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


def test_mistyped_override_names_the_close_match(tmp_path):
  result = cli(cli_args(tmp_path / "run") + ["--config.train.stpes=5"])
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      "electra-jax: error: --config.train.stpes: the config has no key 'stpes'. Did you mean 'steps'? "
      "configs/base.py lists every key with its default."
  )
  assert "Traceback" not in result.stderr
  result = cli(cli_args(tmp_path / "run") + ["--config.train.num_steps=5"])  # no close match
  assert "error: --config.train.num_steps: the config has no key 'num_steps'." in result.stderr
  assert not (tmp_path / "run").exists()
  # A fine-tuning recipe's keys are listed in its own base.
  result = cli(
      [
          "python",
          "-m",
          "electra_jax.main",
          "--mode=finetune",
          "--config=configs/finetune/tiny.py",
          "--config.epochz=1",
          f"--workdir={tmp_path / 'ft'}",
      ]
  )
  assert (
      result.stderr.strip()
      .splitlines()[-1]
      .endswith("configs/finetune/base.py lists every key with its default.")
  )


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


def test_bfloat16_step_keeps_float32_master_weights_and_learns():
  config = tiny_config(
      **{"train.dtype": "bfloat16", "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
  )
  state, batch, schedule = _state_and_batch(config)
  step = jax.jit(train_state.train_step)
  losses = []
  for i in range(8):
    state, metrics = step(state, batch, train_state.step_rng(0, i), schedule)
    losses.append(float(metrics["loss"]))
  assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
  assert {
      leaf.dtype
      for leaf in jax.tree.leaves(state.opt_state)
      if hasattr(leaf, "dtype") and leaf.ndim
  } == {jnp.dtype("float32")}
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # same batch: the loss must drop


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
    train._warn_single_steps(config, 50)  # divides both: no warning
    assert not caplog.records
    train._warn_single_steps(config, 64)
  assert (
      "train.steps_per_call=64 does not divide train.log_every=100, checkpoint.every_steps=1000"
      in caplog.text
  )


def test_steps_per_call_below_one_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="steps_per_call=0"):
    train.train_and_evaluate(tiny_config(**{"train.steps_per_call": 0}), str(tmp_path))


def test_overrides_apply_to_a_workdirs_own_config(tmp_path):
  # configs/workdir.py:DIR reads DIR/config.json, so a run can go on with overrides.
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(train.config_lib.to_json(tiny_config(**{"train.steps": 4})))
  recipe = os.path.join(REPO, "configs", "workdir.py")
  result = run_cli(
      [
          sys.executable,
          "-c",
          (
              "import sys; from absl import flags; from ml_collections import config_flags;"
              "c = config_flags.DEFINE_config_file('config'); flags.FLAGS(sys.argv);"
              "print(c.value.train.steps, c.value.model.hidden_size)"
          ),
          f"--config={recipe}:{workdir}",
          "--config.train.steps=9",
      ]
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["9", str(tiny_config().model.hidden_size)]
  # Overrides without any --config are answered with that recipe.
  result = cli(cli_args(workdir)[:3] + [f"--workdir={workdir}", "--config.train.steps=9"])
  assert "error: --config.train.steps changes a recipe, but no --config was given" in result.stderr
  assert "--config=configs/workdir.py:DIR" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config=configs/dem.py", "--workdir=W"],
            "--config=configs/dem.py: configs/dem.py is not a file, and no recipe has that name. Give a recipe file or a recipe's name",
        ),
        (["--config=W/config.json", "--workdir=W"], "is a JSON file; --config takes a recipe"),
        (
            ["--config=configs/workdir.py", "--workdir=W"],
            "configs/workdir.py needs the workdir to read, after a colon",
        ),
        (
            ["--config=configs/finetune/tiny.py", "--workdir=W"],
            "--config is a fine-tuning recipe (configs/finetune/), but --mode=train",
        ),
        (
            ["--mode=finetune", "--config=configs/demo.py", "--workdir=W"],
            "--mode=finetune takes a fine-tuning recipe",
        ),
        (["--config=configs/demo.py"], "--mode=train needs --workdir."),
    ],
)
def test_cli_mistakes_end_in_one_line(tmp_path, args, message):
  args = [a.replace("=W", f"={tmp_path}") for a in args]
  result = cli([sys.executable, "-m", "electra_jax.main", *args])
  assert result.returncode != 0 and "Traceback" not in result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("electra-jax: error: ") and message in last, result.stderr[-2000:]
  assert "FATAL" not in result.stderr and "--helpfull" not in result.stderr  # no flag listing


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


# ---------------------------------------------------------------------------------------
# train.time_budget
# ---------------------------------------------------------------------------------------
_FAKE_TIMING = resolve.StepTiming(step=0.5, compile=0.0, evaluation=0.0)


def _fake_budget_clock(monkeypatch, measured=None):
  """A budget clock standing still and a step timing of 0.5 s, so the step count is known:
  floor(budget * 0.97 / 0.5). `measured`, a list, records each timing the run asks for."""
  real = resolve.measure_step_time

  def measure(*args):
    if measured is None:
      pytest.fail("a resume with the same time budget timed the step again")
    measured.append(real(*args))  # the real timing runs too; its figures are not used
    return _FAKE_TIMING

  monkeypatch.setattr(resolve, "_budget_clock", lambda: 0.0)
  monkeypatch.setattr(resolve, "measure_step_time", measure)


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
  assert (
      len(measured) == 1
      and measured[0].step > 0
      and measured[0].compile > 0
      and measured[0].evaluation > 0
  )
  saved = json.loads((workdir / "config.json").read_text())
  assert (
      saved["train"]["steps"] == 9 and saved["train"]["time_budget"] == "5s"
  )  # floor(5 * 0.97 / 0.5)
  lines = _metrics(workdir)
  assert lines[-1]["step"] == 9
  # The last update (from step 8) takes lr / 9; the schedule reaches 0 at step 9.
  assert lines[-1]["learning_rate"] == pytest.approx(1e-3 / 9, rel=1e-5)
  assert float(optimizer.learning_rate_schedule(1e-3, 2, saved["train"]["steps"])(9)) == 0.0
  # The count: compiling again, the steps and their evaluations in 97% of what is left.
  timing = resolve.StepTiming(step=1.0, compile=10.0, evaluation=4.0)
  assert (
      resolve.budget_steps(100.0, 20.0, timing, eval_every=10, start_step=0) == 45
  )  # (67.9 - 4) / 1.4
  assert resolve.budget_steps(100.0, 20.0, timing, eval_every=0, start_step=5) == 5 + 67
  assert (
      resolve.budget_steps(10.0, 20.0, timing, eval_every=0, start_step=5) == 6
  )  # spent: one step


def test_the_time_budget_fixes_train_steps_in_the_resolved_run_without_compiling_again(
    tmp_path, monkeypatch
):
  """The schedule (rate, temperature, two_stage's switch) is an argument of the compiled step, so
  fixing train.steps reuses the step timed, for two_stage too; the steps go into the resolved
  config, and the config given stays as it was."""
  monkeypatch.setattr(
      resolve,
      "measure_step_time",
      lambda *args: resolve.StepTiming(step=0.5, compile=2.0, evaluation=0.0),
  )
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


def test_recipes_by_name_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # not the checkout: configs/ is not here
  recipes = config_lib.RECIPES_DIR
  assert config_lib.resolve_recipe("demo") == f"{recipes}/demo.py"
  assert config_lib.resolve_recipe("finetune/glue.py") == f"{recipes}/finetune/glue.py"
  assert config_lib.resolve_recipe("configs/workdir.py:/runs/a") == f"{recipes}/workdir.py:/runs/a"
  assert (
      config_lib.resolve_recipe("electra_smal") == "electra_smal"
  )  # named by the error that follows
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "demo").write_text("")  # a file of that name is what the user meant
  assert config_lib.resolve_recipe("mine/demo") == "mine/demo"

  # From the CLI, outside the checkout: the recipe is loaded (its keys and its kind are known).
  def elsewhere(*args):
    return cli(
        [sys.executable, "-m", "electra_jax.main", *args, f"--workdir={tmp_path}/w"], cwd=tmp_path
    )

  typo = elsewhere("--config=demo", "--config.train.stpes=1")
  assert "--config.train.stpes: the config has no key 'stpes'" in typo.stderr, typo.stderr[-2000:]
  kind = elsewhere("--config=finetune/tiny")
  assert (
      "is a fine-tuning recipe (configs/finetune/), but --mode=train" in kind.stderr
  ), kind.stderr[-2000:]


def test_a_plain_install_carries_the_recipes(tmp_path):
  # `pip install .`, not editable, from a copy (a build writes build/ into its source).
  source, site = tmp_path / "source", tmp_path / "site"
  for tree in ("electra_jax", "configs"):
    shutil.copytree(
        os.path.join(REPO, tree), source / tree, ignore=shutil.ignore_patterns("__pycache__")
    )
  for file in ("setup.py", "README.md"):
    shutil.copy(os.path.join(REPO, file), source / file)
  installed = subprocess.run(
      [
          sys.executable,
          "-m",
          "pip",
          "install",
          "-q",
          "--no-deps",
          "--no-build-isolation",
          "--target",
          str(site),
          str(source),
      ],
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert installed.returncode == 0, installed.stderr[-2000:]
  shutil.rmtree(source)  # nothing of the checkout is left to fall back on
  env = dict(os.environ, PYTHONPATH=str(site))
  where = subprocess.run(
      [sys.executable, "-c", "from electra_jax import config_lib; print(config_lib.RECIPES_DIR)"],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert where.stdout.strip() == str(site / "electra_jax" / "configs"), where.stderr[-2000:]
  typo = subprocess.run(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--config=demo",
          "--config.train.stpes=1",
          f"--workdir={tmp_path}/w",
      ],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert "--config.train.stpes: the config has no key 'stpes'" in typo.stderr, typo.stderr[-2000:]


def test_ctrl_c_saves_where_it_stops_like_sigterm(tmp_path):
  """Ctrl-C lost every step since the last checkpoint, with a traceback; it now ends the run
  after the step like SIGTERM, and the end summary says where it stopped."""
  workdir = tmp_path / "run"
  proc, stdout, stderr = _signal_after_logged(
      workdir, {"train.steps": 400, "checkpoint.every_steps": 1000}, 3, signal.SIGINT
  )
  assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
  saved = [int(d) for d in os.listdir(workdir / "checkpoints")]
  assert len(saved) == 1 and 3 <= saved[0] < 400, saved
  assert (
      f"Ctrl-C (SIGINT) received: saved a checkpoint at step {saved[0]}; run the same command"
      in stderr
  )
  assert f"Stopped: step {saved[0]} of 400" in stdout
  assert [m["step"] for m in _metrics(workdir)][-1] == saved[0]
