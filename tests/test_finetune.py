"""Fine-tuning: layer-wise learning rates under both rules (hand-computed), the optimizer's
actual update, a tiny model that must learn a synthetic task, and initialization from a
pre-training workdir (weights carried over, tokenizer checked, several seeds summarized)."""

import collections
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import REPO
from conftest import deep_tiny_config as tiny_config
import electra_jax
from electra_jax import config_lib, data, models, partitioning, resolve, train, train_state, workdir_files, workdir_lease
from electra_jax.errors import ConfigError
from electra_jax.finetune import model as model_lib
from electra_jax.finetune import optim, tasks, trainer
from electra_jax.interop import export

finetune_tiny = config_lib.sibling(os.path.join(REPO, "configs", "finetune", "tiny.py"), "tiny")
WORDS = [f"w{i}" for i in range(40)]


def three_layer_params(**options):
  """A classifier tree with 3 layers and the E->H projection, leaves = zeros; `options` go to
  the EncoderConfig (norm=, ffn=, use_bias=)."""
  model = models.EncoderConfig(
      hidden_size=8, num_layers=3, num_heads=2, intermediate_size=16, **options
  )
  classifier = model_lib.ElectraClassifier(
      vocab_size=20,
      embedding_size=4,
      max_position_embeddings=8,
      type_vocab_size=2,
      config=model,
      num_outputs=3,
  )
  ids = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(
      lambda: classifier.init(jax.random.key(0), ids, ids, jnp.ones_like(ids))["params"]
  )
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), flax.linen.meta.unbox(shapes))


def test_layerwise_learning_rates_both_rules():
  params = three_layer_params()
  expected = {
      # depth:            embeddings(0) layer_0(1) layer_1(2) layer_2(3) head(4)
      "correct": dict(emb=0.5**4, l0=0.5**3, l1=0.5**2, l2=0.5**1, head=1.0),
      # official _get_layer_lrs: lr * decay^(n + 2 - depth), head at n + 2, layers at l + 1.
      "official": dict(emb=0.5**5, l0=0.5**4, l1=0.5**3, l2=0.5**2, head=1.0),
  }
  for rule, want in expected.items():
    scales = flax.traverse_util.flatten_dict(
        optim.layerwise_lr_scales(params, 3, 0.5, rule), sep="/"
    )
    assert scales["embeddings/word_embeddings/embedding"] == want["emb"]
    assert scales["embeddings/layer_norm/scale"] == want["emb"]
    assert scales["encoder/embeddings_project/kernel"] == want["emb"]
    assert scales["encoder/layer_0/attention/query/kernel"] == want["l0"]
    assert scales["encoder/layer_1/output_layer_norm/bias"] == want["l1"]
    assert scales["encoder/layer_2/intermediate/kernel"] == want["l2"]
    assert scales["classifier/kernel"] == scales["classifier/bias"] == want["head"]
    values = {name: value for name, value in scales.items()}
    assert set(values.values()) == set(want.values())  # every parameter got one of the five
  config = finetune_tiny.get_config()
  config.optimizer.layerwise_lr_decay_rule = "bert"
  with pytest.raises(ConfigError, match="layerwise_lr_decay_rule='bert': use one of"):
    trainer.validate(config)


def test_pre_layer_norm_final_layer_norm_learns_at_the_top_layers_rate():
  # It normalizes the top layer's output: pre-trained encoder weights, not the new head.
  scales = flax.traverse_util.flatten_dict(
      optim.layerwise_lr_scales(three_layer_params(norm="pre"), 3, 0.5), sep="/"
  )
  assert scales["encoder/final_layer_norm/scale"] == scales["encoder/final_layer_norm/bias"] == 0.5
  assert (
      scales["encoder/layer_2/output_layer_norm/scale"] == 0.5
      and scales["classifier/kernel"] == 1.0
  )


def optimizer_config(**overrides):
  fields = dict(
      learning_rate=0.1,
      warmup_fraction=0.0,
      weight_decay=0.1,
      layerwise_lr_decay=0.5,
      layerwise_lr_decay_rule="correct",
      b1=0.9,
      b2=0.999,
      eps=1e-6,
      clip_norm=1e9,
      bias_correction=True,
  )
  return ml_collections.ConfigDict(dict(optimizer={**fields, **overrides}))


@pytest.mark.parametrize("rule, top_layer_scale", [("correct", 0.5), ("official", 0.25)])
def test_optimizer_update_uses_layer_rates_and_decay_mask(rule, top_layer_scale):
  params = jax.tree.map(jnp.ones_like, three_layer_params())
  grads = jax.tree.map(jnp.ones_like, params)
  config = optimizer_config(layerwise_lr_decay_rule=rule)
  tx, schedule = optim.make_optimizer(config, params, 3), optim.schedule(config, total_steps=10)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params, schedule=schedule)
  updates = flax.traverse_util.flatten_dict(updates, sep="/")
  lr = 0.1 * (1 - 0 / 10)  # step 0, no warmup
  adam = 1 / (1 + 1e-6)  # first bias-corrected Adam step: g / (|g| + eps)
  np.testing.assert_allclose(updates["classifier/kernel"], -lr * (adam + 0.1), rtol=2e-5)
  np.testing.assert_allclose(
      updates["classifier/bias"], -lr * adam, rtol=2e-5
  )  # no decay on biases
  np.testing.assert_allclose(
      updates["encoder/layer_2/output/kernel"], -lr * top_layer_scale * (adam + 0.1), rtol=2e-5
  )
  np.testing.assert_allclose(
      updates["encoder/layer_2/output_layer_norm/scale"], -lr * top_layer_scale * adam, rtol=2e-5
  )
  emb_scale = top_layer_scale * 0.5**3
  np.testing.assert_allclose(
      updates["embeddings/word_embeddings/embedding"], -lr * emb_scale * (adam + 0.1), rtol=2e-5
  )


