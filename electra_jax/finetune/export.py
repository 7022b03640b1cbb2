"""Each finished seed of a fine-tuning workdir as a Hugging Face ElectraForSequenceClassification or
ElectraForQuestionAnswering directory, with its tokenizer."""

import contextlib
import os
import pathlib

import flax.linen as nn
import jax
import numpy as np
import safetensors.numpy
from absl import logging

from electra_jax import checkpointing, workdir_files
from electra_jax.encoder import EncoderConfig
from electra_jax.errors import ConfigError
from electra_jax.finetune import model as model_lib
from electra_jax.finetune import squad, trainer
from electra_jax.interop import export, hf

# GELU(x) == x in float32 once x >= _GELU_FLOOR (1 - Phi(8) ~ 6e-16 is below float32's epsilon).
_GELU_FLOOR = 8.0


def export_hf(workdir: str, out_dir: str, export_generator: bool = False) -> dict[str, str]:
  """`--mode=export_hf`: a pre-training workdir's towers, or each finished seed of a fine-tuning
  workdir as <out_dir>/<task>/seed_<s> (logits match ours); returns {what: directory}."""
  tasks = sorted(path.parent.name for path in pathlib.Path(workdir).glob("*/results.json"))
  if not tasks:
    return export.export_workdir(workdir, out_dir, export_generator)
  if export_generator:
    raise ConfigError(f"--export_generator: {workdir} is a fine-tuning workdir (no generator).")
  loaded = {task: load_task_model(workdir, task) for task in tasks}  # refusals before any write
  workdir_files.check_usable(out_dir, "--out")
  written = {}
  for task, (head, backbone, model, seeds) in loaded.items():
    if head.get("answerable"):
      line = "%s: the answerability head has no Hugging Face form and stays out (no-answer: [CLS])."
      logging.warning(line, task)
    for seed in seeds:
      written[f"{task}/seed_{seed}"] = directory = os.path.join(out_dir, task, f"seed_{seed}")
      _write(directory, backbone, head, restore_seed(workdir, task, seed, model))
  return written


def _classification_head(params, head: dict, encoder: EncoderConfig):
  """HF's ElectraClassificationHead (dense -> GELU -> out_proj) holding our one dense layer: dense
  adds c to lift every GELU input (at most |scale| sqrt(H) + |bias| after the final LayerNorm) to
  _GELU_FLOOR or above, where GELU is the identity, and out_proj takes c off; regression: lo, hi."""
  top = params["encoder"][f"layer_{encoder.num_layers - 1}"]
  norm = jax.tree.map(np.abs, top["output_layer_norm"])  # post-LN: HF's only form
  shift = norm["scale"] * np.sqrt(encoder.hidden_size) + norm["bias"] + _GELU_FLOOR
  kernel = np.asarray(params["classifier"]["kernel"], np.float64)
  bias = np.asarray(params["classifier"]["bias"], np.float64)
  if head["kind"] == "regression":
    lo, hi = head["target_range"] or (0.0, 1.0)
    kernel, bias = kernel * hi, bias * hi + lo
  return {
      "classifier.dense.weight": np.eye(encoder.hidden_size, dtype=np.float32),
      "classifier.dense.bias": shift.astype(np.float32),
      "classifier.out_proj.weight": np.ascontiguousarray(kernel.T, np.float32),  # no strides
      "classifier.out_proj.bias": (bias - shift.astype(np.float64) @ kernel).astype(np.float32),
  }


def load_task_model(workdir: str, task: str):
  """(head, backbone without weights, task model, finished seeds) of a fine-tuned task from its
  results.json; refused, before any weight is read, where Hugging Face has no class for it."""
  results = trainer.read_results(os.path.join(workdir, task))
  head, config = results["head"], results["config"]
  if head["kind"] != "span" and config.head.pooling != "cls":
    raise ConfigError(
        f"{workdir}/{task} was fine-tuned with head.pooling={config.head.pooling!r}, and Hugging "
        "Face's ElectraForSequenceClassification reads [CLS] only; fine-tune with head.pooling=cls."
    )
  config.random_init = True  # sizes and tokenizer: the weights come from the task's checkpoint
  backbone = model_lib.load_backbone(config)
  hf.check_hf_form(backbone.model.config)
  if head["kind"] == "span":
    model = backbone.task_model(squad.SquadModel, config, answerable=head["answerable"])
  else:
    model = backbone.classifier(1 if head["kind"] == "regression" else len(head["labels"]), config)
  return head, backbone, model, results["seeds"]


def restore_seed(workdir: str, task: str, seed: int, model):
  """The parameters (numpy) of one seed's kept checkpoint, for the task `model`."""
  ids = np.zeros((1, 8), np.int32)
  shapes = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), ids, ids, ids)))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)
  seed_dir = os.path.join(workdir, task, f"seed_{seed}")
  with contextlib.closing(checkpointing.Checkpointer(seed_dir, keep=1)) as checkpointer:
    step = checkpointer.latest_step(fix=f"fine-tune seed {seed} again")
    return jax.device_get(checkpointer.restore(step, abstract)["params"])


def _write(directory: str, backbone, head: dict, params) -> None:
  encoder = {"embeddings": params["embeddings"], "encoder": params["encoder"]}
  weights = hf.hf_weights_from_params(backbone.model, "encoder", encoder)
  tensors = {"electra." + name: value for name, value in weights.items()}
  settings = hf.hf_config_of(backbone.model, "encoder", backbone.tokenizer.pad_id)
  if head["kind"] == "span":
    span = params["span_head"]["span_logits"]
    tensors["qa_outputs.weight"] = np.ascontiguousarray(np.asarray(span["kernel"], np.float32).T)
    tensors["qa_outputs.bias"] = np.asarray(span["bias"], np.float32)
    settings.update(architectures=["ElectraForQuestionAnswering"], num_labels=2)
  else:
    tensors.update(_classification_head(params, head, backbone.model.config))
    settings["architectures"] = ["ElectraForSequenceClassification"]
    if head["kind"] == "regression":
      settings.update(num_labels=1, problem_type="regression")
    else:
      labels = dict(enumerate(head["labels"]))  # HF infers single-label classification
      settings.update(id2label=labels, label2id={label: i for i, label in labels.items()})
  workdir_files.write_json(os.path.join(directory, "config.json"), settings)
  path = os.path.join(directory, "model.safetensors")
  workdir_files.write_bytes(path, safetensors.numpy.save(tensors, metadata={"format": "pt"}))
  max_length = backbone.model.max_position_embeddings
  export.write_tokenizer_files(backbone.tokenizer, directory, max_length)
