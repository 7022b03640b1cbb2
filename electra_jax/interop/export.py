"""Exporting a pre-training workdir: restores its latest checkpoint on one device and writes the
discriminator (and, if asked, the generator) as Hugging Face directories with their tokenizer."""

import os
import pathlib

import jax
import tokenizers
from tokenizers import normalizers
from sentencepiece import sentencepiece_model_pb2

from electra_jax import config_lib, data, models, objectives, partitioning, resolve, train_state, workdir_files
from electra_jax.data.tokenizer import SPECIAL_TOKENS, WordPieceTokenizer
from electra_jax.errors import ConfigError
from electra_jax.interop.hf import check_hf_form, finite_tensor, save_hf


def one_device_setup(config, tokenizer):
  """(mesh, train_state.build_setup) on one device, whatever mesh trained (orbax re-shards)."""
  mesh = partitioning.make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  return mesh, train_state.build_setup(config, mesh, train_state.special_ids(tokenizer))


def export_workdir(workdir: str, out_dir: str, export_generator: bool = False) -> dict[str, str]:
  """Writes <out_dir>/discriminator (and generator) from `workdir`'s latest checkpoint: {tower:
  directory}. A used `out_dir`, or a model no ElectraModel holds, is refused before the restore."""
  config = config_lib.load_workdir_config(workdir)
  if not workdir_files.exists(workdir_files.path(workdir, "checkpoints")):
    raise ConfigError(f"{workdir} has no checkpoints/ directory: nothing to export yet.")
  pretrainer = models.build_model(config, objectives.towers(config))
  check_hf_form(pretrainer.discriminator_config)  # the generator's options are the same
  if export_generator and (why_not := models.no_standalone_generator(pretrainer)):
    raise ConfigError(
        f"--export_generator: {why_not} (objective.name={config.objective.name!r}). "
        "Nothing was written; export without --export_generator."
    )
  workdir_files.check_usable(out_dir, "--out")
  for tower in ("discriminator", "generator"):
    directory = os.path.join(out_dir, tower)
    if os.path.lexists(directory) and not (os.path.isdir(directory) and not os.listdir(directory)):
      why = "is not an empty directory, and an export writes into it without clearing it"
      if tower == "generator" and not export_generator:
        why = "holds an earlier export's generator, which an export without --export_generator "
        why += "would leave beside a discriminator it does not belong to"
      raise ConfigError(
          f"--out={out_dir!r}: {directory} {why}. Nothing was written; pick a new --out, or "
          f"remove {directory} first."
      )

  tok = data.workdir_tokenizer(workdir, config.data)  # build_setup needs its special ids
  mesh, setup = one_device_setup(config, tok)
  step, state = resolve.restore_checkpoint(workdir, setup, mesh)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:  # before any write
    source = f"the checkpoint at step {step} in {workdir}"
    finite_tensor(jax.tree_util.keystr(path), jax.device_get(leaf), source)
  towers = ("discriminator", "generator") if export_generator else ("discriminator",)
  written = {tower: os.path.join(out_dir, tower) for tower in towers}
  for tower, directory in written.items():
    save_hf(setup.model, state.params, directory, kind=tower, pad_token_id=tok.pad_id)
    write_tokenizer_files(tok, directory, config.model.max_position_embeddings)
  return written


def write_tokenizer_files(tok, directory: str, max_length: int) -> None:
  """tokenizer.json (adding [CLS] ... [SEP] as training does), tokenizer_config.json and vocab.txt
  or spm.model beside the weights: AutoTokenizer.from_pretrained(directory) gives training's ids."""
  wordpiece = isinstance(tok, WordPieceTokenizer)
  settings = {
      "model_max_length": max_length,
      "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
      "tokenizer_class": "ElectraTokenizer" if wordpiece else "PreTrainedTokenizerFast",
      **{f"{name}_token": f"[{name.upper()}]" for name in ("unk", "sep", "pad", "cls", "mask")},
  }
  if wordpiece:
    name, source = "vocab.txt", tok.vocab_file
    pipeline = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    # strip_accents None: follow do_lower_case, as BERT's tokenizer (and ours) does.
    settings.update(do_lower_case=tok.lowercase, strip_accents=tok.strip_accents)
  else:
    name, source = "spm.model", tok.model_path
    pipeline = _sentencepiece_pipeline(tok.model_path)
    pipeline.add_special_tokens(list(SPECIAL_TOKENS))
  workdir_files.write_bytes(os.path.join(directory, name), pathlib.Path(source).read_bytes())
  pipeline.post_processor = tokenizers.processors.TemplateProcessing(
      single="[CLS] $A [SEP]",
      pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[("[CLS]", tok.cls_id), ("[SEP]", tok.sep_id)],
  )
  workdir_files.write_text(os.path.join(directory, "tokenizer.json"), pipeline.to_str(pretty=True))
  workdir_files.write_json(os.path.join(directory, "tokenizer_config.json"), settings)


def _sentencepiece_pipeline(model_path: str) -> tokenizers.Tokenizer:
  """sentencepiece's segmentation as a `tokenizers` pipeline: pieces and scores (unigram) or merges
  (BPE), its normalization table, and its spaces (trimmed, runs made one, "\u2581" before words)."""
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(pathlib.Path(model_path).read_bytes())
  spec = proto.trainer_spec
  pieces = [(piece.piece, piece.score) for piece in proto.pieces]
  if spec.model_type == spec.UNIGRAM:
    model = tokenizers.models.Unigram(pieces, spec.unk_id, spec.byte_fallback)
  else:
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    # One merge per way to cut a piece in two pieces, ranked by the merged piece's id.
    merges = sorted(
        (i, vocab[piece[:cut]], vocab[piece[cut:]], piece[:cut], piece[cut:])
        for piece, i in vocab.items()
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    )
    model = tokenizers.models.BPE(
        vocab,
        [merge[3:] for merge in merges],
        unk_token=pieces[spec.unk_id][0],
        fuse_unk=True,
        byte_fallback=spec.byte_fallback,
    )
  pipeline = tokenizers.Tokenizer(model)
  charsmap = proto.normalizer_spec.precompiled_charsmap
  spaces = [normalizers.Strip(), normalizers.Replace(tokenizers.Regex(" {2,}"), " ")]
  pipeline.normalizer = normalizers.Sequence(
      [normalizers.Precompiled(charsmap)] * bool(charsmap) + spaces
  )
  pipeline.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="always")
  pipeline.decoder = tokenizers.decoders.Metaspace(prepend_scheme="always")
  return pipeline