def write_synthetic(directory, n_train, n_dev, n_test, seed=0):
  """label = whether the word 'magic' occurs in a sentence of random words."""
  rng = np.random.default_rng(seed)

  def make(n, labelled):
    rows = []
    for _ in range(n):
      tokens = list(rng.choice(WORDS, rng.integers(6, 12)))
      label = int(rng.random() < 0.5)
      if label:
        tokens.insert(int(rng.integers(0, len(tokens) + 1)), "magic")
      rows.append(
          {"sentence": " ".join(tokens), **({"label": label} if labelled else {}), "truth": label}
      )
    return rows

  paths = {}
  for split, n, labelled in (
      ("train", n_train, True),
      ("dev", n_dev, True),
      ("test", n_test, False),
  ):
    paths[split] = os.path.join(directory, f"{split}.jsonl")
    with open(paths[split], "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in make(n, labelled))
  return paths


def synthetic_config(tmp_path, n_train=400, n_dev=200, **overrides):
  paths = write_synthetic(tmp_path, n_train, n_dev, 50)
  vocab = tmp_path / "vocab.txt"
  vocab.write_text(
      "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "magic", *WORDS]) + "\n"
  )
  config = finetune_tiny.get_config()
  config.custom.update(train_file=paths["train"], dev_file=paths["dev"], test_file=paths["test"])
  config.tokenizer = str(vocab)
  for key, value in overrides.items():
    config[key] = value
  return config


def test_the_last_batch_is_padded_with_rows_that_do_not_count(tmp_path):
  """One compiled shape: the last batch repeats a row at weight 0, and the step's loss is the
  mean over the real rows only (the same as a batch of those rows alone)."""
  features = {"input_ids": np.arange(6)[:, None], "index": np.arange(6)}
  padded = [
      (b["input_ids"][:, 0].tolist(), b["weights"].tolist()) for b in trainer.batches(features, 4)
  ]
  assert padded == [([0, 1, 2, 3], [1, 1, 1, 1]), ([4, 5, 4, 4], [1, 1, 0, 0])]
  config = synthetic_config(tmp_path, n_train=6, n_dev=4, dropout_rate=0.0, head_dropout_rate=0.0)
  config.attention_dropout_rate = 0.0
  backbone = model_lib.load_backbone(config)
  adapter = tasks.make_adapter(config, backbone)
  train_step, _ = trainer._compiled_steps(config, adapter, backbone)
  params = model_lib.init_params(backbone, adapter.model, jax.random.key(0), config.max_seq_len)
  schedule = optim.schedule(config, 10)
  tx = optim.make_optimizer(config, params, backbone.model.config.num_layers)

  def loss(batch):
    fresh = jax.tree.map(jnp.copy, params)  # the step donates what it is given
    return float(train_step(fresh, tx.init(fresh), batch, jax.random.key(1), 0, schedule)[2])

  rows = adapter.train_features
  a, b = (int(np.flatnonzero(rows["labels"] == label)[0]) for label in (0, 1))
  order = np.array([r for r in range(6) if r not in (a, b)] + [a, b])
  [_, last] = trainer.batches(rows, 4, order)  # rows a and b, then row a twice at weight 0
  take = lambda chosen: next(trainer.batches({k: v[chosen] for k, v in rows.items()}, 2))
  per_row = [loss(take([r])) for r in (a, b)]  # each padded with itself at weight 0
  assert per_row[0] != pytest.approx(per_row[1], rel=1e-2)  # else the weights would not show
  assert loss(last) == pytest.approx(loss(take([a, b])), rel=1e-5)
  assert loss(last) == pytest.approx(np.mean(per_row), rel=1e-5)


def test_random_init_model_learns_synthetic_task(tmp_path):
  config = synthetic_config(tmp_path, keep_epoch="best")
  workdir = tmp_path / "work"
  results = trainer.run_finetune(config, str(workdir))
  accuracy = results["summary"]["custom"]["accuracy"]["best"]
  assert accuracy >= 0.9, results  # chance is ~0.5
  seed_dir = workdir / "custom" / "seed_0"
  metrics = json.loads((seed_dir / "metrics.json").read_text())
  assert len(metrics["history"]) == config.epochs
  assert metrics["dev"]["custom"]["accuracy"] == max(
      h["dev"]["custom"]["accuracy"] for h in metrics["history"]
  )
  assert os.listdir(seed_dir / "checkpoints") == [str(metrics["kept_step"])]  # only the best kept
  from test_plots import read_scalars  # noqa: PLC0415 (TensorBoard gets each epoch's figures too)

  scalars = read_scalars(str(seed_dir / "tensorboard"))
  assert scalars["custom/accuracy"] == {
      h["step"]: pytest.approx(h["dev"]["custom"]["accuracy"]) for h in metrics["history"]
  }
  assert set(scalars["train_loss"]) == {h["step"] for h in metrics["history"]}
  # Test predictions follow the rule on unseen sentences, in the submission format.
  lines = (seed_dir / "predictions" / "custom_test.tsv").read_text().splitlines()
  truth = [json.loads(line)["truth"] for line in open(config.custom.test_file)]
  assert lines[0] == "index\tprediction" and len(lines) == len(truth) + 1
  predicted = [int(line.split("\t")[1]) for line in lines[1:]]
  assert np.mean(np.array(predicted) == np.array(truth)) >= 0.9
  saved = json.loads((workdir / "custom" / "results.json").read_text())
  assert saved["config"]["custom"]["train_file"] == config.custom.train_file

  # Exported, the kept model predicts the same with Hugging Face's classes: logits within 1e-4.
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from electra_jax.finetune import export  # noqa: PLC0415

  out = export.export_hf(str(workdir), str(tmp_path / "hf"))
  hf_dir = str(tmp_path / "hf" / "custom" / "seed_0")
  assert out == {"custom/seed_0": hf_dir}
  hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
  assert hf_model.config.id2label == {0: "0", 1: "1"}
  texts = [json.loads(line)["sentence"] for line in open(config.custom.test_file)]
  inputs = transformers.AutoTokenizer.from_pretrained(hf_dir)(
      texts, padding=True, return_tensors="np"
  )
  _, _, model, _ = export.load_task_model(str(workdir), "custom")
  params = export.restore_seed(str(workdir), "custom", 0, model)
  ours = np.asarray(
      model.apply(
          {"params": params},
          inputs["input_ids"],
          inputs["token_type_ids"],
          inputs["attention_mask"],
      )
  )
  with torch.no_grad():
    theirs = hf_model(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4)
  assert theirs.argmax(-1).tolist() == predicted  # the run's own test predictions
  assert saved["electra_jax_version"] == electra_jax.__version__
  # Running again with another config into the same workdir is refused before the finished
  # seed is touched.
  config.optimizer.learning_rate *= 2
  with pytest.raises(
      ConfigError, match="metrics.json holds the results of another config .*learning_rate"
  ):
    trainer.run_finetune(config, str(workdir))
  assert os.listdir(seed_dir / "checkpoints") == [str(metrics["kept_step"])]
  assert json.loads((seed_dir / "metrics.json").read_text()) == metrics


@pytest.mark.fault
def test_interrupted_multi_seed_run_goes_on_with_the_missing_seeds(tmp_path):
  """A 3-seed run stopped after its first seed (here: the same config with num_seeds=1) is
  re-run: seed 0 is kept as it was, seeds 1 and 2 train, and the results equal an uninterrupted
  3-seed run's. The default keep_epoch="last" keeps the last epoch (the official protocol)."""
  config = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=2, num_seeds=3)
  whole = trainer.run_finetune(config, str(tmp_path / "whole"))

  first = config.copy_and_resolve_references()
  first.num_seeds = 1
  trainer.run_finetune(first, str(tmp_path / "cut"))
  seed0 = tmp_path / "cut" / "custom" / "seed_0"
  before = (seed0 / "metrics.json").read_text()
  checkpoint_files = sorted(str(p) for p in seed0.rglob("*"))
  # An interrupted seed leaves checkpoints but no metrics.json: it starts over.
  (tmp_path / "cut" / "custom" / "seed_1" / "checkpoints" / "999").mkdir(parents=True)
  resumed = trainer.run_finetune(config, str(tmp_path / "cut"))

  assert (seed0 / "metrics.json").read_text() == before
  assert sorted(str(p) for p in seed0.rglob("*")) == checkpoint_files
  for run in (whole, resumed):
    for seed in ("0", "1", "2"):
      assert run["seeds"][seed]["kept_epoch"] == 2  # the last epoch, not the best one
  assert {s: r["dev"] for s, r in resumed["seeds"].items()} == {
      s: r["dev"] for s, r in whole["seeds"].items()
  }
  assert (
      resumed["summary"] == whole["summary"] and resumed["summary"]["custom"]["accuracy"]["n"] == 3
  )
  seed1 = json.loads((tmp_path / "cut" / "custom" / "seed_1" / "metrics.json").read_text())
  assert seed1["dev"] == seed1["history"][-1]["dev"]
  assert os.listdir(tmp_path / "cut" / "custom" / "seed_1" / "checkpoints") == [
      str(seed1["history"][-1]["step"])
  ]


