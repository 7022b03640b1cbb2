"""Continuing pre-training from released weights: official TF1 checkpoints read without
TensorFlow (checked against files TensorFlow wrote), a Hugging Face discriminator + generator
pair imported as step 0 of a workdir over ONE embedding tree, training continued from it, and
the vocabulary carried through import and export.

The fixture tests/fixtures/tf1_electra was written by tests/fixtures/make_tf1_checkpoint.py with
TensorFlow's own Saver; its hf_* directories hold the same weights saved by transformers, and
transformers' models loaded from them are the oracle for the logits."""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import flax
import jax
import numpy as np
import pytest
import safetensors.numpy
import transformers

from conftest import REPO, cli, tiny_config
from electra_jax import checkpointing, interop, models, partitioning, train, train_state
from electra_jax.errors import ConfigError
from electra_jax.interop import hf, tf_checkpoint

FIXTURE = os.path.join(REPO, "tests", "fixtures", "tf1_electra")
VOCAB = 61  # the fixture's vocabulary: [PAD] [UNK] [CLS] [SEP] [MASK] w0 .. w55
PYTHON_M_MAIN = ["python", "-m", "electra_jax.main"]
# Sizes a run over the fixture's model can use (20 positions, 61 ids).
RUN_OVERRIDES = {
    "data.max_seq_len": 16,
    "data.max_documents": 60,
    "train.batch_size": 4,
    "train.steps": 2,
    "train.log_every": 1,
    "checkpoint.every_steps": 2,
    "optimizer.warmup_steps": 1,
    "eval.every_steps": 0,
}


def _inputs(seed=0, batch=3, seq=12):
  """Ids with [CLS]/[SEP], two segments, and padding at the end of rows 1 and 2."""
  rng = np.random.default_rng(seed)
  input_ids = rng.integers(5, VOCAB, size=(batch, seq))
  input_ids[:, 0] = 2
  attention_mask, token_type_ids = np.ones_like(input_ids), np.zeros_like(input_ids)
  for row, length in enumerate([seq, 7, 9][:batch]):
    input_ids[row, length - 1] = 3
    input_ids[row, length:], attention_mask[row, length:] = 0, 0
    token_type_ids[row, length // 2 : length] = 1
  return input_ids, attention_mask, token_type_ids


def _hf_logits(hf_class, directory, inputs):
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  model = hf_class.from_pretrained(directory).eval()
  with torch.no_grad():
    return model(
        *(torch.tensor(x) for x in inputs[:1]),
        attention_mask=torch.tensor(inputs[1]),
        token_type_ids=torch.tensor(inputs[2]),
    ).logits.numpy()


def _assert_logits_match(model, params, hf_class, hf_dir, seed=0):
  inputs = _inputs(seed)
  ours = np.asarray(jax.jit(model.apply)({"params": params}, *inputs))
  theirs = _hf_logits(hf_class, hf_dir, inputs)
  real = inputs[1].astype(bool)
  assert ours.shape == theirs.shape
  np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4, rtol=0)


def _cli(*args, **overrides):
  return (
      PYTHON_M_MAIN
      + list(args)
      + [f"--config.{k}={v}" for k, v in {**RUN_OVERRIDES, **overrides}.items()]
  )


# ---------------------------------------------------------------------------------------
# The TF checkpoint reader
# ---------------------------------------------------------------------------------------
def test_reader_reads_what_tensorflow_wrote():
  ckpt = tf_checkpoint.TFCheckpoint(tf_checkpoint.resolve_prefix(FIXTURE))
  # Names as the official code's scopes make them (model/modeling.py, run_pretraining.py).
  for name in (
      "electra/embeddings/word_embeddings",
      "electra/embeddings/LayerNorm/gamma",
      "electra/embeddings_project/kernel",  # E=16 < discriminator hidden 32
      "electra/encoder/layer_1/attention/output/LayerNorm/beta",
      "generator/encoder/layer_0/intermediate/dense/kernel",
      "discriminator_predictions/dense_1/kernel",
      "generator_predictions/output_bias",
      "electra/embeddings/word_embeddings/adam_m",
      "global_step",
  ):
    assert name in ckpt.entries, name
  assert "generator/embeddings_project/kernel" not in ckpt.entries  # generator hidden 16 == E
  # The variable was never incremented (the 7 is only the file name's, from Saver.save).
  assert ckpt.read("global_step").dtype == np.int64 and ckpt.read("global_step").shape == ()
  # Values: the same tensors transformers saved from the same torch model.
  disc = safetensors.numpy.load_file(os.path.join(FIXTURE, "hf_discriminator", "model.safetensors"))
  np.testing.assert_array_equal(
      ckpt.read("electra/embeddings/word_embeddings"),
      disc["electra.embeddings.word_embeddings.weight"],
  )
  np.testing.assert_array_equal(  # a dense kernel: [in, out] in TF, [out, in] in torch
      ckpt.read("electra/encoder/layer_1/intermediate/dense/kernel"),
      disc["electra.encoder.layer.1.intermediate.dense.weight"].T,
  )
  assert ckpt.entries["electra/encoder/layer_0/attention/self/query/kernel"].shape == (32, 32)


