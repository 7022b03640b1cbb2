"""Hugging Face interop: logits equal transformers' in float32 both ways, files round-trip bit
for bit and load without missing or unexpected weights, and unsafe or unrepresentable
checkpoints are refused by name."""

import json
import logging
import os
import re
import shutil

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers

from conftest import cli, cli_args, logged_messages
from conftest import deep_tiny_config as tiny_config
from electra_jax import checkpointing, data, interop, models, objectives, partitioning, resolve, train, train_state
from electra_jax.errors import ConfigError
from electra_jax.interop import hf

transformers.utils.logging.disable_progress_bar()

HF_CLASSES = {
    "discriminator": "ElectraForPreTraining",
    "generator": "ElectraForMaskedLM",
    "encoder": "ElectraModel",
}


# Embedding size equal to, smaller than and larger than the hidden size (ELECTRA-Small's
# generator has H=64 < E=128), an odd vocabulary, one to three layers.
def _sizes(embedding, hidden, layers, heads, ffn, **extra):
  return dict(
      embedding_size=embedding,
      hidden_size=hidden,
      num_hidden_layers=layers,
      num_attention_heads=heads,
      intermediate_size=ffn,
      **extra,
  )


SHAPES = {
    "E=H,1layer": _sizes(32, 32, layers=1, heads=2, ffn=64),
    "E<H,3layers": _sizes(16, 48, layers=3, heads=4, ffn=96, layer_norm_eps=1e-6),
    "E>H,2layers": _sizes(32, 16, layers=2, heads=1, ffn=32),
}
VOCAB = 1001


def _hf_config(**sizes):
  return transformers.ElectraConfig(vocab_size=VOCAB, max_position_embeddings=24, **sizes)


def _random_hf_model(kind, seed=0, **sizes):
  """A transformers model whose every tensor (LayerNorms and biases included) is random."""
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  torch.manual_seed(seed)
  model = getattr(transformers, HF_CLASSES[kind])(_hf_config(**sizes)).eval()
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.add_(0.1 * torch.randn_like(parameter))
  return model


def _inputs(seed=0, batch=3, seq=10):
  """Ids with [CLS]/[SEP], two segments, and padding at the end of rows 1 and 2."""
  rng = np.random.default_rng(seed)
  input_ids = rng.integers(5, VOCAB, size=(batch, seq))
  input_ids[:, 0] = 2
  attention_mask = np.ones_like(input_ids)
  token_type_ids = np.zeros_like(input_ids)
  for row, length in enumerate([seq, 6, 8][:batch]):
    input_ids[row, length - 1] = 3
    input_ids[row, length:], attention_mask[row, length:] = 0, 0
    token_type_ids[row, length // 2 : length] = 1
  return input_ids, attention_mask, token_type_ids


def _hf_outputs(hf_model, input_ids, attention_mask, token_type_ids):
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  with torch.no_grad():
    out = hf_model(
        input_ids=torch.tensor(input_ids),
        attention_mask=torch.tensor(attention_mask),
        token_type_ids=torch.tensor(token_type_ids),
    )
  return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).numpy()


def _random_params(init, *init_args, seed=1):
  """Random everywhere, LayerNorms and biases too, so a swapped scale/bias or a dropped bias
  shows (and no slow eager init)."""
  shapes = jax.eval_shape(init, jax.random.key(0), *init_args)["params"]
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    centre = 1.0 if path[-1].key == "scale" else 0.0
    return centre + 0.1 * rng.standard_normal(leaf.shape, np.float32)

  return jax.tree_util.tree_map_with_path(draw, flax.linen.meta.unbox(shapes))


def _our_outputs(model, params, inputs):
  input_ids, attention_mask, token_type_ids = inputs
  return jax.jit(model.apply)({"params": params}, input_ids, attention_mask, token_type_ids)


def _assert_close_where_real(ours, theirs, attention_mask, atol=1e-4):
  real = attention_mask.astype(bool)  # [batch, seq]; logits at padding are meaningless
  assert ours.shape == theirs.shape
  np.testing.assert_allclose(np.asarray(ours)[real], theirs[real], atol=atol, rtol=0)