@pytest.mark.fault
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_keeps_the_finished_seeds_releases_the_lease_and_says_so(tmp_path, signum):
  """SIGTERM (a preempted VM), SIGHUP (a closed terminal) or Ctrl-C once a seed has finished: that seed's results stay as
  written, the lease is released, one line says what happened, and the exit code is not 0."""
  paths = write_synthetic(tmp_path, 400, 100, 8)
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "magic", *WORDS]))
  out = tmp_path / "ft"
  args = [sys.executable, "-m", "electra_jax.main", "--mode=finetune"]
  args += [f"--config={REPO}/configs/finetune/tiny.py", f"--workdir={out}"]
  args += [f"--config.custom.{k}_file={paths[k]}" for k in ("train", "dev")]
  args += [f"--config.tokenizer={vocab}", "--config.num_seeds=6", "--config.epochs=8"]
  run = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  seed0 = out / "custom" / "seed_0" / "metrics.json"
  deadline = time.time() + 300
  while not seed0.exists() and run.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  finished = seed0.read_text()
  run.send_signal(signum)
  _, stderr = run.communicate(timeout=300)
  assert run.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
  name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
  line = stderr.strip().splitlines()[-1]
  assert line.startswith(f"Fine-tuning stopped by {name}") and str(out / "custom") in line, line
  assert "seed_5" not in os.listdir(out / "custom") and seed0.read_text() == finished
  lease = json.loads((out / "custom" / workdir_lease.LEASE_FILE).read_text())
  assert lease["released"] is True


@pytest.mark.fault
@pytest.mark.parametrize(
    "key, value, named",
    [
        ("tokenizer", "", "needs config.tokenizer"),
        ("task", "colaa", "Unknown task 'colaa'"),
        ("optimizer.learning_rate", -1.0, "optimizer.learning_rate=-1.0 must be > 0"),
        ("optimizer.weight_decay", -3.0, "optimizer.weight_decay=-3.0 must be >= 0"),
        ("keep_epoch", "first", "config.keep_epoch='first'"),
        ("dropout_rate", 1.0, r"config.dropout_rate=1.0 must be in \[0, 1\)"),
        ("custom.label_column", "stars", "no column 'stars'"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, key, value, named):
  config = synthetic_config(tmp_path)
  group, _, name = key.rpartition(".")
  (config[group] if group else config)[name] = value
  with pytest.raises(ConfigError, match=named):
    trainer.run_finetune(config, str(tmp_path / "w"))
  assert not (tmp_path / "w" / "custom").exists()


@pytest.fixture(scope="module")
def pretrained_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  config = tiny_config(**{"train.steps": 2, "checkpoint.every_steps": 2, "eval.every_steps": 0})
  train.train_and_evaluate(config, workdir)
  return workdir, config


@pytest.mark.fault
def test_init_from_a_workdir_without_checkpoints_is_refused_by_name(tmp_path, pretrained_workdir):
  workdir = tmp_path / "pretrain"
  shutil.copytree(pretrained_workdir[0], workdir)
  shutil.rmtree(workdir / "checkpoints" / "2")
  config = synthetic_config(tmp_path, n_train=16, n_dev=8, init_from=str(workdir), tokenizer="")
  with pytest.raises(
      ConfigError, match=f"^{workdir}/checkpoints holds no checkpoint yet; pre-train"
  ):
    model_lib.load_backbone(config)


def test_init_from_pretraining_workdir(tmp_path, pretrained_workdir):
  workdir, pretrain_config = pretrained_workdir
  config = synthetic_config(
      tmp_path, n_train=64, n_dev=32, init_from=workdir, tokenizer="", num_seeds=2, epochs=1
  )
  backbone = model_lib.load_backbone(config)
  classifier = backbone.classifier(2, config)
  params = model_lib.init_params(backbone, classifier, jax.random.key(0), config.max_seq_len)

  # What the checkpoint holds, read independently of the fine-tuning code.
  mesh = partitioning.make_mesh(
      ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)), devices=jax.devices()[:1]
  )
  tok = backbone.tokenizer
  setup = train_state.build_setup(
      pretrain_config, mesh, dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  )
  _, state = resolve.restore_checkpoint(workdir, setup, mesh)
  jax.tree.map(np.testing.assert_array_equal, params["embeddings"], state.params["embeddings"])
  jax.tree.map(
      np.testing.assert_array_equal, params["encoder"], state.params["discriminator"]["encoder"]
  )
  assert backbone.model.config.hidden_size == pretrain_config.model.hidden_size

  config.random_init = True
  fresh = model_lib.init_params(
      model_lib.load_backbone(config), classifier, jax.random.key(0), config.max_seq_len
  )
  assert not np.allclose(
      fresh["encoder"]["layer_0"]["attention"]["query"]["kernel"],
      params["encoder"]["layer_0"]["attention"]["query"]["kernel"],
  )
  config.random_init = False

  results = trainer.run_finetune(config, str(tmp_path / "ft"))
  per_seed = [results["seeds"][s]["dev"]["custom"]["accuracy"] for s in ("0", "1")]
  summary = results["summary"]["custom"]["accuracy"]
  assert summary["n"] == 2
  assert summary["mean"] == pytest.approx(np.mean(per_seed)) and summary["best"] == max(per_seed)
  assert summary["median"] == pytest.approx(np.median(per_seed))

  # A tokenizer other than the pre-training one is refused before anything is trained.
  config.tokenizer = str(tmp_path / "vocab.txt")
  with pytest.raises(ConfigError, match="differs from the one the checkpoint"):
    model_lib.load_backbone(config)  # run_finetune's first step after validating the config


def test_a_moved_workdir_fine_tunes_and_exports_without_the_corpus_that_trained_its_tokenizer(
    tmp_path,
):
  """Pre-training keeps its tokenizer in the workdir (spm.model, byte for byte), so a workdir moved
  to another folder or machine, its corpus left behind, gives fine-tuning and export that tokenizer.
  """
  corpus = tmp_path / "corpus.txt"
  corpus.write_text(
      "\n\n".join("\n".join(document) for document in data.builtin_documents(120)) + "\n"
  )
  config = tiny_config(
      **{
          "data.source": "text",
          "data.files": str(corpus),
          "train.steps": 1,
          "checkpoint.every_steps": 1,
          "eval.every_steps": 0,
      }
  )
  train.train_and_evaluate(config, str(tmp_path / "pretrain"))
  trained = data.load_tokenizer(
      config.data
  )  # the one the cache trained on the corpus, which the run used
  with open(trained.model_path, "rb") as f:
    assert (tmp_path / "pretrain" / "spm.model").read_bytes() == f.read()

  corpus.unlink()
  moved = tmp_path / "moved"
  shutil.move(tmp_path / "pretrain", moved)
  with pytest.raises(ConfigError, match="matches no file"):
    data.load_tokenizer(config.data)  # what reading the workdir needed before it kept its tokenizer
  backbone = model_lib.load_backbone(
      synthetic_config(tmp_path, n_train=16, n_dev=8, init_from=str(moved), tokenizer="")
  )
  assert backbone.tokenizer.fingerprint == trained.fingerprint and backbone.params is not None
  written = export.export_workdir(str(moved), str(tmp_path / "hf"))
  assert (tmp_path / "hf" / "discriminator" / "spm.model").read_bytes() == (
      moved / "spm.model"
  ).read_bytes()
  assert set(written) == {"discriminator"}


