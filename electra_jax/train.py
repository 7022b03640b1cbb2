"""Pre-training: the optimizer, `train_step(state, batch, rng, schedule)`, the sharded setup, and
`train_and_evaluate`: config, mesh, data and model (`prepare`), checkpoint, time budget, lease,
then the loop with its logs, evaluations, checkpoints, preemption and NaN handling."""

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils

from electra_jax import (
    checkpointing,
    config_lib,
    data,
    evaluation,
    flops,
    memory,
    objectives,
    partitioning,
    tensorboard_log,
    workdir_files,
    workdir_lease,
)
from electra_jax.errors import ConfigError
from electra_jax.models import ElectraPretrainer, build_model


@flax.struct.dataclass
class TrainState:
  """Everything a step changes (step, params, opt_state) plus, as static fields, what it uses."""

  step: jax.Array
  params: Any
  opt_state: Any
  model: ElectraPretrainer = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  objective: objectives.ElectraObjective = flax.struct.field(pytree_node=False)
  grad_accum_steps: int = flax.struct.field(pytree_node=False, default=1)


# --- Optimizer
class OfficialAdamState(NamedTuple):
  mu: Any
  nu: Any


def scale_by_adam_without_bias_correction(b1: float, b2: float, eps: float):
  """Adam's direction m / (sqrt(v) + eps) without bias correction, as ELECTRA's AdamWeightDecayOptimizer."""

  def init(params):
    return OfficialAdamState(
        jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)
    )

  def update(updates, state, params=None):
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return direction, OfficialAdamState(mu, nu)

  return optax.GradientTransformation(init, update)


@flax.struct.dataclass
class Schedule:
  """The official rate peak * min(1, step / warmup) * max(0, 1 - step / total) and the temperature's decay
  steps, as float32 arrays: an argument of the compiled step, so runs that differ only there (a resume with
  more steps, a time budget, a sweep over rates) share one program. The rate divides by the counts: 427 *
  float32(1 / 427) is below 1, which would leave it above 0 at the last step."""

  peak: jax.Array
  warmup: jax.Array  # at least 1
  total: jax.Array
  temperature_decay: jax.Array  # 0: no temperature schedule

  def __call__(self, step):
    step = jnp.asarray(step, jnp.float32)
    return (
        self.peak
        * jnp.minimum(1.0, step / self.warmup)
        * (jnp.maximum(0.0, self.total - step) / self.total)
    )


def learning_rate_schedule(
    base_lr: float, warmup_steps: int, total_steps: int, temperature_decay_steps: int = 0
) -> Schedule:
  if total_steps < 1:
    raise ValueError(f"total_steps={total_steps}: the schedule needs at least one step")
  return Schedule(
      *(
          jnp.float32(value)
          for value in (base_lr, max(warmup_steps, 1), total_steps, temperature_decay_steps)
      )
  )


def scale_by_schedule_argument() -> optax.GradientTransformationExtraArgs:
  """optax.scale_by_learning_rate with the Schedule passed to update (`schedule=`) instead of built in."""

  def update(updates, state, params=None, *, schedule: Schedule, **extra):
    del params, extra
    step_size = -1 * schedule(state.count)
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(
      lambda params: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32)), update
  )


def _decays(path, _) -> bool:
  # Weight decay on matrices and embedding tables only, never on LayerNorm or any bias.
  return getattr(path[-1], "key", None) in ("kernel", "embedding")


def warmup_steps(config: ml_collections.ConfigDict) -> int:
  """optimizer.warmup_steps, or round(optimizer.warmup_fraction * train.steps) when that is > 0."""
  o = config.optimizer
  return round(o.warmup_fraction * config.train.steps) if o.warmup_fraction > 0 else o.warmup_steps


def warmup_note(config: ml_collections.ConfigDict) -> str | None:
  """A warning when the warmup does not end before the run (None when it does)."""
  warmup, steps = warmup_steps(config), config.train.steps
  if warmup < steps:
    return None
  return (
      f"optimizer.warmup_steps={warmup} is not shorter than train.steps={steps}: the learning rate "
      f"reaches at most {100 * steps / (4 * warmup):.1f}% of optimizer.learning_rate="
      f"{config.optimizer.learning_rate:g}. Lower optimizer.warmup_steps, or set "
      "optimizer.warmup_fraction (e.g. 0.1) to tie it to the run's length."
  )


def make_optimizer(config: ml_collections.ConfigDict):
  """(tx, schedule): global-norm clipping, then AdamW (optax's, or the official one without bias
  correction), scaled by the official schedule, which tx.update takes as `schedule=`."""
  o = config.optimizer
  tx = _optimizer(o.bias_correction, o.b1, o.b2, o.eps, o.clip_norm, o.weight_decay)
  return tx, learning_rate_schedule(
      o.learning_rate,
      warmup_steps(config),
      config.train.steps,
      objectives.temperature_decay_steps(config),
  )