def _assert_same_outputs(model, params, hf_model, seed=0):
  inputs = _inputs(seed)
  ours = _our_outputs(model, params, inputs)
  _assert_close_where_real(ours, _hf_outputs(hf_model, *inputs), inputs[1])
  return ours


def _from_pretrained_cleanly(kind, directory):
  # Every warning transformers logs (missing/unexpected weights among them).
  with logged_messages("transformers", logging.WARNING) as warnings:
    hf_model, info = getattr(transformers, HF_CLASSES[kind]).from_pretrained(
        directory, output_loading_info=True
    )
  assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  assert warnings == [], warnings
  return hf_model.eval()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["discriminator", "generator", "encoder"])
def test_load_hf_matches_transformers(tmp_path, kind, shape):
  hf_model = _random_hf_model(kind, **SHAPES[shape])
  hf_model.save_pretrained(tmp_path)
  model, params = interop.load_hf(str(tmp_path))
  assert isinstance(model, hf.KINDS[kind][1])

  ours = _assert_same_outputs(model, params, hf_model)
  last_dim = {"discriminator": (), "generator": (VOCAB,), "encoder": (hf_model.config.hidden_size,)}
  assert ours.shape == (3, 10, *last_dim[kind])


@pytest.mark.parametrize(
    "kind, shape",
    [("discriminator", "E<H,3layers"), ("generator", "E>H,2layers"), ("encoder", "E=H,1layer")],
)
def test_save_hf_loads_cleanly_and_matches(tmp_path, kind, shape):
  sizes = SHAPES[shape]
  tower = models.EncoderConfig(
      hidden_size=sizes["hidden_size"],
      num_layers=sizes["num_hidden_layers"],
      num_heads=sizes["num_attention_heads"],
      intermediate_size=sizes["intermediate_size"],
      layer_norm_eps=sizes.get("layer_norm_eps", 1e-12),
  )
  model = hf.KINDS[kind][1](
      vocab_size=VOCAB,
      embedding_size=sizes["embedding_size"],
      max_position_embeddings=24,
      type_vocab_size=2,
      config=tower,
  )
  params = _random_params(model.init, jnp.zeros((1, 4), jnp.int32))

  interop.save_hf(model, params, str(tmp_path))
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == [hf.KINDS[kind][0]]
  assert config["model_type"] == "electra"
  hf_model = _from_pretrained_cleanly(kind, str(tmp_path))

  _assert_same_outputs(model, params, hf_model, seed=3)


@pytest.mark.parametrize("kind", ["discriminator", "generator", "encoder"])
def test_round_trip_through_ours_is_bit_identical(tmp_path, kind):
  import torch  # noqa: PLC0415 (kept out of collection: see conftest._NativePeerWatch)

  hf_model = _random_hf_model(kind, seed=4, **SHAPES["E<H,3layers"])
  hf_model.save_pretrained(tmp_path / "original")
  model, params = interop.load_hf(str(tmp_path / "original"))
  interop.save_hf(model, params, str(tmp_path / "again"))

  # The same file contents as transformers' own save (the tied decoder left out alike) ...
  original = safetensors.numpy.load_file(str(tmp_path / "original" / "model.safetensors"))
  again = safetensors.numpy.load_file(str(tmp_path / "again" / "model.safetensors"))
  assert sorted(again) == sorted(original)
  for name, tensor in original.items():
    assert again[name].dtype == tensor.dtype and np.array_equal(again[name], tensor), name
  # ... and the same model once transformers has loaded it.
  reloaded = _from_pretrained_cleanly(kind, str(tmp_path / "again")).state_dict()
  for name, tensor in hf_model.state_dict().items():
    assert torch.equal(reloaded[name], tensor), name