def test_init_from_a_workdir_with_encoder_options_keeps_them(tmp_path):
  """A pre-LN, GEGLU, bias-free pre-training run fine-tunes with that very encoder: its saved
  config builds it and the checkpoint's encoder (final LayerNorm included) fills it."""
  options = {
      "model.norm": "pre",
      "model.ffn": "geglu",
      "model.use_bias": False,
      "model.attention_conv": 3,
  }
  workdir = str(tmp_path / "pretrain")
  pretrain_config = tiny_config(
      **options, **{"train.steps": 1, "checkpoint.every_steps": 1, "eval.every_steps": 0}
  )
  train.train_and_evaluate(pretrain_config, workdir)
  config = synthetic_config(tmp_path, n_train=16, n_dev=8, init_from=workdir, tokenizer="")
  backbone = model_lib.load_backbone(config)
  classifier = backbone.classifier(2, config)
  assert (
      classifier.config.norm,
      classifier.config.ffn,
      classifier.config.use_bias,
      classifier.config.attention_conv,
  ) == ("pre", "geglu", False, 3)
  params = model_lib.init_params(backbone, classifier, jax.random.key(0), config.max_seq_len)
  mesh = partitioning.make_mesh(
      ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)), devices=jax.devices()[:1]
  )
  tok = backbone.tokenizer
  setup = train_state.build_setup(
      pretrain_config, mesh, dict(pad=tok.pad_id, cls=tok.cls_id, sep=tok.sep_id, mask=tok.mask_id)
  )
  _, state = resolve.restore_checkpoint(workdir, setup, mesh)
  jax.tree.map(
      np.testing.assert_array_equal, params["encoder"], state.params["discriminator"]["encoder"]
  )
  jax.tree.map(np.testing.assert_array_equal, params["embeddings"], state.params["embeddings"])
  assert (
      "final_layer_norm" in params["encoder"]
      and "bias" not in params["encoder"]["layer_0"]["intermediate"]
  )
  ids = jnp.full((2, config.max_seq_len), tok.cls_id, jnp.int32)
  logits = classifier.apply({"params": params}, ids, jnp.zeros_like(ids), jnp.ones_like(ids))
  assert logits.shape == (2, 2) and np.isfinite(np.asarray(logits)).all()

  # reinit_layers=1: the top layer and the final LayerNorm are the fresh draw of the same key
  # (what random_init gives), everything below them the checkpoint's (shifted by 1 here, so no
  # leaf of it can equal a fresh one by chance).
  fresh = model_lib.init_params(
      dataclasses.replace(backbone, params=None), classifier, jax.random.key(0), config.max_seq_len
  )
  shifted = dataclasses.replace(backbone, params=jax.tree.map(lambda x: x + 1.0, backbone.params))
  pretrained = model_lib.init_params(shifted, classifier, jax.random.key(0), config.max_seq_len)
  reinit = model_lib.init_params(
      shifted, classifier, jax.random.key(0), config.max_seq_len, reinit_layers=1
  )
  top = f"layer_{pretrain_config.model.num_layers - 1}"
  assert {top, "final_layer_norm", "layer_0"} <= set(reinit["encoder"])
  for name, tree in reinit["encoder"].items():
    source = fresh if name in (top, "final_layer_norm") else pretrained
    jax.tree.map(np.testing.assert_array_equal, tree, source["encoder"][name])
  jax.tree.map(np.testing.assert_array_equal, reinit["embeddings"], pretrained["embeddings"])
  config.reinit_layers = pretrain_config.model.num_layers + 1
  with pytest.raises(
      ConfigError,
      match=f"config.reinit_layers={config.reinit_layers} exceeds the encoder's "
      f"{pretrain_config.model.num_layers} layers",
  ):
    trainer.run_finetune(config, str(tmp_path / "ft"))
  assert not (tmp_path / "ft" / "custom").exists()


def test_glue_run_writes_submission_files(tmp_path):
  """MNLI from GLUE's layout end to end: both dev sets evaluated, both test files written
  under GLUE's submission names with label strings."""
  from test_finetune_tasks import write_glue

  write_glue(tmp_path / "glue")
  mnli = tmp_path / "glue" / "MNLI"
  (mnli / "test_mismatched.tsv").write_text((mnli / "test_matched.tsv").read_text())
  vocab = tmp_path / "vocab.txt"
  vocab.write_text(
      "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "dog", "cat", "sat"])
      + "\n"
  )
  config = finetune_tiny.get_config()
  config.update(task="mnli", data_dir=str(tmp_path / "glue"), tokenizer=str(vocab), epochs=1)
  results = trainer.run_finetune(config, str(tmp_path / "work"))
  assert set(results["summary"]) == {"mnli-m", "mnli-mm"}
  predictions = tmp_path / "work" / "mnli" / "seed_0" / "predictions"
  assert sorted(os.listdir(predictions)) == ["MNLI-m.tsv", "MNLI-mm.tsv"]
  lines = (predictions / "MNLI-m.tsv").read_text().splitlines()
  assert lines[0] == "index\tprediction" and lines[1].split("\t")[0] == "0"
  assert lines[1].split("\t")[1] in ("contradiction", "entailment", "neutral")


def test_official_epoch_defaults():
  config = finetune_tiny.get_config()
  config.epochs = 0
  for task, epochs in (("rte", 10), ("STS-B", 10), ("cola", 3), ("mnli", 3), ("squad2.0", 2)):
    config.task = task
    assert trainer.resolve_epochs(config, 100)[0] == epochs
  config.epochs = 7
  assert trainer.resolve_epochs(config, 100)[0] == 7


def test_finetune_from_the_command_line(tmp_path, pretrained_workdir):
  """--mode=finetune from a pre-training workdir, as the README runs it."""
  from conftest import cli  # noqa: PLC0415

  workdir, _ = pretrained_workdir
  paths = write_synthetic(tmp_path, 64, 32, 8)
  out = tmp_path / "ft"
  result = cli(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--mode=finetune",
          f"--config={REPO}/configs/finetune/tiny.py",
          f"--config.custom.train_file={paths['train']}",
          f"--config.custom.dev_file={paths['dev']}",
          f"--config.init_from={workdir}",
          "--config.epochs=1",
          f"--workdir={out}",
      ]
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"Results: {out}/custom/results.json" in result.stdout
  saved = json.loads((out / "custom" / "results.json").read_text())
  assert 0.0 <= saved["summary"]["custom"]["accuracy"]["mean"] <= 1.0
  bad = cli([sys.executable, "-m", "electra_jax.main", "--mode=finetune", f"--workdir={out}"])
  assert bad.returncode != 0 and "--mode=finetune needs --config" in bad.stderr


def test_stsb_regression_trains_on_targets_scaled_as_the_official_code(tmp_path):
  """The official RegressionTask trains STS-B on (score - 0) / 5, so the MSE is taken against
  targets in [0, 1]; predictions are read back on GLUE's 0..5 scale for the submission file."""
  from electra_jax.finetune import tasks
  from test_finetune_tasks import glue_config, write_glue

  write_glue(tmp_path / "glue")
  data = tasks.load_task(glue_config("stsb", tmp_path / "glue"))
  data.test = {"STS-B": data.dev["stsb"]}
  vocab = tmp_path / "vocab.txt"
  vocab.write_text(
      "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "dog", "ran"]) + "\n"
  )
  config = finetune_tiny.get_config()
  config.update(task="stsb", tokenizer=str(vocab))
  backbone = model_lib.load_backbone(config)
  adapter = tasks.make_adapter(config, backbone, data)
  labels = jnp.array([4.5, 0.75, 2.0])
  outputs = jnp.array([[0.9], [0.15], [0.0]])
  np.testing.assert_allclose(
      adapter.loss_fn(outputs, {"labels": labels}), [0.0, 0.0, 0.16], atol=1e-6
  )
  written = adapter.write_test(
      lambda features: np.full((len(features["input_ids"]), 1), 0.5, np.float32),
      str(tmp_path / "predictions"),
  )
  lines = open(written[0]).read().splitlines()
  assert lines[1].split("\t")[1] == "2.500"  # 0.5 on the [0, 1] scale the model learned