@functools.cache
def _optimizer(bias_correction, b1, b2, eps, clip_norm, weight_decay):
  # One tx per setting: a static field of TrainState, so an equal config trained again in this process
  # has an equal state structure and jax reuses the traced and compiled steps.
  if bias_correction:
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  else:
    adam = scale_by_adam_without_bias_correction(b1, b2, eps)
  decay_mask = functools.partial(
      jax.tree_util.tree_map_with_path, _decays, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      adam,
      optax.add_decayed_weights(weight_decay, mask=decay_mask),
      scale_by_schedule_argument(),
  )


# --- Update step
def train_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array, schedule: Schedule):
  """One optimizer update on `batch` ([batch, seq] arrays). Masks are drawn for the whole batch first, so
  micro-batch losses share whole-batch denominators and their gradients sum to the full one."""
  objective = state.objective
  registered = objectives.REGISTRY[objective.name]
  params = registered.before_step(objective, state.params, state.step)
  mask_rng, sample_rng, dropout_rng = jax.random.split(rng, 3)
  masked = objectives.mask_tokens(mask_rng, batch["input_ids"], batch["attention_mask"], objective)
  sample_keys = jax.random.split(sample_rng, batch["input_ids"].shape[0])
  normalizers = objectives.Normalizers.of(
      masked,
      batch["attention_mask"],
      objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
  )
  temperature = objectives.sampling_temperature(objective, state.step, schedule.temperature_decay)

  def loss_fn(params, micro_batch, micro_masked, micro_sample_keys, micro_dropout_rng):
    return objectives.electra_forward(
        state.model,
        params,
        micro_batch,
        micro_masked,
        micro_sample_keys,
        micro_dropout_rng,
        objective,
        normalizers,
        step=state.step,
        temperature=temperature,
    )

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  num_micro = state.grad_accum_steps
  if num_micro == 1:
    (_, (stats, per_token)), grads = grad_fn(params, batch, masked, sample_keys, dropout_rng)
  else:
    # Micro-batch i takes rows i, i + k, i + 2k, ...: each stays spread over every data shard.
    def split(x):
      return x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)

    micro_inputs = jax.tree.map(split, (batch, masked, sample_keys))
    micro_dropout_rngs = jax.random.split(dropout_rng, num_micro)

    def accumulate(carry, inputs):
      (micro_batch, micro_masked, micro_keys), micro_dropout_rng = inputs
      (_, (stats, per_token)), grads = grad_fn(
          params, micro_batch, micro_masked, micro_keys, micro_dropout_rng
      )
      return jax.tree.map(jnp.add, carry, (grads, stats)), per_token

    first = jax.tree.map(lambda x: x[0], micro_inputs)
    (_, (stats_shape, _)), grads_shape = jax.eval_shape(
        grad_fn, params, *first, micro_dropout_rngs[0]
    )
    zeros = jax.tree.map(jnp.zeros_like, (grads_shape, stats_shape))
    (grads, stats), per_token = jax.lax.scan(accumulate, zeros, (micro_inputs, micro_dropout_rngs))

  updates, opt_state = state.tx.update(grads, state.opt_state, params, schedule=schedule)
  params = optax.apply_updates(params, registered.updates(objective, updates, state.step))
  metrics = objectives.summarize(stats, per_token, objective)
  metrics["grad_norm"] = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
  metrics["learning_rate"] = schedule(state.step)
  # NaN where nothing is sampled: mlm's step then does not depend on the temperature keys.
  metrics["sampling_temperature"] = jnp.asarray(
      temperature if registered.samples else jnp.nan, jnp.float32
  )
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def train_steps(
    state: TrainState, batches: dict[str, jax.Array], rngs: jax.Array, schedule: Schedule
):
  """train_step over batches and rngs stacked on a leading axis; each step's metrics stacked."""
  return jax.lax.scan(lambda s, inputs: train_step(s, *inputs, schedule), state, (batches, rngs))


def step_rng(seed: int, step: int) -> jax.Array:
  """The step's randomness depends only on (seed, step), so a resumed run draws the same."""
  return jax.random.fold_in(jax.random.key(seed), step)


def step_rngs(seed: int, first_step: int, num_steps: int) -> jax.Array:
  """step_rng(seed, s) for s in first_step .. first_step + num_steps - 1, stacked."""
  return jax.vmap(lambda s: step_rng(seed, s))(jnp.arange(first_step, first_step + num_steps))


# --- Building the state
@dataclasses.dataclass(frozen=True)
class StateInit:
  """rng -> a fresh state, its parameters still boxed (nn.Partitioned) for the shardings. Equal settings
  make equal (hashable) inits, so a state is initialized by one traced function per setting."""

  model: ElectraPretrainer
  objective: objectives.ElectraObjective
  tx: optax.GradientTransformation
  seq_len: int
  grad_accum_steps: int

  def __call__(self, rng: jax.Array) -> TrainState:
    ids = jnp.zeros((1, self.seq_len), jnp.int32)
    positions = jnp.zeros((1, self.objective.max_predictions), jnp.int32)
    params = self.model.init(rng, ids, ids, jnp.ones_like(ids), positions)["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.tx.init(params),
        model=self.model,
        tx=self.tx,
        objective=self.objective,
        grad_accum_steps=self.grad_accum_steps,
    )