def test_pretrainer_towers_export_to_transformers(tmp_path):
  config = tiny_config(**{"model.vocab_size": VOCAB, "model.embedding_size": 24})
  pretrainer = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = _random_params(
      pretrainer.init, ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32)
  )
  input_ids, attention_mask, token_type_ids = _inputs(seed=5)
  every_position = np.broadcast_to(np.arange(input_ids.shape[1]), input_ids.shape)
  # Both towers' logits from the pre-trainer itself, at every position.
  generator_logits, disc_logits = jax.jit(pretrainer.apply)(
      {"params": params}, input_ids, token_type_ids, attention_mask, every_position
  )
  expected = {"discriminator": disc_logits, "generator": generator_logits}
  for kind in ("discriminator", "generator"):
    interop.save_hf(pretrainer, params, str(tmp_path / kind), kind=kind)
    hf_model = _from_pretrained_cleanly(kind, str(tmp_path / kind))
    theirs = _hf_outputs(hf_model, input_ids, attention_mask, token_type_ids)
    _assert_close_where_real(expected[kind], theirs, attention_mask)
  generator_config = transformers.ElectraConfig.from_pretrained(tmp_path / "generator")
  assert generator_config.hidden_size == 16 and generator_config.embedding_size == 24  # E > H_g

  with pytest.raises(
      ConfigError, match=r"tower=None is not one of \['discriminator', 'generator'\]"
  ):
    interop.save_hf(pretrainer, params, str(tmp_path / "neither"))


def _save_hf_discriminator(directory):
  hf_model = _random_hf_model("discriminator", **SHAPES["E=H,1layer"])
  hf_model.save_pretrained(directory)
  return hf_model


@pytest.mark.fault
@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_act", "relu"),
        ("hidden_act", "gelu_new"),
        ("position_embedding_type", "relative_key"),
        ("architectures", ["ElectraForSequenceClassification"]),
        ("model_type", "bert"),
    ],
)
def test_unsupported_config_is_refused_by_name(tmp_path, key, value):
  _save_hf_discriminator(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  config[key] = value
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=key):
    interop.load_hf(str(tmp_path))


def test_sharded_safetensors_load(tmp_path):
  hf_model = _random_hf_model("generator", **SHAPES["E<H,3layers"])
  hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  model, params = interop.load_hf(str(tmp_path))
  _assert_same_outputs(model, params, hf_model)