@pytest.mark.fault
def test_prefix_resolution_and_bad_paths(tmp_path):
  prefix = os.path.join(FIXTURE, "model.ckpt-7")
  assert tf_checkpoint.resolve_prefix(FIXTURE) == prefix
  assert tf_checkpoint.resolve_prefix(prefix + ".index") == prefix
  # Without a `checkpoint` state file: the highest-numbered model.ckpt-N in the directory.
  for name in os.listdir(FIXTURE):
    if name.startswith("model.ckpt-7"):
      shutil.copy(os.path.join(FIXTURE, name), tmp_path / name.replace("ckpt-7", "ckpt-12"))
      shutil.copy(os.path.join(FIXTURE, name), tmp_path / name.replace("ckpt-7", "ckpt-3"))
  assert tf_checkpoint.resolve_prefix(str(tmp_path)) == str(tmp_path / "model.ckpt-12")
  with pytest.raises(ConfigError, match="is not a TensorFlow checkpoint"):
    tf_checkpoint.resolve_prefix(str(tmp_path / "nothing_here"))
  (tmp_path / "junk.index").write_bytes(b"not a table" * 10)
  with pytest.raises(ConfigError, match="not a readable TensorFlow checkpoint index"):
    tf_checkpoint.TFCheckpoint(str(tmp_path / "junk"))
  # A truncated data file is named, not read as garbage.
  data = tmp_path / "model.ckpt-12.data-00000-of-00001"
  data.write_bytes(data.read_bytes()[:1000])
  with pytest.raises(ConfigError, match="truncated"):
    tf_checkpoint.TFCheckpoint(str(tmp_path / "model.ckpt-12")).read(
        "generator_predictions/output_bias"
    )


# Opens a FIFO for writing 5 s later, from another process (a reader blocked in native code
# holds the GIL): a reader that waits on it then fails the test instead of hanging it.
_UNBLOCK = (
    "import os, sys, time\ntime.sleep(5)\n"
    "try: os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))\nexcept OSError: pass\n"
)


@pytest.fixture
def unblock_later():
  writers = []
  yield lambda fifo: writers.append(subprocess.Popen([sys.executable, "-c", _UNBLOCK, fifo]))
  for writer in writers:
    writer.kill()
    writer.wait()


def _overwrite(path, offset, data):
  with open(path, "r+b") as f:
    f.seek(offset)
    f.write(data)


def _entry(directory, name):
  return tf_checkpoint.TFCheckpoint(os.path.join(directory, "model.ckpt-7")).entries[name]