def make_init_fn(config, model: ElectraPretrainer, objective) -> StateInit:
  return StateInit(
      model,
      objective,
      make_optimizer(config)[0],
      config.data.max_seq_len,
      config.train.grad_accum_steps,
  )


def _unboxed_init(init: StateInit, rng: jax.Array) -> TrainState:
  return nn.meta.unbox(init(rng))


def fresh_state(setup, seed: int) -> TrainState:
  """The state a run starts from: `setup.init_fn` at key(seed), each device initializing its own shards."""
  init = jax.jit(_unboxed_init, static_argnums=0, out_shardings=setup.state_shardings)
  return init(setup.init_fn, jax.random.key(seed))


def param_shapes(params) -> dict[str, list[int]]:
  """{'generator/encoder/layer_0/...': shape}, stored with each checkpoint."""
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(params), sep="/")
  return {name: list(leaf.shape) for name, leaf in flat.items()}


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
  """What the loop, the benchmarks and the tests need to build and step a sharded state."""

  model: ElectraPretrainer
  objective: objectives.ElectraObjective
  init_fn: StateInit
  state_shardings: TrainState  # NamedSharding leaves
  abstract_state: TrainState  # ShapeDtypeStruct leaves carrying those shardings
  param_shapes: dict[str, list[int]]
  schedule: Schedule  # train_step's last argument


def build_setup(config, mesh, special_ids: dict[str, int]) -> TrainingSetup:
  model = build_model(config)
  objective = objectives.objective_from_config(config, special_ids)
  init_fn = make_init_fn(config, model, objective)
  boxed_shapes = jax.eval_shape(init_fn, jax.random.key(0))
  state_shardings = partitioning.shardings_for(boxed_shapes, mesh)
  unsharded = partitioning.unsharded_dimensions(boxed_shapes.params, mesh)
  if unsharded:
    logging.warning(
        "Replicated on every device because a mesh axis does not divide them (each one's "
        "optimizer moments too): %s. Make those sizes multiples of the mesh axes (e.g. "
        "model.vocab_size), or use smaller mesh axes.",
        "; ".join(unsharded),
    )
  abstract_state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      nn.meta.unbox(boxed_shapes),
      state_shardings,
  )
  return TrainingSetup(
      model,
      objective,
      init_fn,
      state_shardings,
      abstract_state,
      param_shapes(boxed_shapes.params),
      make_optimizer(config)[1],
  )


def batch_keys(config) -> tuple[str, ...]:
  """The arrays of a training batch that go to the devices (`data.batch_keys`)."""
  return data.batch_keys(bool(config.data.pack_rows))


def compile_train_step(setup: TrainingSetup, config, mesh, num_steps: int | None = None):
  """train_step compiled for this config's global batch with the state donated, or with `num_steps`,
  train_steps over that many stacked batches and keys. Call it inside `partitioning.activate(mesh)`.
  """
  # Abstract keys: compile-only devices (benchmarks/compile_audit.py) cannot run anything.
  if num_steps is None:
    fn, batch_sharding, leading = train_step, partitioning.batch_sharding(mesh), ()
    rng = jax.eval_shape(lambda: jax.random.key(0))
  else:
    fn, batch_sharding, leading = (
        train_steps,
        partitioning.stacked_batch_sharding(mesh),
        (num_steps,),
    )
    rng = jax.eval_shape(lambda: step_rngs(0, 0, num_steps))
  replicated = partitioning.replicated(mesh)
  shape = (*leading, config.train.batch_size, config.data.max_seq_len)
  abstract_batch = {
      name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
      for name in batch_keys(config)
  }
  abstract_rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated)
  abstract_schedule = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated), setup.schedule
  )
  jitted = jax.jit(
      fn,
      in_shardings=(setup.state_shardings, batch_sharding, replicated, replicated),
      out_shardings=(setup.state_shardings, replicated),
      donate_argnums=(0,),
  )
  return jitted.lower(
      setup.abstract_state, abstract_batch, abstract_rng, abstract_schedule
  ).compile()


def step_compiler(config, setup: TrainingSetup, mesh):
  """batch_size -> compile_train_step for this config at that global batch (memory's probe)."""

  def compile_step(batch_size: int):
    sized = config.copy_and_resolve_references()
    sized.train.batch_size = batch_size
    with partitioning.activate(mesh):
      return compile_train_step(setup, sized, mesh)

  return compile_step


def special_ids(tokenizer) -> dict[str, int]:
  """The token ids build_setup needs from the corpus's tokenizer."""
  return dict(
      pad=tokenizer.pad_id,
      cls=tokenizer.cls_id,
      sep=tokenizer.sep_id,
      mask=tokenizer.mask_id,
      vocab_size=tokenizer.vocab_size,
  )


def _from_process_0(value: int) -> int:
  """`value` as process 0 has it, on every process."""
  return (
      int(multihost_utils.broadcast_one_to_all(np.int32(value)))
      if jax.process_count() > 1
      else value
  )


