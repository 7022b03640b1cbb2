"""A run resolved before anything trains. `run(config, workdir)` checks every config group once,
builds the mesh, the training data and the sharded setup, finds the checkpoint to resume from
(checked against that setup and data), and fixes what a run decides at its start: the batch size a
search finds (train.batch_size=-1), the steps a time budget gives, the keys an objective fixes. It
writes nothing, and after it nothing changes the config."""

import dataclasses
import math
import os
import time
from typing import Any, NamedTuple

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
    evaluation,
    memory,
    objectives,
    optimizer,
    partitioning,
    train_state,
    workdir_files,
)
from electra_jax.errors import ConfigError
from electra_jax.optimizer import Schedule
from electra_jax.train_state import TrainingSetup


@dataclasses.dataclass(frozen=True)
class Start:
  """The checkpoint a run goes on from."""

  step: int
  state: Any  # its arrays, sharded for the run's mesh
  stream_offset: int  # where its data stream stands beyond step * train.batch_size
  newer_damaged: bool  # newer steps did not restore: they are set aside before the run saves


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a training run needs, resolved: nothing in it changes while the run trains."""

  config: ml_collections.FrozenConfigDict  # the config it trains, as config.json records it
  workdir: str | None
  mesh: jax.sharding.Mesh
  corpus: data.PretrainingData  # the train split
  setup: TrainingSetup
  schedule: Schedule  # train_step's last argument
  start: Start | None  # None: a fresh state at train.seed
  saved_config: dict | None  # the workdir's config.json before this run, if any


def run(config: ml_collections.ConfigDict, workdir: str | None = None) -> Run:
  """`config` resolved for a run in `workdir` (None: no checkpoint is looked for). Every refusal
  comes from here, before anything is compiled for the run or written; a time budget counts from
  here."""
  started = _budget_clock()
  if workdir is not None:
    workdir_files.check_usable(workdir)
  # --- Config, mesh, data, setup
  config_lib.validate(config)
  mesh = partitioning.make_mesh(config.mesh)
  partitioning.check_process_shards(mesh, jax.process_count())
  platform = jax.devices()[0].platform
  if config.model.attention_impl == "cudnn" and platform != "gpu":
    raise ConfigError(
        f"model.attention_impl='cudnn' is NVIDIA's fused attention, but the devices here are "
        f"{platform}: use model.attention_impl='xla' (or 'splash' on TPU)."
    )
  auto_batch = config.train.batch_size == -1  # the largest batch that fits in device memory
  if not auto_batch:
    config_lib.validate_for_mesh(config, partitioning.batch_shards(mesh))
  logging.info("Mesh %s over %d %s devices.", dict(mesh.shape), mesh.size, platform)
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
  # The setup depends on neither the batch size nor the run's length.
  setup = train_state.build_setup(config, mesh, train_state.special_ids(corpus.tokenizer))

  # --- What the run decides at its start (a batch the search finds is a multiple of the shards)
  saved = config_lib.saved_config(workdir) if workdir is not None else None
  with partitioning.activate(mesh):
    if auto_batch:
      config = _with(config, {"train.batch_size": _largest_batch(config, setup, mesh)})
    start = _start(config, workdir, setup, corpus) if workdir is not None else None
    if config.train.time_budget:
      steps = _budget_steps(config, saved, start, mesh, corpus, setup, started)
      config = _with(config, {"train.steps": steps})
  fixed = objectives.REGISTRY[config.objective.name].fixed_at_start(
      config, saved, start and start.step
  )
  resolved = _with(config, fixed)
  if (note := optimizer.warmup_note(resolved)) is not None:
    logging.warning("%s", note)
  return Run(
      ml_collections.FrozenConfigDict(resolved),
      workdir,
      mesh,
      corpus,
      setup,
      optimizer.make_schedule(resolved),
      start,
      saved,
  )


def _with(config: ml_collections.ConfigDict, fixed: dict) -> ml_collections.ConfigDict:
  """A copy of `config` with the dotted keys of `fixed` set."""
  copy = config.copy_and_resolve_references()
  for key, value in fixed.items():
    group, name = key.split(".")
    copy[group][name] = value
  return copy


def _largest_batch(config, setup: TrainingSetup, mesh) -> int:
  """train.batch_size=-1: the largest global batch whose step fits in train.memory_fraction of a
  device's memory (every process takes the smallest answer: hosts may see different free memory)."""
  limit = int(config.train.memory_fraction * memory.device_memory_bytes())
  quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
  batch_size, _ = memory.largest_batch(step_compiler(config, setup, mesh), limit, quantum)
  if jax.process_count() > 1:
    batch_size = int(multihost_utils.process_allgather(np.int64(batch_size)).min())
  logging.info("train.batch_size=-1: using %d, the largest batch that fits.", batch_size)
  return batch_size


def step_compiler(config, setup: TrainingSetup, mesh):
  """batch_size -> the train step compiled for this config at that global batch (memory's probe)."""

  def compile_step(batch_size: int):
    with partitioning.activate(mesh):
      return train_state.compile_train_step(
          setup, _with(config, {"train.batch_size": batch_size}), mesh
      )

  return compile_step


