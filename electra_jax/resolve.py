"""A run resolved before anything trains (`run`), writing nothing: every group checked, the mesh,
data, setup, the checkpoint to resume from and what a run decides at its start (a searched batch
size, a time budget's steps, an objective's fixed keys); nothing changes the config after it."""

import dataclasses
import functools
import math
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from electra_jax import (
    checkpointing,
    config_lib,
    data,
    distributed,
    memory,
    objectives,
    optimizer,
    partitioning,
    train_state,
    workdir_files,
)
from electra_jax.errors import CheckpointRotated, ConfigError, WorkdirInUse
from electra_jax.optimizer import Schedule
from electra_jax.train_state import TrainingSetup

_BUDGET_MARGIN = 0.03  # the share of the time left kept for logs, checkpoints and the host's work
_budget_clock = time.monotonic  # when the budget's time started and how much is spent


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a training run needs, resolved: nothing in it changes while the run trains."""

  config: ml_collections.FrozenConfigDict  # the config it trains, as config.json records it
  mesh: jax.sharding.Mesh
  corpus: data.PretrainingData  # the train split
  setup: TrainingSetup
  schedule: Schedule  # train_step's last argument
  start: checkpointing.Start | None  # None: a fresh state at train.seed
  saved_config: dict | None  # the workdir's config.json before this run, if any


def run(config: ml_collections.ConfigDict, workdir: str | None = None) -> Run:
  """`config` resolved for a run in `workdir` (None: no checkpoint is looked for). Every refusal
  comes from here, before anything is compiled for the run or written; a time budget counts here."""
  started = _budget_clock()
  if workdir is not None:
    workdir_files.check_usable(workdir)
  # --- Checks: the time budget, config.json (it names a checkpoint's other model), groups, mesh
  budget = config_lib.parse_duration(config.train.time_budget) if config.train.time_budget else 0
  saved = config_lib.saved_config(workdir) if workdir is not None else None
  changes = saved and config_lib.changed_keys(
      {"model": saved["model"]}, {"model": config_lib.as_saved(config)["model"]}
  )
  config_lib.validate(config)
  mesh = partitioning.make_mesh(config.mesh)
  partitioning.check_shards(mesh, config.train, jax.process_count())
  quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
  platform = jax.devices()[0].platform
  if config.model.attention_impl == "cudnn" and platform != "gpu":
    raise ConfigError(
        f"model.attention_impl='cudnn' is NVIDIA's fused attention, but the devices here are "
        f"{platform}: use model.attention_impl='xla' (or 'splash' on TPU)."
    )
  logging.info("Mesh %s over %d %s devices.", dict(mesh.shape), mesh.size, platform)

  # --- Data and setup (the setup depends on neither the batch size nor the run's length)
  corpus = data.load_pretraining_data(config.data, split="train")
  if config.train.batch_size > corpus.num_rows:
    raise ConfigError(
        f"train.batch_size={config.train.batch_size} is more than the {corpus.num_rows} training "
        "rows of this data: every batch would repeat rows. Lower train.batch_size, or add data."
    )
  if config.model.vocab_size < corpus.tokenizer.vocab_size:
    raise ConfigError(
        f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
        f"({corpus.tokenizer.vocab_size}). Set model.vocab_size >= {corpus.tokenizer.vocab_size}."
    )
  setup = train_state.build_setup(config, mesh, train_state.special_ids(corpus.tokenizer))
  # The same limit on every process (a host's free memory differs), so all find the same batch.
  t, device_bytes = config.train, memory.device_memory_bytes()
  if jax.process_count() > 1:  # in MiB: without jax_enable_x64 the gather is int32
    mib = multihost_utils.process_allgather(np.int32(device_bytes >> 20))
    device_bytes = int(mib.min()) << 20
  limit = int(t.memory_fraction * device_bytes)
  micro, seq_len = t.batch_size // t.grad_accum_steps, config.data.max_seq_len
  needs = memory.floor_bytes(setup, micro, seq_len, partitioning.batch_shards(mesh))
  if t.batch_size != -1 and needs > limit:
    cpu = " (on CPU, the host's available memory over its devices)" if platform == "cpu" else ""
    raise ConfigError(
        f"train.batch_size={t.batch_size} needs at least {needs / 2**30:.2f} GiB a device (state "
        f"and the inputs the backward pass keeps), more than train.memory_fraction="
        f"{t.memory_fraction:g} of the {device_bytes / 2**30:.2f} GiB a device has{cpu}: lower it, "
        "raise train.grad_accum_steps, or set train.batch_size=-1 for the largest batch that fits."
    )

  # --- What the run decides at its start: the checkpoint, the batch, the steps
  resolved = config.copy_and_resolve_references()
  with partitioning.activate(mesh):
    start = None if workdir is None else checkpointing.newest_start(workdir, setup, corpus, changes)
    if t.batch_size == -1:  # the largest that fits in train.memory_fraction of a device
      compile_step = functools.partial(train_state.compile_train_step, setup, config, mesh)
      batch_size, _ = memory.largest_batch(compile_step, limit, quantum)
      logging.info("train.batch_size=-1: using %d, the largest batch that fits.", batch_size)
      resolved.update_from_flattened_dict({"train.batch_size": batch_size})
    if t.time_budget and start and saved and saved["train"]["time_budget"] == t.time_budget:
      steps = int(saved["train"]["steps"])  # a resume under the same budget keeps its schedule
      logging.info(f"train.time_budget={t.time_budget}: train.steps={steps} as config.json has it.")
    elif t.time_budget:
      step_time, compile_time, eval_time = train_state.measure_step_time(
          resolved, setup, mesh, corpus
      )
      # The run compiles the same step again (jax's cache answers): compiling is not counted. The
      # steps, their evaluations and a last one fit in (1 - _BUDGET_MARGIN) of the budget left.
      left = (budget - (_budget_clock() - started)) * (1.0 - _BUDGET_MARGIN)
      every = config.eval.every_steps
      per_step = step_time + (eval_time / every if every else 0.0)
      new_steps = math.floor((left - (eval_time if every else 0.0)) / per_step)
      steps = (start.step if start else 0) + max(new_steps, 1)  # at least one new step
      logging.info(
          f"train.time_budget={t.time_budget}: measured {step_time:.4g} s/step (compiling "
          f"{compile_time:.1f} s, evaluation {eval_time:.1f} s), training {steps} steps."
      )
    if t.time_budget:
      resolved.update_from_flattened_dict({"train.steps": distributed.from_process_0(steps)})
  fixed = objectives.REGISTRY[config.objective.name].fixed_at_start(
      resolved, saved, start and start.step
  )
  resolved.update_from_flattened_dict(fixed)
  if (note := optimizer.warmup_note(resolved)) is not None:
    logging.warning("%s", note)
  schedule = optimizer.make_schedule(resolved)
  return Run(ml_collections.FrozenConfigDict(resolved), mesh, corpus, setup, schedule, start, saved)


def restore_checkpoint(workdir: str, setup, mesh, step: int | None = None, corpus=None):
  """(step, state) saved at `step` (default: the newest intact one) in `workdir`, sharded for `mesh`,
  once it is known to hold this setup's model (and given `corpus`, its data). The newest is read
  again when a live run rotates it away meanwhile; one that keeps doing so is refused as live."""
  for tries_left in reversed(range(3 if step is None else 1)):
    checkpointer = checkpointing.Checkpointer(workdir, keep=1)  # reading only: keep acts on saves
    try:
      latest = checkpointer.latest_step(fix="train first, or fix --workdir")
      if step is not None and step not in checkpointer.all_steps():
        raise ConfigError(
            f"{workdir} holds no checkpoint of step {step}; its checkpoints are of steps "
            f"{checkpointer.all_steps()}. Pick one of those, or leave --step out for the latest."
        )
      check = checkpointing.fits(checkpointer, setup, workdir, corpus)
      with partitioning.activate(mesh):
        if step is None:
          return checkpointer.restore_newest_intact(setup.abstract_state, latest, check)[:2]
        check(step, checkpointer.read_meta(step))
        return step, checkpointer.restore(step, setup.abstract_state)
    except CheckpointRotated as error:
      if not tries_left:
        raise WorkdirInUse(
            f"{workdir} is written by a live run: {error} Try again once it stops, or with a "
            "larger checkpoint.every_steps (it rotates less); its checkpoints are healthy."
        ) from None
      logging.info("%s Reading the newest again.", error)
    finally:
      checkpointer.close()