def prepare(config):
  """Config checks, mesh, training data and the sharded setup, in that order: every mistake is
  reported before anything is compiled or written."""
  config_lib.validate(config)  # everything checkable without devices or data
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
  tokenizer = corpus.tokenizer
  if config.model.vocab_size < tokenizer.vocab_size:
    raise ConfigError(
        f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
        f"({tokenizer.vocab_size}). Set model.vocab_size >= {tokenizer.vocab_size}."
    )
  setup = build_setup(config, mesh, special_ids(tokenizer))
  if auto_batch:  # the setup does not depend on the batch; config.json records the one found
    limit = int(config.train.memory_fraction * memory.device_memory_bytes())
    quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
    batch_size, _ = memory.largest_batch(step_compiler(config, setup, mesh), limit, quantum)
    if jax.process_count() > 1:  # hosts may see different free memory: all take the smallest answer
      batch_size = int(multihost_utils.process_allgather(np.int64(batch_size)).min())
    config.train.batch_size = batch_size
    logging.info("train.batch_size=-1: using %d, the largest batch that fits.", batch_size)
    config_lib.validate_for_mesh(config, partitioning.batch_shards(mesh))
  return mesh, corpus, setup


# --- Checkpoints
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


def evaluate_checkpoint(
    config: ml_collections.ConfigDict, workdir: str, step: int | None = None
) -> dict:
  """Held-out metrics of a saved checkpoint (the latest unless `step` is given), also written to
  <workdir>/eval_step_<N>.json."""
  mesh, corpus, setup = prepare(config)
  step, state = restore_checkpoint(workdir, setup, mesh, step, corpus)
  held_out = evaluation.HeldOutEvaluator(config, setup, mesh)(state)
  held_out["step"] = step
  if jax.process_index() == 0:
    workdir_files.write_json(workdir_files.path(workdir, f"eval_step_{step}.json"), held_out)
  return held_out