def _flip_index_block(directory):
  index = os.path.join(directory, "model.ckpt-7.index")
  _overwrite(index, os.path.getsize(index) // 2, b"\xff" * 16)


def _index_handle_past_the_end(directory):
  index = os.path.join(directory, "model.ckpt-7.index")
  _overwrite(index, os.path.getsize(index) - 48 + 2, b"\xff\xff\x7f")  # the index block's offset


def _write_in_data(value):
  def damage(directory):
    entry = _entry(directory, "generator_predictions/output_bias")
    data = os.path.join(directory, "model.ckpt-7.data-00000-of-00001")
    _overwrite(data, entry.offset + 8, np.array([value], np.float32).tobytes())

  return damage


def _replace_data(make):
  def damage(directory):
    data = os.path.join(directory, "model.ckpt-7.data-00000-of-00001")
    os.remove(data)
    make(data)

  return damage


@pytest.mark.fault
@pytest.mark.parametrize(
    "damage, message",
    [
        pytest.param(_flip_index_block, "index is not a readable TensorFlow", id="index-bytes"),
        pytest.param(_index_handle_past_the_end, "index is not a readable", id="index-handle"),
        pytest.param(_write_in_data(np.nan), "output_bias's bytes .* fail their", id="data-nan"),
        pytest.param(_write_in_data(0.25), "output_bias's bytes .* fail their", id="data-value"),
        pytest.param(_replace_data(lambda data: None), "names for .* does not exist", id="no-data"),
        pytest.param(_replace_data(os.mkfifo), "is a FIFO, not a regular file", id="data-fifo"),
        pytest.param(
            _replace_data(lambda data: os.symlink("/dev/zero", data)),
            "is a device, not a regular file",
            id="data-device",
        ),
    ],
)
def test_a_damaged_tf_checkpoint_is_refused_in_one_line(tmp_path, unblock_later, damage, message):
  """The index's block checksums and each tensor's crc32c are checked, and data files must be
  regular files: a damaged index was a ValueError traceback, a changed weight or a /dev/zero data
  file loaded silently, a FIFO waited forever."""
  directory = tmp_path / "ckpt"
  shutil.copytree(FIXTURE, directory)
  damage(str(directory))
  unblock_later(str(directory / "model.ckpt-7.data-00000-of-00001"))
  with pytest.raises(ConfigError, match=message) as refused:
    interop.pair_from_tf(str(directory))
  assert "\n" not in str(refused.value)


@pytest.mark.fault
@pytest.mark.parametrize("recorded", ["{outside}/model.ckpt-9", "../outside/model.ckpt-9"])
def test_a_checkpoint_state_file_naming_a_prefix_outside_its_folder_is_not_followed(
    tmp_path, recorded
):
  """The `checkpoint` file's model_checkpoint_path is read as a file name in its own folder."""
  inside, outside = tmp_path / "inside", tmp_path / "outside"
  inside.mkdir(), outside.mkdir()
  for name in os.listdir(FIXTURE):
    if name.startswith("model.ckpt-7"):
      shutil.copy(os.path.join(FIXTURE, name), inside / name)
      shutil.copy(os.path.join(FIXTURE, name), outside / name.replace("ckpt-7", "ckpt-9"))
  path = recorded.format(outside=outside)
  (inside / "checkpoint").write_text(f'model_checkpoint_path: "{path}"\n')
  assert tf_checkpoint.resolve_prefix(str(inside)) == str(inside / "model.ckpt-7")


def _hf_discriminator(tmp_path):
  directory = tmp_path / "hf"
  shutil.copytree(os.path.join(FIXTURE, "hf_discriminator"), directory)
  return directory


def _rewrite_weights(change):
  def damage(directory):
    weights = safetensors.numpy.load_file(directory / "model.safetensors")
    change(weights)
    safetensors.numpy.save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

  return damage


def _truncate_weights(directory):
  content = (directory / "model.safetensors").read_bytes()
  (directory / "model.safetensors").write_bytes(content[: len(content) // 2])


def _as_int(weights):
  name = "electra.embeddings.word_embeddings.weight"
  weights[name] = (weights[name] * 100).astype(np.int32)


def _cut_a_row(weights):  # layer 1 only: layer 0 (which config.json is checked against) is intact
  name = "electra.encoder.layer.1.intermediate.dense.weight"
  weights[name] = weights[name][:-1]


def _shard_index(weight_map):
  def damage(directory):
    os.rename(directory / "model.safetensors", directory / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))

  return damage


def _weights_fifo(directory):
  os.remove(directory / "model.safetensors")
  os.mkfifo(directory / "model.safetensors")


@pytest.mark.fault
@pytest.mark.parametrize(
    "damage, message",
    [
        pytest.param(_truncate_weights, "is not a readable safetensors file", id="truncated"),
        pytest.param(
            _rewrite_weights(_as_int), "word_embeddings.weight' has dtype int32", id="int32"
        ),
        pytest.param(
            _rewrite_weights(_cut_a_row),
            r"unexpected: \['encoder.layer.1.intermediate.dense.weight \(127, 32\)'\]",
            id="shape",
        ),
        pytest.param(
            _shard_index(
                {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
            ),
            "shard 'model-00002-of-00002.safetensors' is not a file beside it",
            id="missing-shard",
        ),
        pytest.param(
            _shard_index({"a": "../hf_generator/model.safetensors"}),
            "shard '../hf_generator/model.safetensors' is not a file beside it",
            id="shard-outside",
        ),
        pytest.param(_weights_fifo, "is a FIFO, not a regular file", id="fifo"),
    ],
)
def test_damaged_or_mismatched_safetensors_are_refused_in_one_line(
    tmp_path, unblock_later, damage, message
):
  directory = _hf_discriminator(tmp_path)
  damage(directory)
  unblock_later(str(directory / "model.safetensors"))
  with pytest.raises(ConfigError, match=message) as refused:
    interop.load_hf(str(directory))
  assert "\n" not in str(refused.value)


@pytest.mark.fault
@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "tokenizer_config.json is not a readable JSON file"),
        ("[true]", "tokenizer_config.json holds a JSON list, not an object"),
        ('{"do_lower_case": "false"}', r"must each be true, false or null, not \('false', None\)"),
    ],
)
def test_a_damaged_tokenizer_config_is_refused_by_name(tmp_path, content, message):
  """Was a JSONDecodeError traceback, and the string "false" lowercased the text."""
  dirs = _hf_pair_with_vocab(tmp_path)
  with open(os.path.join(dirs["discriminator"], "tokenizer_config.json"), "w") as f:
    f.write(content)
  with pytest.raises(ConfigError, match=message):
    interop.pair_from_hf(dirs["discriminator"], dirs["generator"])