@pytest.mark.fault
def test_weights_that_disagree_with_the_config_are_refused(tmp_path):
  _save_hf_discriminator(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
  # Named by the key, before a model of the claimed size is built.
  with pytest.raises(ConfigError, match="num_hidden_layers=2, but the weight files hold 1"):
    interop.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
  with pytest.raises(ConfigError, match="intermediate_size=32, but the weight files hold"):
    interop.load_hf(str(tmp_path))


@pytest.mark.fault
def test_stored_decoder_must_equal_the_word_table(tmp_path):
  hf_model = _random_hf_model("generator", **SHAPES["E=H,1layer"])
  hf_model.save_pretrained(tmp_path)
  # Older checkpoints store the tied decoder explicitly (accepted when it is the word table) and
  # the position_ids buffer (left out).
  state_dict = {name: tensor.numpy() for name, tensor in hf_model.state_dict().items()}
  assert "generator_lm_head.weight" in state_dict
  state_dict["electra.embeddings.position_ids"] = np.arange(24)[None]
  safetensors.numpy.save_file(state_dict, str(tmp_path / "model.safetensors"))
  model, params = interop.load_hf(str(tmp_path))
  _assert_same_outputs(model, params, hf_model)

  state_dict["generator_lm_head.weight"] = state_dict["generator_lm_head.weight"] + 1.0
  safetensors.numpy.save_file(state_dict, str(tmp_path / "model.safetensors"))
  with pytest.raises(ConfigError, match="generator_lm_head.weight differs"):
    interop.load_hf(str(tmp_path))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """A 2-step pre-training run of the tiny config (its checkpoint at step 2), never modified:
  the export tests each copy it."""
  workdir = tmp_path_factory.mktemp("pretrained") / "run"
  config = tiny_config(**{"train.steps": 2, "checkpoint.every_steps": 2, "eval.every_steps": 0})
  train.train_and_evaluate(config, str(workdir))
  return workdir


def test_cli_exports_a_pretraining_workdir(tmp_path, pretrained):
  workdir, out = tmp_path / "run", tmp_path / "hf"
  shutil.copytree(pretrained, workdir)
  python_m_main = cli_args(workdir)[:3]
  result = cli(
      [
          *python_m_main,
          "--mode=export_hf",
          f"--workdir={workdir}",
          f"--out={out}",
          "--export_generator",
      ]
  )
  assert result.returncode == 0, result.stderr[-3000:]

  # Each exported tower holds exactly the arrays of the checkpoint's tower, under the same sizes.
  config = tiny_config()
  mesh = partitioning.make_mesh(config.mesh)
  setup = train_state.build_setup(config, mesh, dict(pad=0, cls=2, sep=3, mask=4))
  checkpointer = checkpointing.Checkpointer(str(workdir), keep=1)
  with partitioning.activate(mesh):
    state = checkpointer.restore(checkpointer.latest_step(), setup.abstract_state)
  checkpointer.close()
  for kind in ("discriminator", "generator"):
    model, params = interop.load_hf(str(out / kind))
    reference_model, reference_params = models.tower_from_pretrainer(
        setup.model, state.params, kind
    )
    flat = flax.traverse_util.flatten_dict(params)
    reference = flax.traverse_util.flatten_dict(jax.device_get(reference_params))
    assert sorted(flat) == sorted(reference)
    assert all(np.array_equal(flat[path], reference[path]) for path in flat)
    assert model.config == reference_model.config

  # The export of a sentencepiece run carries spm.model; importing it back gives a workdir that
  # tokenizes with that very model and starts from the exported weights.
  pair = interop.pair_from_hf(str(out / "discriminator"), str(out / "generator"))
  imported = tmp_path / "imported"
  # A recipe asking for encoder options ELECTRA checkpoints lack gets the pair's (the defaults).
  recipe = tiny_config(
      **{
          "model.norm": "pre",
          "model.ffn": "geglu",
          "model.use_bias": False,
          "model.attention_conv": 3,
      }
  )
  interop.write_pretraining_workdir(pair, recipe, str(imported))
  model_config = train.config_lib.load_workdir_config(str(imported)).model
  assert (
      model_config.norm,
      model_config.ffn,
      model_config.use_bias,
      model_config.attention_conv,
  ) == ("post", "gelu", True, 0)
  data_config = train.config_lib.load_workdir_config(str(imported)).data
  assert data_config.tokenizer == "sentencepiece" and data_config.spm_model_file == str(
      imported / "spm.model"
  )
  assert (imported / "spm.model").read_bytes() == (out / "discriminator" / "spm.model").read_bytes()


def _listing(directory):
  """Every file under `directory` with its bytes: what "untouched" compares."""
  return {
      os.path.relpath(os.path.join(root, name), directory): open(
          os.path.join(root, name), "rb"
      ).read()
      for root, _, names in os.walk(directory)
      for name in names
  }


@pytest.mark.fault
def test_export_refuses_an_out_holding_another_export_and_leaves_it_untouched(
    tmp_path, monkeypatch, pretrained
):
  workdir, out = tmp_path / "run", tmp_path / "hf"
  shutil.copytree(pretrained, workdir)
  first = interop.export_workdir(str(workdir), str(out), export_generator=True)
  assert sorted(first) == ["discriminator", "generator"]
  before = _listing(out)

  # The refusal comes before the checkpoint is even restored: it costs nothing, writes nothing.
  def no_restore(*args, **kwargs):
    raise AssertionError("restored a checkpoint for an export that is refused")

  monkeypatch.setattr(resolve, "restore_checkpoint", no_restore)
  # Written over, discriminator/ would mix two exports' files (another tokenizer's vocab, say).
  with pytest.raises(
      ConfigError, match=r"hf/discriminator is not an empty directory.*pick a new --out, or remove"
  ):
    interop.export_workdir(str(workdir), str(out))
  assert _listing(out) == before
  # With discriminator/ gone, the old generator/ would still pose as the new model's generator.
  os.rename(out / "discriminator", tmp_path / "old_discriminator")
  before = _listing(out)
  with pytest.raises(
      ConfigError, match=r"hf/generator holds an earlier export's generator.*without --export_gen"
  ):
    interop.export_workdir(str(workdir), str(out))
  assert _listing(out) == before and not (out / "discriminator").exists()
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ConfigError, match="is a file"):
    interop.export_workdir(str(workdir), str(tmp_path / "a_file"))
  # The command line reports it as an error, before loading anything.
  python_m_main = cli_args(workdir)[:3]
  refused = cli([*python_m_main, "--mode=export_hf", f"--workdir={workdir}", f"--out={out}"])
  assert refused.returncode != 0 and "holds an earlier export's generator" in refused.stderr
  assert _listing(out) == before

  # Empty tower directories hold nothing to mix up: an export into them goes ahead.
  monkeypatch.undo()
  fresh = tmp_path / "fresh"
  os.makedirs(fresh / "discriminator")
  written = interop.export_workdir(str(workdir), str(fresh))
  assert sorted(os.listdir(written["discriminator"])) == sorted(
      os.listdir(tmp_path / "old_discriminator")
  )