def _keep_changed_config(config, workdir: str, start_step: int | None) -> None:
  """Resuming with other settings: says which, and keeps the config the checkpoint was trained with
  as config.step<N>.json before config.json takes the new one."""
  before = config_lib.saved_config(workdir) if start_step is not None else None
  changes = (
      config_lib.changed_keys(before, config_lib.as_saved(config)) if before is not None else None
  )
  if not changes:
    return
  kept = workdir_files.path(workdir, f"config.step{start_step}.json")
  # A second resume from the same checkpoint finds the first one's settings in config.json,
  # which never trained it: the file the first resume kept stays as it is.
  if not workdir_files.exists(kept):
    workdir_files.write_text(
        kept, workdir_files.read_text(workdir_files.path(workdir, "config.json"))
    )
  logging.warning(
      "Resuming at step %d with settings that differ from the workdir's config.json (kept as %s): %s",
      start_step,
      f"config.step{start_step}.json",
      "; ".join(changes),
  )


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
  evaluation (after a first that compiles); nothing of the run is advanced."""
  seed = config.train.seed
  with partitioning.activate(mesh):
    step_fn, compile_seconds = _timed(compile_train_step, setup, config, mesh)
    local = data.get_batch(
        corpus, 0, config.train.batch_size, seed, jax.process_index(), jax.process_count()
    )
    batch = partitioning.global_batch_from_local(local, mesh, keys=batch_keys(config))
    rng = step_rng(seed, 0)
    (state, _), _ = _timed(step_fn, fresh_state(setup, seed), batch, rng, setup.schedule)

    def timed_steps(state):
      for _ in range(_TIMED_STEPS):
        state, metrics = step_fn(state, batch, rng, setup.schedule)
      return state, metrics

    (state, _), seconds = _timed(timed_steps, state)
  eval_seconds = 0.0
  if config.eval.every_steps:
    evaluator = evaluation.HeldOutEvaluator(config, setup, mesh)
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


def resolve_time_budget(
    config, workdir: str, start_step: int | None, mesh, corpus, setup: TrainingSetup, started: float
) -> None:
  """Sets train.steps for train.time_budget: on a resume under the same budget what config.json
  records (the interrupted run's schedule), else process 0's budget_steps since `started`."""
  t = config.train
  saved = config_lib.saved_config(workdir) if start_step is not None else None
  if saved is not None and saved["train"]["time_budget"] == t.time_budget:
    steps = int(saved["train"]["steps"])
    logging.info(
        "train.time_budget=%s: train.steps=%d, as this workdir's config.json records.",
        t.time_budget,
        steps,
    )
  else:
    timing = measure_step_time(config, setup, mesh, corpus)
    budget, elapsed = config_lib.parse_duration(t.time_budget), _budget_clock() - started
    steps = budget_steps(
        budget, elapsed, timing._replace(compile=0.0), config.eval.every_steps, start_step or 0
    )
    # The schedule is an argument of the compiled step: it compiles again only for an objective
    # that reads train.steps (two_stage's switch at half the run).
    sized = config.copy_and_resolve_references()
    sized.train.steps = steps
    if objectives.objective_from_config(sized, special_ids(corpus.tokenizer)) != setup.objective:
      steps = budget_steps(budget, elapsed, timing, config.eval.every_steps, start_step or 0)
    logging.info(
        "train.time_budget=%s: measured %.4g s/step (compiling %.1f s, evaluation %.1f s), training %d steps.",
        t.time_budget,
        timing.step,
        timing.compile,
        timing.evaluation,
        steps,
    )
  t.steps = _from_process_0(steps)


# --- SIGTERM, the lease, non-finite values
# Set by any SIGTERM this process took, a run's handler or a sweep's (sweep.py asks after each
# run, so one that came during a run's last step, or between runs, still stops the sweep).
_SIGTERM = threading.Event()


def sigterm_received() -> bool:
  return _SIGTERM.is_set()


def clear_sigterm() -> None:
  _SIGTERM.clear()


def note_sigterm(signum=None, frame=None) -> None:
  """A SIGTERM handler that only records the signal (for loops around several runs)."""
  _SIGTERM.set()


class _Preemption:
  """SIGTERM for a whole run: while it starts it unwinds at once (SystemExit(0), the lease released);
  once the loop runs, SIGTERM or a first Ctrl-C ends it after a step, with a checkpoint. Under
  jax.distributed the save is collective: JAX's preemption service, which catches SIGTERM from
  initialize on, picks a loop call every process reaches; no Python handler then."""

  def __init__(self):
    self.requested = self.unwound = self.looping = False
    self.signal_name = "SIGTERM"
    self._previous = {}
    self._collective = jax.distributed.is_initialized()

  def _install(self, signum) -> None:
    if jax.process_count() == 1 and not self._collective:
      with contextlib.suppress(
          ValueError
      ):  # not the main thread (some notebook runners): no handler then
        self._previous[signum] = signal.signal(signum, self._handle)

  def __enter__(self):
    self._install(signal.SIGTERM)
    return self

  def start_loop(self) -> None:
    self.looping = True
    if (
        jax.process_count() > 1 and not self._collective
    ):  # several processes joined by the runtime alone
      logging.warning(
          "%d processes without jax.distributed: a SIGTERM stops this run without a checkpoint "
          "(it resumes from the last periodic one). Start it through electra_jax.main, which "
          "joins the job.",
          jax.process_count(),
      )
    self._install(
        signal.SIGINT
    )  # a first Ctrl-C saves at the end of the step too; a second one stops at once

  def _handle(self, signum, frame):
    if not self.looping:
      self.unwound = True
      raise SystemExit(0)
    self.requested = True
    _SIGTERM.set()
    if signum == signal.SIGINT:
      self.signal_name = "Ctrl-C (SIGINT)"
      signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))

  def stop_after(self, call: int) -> bool:
    if self._collective and not self.requested:
      try:
        self.requested = multihost_utils.reached_preemption_sync_point(call)
        if self.requested:
          _SIGTERM.set()
      except RuntimeError as error:  # jax_enable_preemption_service=False
        logging.warning(
            "No preemption handling (%s): a SIGTERM stops this run without a checkpoint; it "
            "resumes from the last periodic one.",
            error,
        )
        self._collective = False
    return self.requested

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    if self.unwound:
      logging.warning(
          "SIGTERM while the run was starting: it stopped before its first step and saved "
          "nothing new. Run the same command to go on."
      )


def _refused_everywhere(attempt: Callable[[], Any] | None) -> None:
  """Runs process 0's `attempt` (None on the others); a WorkdirInUse it raises is raised on every process."""
  problem = None
  if attempt is not None:
    try:
      attempt()
    except workdir_lease.WorkdirInUse as error:
      problem = str(error)
  if _from_process_0(problem is not None):
    raise workdir_lease.WorkdirInUse(problem or "Process 0 stopped the run; its log says why.")


def _hold_workdir(lease: workdir_lease.WorkdirLease | None, max_age_seconds: float = 0.0) -> None:
  """Raises WorkdirInUse on every process once another run has taken the workdir over."""
  _refused_everywhere(None if lease is None else lambda: lease.check(max_age_seconds))


def acquire_lease(
    directory: str, take_over: bool, name: str = "The workdir"
) -> workdir_lease.WorkdirLease | None:
  """Process 0 takes `directory`'s lease (returned; None on the other processes), or every
  process raises WorkdirInUse with its message."""
  lease = workdir_lease.WorkdirLease(directory, name=name) if jax.process_index() == 0 else None
  _refused_everywhere(None if lease is None else lambda: lease.acquire(take_over=take_over))
  return lease


def _check_shared_workdir(workdir: str, lease: workdir_lease.WorkdirLease | None) -> None:
  """Every process must see the lease process 0 just wrote: checkpoints are saved by all together,
  and a workdir local to each host would leave orbax waiting forever."""
  if jax.process_count() == 1:
    return
  run_id = lease.run_id if lease is not None else ""
  ids = (
      np.frombuffer(run_id.encode().ljust(32), np.uint8)
      if jax.process_index() == 0
      else np.zeros(32, np.uint8)
  )
  expected = bytes(np.asarray(multihost_utils.broadcast_one_to_all(ids), np.uint8)).decode().strip()
  seen = (workdir_lease.read_lease(workdir) or {}).get("run_id")
  sees = np.asarray(multihost_utils.process_allgather(np.int32(seen == expected))).reshape(-1)
  blind = [int(i) for i in np.flatnonzero(sees == 0)]
  if blind:
    raise ConfigError(
        f"--workdir={workdir} is not one directory every process sees: process(es) {blind} cannot "
        f"read the {workdir_lease.LEASE_FILE} process 0 wrote there, and checkpoints are saved by "
        "all processes together. On a multi-host slice use a bucket (gs://...) or a shared mount."
    )


def _stop_if_not_finite(
    what: str, value: float, step: int, checkpointer, config, first_bad_step=None
) -> None:
  """Stops the run when `value` is not finite; `first_bad_step`, when known, tells whether the
  latest checkpoint already produced it."""
  if math.isfinite(value):
    return
  checkpointer.wait()  # the last good checkpoint may still be being written
  latest = checkpointer.latest_step()
  dtype_hint = ", or use train.dtype=float32" if config.train.dtype != "float32" else ""
  diverged = ""
  if latest is not None and first_bad_step is not None and latest >= first_bad_step - 1:
    diverged = (
        f" Its parameters are finite but already gave step {latest + 1} a non-finite loss: "
        "resume from an earlier checkpoint (checkpoint.keep keeps more) or start over."
    )
  saved = (
      f"The last checkpoint is step {latest}."
      if latest is not None
      else "No checkpoint was saved yet: the next start begins from scratch."
  )
  raise FloatingPointError(
      f"The {what} became {value} by step {step}; stopping without saving. {saved}{diverged} "
      f"Lower optimizer.learning_rate or raise optimizer.warmup_steps{dtype_hint}."
  )


def _first_non_finite_step(window: list, last_step: int) -> int | None:
  """The first step of a log window (ending at `last_step`) whose loss was not finite."""
  losses = np.concatenate([np.ravel(m["loss"]) for m in jax.device_get(window)])
  bad = np.flatnonzero(~np.isfinite(losses))
  return int(last_step - len(losses) + 1 + bad[0]) if bad.size else None


@jax.jit
def _params_finite(params) -> jax.Array:
  """Whether every parameter is finite: a step's loss is taken before its update, which may overflow."""
  return jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(params)]))