class _WritesAFile:
  """Unpickled, it creates `marker`: the code a hostile pytorch_model.bin can run."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return open, (self.marker, "w")


@pytest.mark.fault
def test_pytorch_model_bin_is_read_with_weights_only_and_a_hostile_pickle_runs_nothing(tmp_path):
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  directory = _hf_discriminator(tmp_path)
  model, params = interop.load_hf(str(directory))
  tensors = hf.read_hf_weights(str(directory))
  os.remove(directory / "model.safetensors")
  # As older transformers versions saved it: torch tensors, with the position_ids buffer.
  state_dict = {name: torch.from_numpy(np.array(t)) for name, t in tensors.items()}
  torch.save(
      {**state_dict, "electra.embeddings.position_ids": torch.arange(24)[None]},
      directory / "pytorch_model.bin",
  )
  model_bin, params_bin = interop.load_hf(str(directory))
  assert model_bin == model
  jax.tree.map(np.testing.assert_array_equal, params_bin, params)

  marker = tmp_path / "pickle_ran"
  names_the_file = re.escape(f"Refusing {directory}/pytorch_model.bin")
  for content, reason in (
      (pickle.dumps(_WritesAFile(str(marker))), "weights_only=True"),
      (None, r"entry 'step' is not a str -> torch.Tensor"),
  ):
    if content is None:
      torch.save({**state_dict, "step": 3}, directory / "pytorch_model.bin")
    else:
      (directory / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(ConfigError, match=f"{names_the_file}.*{reason}"):
      interop.load_hf(str(directory))
  assert not marker.exists()


def test_official_names_of_every_weight():
  assert tf_checkpoint.official_name(
      "encoder.layer.11.attention.self.query.weight", "generator"
  ) == ("generator/encoder/layer_11/attention/self/query/kernel")
  assert tf_checkpoint.official_name("embeddings.position_embeddings.weight", "generator") == (
      "electra/embeddings/position_embeddings"  # both towers read the discriminator's scope
  )
  assert tf_checkpoint.official_name("encoder.layer.0.output.LayerNorm.bias", "discriminator") == (
      "electra/encoder/layer_0/output/LayerNorm/beta"
  )
  assert tf_checkpoint.official_name("generator_predictions.LayerNorm.weight", "generator") == (
      "generator_predictions/LayerNorm/gamma"
  )


def test_tf_towers_compute_what_transformers_computes():
  pair = interop.pair_from_tf(FIXTURE)
  assert pair.vocabulary == {
      "tokenizer": "wordpiece",
      "vocab_file": os.path.join(FIXTURE, "vocab.txt"),
  }
  assert pair.discriminator.config.num_heads == 1  # official: max(1, 32 // 64)
  _assert_logits_match(
      pair.discriminator,
      pair.discriminator_params,
      transformers.ElectraForPreTraining,
      os.path.join(FIXTURE, "hf_discriminator"),
  )
  _assert_logits_match(
      pair.generator,
      pair.generator_params,
      transformers.ElectraForMaskedLM,
      os.path.join(FIXTURE, "hf_generator"),
      seed=1,
  )


# ---------------------------------------------------------------------------------------
# A workdir from a pair; continued pre-training; export with the vocabulary
# ---------------------------------------------------------------------------------------
def _hf_pair_with_vocab(tmp_path, lowercase=False):
  """The fixture's Hugging Face pair, with the vocab and tokenizer settings a hub download has."""
  dirs = {}
  for tower in ("discriminator", "generator"):
    target = tmp_path / f"hf_{tower}"
    shutil.copytree(os.path.join(FIXTURE, f"hf_{tower}"), target)
    shutil.copy(os.path.join(FIXTURE, "vocab.txt"), target / "vocab.txt")
    (target / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lowercase}))
    dirs[tower] = str(target)
  return dirs