# --- The checkpoint to go on from
def _start(config, workdir: str, setup: TrainingSetup, corpus) -> Start | None:
  """The newest intact checkpoint in `workdir` that holds this setup's model and this data, or None."""
  checkpointer = latest = None
  if workdir_files.exists(checkpointing.checkpoints_directory(workdir)):  # else none is made here
    checkpointer = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep)
    latest = checkpointer.latest_step()
  # One answer for every process, even if a save ends meanwhile.
  latest = distributed.from_process_0(-1 if latest is None else latest)
  if latest < 0 or checkpointer is None:
    if checkpointer is not None:
      checkpointer.close()
    if latest >= 0:
      raise ConfigError(
          f"--workdir={workdir} is not one directory every process sees: process 0 finds the "
          f"checkpoint at step {latest} there, process {jax.process_index()} finds none. On a "
          "multi-host slice use a bucket (gs://...) or a shared mount."
      )
    return None
  try:
    check = _checkpoint_check(checkpointer, setup, workdir, corpus, config)
    step, state, meta = checkpointer.restore_newest_intact(setup.abstract_state, latest, check)
  finally:
    checkpointer.close()
  # A checkpoint records the stream position it reached, so a run resumed with another batch size
  # (train.batch_size=-1 resolves it on each start) goes on from there.
  stream_offset = int(meta["stream_position"]) - step * config.train.batch_size if step else 0
  if stream_offset:
    logging.info(
        "The checkpoint at step %d read %d rows of the data stream (the batch size changed along "
        "the way); batches of %d go on from there.",
        step,
        meta["stream_position"],
        config.train.batch_size,
    )
  return Start(step, state, stream_offset, newer_damaged=step != latest)


def _checkpoint_check(checkpointer, setup, workdir: str, corpus=None, config=None):
  """(step, meta) -> None, refusing a checkpoint of another model, data (given `corpus`) or state
  structure; `config` names the model settings that differ."""

  def check(step: int, meta: dict) -> None:
    saved, current = meta["param_shapes"], setup.param_shapes
    for name in sorted(set(saved) | set(current)):
      if saved.get(name) != current.get(name):
        before = config_lib.saved_config(workdir) if config is not None else None
        changes = before and config_lib.changed_keys(
            {"model": before["model"]}, {"model": config_lib.as_saved(config)["model"]}
        )
        settings = (
            f" The model settings that differ from its config.json: {'; '.join(changes)}."
            if changes
            else ""
        )
        raise ConfigError(
            f"The workdir {workdir} holds a checkpoint of a different model: parameter {name!r} "
            f"is {saved.get(name, 'absent')} there but {current.get(name, 'absent')} in this "
            f"config.{settings} Use a new --workdir, or the config that made this checkpoint "
            f"({os.path.join(workdir, 'config.json')}). Nothing was overwritten."
        )
    if (
        corpus is not None and meta["data_fingerprint"] is None
    ):  # imported weights: bound to a vocabulary alone
      if meta["tokenizer_fingerprint"] != corpus.tokenizer.fingerprint:
        raise ConfigError(
            f"The checkpoint in {workdir} holds weights imported from {meta['imported_from']} with "
            f"their own vocabulary (tokenizer {meta['tokenizer_fingerprint']}), but this config "
            f"tokenizes with {corpus.tokenizer.fingerprint}. Train with the workdir's config.json "
            "(which names that vocabulary), e.g. leave out --config."
        )
    elif corpus is not None and meta["data_fingerprint"] != corpus.fingerprint:
      raise ConfigError(
          f"The checkpoint in {workdir} was trained on data {meta['data_fingerprint']} but this "
          f"config gives {corpus.fingerprint} (a different tokenizer, corpus, max_seq_len or data.pack_rows). "
          "Use a new --workdir, or the data settings of its config.json."
      )
    missing, extra = checkpointer.state_difference(step, setup.abstract_state)
    if missing or extra:
      optimizer = all(p.startswith("opt_state") for p in missing + extra)
      hint = (
          " optimizer.bias_correction decides whether Adam keeps a step count (True: optax's Adam; "
          "False: the official one): resume with the value in its config.json."
          if optimizer
          else ""
      )
      raise ConfigError(
          f"The checkpoint at step {step} in {workdir} holds {'an optimizer' if optimizer else 'a train'} state "
          f"of another structure than this config's (missing from it: {missing[:3] or 'none'}; only in it: "
          f"{extra[:3] or 'none'}).{hint} Or use a new --workdir. Nothing was overwritten."
      )

  return check