# NaN on some healthy steps (a step's tokens all one class, an empty bin): their window mean skips NaN
# steps. Any other NaN (loss, grad_norm, ...) is a diverged step and must show in the mean.
_NAN_WHEN_HEALTHY = frozenset({"disc_auc", *objectives.BINNED_METRICS})


def _mean_metrics(window: list[dict]) -> dict[str, float]:
  """Means over the window: NaN if any step's was, except that _NAN_WHEN_HEALTHY skip NaN steps."""
  host = jax.device_get(window)  # one entry per call: scalars, or [k] for k steps per call
  means = {}
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
    for name in host[0]:
      values = np.concatenate([np.ravel(m[name]) for m in host])
      means[name] = float(np.nanmean(values) if name in _NAN_WHEN_HEALTHY else np.mean(values))
  return means


def _periods(config) -> dict[str, int]:
  """The steps between logs, checkpoints and evaluations."""
  periods = {
      "train.log_every": config.train.log_every,
      "checkpoint.every_steps": config.checkpoint.every_steps,
  }
  if config.eval.every_steps:
    periods["eval.every_steps"] = config.eval.every_steps
  return periods


def _warn_single_steps(config, steps_per_call: int) -> None:
  """Says so when train.steps_per_call leaves steps before a boundary to run one call each."""
  uneven = {name: p for name, p in _periods(config).items() if p % steps_per_call}
  if steps_per_call > 1 and uneven:
    logging.warning(
        "train.steps_per_call=%d does not divide %s: the steps before each such boundary that do not fill a "
        "call run one call each (slower). Make them multiples of %d.",
        steps_per_call,
        ", ".join(f"{name}={p}" for name, p in uneven.items()),
        steps_per_call,
    )


def _summary(config, setup: TrainingSetup, corpus, flops_per_token: float) -> str:
  """The line a run starts with: what it trains, how big, on what."""
  parts = collections.Counter()
  for path, shape in setup.param_shapes.items():
    parts[path.split("/", 1)[0]] += math.prod(shape)
  counts = ", ".join(f"{name} {count / 1e6:.2f}M" for name, count in sorted(parts.items()))
  seq_len, global_batch = config.data.max_seq_len, config.train.batch_size
  return (
      f"Training {config.objective.name}: parameters {counts} ({sum(parts.values()) / 1e6:.2f}M in all); "
      f"{flops_per_token / 1e6:.1f} model MFLOPs per token; {global_batch * seq_len:,} tokens per step "
      f"(batch {global_batch} x {seq_len}) for {config.train.steps:,} steps; {config.train.dtype}, attention "
      f"{config.model.attention_impl}; data {config.data.source}: {corpus.num_examples:,} train examples, "
      f"vocabulary {corpus.tokenizer.vocab_size:,}."
  )