def _restore_params(workdir, step):
  config = train.config_lib.load_workdir_config(str(workdir))
  mesh = partitioning.make_mesh(tiny_config().mesh)
  setup = train_state.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4))
  checkpointer = checkpointing.Checkpointer(str(workdir), keep=1)
  try:
    with partitioning.activate(mesh):
      return setup.model, jax.device_get(checkpointer.restore(step, setup.abstract_state).params)
  finally:
    checkpointer.close()


def test_import_hf_pair_continue_pretraining_and_export(tmp_path):
  dirs = _hf_pair_with_vocab(tmp_path, lowercase=False)
  workdir, out = tmp_path / "run", tmp_path / "exported"
  imported = cli(
      _cli(
          "--mode=import_hf",
          f"--hf_discriminator={dirs['discriminator']}",
          f"--hf_generator={dirs['generator']}",
          f"--config={REPO}/configs/base.py",
          f"--workdir={workdir}",
      )
  )
  assert imported.returncode == 0, imported.stderr[-3000:]
  config = json.loads((workdir / "config.json").read_text())
  # Sizes and vocabulary come from the weights, whatever the recipe said.
  assert config["model"]["hidden_size"] == 32 and config["model"]["generator_fraction"] == 0.5
  assert config["model"]["vocab_size"] == VOCAB and config["model"]["num_heads"] == 1
  assert config["data"]["tokenizer"] == "wordpiece" and config["data"]["lowercase"] is False
  assert config["data"]["vocab_file"] == str(workdir / "vocab.txt")

  # Step 0 holds exactly the Hugging Face weights, both towers over one embedding tree.
  pretrainer, params = _restore_params(workdir, 0)
  assert sorted(params) == ["discriminator", "embeddings", "generator"]
  for tower, hf_class in (
      ("discriminator", transformers.ElectraForPreTraining),
      ("generator", transformers.ElectraForMaskedLM),
  ):
    model, tower_params = models.tower_from_pretrainer(pretrainer, params, tower)
    _assert_logits_match(model, tower_params, hf_class, dirs[tower])

  # The usual command, without --config, continues from it.
  trained = cli(PYTHON_M_MAIN + [f"--workdir={workdir}"])
  assert trained.returncode == 0, trained.stderr[-3000:]
  logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in logged] == [1, 2]
  assert all(np.isfinite(m["loss"]) and m["loss"] > 0 for m in logged)
  _, after = _restore_params(workdir, 2)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), params, after)
  # One shared table, trained by both losses: it moved, and no tower grew a table of its own.
  assert changed["embeddings"]["word_embeddings"]["embedding"]
  assert sorted(after) == ["discriminator", "embeddings", "generator"]
  for tower in ("discriminator", "generator"):
    assert not any(
        k.endswith("/embedding") for k in flax.traverse_util.flatten_dict(after[tower], sep="/")
    )

  # Export: the vocabulary and its settings travel, and tokenize as the original did.
  exported = cli(PYTHON_M_MAIN + ["--mode=export_hf", f"--workdir={workdir}", f"--out={out}"])
  assert exported.returncode == 0, exported.stderr[-3000:]
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "discriminator"))
  original = transformers.BertTokenizer(
      os.path.join(dirs["discriminator"], "vocab.txt"), do_lower_case=False
  )
  text = "w1 w22 W3 unknown w55w4 [MASK] w0"
  assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
  assert (
      original.convert_ids_to_tokens(original(text)["input_ids"])[3] == "[UNK]"
  )  # cased: W3 unknown