def _assert_glorot_uniform(kernel, fan_in, fan_out):
  """Glorot (Xavier) uniform: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out))."""
  kernel = np.asarray(kernel)
  limit = np.sqrt(6.0 / (fan_in + fan_out))
  assert np.abs(kernel).max() <= limit
  assert (
      np.abs(kernel).max() > 0.8 * limit
  )  # bert_init's N(0, 0.02) cut at 2 sigma stays below 0.04
  np.testing.assert_allclose(kernel.std(), limit / np.sqrt(3.0), rtol=0.2)


def test_task_heads_start_from_the_official_glorot_uniform_init():
  """The official heads are tf.layers.dense with no initializer: TF1's default glorot_uniform
  (the encoder's truncated normal 0.02 covers only the pre-trained weights)."""
  from electra_jax.finetune import squad

  hidden_size = 64
  encoder = models.EncoderConfig(
      hidden_size=hidden_size, num_layers=1, num_heads=2, intermediate_size=32
  )
  ids = jnp.zeros((1, 8), jnp.int32)
  classifier = model_lib.ElectraClassifier(
      vocab_size=20,
      embedding_size=hidden_size,
      max_position_embeddings=8,
      type_vocab_size=2,
      config=encoder,
      num_outputs=3,
  )
  params = flax.linen.meta.unbox(
      classifier.init(jax.random.key(0), ids, ids, jnp.ones_like(ids))["params"]
  )
  _assert_glorot_uniform(params["classifier"]["kernel"], hidden_size, 3)

  head = squad.SpanHead(answerable=True)
  hidden = jnp.zeros((1, 8, hidden_size))
  head_params = flax.linen.meta.unbox(
      head.init(jax.random.key(1), hidden, ids, jnp.ones_like(ids))["params"]
  )
  # Official: separate dense(H -> 1) layers for the start and the end logits.
  for column in range(2):
    _assert_glorot_uniform(head_params["span_logits"]["kernel"][:, column], hidden_size, 1)
  _assert_glorot_uniform(head_params["answerable_hidden"]["kernel"], 2 * hidden_size, 512)
  _assert_glorot_uniform(head_params["answerable_logit"]["kernel"], 512, 1)


@pytest.mark.fault
def test_another_config_does_not_replace_the_results_of_the_first(tmp_path):
  """A second config fine-tuned into the same workdir with other seeds (so no finished seed
  is in the way) used to replace <task>/results.json, the first config's table, with its own."""
  config = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=1)
  trainer.run_finetune(config, str(tmp_path / "work"))
  results = tmp_path / "work" / "custom" / "results.json"
  before = results.read_text()
  other = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=1, seed=5)
  other.optimizer.learning_rate *= 2
  with pytest.raises(ConfigError, match="results.json holds the results of another config"):
    trainer.run_finetune(other, str(tmp_path / "work"))
  assert results.read_text() == before
  assert not (tmp_path / "work" / "custom" / "seed_5").exists()
  # The same config with more seeds still goes on in that workdir.
  more = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=1, num_seeds=2)
  assert (
      trainer.run_finetune(more, str(tmp_path / "work"))["summary"]["custom"]["accuracy"]["n"] == 2
  )


# (name, file, its text given the run's config as saved, what the refusal says)
_SEED = dict(kept_epoch=1, test_predictions=[], dev={"custom": {"accuracy": 0.5, "score": 0.5}})
_HEAD = {"kind": "span", "answerable": True}
EDITED_FILES = [
    ("results not an object", "results.json", lambda c: "[]", "TypeError: list indices"),
    (
        "results config of another type",
        "results.json",
        lambda c: json.dumps({"config": dict(c, epochs="x"), "head": _HEAD, "seeds": {}}),
        "epochs='x' is of type str",
    ),
    (
        "results unknown key",
        "results.json",
        lambda c: json.dumps({"config": dict(c, epoks=1), "head": _HEAD, "seeds": {}}),
        "epoks is no key",
    ),
    (
        "results value out of range",
        "results.json",
        lambda c: json.dumps({"config": dict(c, epochs=-1), "head": _HEAD, "seeds": {}}),
        r"config.epochs=-1 must be an int >= 0",
    ),
    (
        "results without a head",
        "results.json",
        lambda c: json.dumps({"config": c, "seeds": {}}),
        "KeyError: 'head'",
    ),
    ("metrics not an object", "seed_0/metrics.json", lambda c: '"done"', "lacks"),
    (
        "metrics without dev",
        "seed_0/metrics.json",
        lambda c: json.dumps({"config": c}),
        r"lacks \['dev', 'kept_epoch'",
    ),
    (
        "metrics with a text score",
        "seed_0/metrics.json",
        lambda c: json.dumps(dict(_SEED, config=c, dev={"custom": {"score": "high"}})),
        "are not all numbers",
    ),
    (
        "metrics config of another type",
        "seed_0/metrics.json",
        lambda c: json.dumps(dict(_SEED, config=dict(c, head={"pooling": 1}))),
        "head.pooling=1 is of type int",
    ),
]


@pytest.mark.fault
@pytest.mark.parametrize(
    "file, text, named", [c[1:] for c in EDITED_FILES], ids=[c[0] for c in EDITED_FILES]
)
def test_an_edited_results_or_metrics_file_is_refused_naming_it(tmp_path, file, text, named):
  """A results.json or a finished seed's metrics.json a person edited is refused by the one reader
  of our files, naming the file and what is wrong, before anything trains or is written."""
  config = synthetic_config(tmp_path, n_train=16, n_dev=8, epochs=1)
  path = tmp_path / "w" / "custom" / file
  path.parent.mkdir(parents=True)
  path.write_text(text(config_lib.as_saved(config)))
  with pytest.raises(ConfigError, match=f"{path} is not as electra-jax writes it .*{named}"):
    trainer.run_finetune(config, str(tmp_path / "w"))
  assert sorted(p.name for p in (tmp_path / "w").rglob("*")) == sorted(["custom", *file.split("/")])


@pytest.mark.fault
@pytest.mark.parametrize(
    "key, value, named",
    [
        ("num_heads", 0, "config.model.num_heads=0 must be >= 1"),  # was a ZeroDivisionError
        (
            "hidden_size",
            33,
            "config.model.hidden_size=33 is not divisible by config.model.num_heads=2",
        ),
        ("intermediate_size", 0, "config.model.intermediate_size=0 must be >= 1"),
    ],
)
def test_random_init_sizes_are_refused_by_name_before_training(tmp_path, key, value, named):
  config = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=1)
  config.model[key] = value
  with pytest.raises(ConfigError, match=named):
    trainer.run_finetune(config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


@pytest.mark.fault
def test_a_workdir_that_cannot_be_made_is_refused_before_anything_loads(tmp_path, monkeypatch):
  """A --workdir under a file (or an unwritable directory) was an OSError traceback from
  os.makedirs, after the data and the backbone were loaded."""
  config = synthetic_config(tmp_path, n_train=48, n_dev=24, epochs=1)
  monkeypatch.setattr(
      trainer.model_lib, "load_backbone", lambda *a, **k: pytest.fail("backbone loaded")
  )
  (tmp_path / "a_file").write_text("not a directory")
  with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file"):
    trainer.run_finetune(config, str(tmp_path / "a_file" / "work"))


def tiny_classifier(pooling):
  encoder = models.EncoderConfig(
      hidden_size=8, num_layers=2, num_heads=2, intermediate_size=16, attention_conv=3
  )
  return model_lib.ElectraClassifier(
      vocab_size=20,
      embedding_size=8,
      max_position_embeddings=8,
      type_vocab_size=2,
      config=encoder,
      num_outputs=3,
      pooling=pooling,
  )


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_head_pooling_by_hand_and_blind_to_padding(pooling):
  """head.pooling: "cls" is the first token's final state (the official head), "mean" the mean
  over the real tokens; either way a padded position's id changes nothing, nor does cutting the
  padding off (tasks.encode_examples pads to the longest row only)."""
  mask = jnp.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], jnp.int32)
  ids = jnp.array([[2, 5, 6, 7, 3, 0, 0, 0], [2, 9, 3, 0, 0, 0, 0, 0]], jnp.int32)
  types = jnp.zeros_like(ids)
  model = tiny_classifier(pooling)
  params = flax.linen.meta.unbox(model.init(jax.random.key(0), ids, types, mask)["params"])
  logits = model.apply({"params": params}, ids, types, mask)

  hidden = np.asarray(
      model.apply(
          {"params": params},
          ids,
          types,
          mask,
          method=lambda m, i, t, a: m.encoder(m.embeddings(i, t, True), a, True),
      )
  )
  m = np.asarray(mask, np.float32)[..., None]
  pooled = (hidden * m).sum(1) / m.sum(1) if pooling == "mean" else hidden[:, 0]
  expected = pooled @ np.asarray(params["classifier"]["kernel"]) + np.asarray(
      params["classifier"]["bias"]
  )
  np.testing.assert_allclose(logits, expected, atol=1e-5)

  other_padding = jnp.where(mask == 1, ids, 11)
  np.testing.assert_allclose(
      model.apply({"params": params}, other_padding, types, mask), logits, atol=1e-6
  )
  trimmed = [x[:, :5] for x in (ids, types, mask)]
  np.testing.assert_allclose(model.apply({"params": params}, *trimmed), logits, atol=1e-5)
  if pooling == "mean":  # the same weights under the first-token head read something else
    assert not np.allclose(
        tiny_classifier("cls").apply({"params": params}, ids, types, mask), logits, atol=1e-3
    )
  assert model_lib.ElectraClassifier.pooling == "cls"  # the official head unless asked