def restore_checkpoint(workdir: str, setup, mesh, step: int | None = None, corpus=None):
  """(step, state): the state saved at `step` (default: the newest intact one) in `workdir`, sharded
  for `mesh`, once the checkpoint is known to hold this setup's model (and given `corpus`, its data).
  """
  checkpointer = checkpointing.Checkpointer(workdir, keep=1)  # reading only: keep acts on saves
  try:
    latest = step is None
    step = checkpointer.latest_step() if latest else step
    if step is None:
      raise ConfigError(f"{workdir} holds no checkpoint yet; train first or fix --workdir.")
    if step not in checkpointer.all_steps():
      raise ConfigError(
          f"{workdir} holds no checkpoint of step {step}; its checkpoints are of steps "
          f"{checkpointer.all_steps()}. Pick one of those, or leave --step out for the latest."
      )
    check = _checkpoint_check(checkpointer, setup, workdir, corpus)
    with partitioning.activate(mesh):
      if latest:
        return checkpointer.restore_newest_intact(setup.abstract_state, step, check)[:2]
      check(step, checkpointer.read_meta(step))
      return step, checkpointer.restore(step, setup.abstract_state)
  finally:
    checkpointer.close()


# --- train.time_budget
_BUDGET_MARGIN = 0.03  # the share of the time left kept for logs, checkpoints and the host's work
_TIMED_STEPS = 3  # after one warm-up step
_budget_clock = time.monotonic  # when the budget's time started and how much is spent


class StepTiming(NamedTuple):
  """What measure_step_time found, in seconds."""

  step: float  # one compiled training step
  compile: (
      float  # compiling the step and the evaluation (again only if the objective reads train.steps)
  )
  evaluation: float  # one held-out evaluation (0 without eval.every_steps)


def _timed(fn, *args):
  """(fn(*args) once its arrays are ready, the seconds that took)."""
  clock = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return result, time.perf_counter() - clock


def measure_step_time(config, setup: TrainingSetup, mesh, corpus) -> StepTiming:
  """Times the train step on a throwaway state and batch 0 (after a warm-up step) and one held-out
  evaluation (after a first that compiles), inside partitioning.activate(mesh); nothing of the run
  is advanced."""
  seed, schedule = config.train.seed, optimizer.make_schedule(config)
  step_fn, compile_seconds = _timed(train_state.compile_train_step, setup, config, mesh)
  local = data.get_batch(
      corpus, 0, config.train.batch_size, seed, jax.process_index(), jax.process_count()
  )
  batch = partitioning.global_batch_from_local(local, mesh, keys=train_state.batch_keys(config))
  rng = train_state.step_rng(seed, 0)
  (state, _), _ = _timed(step_fn, train_state.fresh_state(setup, seed), batch, rng, schedule)

  def timed_steps(state):
    for _ in range(_TIMED_STEPS):
      state, metrics = step_fn(state, batch, rng, schedule)
    return state, metrics

  (state, _), seconds = _timed(timed_steps, state)
  eval_seconds = 0.0
  if config.eval.every_steps:
    evaluator = evaluation.HeldOutEvaluator(config, setup, mesh, schedule)
    first, eval_seconds = _timed(evaluator, state)[1], _timed(evaluator, state)[1]
    compile_seconds += max(first - eval_seconds, 0.0)
  return StepTiming(seconds / _TIMED_STEPS, compile_seconds, eval_seconds)


def budget_steps(
    budget_seconds: float,
    elapsed_seconds: float,
    timing: StepTiming,
    eval_every: int,
    start_step: int,
) -> int:
  """train.steps for a run at `start_step`: the most new steps (at least one) for which compiling
  again, the steps and their evaluations fit in (1 - _BUDGET_MARGIN) of the budget left."""
  left = (budget_seconds - elapsed_seconds - timing.compile) * (1.0 - _BUDGET_MARGIN)
  per_step = timing.step + (timing.evaluation / eval_every if eval_every else 0.0)
  new_steps = math.floor((left - (timing.evaluation if eval_every else 0.0)) / per_step)
  return start_step + max(new_steps, 1)


def _budget_steps(
    config, saved: dict | None, start: Start | None, mesh, corpus, setup, started
) -> int:
  """train.steps for train.time_budget: on a resume under the same budget what config.json records
  (the interrupted run's schedule), else process 0's budget_steps since `started`."""
  t = config.train
  if start is not None and saved is not None and saved["train"]["time_budget"] == t.time_budget:
    steps = int(saved["train"]["steps"])
    logging.info(
        "train.time_budget=%s: train.steps=%d, as this workdir's config.json records.",
        t.time_budget,
        steps,
    )
  else:
    timing = measure_step_time(config, setup, mesh, corpus)
    budget, elapsed = config_lib.parse_duration(t.time_budget), _budget_clock() - started
    # The run compiles the same program again (jax's cache answers), so compiling is not counted.
    steps = budget_steps(
        budget,
        elapsed,
        timing._replace(compile=0.0),
        config.eval.every_steps,
        start.step if start else 0,
    )
    logging.info(
        "train.time_budget=%s: measured %.4g s/step (compiling %.1f s, evaluation %.1f s), training %d steps.",
        t.time_budget,
        timing.step,
        timing.compile,
        timing.evaluation,
        steps,
    )
  return distributed.from_process_0(steps)