def test_import_tf_via_the_cli(tmp_path):
  workdir = tmp_path / "run"
  result = cli(
      _cli(
          "--mode=import_tf",
          f"--tf_checkpoint={FIXTURE}",
          f"--config={REPO}/configs/base.py",
          f"--workdir={workdir}",
      )
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Continue pre-training with: electra-jax --workdir=" in result.stdout
  pretrainer, params = _restore_params(workdir, 0)
  model, tower_params = models.tower_from_pretrainer(pretrainer, params, "discriminator")
  _assert_logits_match(
      model,
      tower_params,
      transformers.ElectraForPreTraining,
      os.path.join(FIXTURE, "hf_discriminator"),
      seed=2,
  )
  # Importing again into the same workdir changes nothing and says why.
  again = cli(
      _cli(
          "--mode=import_tf",
          f"--tf_checkpoint={FIXTURE}",
          f"--config={REPO}/configs/base.py",
          f"--workdir={workdir}",
      )
  )
  assert again.returncode != 0 and "already holds checkpoints" in again.stderr


def _import(pair, workdir, **kwargs):
  return interop.write_pretraining_workdir(
      pair, tiny_config(**RUN_OVERRIDES), str(workdir), **kwargs
  )


@pytest.mark.fault
def test_unequal_embeddings_are_refused_unless_one_side_is_chosen(tmp_path):
  dirs = _hf_pair_with_vocab(tmp_path)
  weights_path = os.path.join(dirs["generator"], "model.safetensors")
  weights = safetensors.numpy.load_file(weights_path)
  weights["electra.embeddings.position_embeddings.weight"][3, 1] += 0.5
  safetensors.numpy.save_file(weights, weights_path, metadata={"format": "pt"})
  pair = interop.pair_from_hf(dirs["discriminator"], dirs["generator"])
  with pytest.raises(
      ConfigError,
      match=r"embeddings differ \(position_embeddings/embedding: max \|difference\| 0.5",
  ):
    _import(pair, tmp_path / "refused")
  assert not os.path.exists(tmp_path / "refused" / "checkpoints")

  _import(pair, tmp_path / "chosen", embeddings_from="generator")
  _, params = _restore_params(tmp_path / "chosen", 0)
  np.testing.assert_array_equal(
      params["embeddings"]["position_embeddings"]["embedding"],
      weights["electra.embeddings.position_embeddings.weight"],
  )


@pytest.mark.fault
def test_nan_weights_and_a_broken_shard_index_are_refused_by_name(tmp_path):
  dirs = _hf_pair_with_vocab(tmp_path)
  weights_path = os.path.join(dirs["discriminator"], "model.safetensors")
  weights = safetensors.numpy.load_file(weights_path)
  weights["discriminator_predictions.dense.weight"][0, :3] = [np.nan, np.inf, -np.inf]
  safetensors.numpy.save_file(weights, weights_path, metadata={"format": "pt"})
  with pytest.raises(
      ConfigError, match=r"discriminator_predictions.dense.weight' holds 3 NaN or infinite values"
  ):
    interop.pair_from_hf(dirs["discriminator"], dirs["generator"])
  # A sharded checkpoint whose index is not one is named, not a KeyError.
  os.remove(weights_path)
  index = weights_path + ".index.json"
  with open(index, "w") as f:
    json.dump({"metadata": {}}, f)
  with pytest.raises(ConfigError, match=f'Refusing {index}: its "weight_map" is not'):
    interop.pair_from_hf(dirs["discriminator"], dirs["generator"])


@pytest.mark.fault
def test_a_vocab_linked_from_outside_or_without_specials_is_refused_before_the_copy(tmp_path):
  dirs = _hf_pair_with_vocab(tmp_path)
  outside = tmp_path / "elsewhere.txt"
  shutil.copy(os.path.join(FIXTURE, "vocab.txt"), outside)
  for tower in ("discriminator", "generator"):
    os.remove(os.path.join(dirs[tower], "vocab.txt"))
  os.symlink(outside, os.path.join(dirs["discriminator"], "vocab.txt"))
  with pytest.raises(ConfigError, match=f"links to {outside}, outside {dirs['discriminator']}"):
    interop.pair_from_hf(dirs["discriminator"], dirs["generator"])
  # A vocabulary without [MASK] is refused before the workdir gets a copy of it.
  os.remove(os.path.join(dirs["discriminator"], "vocab.txt"))
  lines = [t for t in open(outside).read().splitlines() if t != "[MASK]"]
  with open(os.path.join(dirs["discriminator"], "vocab.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
  pair = interop.pair_from_hf(dirs["discriminator"], dirs["generator"])
  with pytest.raises(ConfigError, match=r"lacks the special token \[MASK\]"):
    _import(pair, tmp_path / "work")
  assert not os.path.exists(tmp_path / "work" / "vocab.txt") and not os.path.exists(
      tmp_path / "work" / "checkpoints"
  )


@pytest.mark.fault
@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": 1000}, "num_hidden_layers=1000, but the weight files hold 2"),
        ({"hidden_size": 64}, "hidden_size=64, but the weight files hold 32"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive whole number"),
        (
            {"max_position_embeddings": "512"},
            "max_position_embeddings='512' must be a positive whole number",
        ),
        ({"hidden_dropout_prob": None}, r"hidden_dropout_prob=None must be a number in \[0, 1\)"),
    ],
)
def test_a_config_json_the_weights_contradict_or_with_bad_values_is_refused_by_key(
    tmp_path, change, message
):
  directory = tmp_path / "hf"
  shutil.copytree(os.path.join(FIXTURE, "hf_discriminator"), directory)
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, **change}))
  with pytest.raises(ConfigError, match=message):
    interop.load_hf(str(directory))
  (directory / "config.json").write_text("{not json")
  with pytest.raises(ConfigError, match="config.json is not a readable JSON file"):
    interop.load_hf(str(directory))