def test_min_steps_raises_the_epochs_and_the_schedule_spans_them(tmp_path, monkeypatch):
  """40 examples at batch 16 are ceil(40/16) = 3 steps an epoch: min_steps=7 turns 1 epoch
  into ceil(7/3) = 3, and the warmup/decay schedule is built for those 9 steps."""
  totals = []
  schedule = optim.schedule

  def recording(config, total_steps, learning_rate=None):
    totals.append(total_steps)
    return schedule(config, total_steps, learning_rate)

  monkeypatch.setattr(trainer.optim, "schedule", recording)
  config = synthetic_config(tmp_path, n_train=40, n_dev=16, epochs=1, min_steps=7)
  results = trainer.run_finetune(config, str(tmp_path / "work"))
  metrics = json.loads((tmp_path / "work" / "custom" / "seed_0" / "metrics.json").read_text())
  assert (results["epochs"], results["steps_per_seed"], totals) == (3, 9, [9])
  assert (metrics["epochs"], metrics["steps"]) == (3, 9)
  assert [h["step"] for h in metrics["history"]] == [3, 6, 9]
  assert results["config"]["epochs"] == 1 and results["config"]["min_steps"] == 7  # what was asked


def test_resolve_epochs():
  config = ml_collections.ConfigDict(dict(task="rte", epochs=0, batch_size=16, min_steps=0))
  assert trainer.resolve_epochs(config, 100) == (10, 70)  # off: RTE's official 10 epochs of 7 steps
  config.min_steps = 70
  assert trainer.resolve_epochs(config, 100) == (10, 70)  # 70 steps already
  config.min_steps = 71
  assert trainer.resolve_epochs(config, 100) == (11, 77)  # ceil(71 / 7)
  config.update(epochs=2, min_steps=1000)
  assert trainer.resolve_epochs(config, 2000) == (8, 1000)  # ceil(1000 / 125)


@pytest.mark.fault
@pytest.mark.parametrize(
    "task, key, value, named",
    [
        (
            "custom",
            "head.pooling",
            "max",
            r"config.head.pooling='max': use one of \['cls', 'mean'\]",
        ),
        ("squad2.0", "head.pooling", "mean", "config.head.pooling='mean': SQuAD's span head pools"),
        ("custom", "min_steps", -5, "config.min_steps=-5 must be an int >= 0"),
        ("custom", "reinit_layers", -1, "config.reinit_layers=-1 must be an int >= 0"),
        ("custom", "reinit_layers", True, "config.reinit_layers=True must be an int >= 0"),
        ("custom", "optimizer.learning_rate", float("inf"), "learning_rate=inf is not a finite"),
        ("custom", "optimizer.layerwise_lr_decay", float("nan"), "layerwise_lr_decay=nan is not a"),
        (
            "custom",
            "optimizer.layerwise_lr_decay",
            0.0,
            r"layerwise_lr_decay=0.0 must be in \(0, 1\]",
        ),
        ("custom", "optimizer.warmup_fraction", 1.0, r"warmup_fraction=1.0 must be in \[0, 1\)"),
        ("custom", "optimizer.layerwise_lr_decay_rule", "paper", "rule='paper': use one of"),
        ("custom", "batch_size", 0, "config.batch_size=0 must be an int >= 1"),
        ("custom", "num_seeds", 0, "config.num_seeds=0 must be an int >= 1"),
        ("custom", "max_seq_len", 2, "config.max_seq_len=2 must be an int >= 3"),
        ("custom", "epochs", True, "config.epochs=True must be an int >= 0"),
        ("custom", "source", "hub", r"config.source='hub': use one of \['dir', 'tfds'\]"),
        ("custom", "dtype", "float8", "config.dtype='float8': use one of"),
        ("custom", "custom.kind", "ranking", "config.custom.kind='ranking': use one of"),
        ("custom", "select.fraction", 1.0, r"select.fraction=1.0 must be in \(0, 1\)"),
        ("squad2.0", "squad.doc_stride", 0, "config.squad.doc_stride=0 must be >= 1"),
        ("squad3.0", "task", "squad3.0", "config.task='squad3.0': for SQuAD use 'squad1.1' or"),
        ("squad1.1", "max_seq_len", 40, "config.max_seq_len=40 leaves no room for the context"),
    ],
)
def test_bad_fine_tuning_values_are_refused_by_name(task, key, value, named):
  config = finetune_tiny.get_config()
  config.task = task
  config.select.learning_rates = "1e-3" if key == "select.fraction" else ""
  group, _, name = key.rpartition(".")
  (config[group] if group else config)[name] = value
  with pytest.raises(ConfigError, match=named):
    trainer.validate(config)


@pytest.mark.fault
def test_the_keys_a_seed_depends_on_make_another_config(tmp_path):
  """A finished seed or results table of min_steps=0 is another config's for min_steps=1000, and so
  for head.pooling, custom.group_column and select.folds; its seed and log_every change nothing."""
  config = finetune_tiny.get_config()
  for key, value in (
      ("min_steps", 1000),
      ("head.pooling", "mean"),
      ("custom.group_column", "page"),
      ("select.folds", 2),
  ):
    variant = config.copy_and_resolve_references()
    group, _, name = key.rpartition(".")
    (variant[group] if group else variant)[name] = value
    with pytest.raises(ConfigError, match=rf"x.json holds the results of another config \({key}: "):
      trainer._refuse_another_config("x.json", config, variant)
  same = config.copy_and_resolve_references()
  same.seed, same.num_seeds, same.log_every = 9, 4, 3
  trainer._refuse_another_config("x.json", config, same)