@pytest.mark.fault
def test_cli_asks_for_what_each_mode_needs(tmp_path):
  python_m_main = cli_args(tmp_path)[:3]
  no_out = cli([*python_m_main, "--mode=export_hf", f"--workdir={tmp_path}"])
  assert no_out.returncode != 0 and "--mode=export_hf needs --out" in no_out.stderr
  no_config = cli([*python_m_main, f"--workdir={tmp_path}"])
  assert no_config.returncode != 0 and "has no config.json" in no_config.stderr
  assert "give --config" in no_config.stderr
  not_a_workdir = cli(
      [*python_m_main, "--mode=export_hf", f"--workdir={tmp_path}", f"--out={tmp_path}/hf"]
  )
  assert not_a_workdir.returncode != 0 and "has no config.json" in not_a_workdir.stderr


@pytest.mark.fault
def test_export_to_an_out_that_cannot_be_made_is_refused_before_the_restore(tmp_path, monkeypatch):
  """An --out under a file (or an unwritable directory) was an OSError traceback from
  os.makedirs, after the checkpoint was restored."""
  from electra_jax.interop import export  # noqa: PLC0415

  workdir = tmp_path / "run"
  (workdir / "checkpoints").mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps(tiny_config().to_dict()))
  monkeypatch.setattr(resolve, "restore_checkpoint", lambda *a, **k: pytest.fail("restored"))
  (tmp_path / "a_file").write_text("not a directory")
  with pytest.raises(ConfigError, match=f"{tmp_path / 'a_file'} is a file"):
    export.export_workdir(str(workdir), str(tmp_path / "a_file" / "hf"))


@pytest.mark.fault
@pytest.mark.parametrize(
    "options, named",
    [
        (
            {"model.norm": "pre"},
            [
                r"model.norm='pre' has no Hugging Face ElectraModel form \(it is post-LayerNorm only\); "
                r"fine-tune or evaluate it in electra-jax instead."
            ],
        ),
        ({"model.ffn": "geglu"}, [r"model.ffn='geglu' has no Hugging Face ElectraModel form"]),
        (
            {"model.use_bias": False},
            [r"model.use_bias=False has no Hugging Face ElectraModel form"],
        ),
        (
            {"model.attention_conv": 3},
            [
                r"model.attention_conv=3 has no Hugging Face ElectraModel form \(its attention has no convolution\)"
            ],
        ),
        (
            {"model.norm": "pre", "model.ffn": "geglu", "model.use_bias": False},
            [r"model.norm='pre'", r"model.ffn='geglu'", r"model.use_bias=False"],
        ),
    ],
)
def test_export_refuses_encoder_options_hugging_face_cannot_hold(
    tmp_path, monkeypatch, options, named
):
  """Pre-LN, GEGLU, bias-free and convolved encoders have no ElectraModel form: the export says which
  option, one line each, before restoring or writing anything."""
  config = tiny_config(**options)
  workdir, out = tmp_path / "run", tmp_path / "hf"
  (workdir / "checkpoints").mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps(config.to_dict()))
  monkeypatch.setattr(resolve, "restore_checkpoint", lambda *a, **k: pytest.fail("restored"))
  with pytest.raises(ConfigError) as refused:
    interop.export_workdir(str(workdir), str(out), export_generator=True)
  lines = str(refused.value).split("\n")
  assert len(lines) == len(named) and all(
      re.fullmatch(f"{want}.*", line) for want, line in zip(named, lines)
  )
  assert not out.exists()
  # save_hf itself refuses too (a pre-training state or a standalone tower alike).
  pretrainer = models.build_model(config, objectives.towers(config))
  ids = jnp.zeros((1, 8), jnp.int32)
  params = flax.linen.meta.unbox(
      pretrainer.init(
          jax.random.key(0), ids, ids, jnp.ones_like(ids), jnp.zeros((1, 2), jnp.int32)
      )["params"]
  )
  for kind in ("discriminator", "generator"):
    with pytest.raises(ConfigError, match=named[0]):
      interop.save_hf(pretrainer, params, str(out / kind), kind=kind)
  assert not out.exists()