@pytest.mark.fault
def test_pairs_electra_jax_cannot_represent_are_refused(tmp_path):
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  dirs = _hf_pair_with_vocab(tmp_path)
  config = json.loads(open(os.path.join(dirs["generator"], "config.json")).read())
  config["intermediate_size"] = 48  # the official generator's FFN is 4 x hidden = 64
  torch.manual_seed(0)
  transformers.ElectraForMaskedLM(transformers.ElectraConfig(**config)).save_pretrained(
      tmp_path / "odd_generator"
  )
  shutil.copy(os.path.join(FIXTURE, "vocab.txt"), tmp_path / "odd_generator" / "vocab.txt")
  pair = interop.pair_from_hf(dirs["discriminator"], str(tmp_path / "odd_generator"))
  with pytest.raises(ConfigError, match=r"intermediate_size=48 \(derived: 64\)"):
    _import(pair, tmp_path / "w1")

  with pytest.raises(ConfigError, match="--hf_generator needs an ElectraForMaskedLM"):
    interop.pair_from_hf(dirs["discriminator"], dirs["discriminator"])

  os.remove(os.path.join(dirs["generator"], "vocab.txt"))
  (tmp_path / "other_vocab.txt").write_text(
      open(os.path.join(FIXTURE, "vocab.txt")).read() + "extra\n"
  )
  shutil.copy(tmp_path / "other_vocab.txt", os.path.join(dirs["generator"], "vocab.txt"))
  with pytest.raises(ConfigError, match="trained with different vocabularies"):
    interop.pair_from_hf(dirs["discriminator"], dirs["generator"])


@pytest.mark.fault
@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            {"model.tie": "gdes"},
            "fills: parameter 'discriminator_word_delta' is .* but absent in the pair .*tie='gdes'",
        ),
        ({"objective.name": "mlm"}, "fills: .*objective.name='mlm'"),
    ],
)
def test_a_recipe_the_pair_cannot_fill_is_refused_before_anything_is_written(
    tmp_path, overrides, named
):
  workdir = tmp_path / "w"
  with pytest.raises(
      ConfigError, match=f"not the one an imported pair {named}.* Nothing was written"
  ):
    interop.write_pretraining_workdir(
        interop.pair_from_tf(FIXTURE), tiny_config(**RUN_OVERRIDES, **overrides), str(workdir)
    )
  assert not workdir.exists()


@pytest.mark.fault
def test_a_pair_without_vocabulary_is_refused(tmp_path):
  pair = interop.pair_from_hf(
      os.path.join(FIXTURE, "hf_discriminator"), os.path.join(FIXTURE, "hf_generator")
  )
  assert pair.vocabulary == {}
  with pytest.raises(ConfigError, match=r"no vocab.txt \(or spm.model\) beside the weights"):
    _import(pair, tmp_path / "w")


@pytest.mark.fault
def test_training_refuses_another_tokenizer_on_imported_weights(tmp_path):
  workdir = tmp_path / "run"
  _import(interop.pair_from_tf(FIXTURE), workdir)
  # The imported model's sizes, but another vocabulary of the same size (words reordered).
  lines = open(os.path.join(FIXTURE, "vocab.txt")).read().splitlines()
  (tmp_path / "reordered.txt").write_text("\n".join(lines[:5] + lines[5:][::-1]) + "\n")
  config = train.config_lib.load_workdir_config(str(workdir))
  config.data.vocab_file = str(tmp_path / "reordered.txt")
  with pytest.raises(
      ConfigError, match="imported from TensorFlow checkpoint .* with their own vocabulary"
  ):
    train.train_and_evaluate(config, str(workdir))