# --- The whole run
def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, take_over_workdir: bool = False
) -> dict[str, float]:
  """Pre-trains per `config`, resuming from `workdir` if it holds a checkpoint; the last logged
  metrics. A workdir another live run holds is refused, unless `take_over_workdir`."""
  started = _budget_clock()
  with _Preemption() as preemption:
    workdir_files.check_usable(workdir)
    mesh, corpus, setup = prepare(config)
    # Restore, or start afresh: every refusal comes before anything is written.
    checkpointer = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep)
    try:
      latest = checkpointer.latest_step()
      start_step = _from_process_0(
          -1 if latest is None else latest
      )  # one for all, even if a save ends meanwhile
      start_step = None if start_step < 0 else start_step
      start_meta = restored = None
      if start_step is not None:
        with partitioning.activate(mesh):
          check = _checkpoint_check(checkpointer, setup, workdir, corpus, config)
          start_step, restored, start_meta = checkpointer.restore_newest_intact(
              setup.abstract_state, start_step, check
          )
      if config.train.time_budget:
        resolve_time_budget(config, workdir, start_step, mesh, corpus, setup, started)
      # Once train.steps is final: the objective's keys a resume must keep (two_stage's switch), then
      # the setup, built again only where the objective reads train.steps (else just its schedule).
      objectives.REGISTRY[config.objective.name].start_run(
          config, lambda: config_lib.saved_config(workdir), start_step
      )
      ids = special_ids(corpus.tokenizer)
      if objectives.objective_from_config(config, ids) != setup.objective:
        setup = build_setup(config, mesh, ids)
      else:
        setup = dataclasses.replace(setup, schedule=make_optimizer(config)[1])
      if (note := warmup_note(config)) is not None:
        logging.warning("%s", note)
      lease = acquire_lease(workdir, take_over_workdir)
    except BaseException:
      checkpointer.close()
      raise
    try:
      _check_shared_workdir(workdir, lease)
      if (
          start_step is not None and start_step != checkpointer.latest_step()
      ):  # newer ones were damaged
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices(
              "electra_jax: before setting damaged checkpoints aside"
          )
        checkpointer.set_aside_after(start_step, rename=jax.process_index() == 0)
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices("electra_jax: damaged checkpoints set aside")
      # A checkpoint records the stream position it reached, so a run resumed with another batch
      # size (train.batch_size=-1 resolves it on each start) goes on from there.
      stream_offset = 0
      if start_step:
        stream_offset = int(start_meta["stream_position"]) - start_step * config.train.batch_size
        if stream_offset:
          logging.info(
              "The checkpoint at step %d read %d rows of the data stream (the batch size changed "
              "along the way); batches of %d go on from there.",
              start_step,
              start_meta["stream_position"],
              config.train.batch_size,
          )
      return _train(
          config,
          workdir,
          mesh,
          corpus,
          setup,
          checkpointer,
          start_step,
          restored,
          lease,
          stream_offset,
          preemption,
      )
    finally:
      if lease is not None:
        lease.release()