# Mixed English, accented and CJK text, with the spacing sentencepiece and BERT each normalize.
TOKENIZER_TEXTS = [
    "The café's naïve résumé, déjà vu in Zürich.",
    "東京は日本の首都です。北京是中国的首都。",
    "Mixed 中文 and English,  with  double spaces and ß, ﬁ, ½.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines; ÀÉÎÕÜ Ñandú",
]


def _tokenizer_corpus():
  english = [line for document in data.builtin_documents()[:40] for line in document]
  return english + TOKENIZER_TEXTS * 50 + ["日本語の文章と中国語の文章と한국어 문장"] * 50


def _trained_tokenizers(tmp_path):
  """Tokenizers of each kind, trained here on mixed text: two sentencepiece models and a
  WordPiece vocabulary from `tokenizers`' trainer, cased and lowercased."""
  corpus = _tokenizer_corpus()
  for model_type in ("unigram", "bpe"):
    path = data.train_sentencepiece(corpus, str(tmp_path / f"{model_type}.model"), 1200, model_type)
    yield model_type, data.SentencePieceTokenizer(path)
  import tokenizers  # noqa: PLC0415

  for lowercase in (True, False):
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
    wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(
        corpus,
        tokenizers.trainers.WordPieceTrainer(
            vocab_size=1200, special_tokens=list(data.SPECIAL_TOKENS)
        ),
    )
    vocab = tmp_path / f"vocab_{lowercase}.txt"
    vocab.write_text(
        "".join(
            f"{token}\n" for token, _ in sorted(wordpiece.get_vocab().items(), key=lambda t: t[1])
        )
    )
    yield f"wordpiece lowercase={lowercase}", data.WordPieceTokenizer(str(vocab), lowercase)


def test_exported_tokenizers_give_autotokenizer_the_training_ids(tmp_path):
  for name, tok in _trained_tokenizers(tmp_path):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "electra"}))
    interop.export.write_tokenizer_files(tok, str(directory), max_length=128)
    assert (directory / "tokenizer.json").exists() and (
        directory / "tokenizer_config.json"
    ).exists()
    loaded = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert (
        loaded.pad_token_id,
        loaded.cls_token_id,
        loaded.sep_token_id,
        loaded.mask_token_id,
    ) == (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id), name
    for text in TOKENIZER_TEXTS:
      assert loaded(text)["input_ids"] == [tok.cls_id, *tok.encode(text), tok.sep_id], (name, text)
    pair = loaded(TOKENIZER_TEXTS[0], TOKENIZER_TEXTS[1])
    first, second = tok.encode(TOKENIZER_TEXTS[0]), tok.encode(TOKENIZER_TEXTS[1])
    assert pair["input_ids"] == [tok.cls_id, *first, tok.sep_id, *second, tok.sep_id], name
    assert pair["token_type_ids"] == [0] * (len(first) + 2) + [1] * (len(second) + 1), name
    # Not a match of unknown pieces: the vocabulary holds the texts' characters.
    assert tok.unk_id not in tok.encode(" ".join(TOKENIZER_TEXTS)), name