def test_fine_tuning_starts_from_imported_weights_and_checks_their_vocabulary(tmp_path):
  # An imported workdir's step 0 has no data fingerprint yet (nothing trained on a corpus).
  from electra_jax.finetune import model as model_lib  # noqa: PLC0415

  workdir = tmp_path / "run"
  _import(interop.pair_from_tf(FIXTURE), workdir)
  config = train.config_lib.sibling(
      os.path.join(REPO, "configs", "finetune", "tiny.py"), "tiny"
  ).get_config()
  config.init_from, config.max_seq_len = str(workdir), 16  # the fixture's 20 positions
  backbone = model_lib.load_backbone(config)
  params = model_lib.init_params(
      backbone, backbone.classifier(2, config), jax.random.key(0), config.max_seq_len
  )
  _, imported = _restore_params(workdir, 0)
  jax.tree.map(
      np.testing.assert_array_equal, params["encoder"], imported["discriminator"]["encoder"]
  )
  # Another vocabulary of the same size is still refused, by the imported one's fingerprint.
  lines = open(os.path.join(FIXTURE, "vocab.txt")).read().splitlines()
  (tmp_path / "reordered.txt").write_text("\n".join(lines[:5] + lines[5:][::-1]) + "\n")
  config.tokenizer = str(tmp_path / "reordered.txt")
  with pytest.raises(ConfigError, match="differs from the one the checkpoint"):
    model_lib.load_backbone(config)


def test_fine_tuning_from_a_hugging_face_directory_normalizes_as_it_records(tmp_path):
  """A cased model's directory (tokenizer_config.json: do_lower_case false) is fine-tuned on
  cased ids; an uncased one lowercases; config.lowercase overrides what is recorded."""
  from electra_jax.finetune import model as model_lib  # noqa: PLC0415

  config = train.config_lib.sibling(
      os.path.join(REPO, "configs", "finetune", "tiny.py"), "tiny"
  ).get_config()
  config.max_seq_len = 16  # the fixture's 20 positions
  for recorded, override, expected in (
      (False, None, False),
      (True, None, True),
      (False, True, True),
  ):
    directory = _hf_pair_with_vocab(tmp_path / f"{recorded}_{override}", lowercase=recorded)[
        "discriminator"
    ]
    config.init_from, config.lowercase = directory, override
    tokenizer = model_lib.load_backbone(config).tokenizer
    assert tokenizer.lowercase is expected
    first_word = open(os.path.join(FIXTURE, "vocab.txt")).read().splitlines()[5]  # w0
    cased = tokenizer.encode(first_word.upper())
    assert (cased == tokenizer.encode(first_word)) is expected, (recorded, override, cased)
  os.remove(os.path.join(directory, "vocab.txt"))
  with pytest.raises(ConfigError, match="has neither vocab.txt nor spm.model"):
    model_lib.load_backbone(config)


@pytest.mark.fault
def test_an_import_killed_mid_save_does_not_block_the_next_one(tmp_path):
  """orbax writes a step under <step>.orbax-checkpoint-tmp and renames it when complete; an
  import killed before that left only the temporary directory, which the next import took for
  checkpoints ("already holds checkpoints") although the workdir holds none."""
  workdir = tmp_path / "w"
  (workdir / "checkpoints" / "0.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  interop.write_pretraining_workdir(
      interop.pair_from_tf(FIXTURE), tiny_config(**RUN_OVERRIDES), str(workdir)
  )
  assert checkpointing.Checkpointer(str(workdir), keep=1).all_steps() == [0]
  with pytest.raises(
      ConfigError, match="already holds checkpoints"
  ):  # a complete one is still refused
    interop.write_pretraining_workdir(
        interop.pair_from_tf(FIXTURE), tiny_config(**RUN_OVERRIDES), str(workdir)
    )


@pytest.mark.fault
def test_an_import_into_a_workdir_that_cannot_be_made_is_refused_by_name(tmp_path):
  """Was a NotADirectoryError traceback from os.makedirs, after the pair was checked."""
  (tmp_path / "a_file").write_text("not a directory")
  with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file"):
    interop.write_pretraining_workdir(
        interop.pair_from_tf(FIXTURE), tiny_config(**RUN_OVERRIDES), str(tmp_path / "a_file" / "w")
    )