@pytest.mark.fault
def test_a_second_run_on_the_same_task_folder_is_refused_before_it_deletes_anything(tmp_path):
  """Each seed starts by deleting its checkpoints: two runs of one task in one workdir used to
  pull them from under each other. The task folder now has one run at a time."""
  config = synthetic_config(tmp_path, n_train=16, n_dev=8, epochs=1, num_seeds=1)
  task_dir = tmp_path / "w" / "custom"
  kept = task_dir / "seed_0" / "checkpoints" / "7"
  kept.mkdir(parents=True)
  holder = dict(
      run_id="otherrun1234",
      host="elsewhere",
      pid=1,
      started="now",
      heartbeat=time.time(),
      released=False,
  )
  (task_dir / workdir_lease.LEASE_FILE).write_text(json.dumps(holder))
  with pytest.raises(
      workdir_lease.WorkdirInUse, match="in use by run otherrun1234 on host elsewhere"
  ):
    trainer.run_finetune(config, str(tmp_path / "w"))
  assert kept.exists()
  (task_dir / workdir_lease.LEASE_FILE).write_text(json.dumps(dict(holder, released=True)))
  trainer.run_finetune(config, str(tmp_path / "w"))  # the other run has ended: this one goes
  assert (
      not kept.exists()
      and json.loads((task_dir / workdir_lease.LEASE_FILE).read_text())["released"]
  )


_API_SCRIPT = """
import json, sys
from electra_jax import api
from electra_jax.errors import ConfigError
workdir, finetuned, hf, overrides, train_file, dev_file = sys.argv[1:]
try:
  api.load_config("demo", {"train.stpes": 4})
except ConfigError as error:
  print(json.dumps({"typo": str(error)}))
config = api.load_config("demo", json.loads(overrides))
print(json.dumps({"sizes": [config.objective.temperature, config.train.steps, config.model.hidden_size]}))
print(json.dumps({"pretrain": api.pretrain(config, workdir)}))
print(json.dumps({"evaluate": api.evaluate(workdir)}))
finetuning = api.load_config("finetune/tiny", {"init_from": workdir, "epochs": 1, "custom.train_file": train_file,
                                               "custom.dev_file": dev_file})
print(json.dumps({"finetune": api.finetune(finetuning, finetuned)["summary"]}))
print(json.dumps({"export": api.export_hf(workdir, hf)}))
print(json.dumps({"export_finetuned": api.export_hf(finetuned, hf + "_finetuned")}))
"""