def _train(
    config,
    workdir,
    mesh,
    corpus,
    setup,
    checkpointer,
    start_step,
    restored,
    lease,
    stream_offset,
    preemption: _Preemption,
) -> dict[str, float]:
  """The loop, from `restored` at `start_step` (None: a fresh state); the last logged metrics."""
  is_chief = jax.process_index() == 0
  evaluator = evaluation.HeldOutEvaluator(config, setup, mesh) if config.eval.every_steps else None
  if is_chief:  # the workdir may be a bucket (gs://...): see workdir_files.py
    workdir_files.makedirs(workdir_files.path(workdir))
    _keep_changed_config(config, workdir, start_step)
    workdir_files.write_text(
        workdir_files.path(workdir, "config.json"), config_lib.config_file_text(config)
    )
    data.keep_tokenizer(corpus.tokenizer, workdir)  # fine-tuning and export need no corpus then
    # metrics.jsonl and eval_metrics.jsonl, TensorBoard events, and the runs train.metric_writers names.
    metrics_log, eval_log = tensorboard_log.open_logs(
        workdir, config.train.metric_writers, json.loads(config_lib.to_json(config))
    )

  with partitioning.activate(mesh):
    if start_step is None:
      state, start_step = fresh_state(setup, config.train.seed), 0
    else:
      logging.info(
          "Resuming from the checkpoint at step %d in %s.", start_step, checkpointer.directory
      )
      # The arrays restored under this setup's static fields (its schedule and objective may read a
      # train.steps fixed after the restore).
      state = jax.tree.unflatten(
          jax.tree.structure(setup.abstract_state), jax.tree.leaves(restored)
      )
    if is_chief:  # a run killed after its checkpoint logged steps this one will log again
      metrics_log.truncate_after(start_step)
      eval_log.truncate_after(start_step)
    # Ahead of time, so compile time stays out of the throughput figures.
    compile_start = time.perf_counter()
    compiled_step = compile_train_step(setup, config, mesh)
    steps_per_call = config.train.steps_per_call
    compiled_steps = (
        compile_train_step(setup, config, mesh, steps_per_call) if steps_per_call > 1 else None
    )
    logging.info("Compiled the train step in %.1f s.", time.perf_counter() - compile_start)
    _warn_single_steps(config, steps_per_call)

  total_steps, seed = config.train.steps, config.train.seed
  seq_len, global_batch = config.data.max_seq_len, config.train.batch_size
  flops_per_token = flops.objective_flops_per_token(setup.model, setup.objective, seq_len)
  logging.info("%s", _summary(config, setup, corpus, flops_per_token))
  peak = flops.peak_flops(jax.devices()[0])
  meta = {"param_shapes": setup.param_shapes, "data_fingerprint": corpus.fingerprint}
  window, window_steps, last_logged, step, call = [], 0, {}, start_step, 0
  keys, periods = batch_keys(config), tuple(_periods(config).values())
  window_start = time.perf_counter()
  if start_step >= total_steps:
    logging.info(
        "Nothing to do: the checkpoint at step %d reached train.steps=%d.", start_step, total_steps
    )

  def fetch(step_index):
    return data.get_batch(
        corpus,
        step_index,
        global_batch,
        seed,
        jax.process_index(),
        jax.process_count(),
        stream_offset,
    )

  try:  # whatever ends the loop (done, SIGTERM, NaN, an error), saves in flight are completed
    preemption.start_loop()
    # Batches are read and gathered on a background thread, a step or two ahead.
    with data.Prefetcher(fetch, start_step, stop_step=total_steps) as batches:
      while step < total_steps:
        # Several steps in one call where they fit before the next log, eval or checkpoint step.
        to_boundary = min([*(p - step % p for p in periods), total_steps - step])
        num_steps = steps_per_call if to_boundary >= steps_per_call else 1
        if num_steps > 1:
          local = [next(batches) for _ in range(num_steps)]
          stacked = {name: np.stack([b[name] for b in local]) for name in keys}
          batch = partitioning.global_batch_from_local(stacked, mesh, stacked=True)
          state, metrics = compiled_steps(
              state, batch, step_rngs(seed, step, num_steps), setup.schedule
          )
        else:
          batch = partitioning.global_batch_from_local(next(batches), mesh, keys=keys)
          state, metrics = compiled_step(state, batch, step_rng(seed, step), setup.schedule)
        step += num_steps
        window_steps += num_steps
        window.append(metrics)
        stopping = preemption.stop_after(call)
        call += 1

        if step % config.train.log_every == 0 or step == total_steps or stopping:
          # The lease file (local: at each log step; a bucket: every 10 s at most): a run that took
          # the workdir over owns its logs from its checkpoint on.
          _hold_workdir(lease, 10.0 if workdir_files.is_remote(workdir) else 0.0)
          logged = _mean_metrics(window)
          steps_per_sec = window_steps / (time.perf_counter() - window_start)
          logged.update(
              step=step,
              steps_per_sec=steps_per_sec,
              tokens_per_sec=steps_per_sec * global_batch * seq_len,
          )
          if peak is not None:
            logged["mfu"] = logged["tokens_per_sec"] * flops_per_token / (peak * jax.device_count())
          if not math.isfinite(logged["loss"]):
            first_bad = _first_non_finite_step(window, step)
            _stop_if_not_finite("loss", logged["loss"], step, checkpointer, config, first_bad)
          if is_chief:
            metrics_log.append(logged)
            logging.info(
                "step %d/%d | loss %.4f | mlm_acc %.3f | disc_auc %.3f | %s tokens/s | ETA %s",
                step,
                total_steps,
                logged["loss"],
                logged["masked_lm_accuracy"],
                logged["disc_auc"],
                f"{logged['tokens_per_sec']:,.0f}",
                config_lib.format_duration((total_steps - step) / steps_per_sec),
            )
          last_logged, window, window_steps, window_start = logged, [], 0, time.perf_counter()

        if evaluator and (step % config.eval.every_steps == 0 or step == total_steps):
          eval_start = time.perf_counter()
          held_out = evaluator(state)
          window_start += time.perf_counter() - eval_start  # keep eval out of tokens/s
          if is_chief:
            eval_log.append(dict(held_out, step=step))
            logging.info(
                "eval step %d (%d held-out %s) | loss %.4f | mlm_acc %.3f | disc_auc %.3f",
                step,
                evaluator.num_examples,
                "rows" if config.data.pack_rows else "examples",
                held_out["loss"],
                held_out["masked_lm_accuracy"],
                held_out["disc_auc"],
            )

        if step % config.checkpoint.every_steps == 0 or step == total_steps or stopping:
          last_loss = float(np.ravel(jax.device_get(metrics["loss"]))[-1])
          _stop_if_not_finite("loss", last_loss, step, checkpointer, config, step)
          # Never save a state that is not finite: the loss above predates the last update.
          if not bool(_params_finite(state.params)):
            _stop_if_not_finite("parameters", float("nan"), step, checkpointer, config)
          _hold_workdir(lease)  # never save over the checkpoints of a run that took over
          checkpointer.save(
              step, state, dict(meta, stream_position=stream_offset + step * global_batch)
          )
          if is_chief:  # a bucket's logs are rewritten now and then, and at least here
            metrics_log.flush()
            eval_log.flush()
        if stopping:
          logging.warning(
              "%s received: saved a checkpoint at step %d; run the same command to resume.",
              preemption.signal_name,
              step,
          )
          break
  finally:
    checkpointer.wait()
    checkpointer.close()
    if is_chief:
      metrics_log.close()
      eval_log.close()
  if step >= total_steps and is_chief:
    logging.info("Done: step %d, checkpoints in %s.", step, checkpointer.directory)
  return last_logged