def test_the_python_api_pretrains_evaluates_finetunes_and_exports_the_demo(tmp_path, monkeypatch):
  # In a process of its own, as a notebook's: the API turns on absl's logging process-wide.
  from conftest import TINY_OVERRIDES, run_cli  # noqa: PLC0415

  overrides = {
      **TINY_OVERRIDES,
      "train.steps": 4,
      "checkpoint.every_steps": 4,
      "eval.every_steps": 4,
      "objective.temperature": 1.5,
      "train.log_every": 2,
      "train.metric_writers": "mlflow",
  }
  paths = write_synthetic(tmp_path, 64, 32, 8)
  workdir, finetuned, hf = tmp_path / "pretrained", tmp_path / "finetuned", tmp_path / "hf"
  mlflow_env = {
      "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
      "MLFLOW_ALLOW_FILE_STORE": "true",
  }
  done = run_cli(
      [
          sys.executable,
          "-c",
          _API_SCRIPT,
          str(workdir),
          str(finetuned),
          str(hf),
          json.dumps(overrides),
          paths["train"],
          paths["dev"],
      ],
      env_extra=mlflow_env,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = {
      key: value
      for line in done.stdout.splitlines()
      if line.startswith("{")
      for key, value in json.loads(line).items()
  }
  assert "Override key 'train.stpes' is not a config key" in out["typo"]
  assert out["sizes"] == [1.5, 4, 32]
  assert out["pretrain"]["step"] == 4 and np.isfinite(out["pretrain"]["loss"])
  assert "Compiled the train step" in done.stderr  # the progress reaches a notebook's stderr
  assert out["evaluate"]["step"] == 4 and 0.0 <= out["evaluate"]["disc_auc"] <= 1.0
  assert 0.0 <= out["finetune"]["custom"]["accuracy"]["mean"] <= 1.0
  assert (finetuned / "custom" / "results.json").exists()
  assert (
      sorted(out["export"]) == ["discriminator"]
      and (hf / "discriminator" / "tokenizer.json").exists()
  )
  assert out["export_finetuned"] == {
      "custom/seed_0": str(tmp_path / "hf_finetuned" / "custom" / "seed_0")
  }
  # train.metric_writers reaches the run: MLflow got the logged steps and the held-out metrics.
  import mlflow  # noqa: PLC0415

  for name, value in mlflow_env.items():
    monkeypatch.setenv(name, value)
  run_id = (workdir / "mlflow_run_id").read_text()
  client = mlflow.MlflowClient(mlflow_env["MLFLOW_TRACKING_URI"])
  assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [2, 4]
  assert [m.step for m in client.get_metric_history(run_id, "eval/disc_auc")] == [4]


def test_the_exported_head_is_ours_at_the_layer_norms_bounds():
  """ElectraClassificationHead (dense -> GELU -> out_proj) holding our one dense layer: exact
  for every [CLS] vector the final LayerNorm can give, its extremes included; regression on a
  (lo, hi) range comes out on the labels' scale."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from electra_jax.finetune import export  # noqa: PLC0415

  size, rng = 16, np.random.default_rng(0)
  scale, bias = rng.normal(size=size).astype(np.float32), rng.normal(size=size).astype(np.float32)
  encoder = models.EncoderConfig(hidden_size=size, num_layers=1, num_heads=2, intermediate_size=32)
  bound = np.abs(scale) * np.sqrt(size) + np.abs(bias)
  pooled = np.concatenate([-bound[None], bound[None], rng.normal(size=(6, size)) * 3]).astype(
      np.float32
  )
  for kind, outputs in (("classification", 3), ("regression", 1)):
    kernel = rng.normal(size=(size, outputs)).astype(np.float32)
    head_bias = rng.normal(size=outputs).astype(np.float32)
    params = {
        "encoder": {"layer_0": {"output_layer_norm": {"scale": scale, "bias": bias}}},
        "classifier": {"kernel": kernel, "bias": head_bias},
    }
    head = dict(kind=kind, target_range=[0.0, 5.0] if kind == "regression" else None)
    tensors = export._classification_head(params, head, encoder)
    hf_head = transformers.models.electra.modeling_electra.ElectraClassificationHead(
        transformers.ElectraConfig(hidden_size=size, num_labels=outputs)
    ).eval()
    hf_head.load_state_dict(
        {name.removeprefix("classifier."): torch.tensor(v) for name, v in tensors.items()}
    )
    with torch.no_grad():
      theirs = hf_head(torch.tensor(pooled)[:, None, :]).numpy()
    ours = pooled @ kernel + head_bias
    # float32 rounding of x + c only (c ~ 20 here): a GELU off its identity would be off by O(1).
    np.testing.assert_allclose(
        theirs, ours * 5.0 if kind == "regression" else ours, rtol=1e-5, atol=1e-4
    )


@pytest.mark.fault
def test_exports_hugging_face_cannot_hold_are_refused_by_name(tmp_path):
  from electra_jax.finetune import export  # noqa: PLC0415

  task = tmp_path / "work" / "custom"
  task.mkdir(parents=True)
  results = {"config": {"head": {"pooling": "mean"}}, "seeds": {"0": {}}}
  (task / "results.json").write_text(json.dumps(results))
  with pytest.raises(
      ConfigError, match=r"results.json is not as electra-jax writes it \(KeyError: 'head'\)"
  ):
    export.export_hf(str(tmp_path / "work"), str(tmp_path / "out"))
  (task / "results.json").write_text(
      json.dumps(dict(results, head={"kind": "classification", "labels": ["a", "b"]}))
  )
  with pytest.raises(
      ConfigError, match=r"head.pooling='mean', and Hugging Face's ElectraForSequenceClassification"
  ):
    export.export_hf(str(tmp_path / "work"), str(tmp_path / "out"))
  with pytest.raises(ConfigError, match="--export_generator: .* is a fine-tuning workdir"):
    export.export_hf(str(tmp_path / "work"), str(tmp_path / "out"), export_generator=True)
  for edited, named in (
      ({"head": {"kind": "classification"}}, r"head \{'kind': 'classification'\} is not a"),
      (
          {"head": {"kind": "ranking", "labels": []}},
          "is not a classification, regression or span head",
      ),
      ({"seeds": 5}, "TypeError: 'int' object is not iterable"),
      ({"seeds": {"zero": {}}}, "ValueError: invalid literal for int"),
      ({"config": {"head": {"pooling": 3}}}, "ValueError: head.pooling=3 is of type int"),
  ):
    (task / "results.json").write_text(
        json.dumps({**results, "head": {"kind": "span", "answerable": False}, **edited})
    )
    with pytest.raises(
        ConfigError, match=f"results.json is not as electra-jax writes it .*{named}"
    ):
      export.export_hf(str(tmp_path / "work"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_the_learning_rate_is_chosen_on_train_never_dev_and_kept_on_a_rerun(tmp_path):
  config = synthetic_config(tmp_path, n_train=240, n_dev=48, epochs=4)
  config.select.learning_rates = "1e-7,3e-3"
  config.optimizer.learning_rate = 1e-7  # replaced by the choice
  workdir = tmp_path / "work"
  results = trainer.run_finetune(config, str(workdir))
  scores = results["selection"]["held_out_scores"]
  assert (
      results["selection"]["learning_rate"] == 3e-3 and scores["0.003"] > scores["1e-07"]
  ), results["selection"]
  assert (
      results["summary"]["custom"]["accuracy"]["mean"] >= 0.8
  )  # trained at the choice (1e-7 stays at chance)
  trial = workdir / "custom" / "select" / "lr_0.003" / "seed_0" / "metrics.json"
  history = json.loads(trial.read_text())["history"]
  assert all(
      list(epoch["dev"]) == ["held_out"] for epoch in history
  )  # scored on held-out train rows only
  assert history[-1]["step"] == 4 * math.ceil(192 / config.batch_size)  # 240 - 48 held out

  # More seeds later: the trials are read back, not trained again, and choose the same rate.
  before = trial.stat().st_mtime_ns
  config.num_seeds = 2
  again = trainer.run_finetune(config, str(workdir))
  assert again["selection"] == results["selection"] and trial.stat().st_mtime_ns == before
  assert again["seeds"]["0"] == results["seeds"]["0"]

  # select.folds=2: each rate is scored on both halves of train in turn, by the mean.
  config.num_seeds, config.select.folds = 1, 2
  folded = trainer.run_finetune(config, str(tmp_path / "folds"))
  for rate in ("1e-07", "0.003"):
    fold_scores = []
    for k in (1, 2):
      trial = json.loads(
          (
              tmp_path
              / "folds"
              / "custom"
              / "select"
              / f"lr_{rate}_fold{k}of2"
              / "seed_0"
              / "metrics.json"
          ).read_text()
      )
      assert trial["history"][-1]["step"] == 4 * math.ceil(
          120 / config.batch_size
      )  # half of 240 held out
      fold_scores.append(trial["dev"]["held_out"]["score"])
    assert folded["selection"]["held_out_scores"][rate] == pytest.approx(np.mean(fold_scores))
  assert folded["selection"]["learning_rate"] == 3e-3


def test_the_held_out_share_takes_whole_groups():
  """With custom.group_column the learning rate is scored on groups it never trained on, as dev
  is; without, on random rows, as before."""
  rng = np.random.default_rng(0)
  groups = [f"page{g}" for g in rng.integers(0, 40, 500)]
  [(held, fit)] = tasks.held_out_rows(groups, 0.2, seed=3)
  assert sorted(np.concatenate([held, fit])) == list(range(500))
  assert not {groups[i] for i in held} & {groups[i] for i in fit}
  sizes = collections.Counter(groups)
  assert 100 <= len(held) < 100 + max(sizes.values())  # whole groups until a fifth is held out
  assert tasks.held_out_rows(groups, 0.2, seed=4)[0][0].tolist() != held.tolist()
  [ungrouped] = tasks.held_out_rows([None] * 500, 0.2, seed=3)
  order = np.random.default_rng([3, 7]).permutation(500)  # the rows' draw, unchanged
  assert (
      ungrouped[0].tolist() == order[:100].tolist()
      and ungrouped[1].tolist() == order[100:].tolist()
  )
  with pytest.raises(
      ConfigError, match="config.select.fraction=0.9 leaves a share of the training set's 2 groups"
  ):
    tasks.held_out_rows(["a", "b", "b"], 0.9, seed=0)


@pytest.mark.parametrize("grouped", [True, False])
def test_folds_hold_out_every_row_once(grouped):
  rng = np.random.default_rng(1)
  groups = [f"page{g}" for g in rng.integers(0, 40, 500)] if grouped else [None] * 500
  splits = tasks.held_out_rows(groups, 0.2, seed=3, folds=3)
  assert len(splits) == 3
  assert sorted(np.concatenate([held for held, _ in splits]).tolist()) == list(
      range(500)
  )  # each row once
  for held, fit in splits:
    assert sorted(np.concatenate([held, fit]).tolist()) == list(range(500))
    assert abs(len(held) - 500 / 3) <= (max(collections.Counter(groups).values()) if grouped else 1)
    if grouped:
      assert not {groups[i] for i in held} & {groups[i] for i in fit}
  with pytest.raises(
      ConfigError,
      match="config.select.folds=3 leaves a share of the training set's 2 groups",
  ):
    tasks.held_out_rows(["a", "b", "b"], 0.2, seed=0, folds=3)


def test_a_custom_task_reads_its_group_column(tmp_path):
  config = synthetic_config(tmp_path, n_train=16, n_dev=8)
  rows = [json.loads(line) for line in open(config.custom.train_file)]
  with open(config.custom.train_file, "w") as f:
    f.writelines(json.dumps(dict(row, page=f"p{i // 4}")) + "\n" for i, row in enumerate(rows))
  config.custom.group_column = "page"
  data = tasks.load_custom(config.custom)
  assert [e.group for e in data.train] == [f"p{i // 4}" for i in range(16)]
  assert all(e.group is None for e in data.dev["custom"])  # dev needs no such column
  config.custom.group_column = "source"
  with pytest.raises(ConfigError, match="row 1 has no column 'source'"):
    tasks.load_custom(config.custom)


@pytest.mark.fault
@pytest.mark.parametrize(
    "task, rates, named",
    [
        (
            "custom",
            "3e-4,abc",
            "config.select.learning_rates='3e-4,abc': give distinct positive rates",
        ),
        ("custom", "1e-3,1e-3", "give distinct positive rates"),
        ("custom", "0", "give distinct positive rates"),
        ("squad1.1", "1e-3", "SQuAD's windows cannot be split by rows"),
        ("custom", "1e-3 folds=0", "config.select.folds=0 must be an int >= 1"),
    ],
)
def test_learning_rate_choices_are_refused_by_name(tmp_path, task, rates, named):
  config = synthetic_config(tmp_path, n_train=16, n_dev=8)
  rates, _, folds = rates.partition(" folds=")
  config.task, config.select.learning_rates, config.select.folds = task, rates, int(folds or 1)
  with pytest.raises(ConfigError, match=re.escape(named)):
    trainer.validate(config)
