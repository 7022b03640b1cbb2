"""Pre-training: the optimizer, the module-level `train_step(state, batch, rng)`, and
`train_and_evaluate`, which reads top to bottom: config, mesh, input, model, shardings,
checkpoint, compile, loop (with preemption and NaN handling)."""

import collections
import contextlib
import dataclasses
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
    checkpointing, config_lib, data, evaluation, flops, memory, objectives, partitioning, tensorboard_log,
    workdir_files, workdir_lease,
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
  learning_rate_fn: Callable[[jax.Array], jax.Array] = flax.struct.field(pytree_node=False)
  objective: objectives.ElectraObjective = flax.struct.field(pytree_node=False)
  grad_accum_steps: int = flax.struct.field(pytree_node=False, default=1)


# ---------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------
class OfficialAdamState(NamedTuple):
  mu: Any
  nu: Any


def scale_by_adam_without_bias_correction(b1: float, b2: float, eps: float):
  """Adam's direction m / (sqrt(v) + eps) with no bias correction, as in BERT's and ELECTRA's
  AdamWeightDecayOptimizer (its early updates are smaller than optax's adam)."""

  def init(params):
    return OfficialAdamState(jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))

  def update(updates, state, params=None):
    del params
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return direction, OfficialAdamState(mu, nu)

  return optax.GradientTransformation(init, update)


def learning_rate_schedule(base_lr: float, warmup_steps: int, total_steps: int):
  """lr * min(1, step / warmup) * max(0, 1 - step / total): the official ELECTRA schedule."""

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warmup = jnp.minimum(1.0, step / max(warmup_steps, 1))
    decay = jnp.maximum(0.0, 1.0 - step / total_steps)
    return base_lr * warmup * decay

  return schedule


def _decays(path, _) -> bool:
  # Weight decay on matrices and embedding tables only, never on LayerNorm or any bias.
  return getattr(path[-1], "key", None) in ("kernel", "embedding")


def warmup_steps(config: ml_collections.ConfigDict) -> int:
  """optimizer.warmup_steps, or round(optimizer.warmup_fraction * train.steps) when that is > 0."""
  o = config.optimizer
  return round(o.warmup_fraction * config.train.steps) if o.warmup_fraction > 0 else o.warmup_steps


def warmup_note(config: ml_collections.ConfigDict) -> str | None:
  """A warning when the warmup does not end before the run: the schedule then never reaches
  optimizer.learning_rate, at most steps / (4 * warmup) of it (at the middle of the run)."""
  warmup, steps = warmup_steps(config), config.train.steps
  if warmup < steps:
    return None
  return (f"optimizer.warmup_steps={warmup} is not shorter than train.steps={steps}: the learning rate "
          f"reaches at most {100 * steps / (4 * warmup):.1f}% of optimizer.learning_rate="
          f"{config.optimizer.learning_rate:g}. Lower optimizer.warmup_steps, or set "
          "optimizer.warmup_fraction (e.g. 0.1) to tie it to the run's length.")


def make_optimizer(config: ml_collections.ConfigDict):
  """Global-norm clipping, then AdamW (optax's, or the official one without bias correction)."""
  o = config.optimizer
  schedule = learning_rate_schedule(o.learning_rate, warmup_steps(config), config.train.steps)
  if o.bias_correction:
    adam = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps)
  else:
    adam = scale_by_adam_without_bias_correction(o.b1, o.b2, o.eps)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      _decays, params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )
  tx = optax.chain(
      optax.clip_by_global_norm(o.clip_norm),
      adam,
      optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
      optax.scale_by_learning_rate(schedule),
  )
  return tx, schedule


# ---------------------------------------------------------------------------------------
# Update step
# ---------------------------------------------------------------------------------------
def train_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array):
  """One optimizer update on `batch` (input_ids, token_type_ids, attention_mask [batch, seq]).

  Masks are drawn for the whole batch first, so with grad_accum_steps > 1 the micro-batch
  losses are normalized by whole-batch counts and their gradients sum to the full-batch one.
  """
  objective = state.objective
  registered = objectives.REGISTRY[objective.name]
  params = registered.before_step(objective, state.params, state.step)
  second_stage = objectives.in_second_stage(objective, state.step)
  mask_rng, sample_rng, dropout_rng = jax.random.split(rng, 3)
  masked = objectives.mask_tokens(mask_rng, batch["input_ids"], batch["attention_mask"], objective)
  sample_keys = jax.random.split(sample_rng, batch["input_ids"].shape[0])
  normalizers = objectives.Normalizers.of(
      masked, batch["attention_mask"],
      objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
  )
  temperature = objectives.sampling_temperature(objective, state.step)

  def loss_fn(params, micro_batch, micro_masked, micro_sample_keys, micro_dropout_rng):
    return objectives.electra_forward(
        state.model, params, micro_batch, micro_masked, micro_sample_keys, micro_dropout_rng,
        objective, normalizers, second_stage=second_stage, temperature=temperature,
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
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grads_shape, stats_shape))
    (grads, stats), per_token = jax.lax.scan(accumulate, zeros, (micro_inputs, micro_dropout_rngs))

  updates, opt_state = state.tx.update(grads, state.opt_state, params)
  updates = registered.updates(objective, updates, state.step)
  params = optax.apply_updates(params, updates)
  metrics = objectives.summarize(stats, per_token, objective)
  metrics["grad_norm"] = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
  metrics["learning_rate"] = state.learning_rate_fn(state.step)
  # NaN where nothing is sampled: mlm's step then does not depend on the temperature keys.
  metrics["sampling_temperature"] = jnp.asarray(temperature if objective.samples else jnp.nan, jnp.float32)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def train_steps(state: TrainState, batches: dict[str, jax.Array], rngs: jax.Array):
  """len(rngs) optimizer updates in one call: train_step over batches stacked on a leading
  axis, with rngs[i] the key of the i-th. Returns the state and each step's metrics stacked."""
  return jax.lax.scan(lambda s, inputs: train_step(s, *inputs), state, (batches, rngs))


def step_rngs(seed: int, first_step: int, num_steps: int) -> jax.Array:
  """step_rng(seed, s) for s in first_step .. first_step + num_steps - 1, stacked."""
  steps = jnp.arange(first_step, first_step + num_steps)
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(seed), s))(steps)


def step_rng(seed: int, step: int) -> jax.Array:
  """The step's randomness depends only on (seed, step), so a resumed run draws the same."""
  return jax.random.fold_in(jax.random.key(seed), step)


# ---------------------------------------------------------------------------------------
# Building the state
# ---------------------------------------------------------------------------------------
def make_init_fn(config, model: ElectraPretrainer, objective) -> Callable[[jax.Array], TrainState]:
  """rng -> a fresh state whose parameters still carry their logical-axis boxes
  (nn.Partitioned): jax.eval_shape of it gives the shardings, nn.meta.unbox of it the real
  state. The optimizer is built once here, so every state shares the same static fields."""
  tx, schedule = make_optimizer(config)
  ids = jnp.zeros((1, config.data.max_seq_len), jnp.int32)
  positions = jnp.zeros((1, objective.max_predictions), jnp.int32)

  def init_fn(rng):
    params = model.init(rng, ids, ids, jnp.ones_like(ids), positions)["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        model=model,
        tx=tx,
        learning_rate_fn=schedule,
        objective=objective,
        grad_accum_steps=config.train.grad_accum_steps,
    )

  return init_fn


def param_shapes(params) -> dict[str, list[int]]:
  """{'generator/encoder/layer_0/...': shape}; stored with each checkpoint to refuse a
  workdir whose model differs from the config."""
  flat = flax.traverse_util.flatten_dict(nn.meta.unbox(params), sep="/")
  return {name: list(leaf.shape) for name, leaf in flat.items()}


def _check_checkpoint_matches(meta: dict, setup, corpus, workdir: str, config=None) -> None:
  """Refuses a checkpoint of another model, or (given `corpus`) trained on other data."""
  check_same_model(meta["param_shapes"], setup.param_shapes, workdir, config)
  if corpus is None:
    return
  if meta["data_fingerprint"] is None:
    # Imported weights (interop/pretraining.py): bound to their vocabulary, not yet to a corpus.
    if meta["tokenizer_fingerprint"] != corpus.tokenizer.fingerprint:
      raise ConfigError(
          f"The checkpoint in {workdir} holds weights imported from {meta.get('imported_from')} with "
          f"their own vocabulary (tokenizer {meta['tokenizer_fingerprint']}), but this config "
          f"tokenizes with {corpus.tokenizer.fingerprint}. Train with the workdir's config.json "
          "(which names that vocabulary), e.g. leave out --config."
      )
    return
  if meta["data_fingerprint"] != corpus.fingerprint:
    raise ConfigError(
        f"The checkpoint in {workdir} was trained on data {meta['data_fingerprint']} but this "
        f"config gives {corpus.fingerprint} (a different tokenizer, corpus, max_seq_len or data.pack_rows). "
        "Use a new --workdir, or the data settings of its config.json."
    )


def _check_state_structure(checkpointer, step: int, setup, workdir: str) -> None:
  """Refuses a checkpoint whose train state has another structure than this config's, which
  the parameter shapes do not show: the optimizer's state (optimizer.bias_correction picks
  optax's Adam, with a step count, or the official one, without)."""
  missing, extra = checkpointer.state_difference(step, setup.abstract_state)
  if not (missing or extra):
    return
  what = "optimizer state" if all(p.startswith("opt_state") for p in missing + extra) else "train state"
  hint = (" optimizer.bias_correction decides whether Adam keeps a step count (True: optax's Adam; "
          "False: the official one): resume with the value in its config.json." if what == "optimizer state" else "")
  raise ConfigError(
      f"The checkpoint at step {step} in {workdir} holds {'an' if what[0] == 'o' else 'a'} {what} of another structure than this "
      f"config's (missing from it: {missing[:3] or 'none'}; only in it: {extra[:3] or 'none'}).{hint} Or "
      "use a new --workdir. Nothing was overwritten."
  )


def _stream_offset(meta: dict | None, start_step: int | None, global_batch: int) -> int:
  """Where batch `step` starts in the row stream is stream_offset + step * global_batch. A
  checkpoint records the stream position it reached, so a run resumed with another batch size
  (train.batch_size=-1 resolves it again on each start) goes on from there: no example of the
  epoch is skipped or seen twice. 0 on a fresh start, for checkpoints that predate the record
  (which assumed one batch size throughout), and for a run whose batch size never changed.
  `meta`: the resumed checkpoint's (None on a fresh start)."""
  position = (meta or {}).get("stream_position")
  if not start_step or position is None:
    return 0
  offset = int(position) - start_step * global_batch
  if offset:
    logging.info("The checkpoint at step %d read %d rows of the data stream (the batch size changed "
                 "along the way); batches of %d go on from there.", start_step, position, global_batch)
  return offset


def restore_checkpoint(workdir: str, setup, mesh, step: int | None = None, corpus=None):
  """(step, state): the train state saved at `step` (default: the newest intact one) in
  `workdir`, sharded for `mesh` whatever mesh saved it, once the checkpoint is known to hold
  this setup's model (and, given `corpus`, to come from its data)."""
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
    with partitioning.activate(mesh):
      if latest:
        return _restore_intact(checkpointer, step, setup, workdir, corpus)[:2]
      _check_checkpoint_matches(checkpointer.read_meta(step), setup, corpus, workdir)
      _check_state_structure(checkpointer, step, setup, workdir)
      return step, checkpointer.restore(step, setup.abstract_state)
  finally:
    checkpointer.close()


def _restore_intact(checkpointer, latest: int, setup, workdir: str, corpus, config=None):
  """(step, state, meta) of the newest intact checkpoint up to `latest` (a damaged one is named
  and skipped), each refused before its arrays are read if it holds another model, data or
  state structure."""
  def check(step, meta):
    _check_checkpoint_matches(meta, setup, corpus, workdir, config)
    _check_state_structure(checkpointer, step, setup, workdir)

  return checkpointer.restore_newest_intact(setup.abstract_state, latest, check)


def check_same_model(saved: dict, current: dict, workdir: str, config=None) -> None:
  for name in sorted(set(saved) | set(current)):
    if saved.get(name) != current.get(name):
      settings = ""
      before = config_lib.saved_config(workdir) if config is not None else None
      if before is not None:
        changes = config_lib.changed_keys(
            {"model": before.get("model", {})}, {"model": config_lib.as_saved(config)["model"]})
        if changes:
          settings = f" The model settings that differ from its config.json: {'; '.join(changes)}."
      raise ConfigError(
          f"The workdir {workdir} holds a checkpoint of a different model: parameter {name!r} "
          f"is {saved.get(name, 'absent')} there but {current.get(name, 'absent')} in this "
          f"config.{settings} Use a new --workdir, or the config that made this checkpoint "
          f"({os.path.join(workdir, 'config.json')}). Nothing was overwritten."
      )


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
  """What the loop, the benchmarks and the tests need to build and step a sharded state."""

  model: ElectraPretrainer
  objective: objectives.ElectraObjective
  init_fn: Callable[[jax.Array], TrainState]  # boxed; see make_init_fn
  state_shardings: TrainState  # NamedSharding leaves
  abstract_state: TrainState  # ShapeDtypeStruct leaves carrying those shardings
  param_shapes: dict[str, list[int]]


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
        "model.vocab_size), or use smaller mesh axes.", "; ".join(unsharded),
    )
  abstract_state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      nn.meta.unbox(boxed_shapes),
      state_shardings,
  )
  return TrainingSetup(
      model, objective, init_fn, state_shardings, abstract_state, param_shapes(boxed_shapes.params)
  )


def batch_keys(config) -> tuple[str, ...]:
  """The arrays of a training batch that go to the devices (`data.batch_keys`)."""
  return data.batch_keys(bool(config.data.get("pack_rows", False)))


def compile_train_step(setup: TrainingSetup, config, mesh):
  """train_step compiled for this config's global batch, with the state donated. Call it
  inside `partitioning.activate(mesh)`."""
  return _compile_update(train_step, setup, config, mesh, num_steps=None)


def step_compiler(config, setup: TrainingSetup, mesh):
  """batch_size -> compile_train_step for this config at that global batch (memory's probe)."""

  def compile_step(batch_size: int):
    sized = config.copy_and_resolve_references()
    sized.train.batch_size = batch_size
    with partitioning.activate(mesh):
      return compile_train_step(setup, sized, mesh)

  return compile_step


def compile_train_steps(setup: TrainingSetup, config, mesh, num_steps: int):
  """train_steps compiled for `num_steps` stacked global batches (train.steps_per_call)."""
  return _compile_update(train_steps, setup, config, mesh, num_steps)


def _compile_update(fn, setup: TrainingSetup, config, mesh, num_steps: int | None):
  """`fn(state, batch, rng)` compiled with the state donated: one global batch and key
  (num_steps None), or num_steps of each stacked on a leading axis."""
  # The keys' shape and dtype only, so nothing runs on the devices (compile-only ones, as
  # benchmarks/compile_audit.py uses, cannot run anything).
  if num_steps is None:
    batch_sharding, leading = partitioning.batch_sharding(mesh), ()
    rng = jax.eval_shape(lambda: jax.random.key(0))
  else:
    batch_sharding, leading = partitioning.stacked_batch_sharding(mesh), (num_steps,)
    rng = jax.eval_shape(lambda: step_rngs(0, 0, num_steps))
  replicated = partitioning.replicated(mesh)
  shape = (*leading, config.train.batch_size, config.data.max_seq_len)
  abstract_batch = {
      name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding) for name in batch_keys(config)
  }
  abstract_rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated)
  return (
      jax.jit(
          fn,
          in_shardings=(setup.state_shardings, batch_sharding, replicated),
          out_shardings=(setup.state_shardings, replicated),
          donate_argnums=(0,),
      )
      .lower(setup.abstract_state, abstract_batch, abstract_rng)
      .compile()
  )


def _steps_to_boundary(step: int, config) -> int:
  """Steps from `step` to the next one that logs, evaluates, checkpoints or ends the run."""
  periods = [config.train.log_every, config.checkpoint.every_steps]
  if config.eval.every_steps:
    periods.append(config.eval.every_steps)
  to_next = [period - step % period for period in periods]
  return min([*to_next, config.train.steps - step])


def _warn_single_steps(config, steps_per_call: int) -> None:
  """Says so when train.steps_per_call leaves steps to run one call each: the steps before a
  log, evaluation or checkpoint step that do not fill a whole call."""
  periods = {"train.log_every": config.train.log_every, "checkpoint.every_steps": config.checkpoint.every_steps}
  if config.eval.every_steps:
    periods["eval.every_steps"] = config.eval.every_steps
  uneven = {name: p for name, p in periods.items() if p % steps_per_call}
  if steps_per_call > 1 and uneven:
    shown = ", ".join(f"{name}={p}" for name, p in uneven.items())
    logging.warning(
        "train.steps_per_call=%d does not divide %s: the steps before each such boundary that "
        "do not fill a call run one call each (slower). Make them multiples of %d.",
        steps_per_call, shown, steps_per_call,
    )


AUTO_BATCH_SIZE = -1  # train.batch_size=-1: the largest batch that fits in device memory


def special_ids(tokenizer) -> dict[str, int]:
  """The token ids build_setup needs from the corpus's tokenizer."""
  return dict(
      pad=tokenizer.pad_id, cls=tokenizer.cls_id, sep=tokenizer.sep_id, mask=tokenizer.mask_id,
      vocab_size=tokenizer.vocab_size,  # bounds BERT-style random replacements
  )


def prepare(config):
  """Config checks, mesh, training data and the sharded setup, in that order, so that every
  mistake a user can make is reported before anything is compiled or written."""
  # --- Config: everything checkable without devices or data.
  config_lib.validate(config)
  # --- Mesh
  mesh = partitioning.make_mesh(config.mesh)
  partitioning.check_process_shards(mesh, jax.process_count())
  platform = jax.devices()[0].platform
  if config.model.attention_impl == "cudnn" and platform != "gpu":
    raise ConfigError(
        f"model.attention_impl='cudnn' is NVIDIA's fused attention, but the devices here are "
        f"{platform}: use model.attention_impl='xla' (or 'splash' on TPU)."
    )
  auto_batch = config.train.batch_size == AUTO_BATCH_SIZE
  if not auto_batch:
    config_lib.validate_for_mesh(config, partitioning.batch_shards(mesh))
  logging.info("Mesh %s over %d %s devices.", dict(mesh.shape), mesh.size, jax.devices()[0].platform)
  # --- Input
  corpus = data.load_pretraining_data(config.data, split="train")
  tokenizer = corpus.tokenizer
  if config.model.vocab_size < tokenizer.vocab_size:
    raise ConfigError(
        f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
        f"({tokenizer.vocab_size}). Set model.vocab_size >= {tokenizer.vocab_size}."
    )
  # --- Model and shardings
  setup = build_setup(config, mesh, special_ids(tokenizer))
  if auto_batch:
    # The largest batch that fits (the setup does not depend on it); written to config.json.
    limit = int(config.train.get("memory_fraction", 0.9) * memory.device_memory_bytes())
    quantum = partitioning.batch_shards(mesh) * config.train.grad_accum_steps
    batch_size, _ = memory.largest_batch(step_compiler(config, setup, mesh), limit, quantum)
    if jax.process_count() > 1:
      # Hosts may see different free memory (CPU hosts do): all take the smallest answer,
      # a multiple of the quantum that fits everywhere.
      batch_size = int(multihost_utils.process_allgather(np.int64(batch_size)).min())
    config.train.batch_size = batch_size
    logging.info("train.batch_size=-1: using %d, the largest batch that fits.", config.train.batch_size)
    config_lib.validate_for_mesh(config, partitioning.batch_shards(mesh))
  return mesh, corpus, setup


# ---------------------------------------------------------------------------------------
# Host-side helpers of the loop
# ---------------------------------------------------------------------------------------
# Set by any SIGTERM this process took, a run's handler or a sweep's (sweep.py asks after each
# run, so one that came during a run's last step, or between runs, still stops the sweep).
_SIGTERM = threading.Event()


def sigterm_received() -> bool:
  return _SIGTERM.is_set()


def clear_sigterm() -> None:
  _SIGTERM.clear()


def note_sigterm(signum=None, frame=None) -> None:
  """A SIGTERM handler that only records the signal (for loops around several runs)."""
  del signum, frame
  _SIGTERM.set()


class _Preemption:
  """SIGTERM (how TPU VMs and schedulers preempt) ends the run after a step, with a checkpoint.

  One process: a Python handler sets a flag. Several processes: the signal reaches them at
  different times, yet all must save at the same step (orbax's save is collective) and none
  may stop while the others wait in a collective. There JAX's preemption service, which
  `jax.distributed.initialize` starts and which catches SIGTERM itself, picks a call every
  process reaches (`multihost_utils.reached_preemption_sync_point`), so no Python handler is
  installed. `stop_after(call)` is asked once per loop call, with the same count everywhere."""

  def __init__(self):
    self.requested = False
    self.signal_name = "SIGTERM"
    self._previous = None
    self._previous_interrupt = None
    # One process that joined jax.distributed (launch/tpu_vm.py sets ELECTRA_JAX_DISTRIBUTED=auto
    # on single-host slices too) also goes through the service: its notifier has caught every
    # SIGTERM since initialize, so one that came before the loop is only known there.
    self._collective = jax.process_count() > 1 or jax.distributed.is_initialized()

  def __enter__(self):
    if self._collective:
      if not jax.distributed.is_initialized():  # several processes joined by the runtime alone
        logging.warning(
            "%d processes without jax.distributed: a SIGTERM stops this run without a checkpoint "
            "(it resumes from the last periodic one). Start it through electra_jax.main, which "
            "joins the job.", jax.process_count(),
        )
        self._collective = False
      return self
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      # Ctrl-C (or a notebook's interrupt) too: the first saves at the end of the step, as
      # SIGTERM does; the handler is then put back, so a second one stops at once.
      self._previous_interrupt = signal.signal(signal.SIGINT, self._handle)
    except ValueError:  # not the main thread (some notebook runners): no handler then
      self._previous = None
    return self

  def _handle(self, signum, frame):
    del frame
    self.requested = True
    if signum == signal.SIGINT:
      self.signal_name = "Ctrl-C (SIGINT)"
      signal.signal(signal.SIGINT, self._previous_interrupt)
      self._previous_interrupt = None
    _SIGTERM.set()

  def stop_after(self, call: int) -> bool:
    if self._collective and not self.requested:
      try:
        self.requested = multihost_utils.reached_preemption_sync_point(call)
        if self.requested:
          _SIGTERM.set()
      except RuntimeError as error:  # jax_enable_preemption_service=False
        logging.warning(
            "No preemption handling (%s): a SIGTERM stops this run without a checkpoint; it "
            "resumes from the last periodic one.", error,
        )
        self._collective = False
    return self.requested

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    if self._previous_interrupt is not None:
      signal.signal(signal.SIGINT, self._previous_interrupt)


def _stop_if_not_finite(what: str, value: float, step: int, checkpointer, config, first_bad_step=None) -> None:
  """Stops the run when `value` is not finite. `first_bad_step`: the first step whose loss was
  not finite, when known; a checkpoint just before it holds the parameters that produced it."""
  if not math.isfinite(value):
    checkpointer.wait()  # the last good checkpoint may still be being written
    latest = checkpointer.latest_step()
    dtype_hint = ", or use train.dtype=float32" if config.train.dtype != "float32" else ""
    diverged = ""
    if latest is not None and first_bad_step is not None and latest >= first_bad_step - 1:
      diverged = (
          f" Its parameters are finite but already gave step {latest + 1} a non-finite loss: "
          "resume from an earlier checkpoint (checkpoint.keep keeps more) or start over."
      )
    saved = (f"The last checkpoint is step {latest}." if latest is not None else
             "No checkpoint was saved yet: the next start begins from scratch.")
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
  """Whether every parameter is finite: checked before a save, since a step's loss is taken
  before its update, which can be the one that overflows."""
  return jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(params)]))


# Metrics that are NaN on some healthy steps (disc_auc when a step's tokens are all one class,
# the binned AUCs and shares when a bin or the replacements are empty): their window mean skips
# NaN steps. Any other NaN (loss, grad_norm, ...) is a diverged step and must show in the mean.
# (Objectives without a discriminator report NaN disc metrics on every step: NaN either way.)
_NAN_WHEN_HEALTHY = frozenset({"disc_auc", *objectives.BINNED_METRICS})


def _mean_metrics(window: list[dict]) -> dict[str, float]:
  """Means over the window. Those in _NAN_WHEN_HEALTHY ignore NaN steps (NaN, without a
  warning, when every step was); every other metric is NaN if any step's was."""
  host = jax.device_get(window)  # one entry per call: scalars, or [k] for k steps per call
  means = {}
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)
    for name in host[0]:
      values = np.concatenate([np.ravel(m[name]) for m in host])
      means[name] = float(np.nanmean(values) if name in _NAN_WHEN_HEALTHY else np.mean(values))
  return means


# ---------------------------------------------------------------------------------------
# The whole run
# ---------------------------------------------------------------------------------------
def _agreed(problem: str | None) -> str | None:
  """Process 0's verdict on every process: its message, None when it found nothing wrong."""
  if jax.process_count() == 1:
    return problem
  if not int(multihost_utils.broadcast_one_to_all(np.int32(problem is not None))):
    return None
  return problem or "Process 0 stopped the run; its log says why."


def _hold_workdir(lease: workdir_lease.WorkdirLease | None, max_age_seconds: float = 0.0) -> None:
  """Raises WorkdirInUse on every process once another run has taken the workdir over (the
  lease file is read now, or within `max_age_seconds`: asked at each log step and before
  each checkpoint)."""
  problem = None
  if lease is not None:
    try:
      lease.check(max_age_seconds)
    except workdir_lease.WorkdirInUse as error:
      problem = str(error)
  problem = _agreed(problem)
  if problem:
    raise workdir_lease.WorkdirInUse(problem)


def acquire_lease(directory: str, take_over: bool, name: str = "The workdir") -> workdir_lease.WorkdirLease | None:
  """Process 0 takes `directory`'s lease (returned; None on the other processes), or every
  process raises WorkdirInUse with process 0's message, `name` naming the directory."""
  lease, problem = None, None
  if jax.process_index() == 0:
    lease = workdir_lease.WorkdirLease(directory)
    try:
      lease.acquire(take_over=take_over)
    except workdir_lease.WorkdirInUse as error:
      lease, problem = None, str(error).replace("The workdir", name, 1)
  problem = _agreed(problem)
  if problem:
    raise workdir_lease.WorkdirInUse(problem)
  return lease


def start_summary(config, param_shapes: dict[str, list[int]], flops_per_token: float, corpus) -> str:
  """One line on what is about to train: parameters per part of the tree, model FLOPs per token,
  tokens per step, the numerics and the data."""
  parts = collections.Counter()
  for path, shape in param_shapes.items():
    parts[path.split("/", 1)[0]] += math.prod(shape)
  counts = ", ".join(f"{name} {count / 1e6:.2f}M" for name, count in sorted(parts.items()))
  t, d = config.train, config.data
  return (f"Training {config.objective.name}: parameters {counts} ({sum(parts.values()) / 1e6:.2f}M in all); "
          f"{flops_per_token / 1e6:.1f} model MFLOPs per token; {t.batch_size * d.max_seq_len:,} tokens per "
          f"step (batch {t.batch_size} x {d.max_seq_len}) for {t.steps:,} steps; {t.dtype}, attention "
          f"{config.model.attention_impl}; data {d.source}: {corpus.num_examples:,} train examples, vocabulary "
          f"{corpus.tokenizer.vocab_size:,}.")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       take_over_workdir: bool = False) -> dict[str, float]:
  """Pre-trains per `config`, resuming from `workdir` if it holds a checkpoint. Returns the
  last logged metrics. One run per workdir (workdir_lease.py): a run refuses a workdir that
  another live run holds, unless `take_over_workdir`. With train.time_budget, train.steps is
  fixed here (resolve_time_budget) and written to config.json."""
  with _sigterm_unwinds():
    return _train_and_evaluate(config, workdir, take_over_workdir, _budget_clock())


@contextlib.contextmanager
def _sigterm_unwinds():
  """Until the training loop's own handler takes over (_Preemption): SIGTERM raises
  SystemExit(0) in the main thread, as a stop in the loop ends with status 0, so a run stopped
  while it starts (data, compile) releases its lease and leaves nothing half-written, where the
  default action would kill it at once.
  Not where jax.distributed runs (one process or several): JAX's preemption service catches
  SIGTERM from initialize on and the loop stops every process at one step with a checkpoint
  (a process raising alone would leave the others in a collective)."""
  stopped = []

  def unwind(signum, frame):
    stopped.append(signum)
    raise SystemExit(0)

  previous = None
  if jax.process_count() == 1 and not jax.distributed.is_initialized():
    try:
      previous = signal.signal(signal.SIGTERM, unwind)
    except ValueError:  # not the main thread (some notebook runners)
      previous = None
  try:
    yield
  except SystemExit:
    if stopped:
      logging.warning("SIGTERM while the run was starting: it stopped before its first step and saved "
                      "nothing new. Run the same command to go on.")
    raise
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)


def _train_and_evaluate(config, workdir: str, take_over_workdir: bool, started: float) -> dict[str, float]:
  workdir_files.check_usable(workdir)
  budgeted = bool(config.train.time_budget)
  # With a time budget train.steps, and with it the switch's default, is known further down.
  recorded_switch = None if budgeted else _fix_two_stage_switch(config, workdir)
  mesh, corpus, setup = prepare(config)
  # --- Checkpoint: restore or initialize. Refusals happen before anything is written.
  checkpointer = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep)
  start_step = checkpointer.latest_step()
  if jax.process_count() > 1:  # one step for all, even if a save finalizes between the reads
    agreed = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if start_step is None else start_step)))
    start_step = None if agreed < 0 else agreed
  start_meta = restored = None
  if start_step is not None:
    try:
      with partitioning.activate(mesh):
        start_step, restored, start_meta = _restore_intact(checkpointer, start_step, setup, workdir, corpus, config)
    except BaseException:
      checkpointer.close()
      raise
  if budgeted:
    try:
      resolve_time_budget(config, workdir, start_step, mesh, corpus, setup, started)
    except BaseException:
      checkpointer.close()
      raise
    recorded_switch = _fix_two_stage_switch(config, workdir)
    # The learning-rate schedule, the two_stage switch and the temperature's decay read train.steps.
    setup = build_setup(config, mesh, special_ids(corpus.tokenizer))
  if start_step is not None:
    _check_two_stage_resume(config, recorded_switch, start_step, checkpointer)
  if (note := warmup_note(config)) is not None:  # train.steps is final here, budget or not
    logging.warning("%s", note)
  try:
    lease = acquire_lease(workdir, take_over_workdir)
  except workdir_lease.WorkdirInUse:
    checkpointer.close()
    raise
  try:
    _check_shared_workdir(workdir, lease)
    if start_step is not None and start_step != checkpointer.latest_step():  # newer ones were damaged
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("electra_jax: before setting damaged checkpoints aside")
      checkpointer.set_aside_after(start_step, rename=jax.process_index() == 0)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("electra_jax: damaged checkpoints set aside")
    stream_offset = _stream_offset(start_meta, start_step, config.train.batch_size)
    return _train(config, workdir, mesh, corpus, setup, checkpointer, start_step, restored, lease, stream_offset)
  finally:
    if lease is not None:
      lease.release()


# train.time_budget: the share of the time left that steps may take; the rest is kept for
# logging, checkpoints, loading the held-out data and the host's work between steps.
_BUDGET_MARGIN = 0.03
_TIMED_STEPS = 3  # after one warm-up step
_budget_clock = time.monotonic  # when the budget's time started and how much is spent


class StepTiming(NamedTuple):
  """What measure_step_time found, in seconds."""

  step: float  # one compiled training step
  compile: float  # compiling the step and the evaluation, which the run does again
  evaluation: float  # one held-out evaluation (0 without eval.every_steps)


def measure_step_time(config, setup: TrainingSetup, mesh, corpus) -> StepTiming:
  """Times the train step, compiled for `setup`, on a throwaway fresh state and batch 0 (one
  warm-up step, then _TIMED_STEPS), and, with eval.every_steps > 0, one held-out evaluation
  of that state (a first call compiles, a second is timed). Nothing of the run is advanced."""
  with partitioning.activate(mesh):
    clock = time.perf_counter()
    step_fn = compile_train_step(setup, config, mesh)
    compile_seconds = time.perf_counter() - clock
    state = jax.jit(lambda r: nn.meta.unbox(setup.init_fn(r)), out_shardings=setup.state_shardings)(
        jax.random.key(config.train.seed)
    )
    local = data.get_batch(
        corpus, 0, config.train.batch_size, config.train.seed, jax.process_index(), jax.process_count()
    )
    batch = partitioning.global_batch_from_local(local, mesh, keys=batch_keys(config))
    rng = step_rng(config.train.seed, 0)
    state, metrics = step_fn(state, batch, rng)
    jax.block_until_ready((state, metrics))
    clock = time.perf_counter()
    for _ in range(_TIMED_STEPS):
      state, metrics = step_fn(state, batch, rng)
    jax.block_until_ready((state, metrics))
    step_seconds = (time.perf_counter() - clock) / _TIMED_STEPS
  eval_seconds = 0.0
  if config.eval.every_steps:
    evaluator = evaluation.HeldOutEvaluator(config, setup, mesh)
    clock = time.perf_counter()
    evaluator(state)
    first = time.perf_counter() - clock
    clock = time.perf_counter()
    evaluator(state)
    eval_seconds = time.perf_counter() - clock
    compile_seconds += max(first - eval_seconds, 0.0)
  return StepTiming(step_seconds, compile_seconds, eval_seconds)


def budget_steps(budget_seconds: float, elapsed_seconds: float, timing: StepTiming, eval_every: int,
                 start_step: int) -> int:
  """train.steps for a run at `start_step` with `budget_seconds` of which `elapsed_seconds` are
  spent: the most steps n for which compiling again, n steps and their evaluations (every
  `eval_every` steps and at the end) fit in (1 - _BUDGET_MARGIN) of the time left; at least one.
  """
  left = (budget_seconds - elapsed_seconds - timing.compile) * (1.0 - _BUDGET_MARGIN)
  per_step = timing.step + (timing.evaluation / eval_every if eval_every else 0.0)
  new_steps = math.floor((left - (timing.evaluation if eval_every else 0.0)) / per_step)
  return start_step + max(new_steps, 1)


def resolve_time_budget(config, workdir: str, start_step: int | None, mesh, corpus, setup: TrainingSetup,
                        started: float) -> None:
  """Sets train.steps for train.time_budget. A resume (a checkpoint, and a config.json of the
  same budget) takes the train.steps that config.json records, so it trains on the schedule
  the interrupted run had. Otherwise the step is timed (measure_step_time) and the steps that
  fit in the budget left since `started` (_budget_clock) follow it (budget_steps): counted
  from the checkpoint's step, if any, for a budget that changed. Every process takes process
  0's count."""
  t = config.train
  saved = config_lib.saved_config(workdir) if start_step is not None else None
  if saved is not None and saved.get("train", {}).get("time_budget") == t.time_budget:
    steps = int(saved["train"]["steps"])
    logging.info("train.time_budget=%s: train.steps=%d, as this workdir's config.json records.", t.time_budget, steps)
  else:
    timing = measure_step_time(config, setup, mesh, corpus)
    budget = config_lib.parse_duration(t.time_budget)
    steps = budget_steps(budget, _budget_clock() - started, timing, config.eval.every_steps, start_step or 0)
    logging.info(
        "train.time_budget=%s: measured %.4g s/step (compiling %.1f s, evaluation %.1f s), training %d steps.",
        t.time_budget, timing.step, timing.compile, timing.evaluation, steps,
    )
  if jax.process_count() > 1:
    steps = int(multihost_utils.broadcast_one_to_all(np.int32(steps)))
  t.steps = steps


def _check_shared_workdir(workdir: str, lease: workdir_lease.WorkdirLease | None) -> None:
  """Several processes save each checkpoint together, into one directory: a workdir that is
  a local path on each host of a slice would leave orbax waiting forever at the first save.
  Every process must read the lease process 0 just wrote there."""
  if jax.process_count() == 1:
    return
  run_id = lease.run_id if lease is not None else ""
  ids = np.frombuffer(run_id.encode().ljust(32), np.uint8) if jax.process_index() == 0 else np.zeros(32, np.uint8)
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


def _fix_two_stage_switch(config, workdir: str) -> int | None:
  """two_stage: the step the discriminator's stage starts is fixed once per run, at its first
  start, and written to config.json. Left at 0 it defaults to half of train.steps, so without
  this a resume with more train.steps would move it and copy the generator's encoder over the
  trained discriminator again. Returns the switch the workdir recorded (None: none yet)."""
  if config.objective.get("name") != "two_stage":
    return None
  before = config_lib.saved_config(workdir) or {}
  recorded = None
  if before.get("objective", {}).get("name") == "two_stage":
    # config.json before this fix kept 0: the default then was its own train.steps // 2.
    recorded = before["objective"].get("two_stage_switch") or before["train"]["steps"] // 2
  if not config.objective.two_stage_switch:
    config.objective.two_stage_switch = recorded or config.train.steps // 2
    logging.info("objective.two_stage_switch: the discriminator's stage starts at step %d%s.",
                 config.objective.two_stage_switch, " (as this workdir recorded)" if recorded else "")
  return recorded


def _check_two_stage_resume(config, recorded_switch: int | None, start_step: int, checkpointer) -> None:
  """A two_stage switch moved past the checkpoint would copy the generator over the trained
  discriminator again, or leave the discriminator's stage without its copy."""
  switch = config.objective.get("two_stage_switch")
  if recorded_switch is None or switch == recorded_switch or start_step <= min(switch, recorded_switch):
    return
  checkpointer.close()
  harm = ("copy the generator's encoder over the trained discriminator again" if switch > recorded_switch
          else "start the discriminator's stage without the generator's encoder")
  raise ConfigError(
      f"objective.two_stage_switch={switch}, but this workdir's run switches at step {recorded_switch} "
      f"and its checkpoint is at step {start_step}: moving the switch now would {harm}. Leave it at "
      f"{recorded_switch} (or 0), or use a new --workdir."
  )


def _keep_changed_config(config, workdir: str, start_step: int | None) -> None:
  """Resuming with other settings (a new batch size, learning rate, ...): says which, and
  keeps the config the checkpoint was trained with as config.step<N>.json before config.json
  takes the new one, so the run's history stays on record."""
  before = config_lib.saved_config(workdir) if start_step is not None else None
  if before is None:
    return
  changes = config_lib.changed_keys(before, config_lib.as_saved(config))
  if not changes:
    return
  kept = f"config.step{start_step}.json"
  # A second resume from the same checkpoint finds the first one's settings in config.json,
  # which never trained it: the file the first resume kept stays as it is.
  if not workdir_files.exists(workdir_files.path(workdir, kept)):
    workdir_files.write_text(workdir_files.path(workdir, kept), workdir_files.read_text(workdir_files.path(workdir, "config.json")))
  logging.warning("Resuming at step %d with settings that differ from the workdir's config.json (kept as %s): %s",
                  start_step, kept, "; ".join(changes))


def _train(config, workdir, mesh, corpus, setup, checkpointer, start_step, restored, lease,
           stream_offset) -> dict[str, float]:
  is_chief = jax.process_index() == 0
  init_rng = jax.random.key(config.train.seed)
  evaluator = evaluation.HeldOutEvaluator(config, setup, mesh) if config.eval.every_steps else None
  # Local or in a bucket (gs://...): see workdir_files.py. Only process 0 writes them.
  metrics_log = eval_log = None
  if is_chief:
    workdir_files.makedirs(workdir_files.path(workdir))
    _keep_changed_config(config, workdir, start_step)
    workdir_files.write_text(workdir_files.path(workdir, "config.json"), config_lib.config_file_text(config))
    # metrics.jsonl and eval_metrics.jsonl, TensorBoard events under <workdir>/tensorboard, and
    # the W&B / MLflow runs train.metric_writers names.
    metrics_log, eval_log = tensorboard_log.open_logs(workdir, config.train.metric_writers,
                                                      json.loads(config_lib.to_json(config)))

  with partitioning.activate(mesh):
    if start_step is None:
      state = jax.jit(lambda r: nn.meta.unbox(setup.init_fn(r)), out_shardings=setup.state_shardings)(init_rng)
      start_step = 0
      if is_chief:  # a run killed before its first checkpoint logged steps this one will log again
        metrics_log.truncate_after(0)
        eval_log.truncate_after(0)
    else:
      logging.info("Resuming from the checkpoint at step %d in %s.", start_step, checkpointer.directory)
      # The arrays restored at the start, under this setup's static fields (a time budget builds
      # the setup again once train.steps is known: its schedule and objective read them).
      state = jax.tree.unflatten(jax.tree.structure(setup.abstract_state), jax.tree.leaves(restored))
      if is_chief:
        metrics_log.truncate_after(start_step)
        eval_log.truncate_after(start_step)
    # Ahead of time, so compile time stays out of the throughput figures.
    compile_start = time.perf_counter()
    compiled_step = compile_train_step(setup, config, mesh)
    steps_per_call = config.train.get("steps_per_call", 1)
    compiled_steps = compile_train_steps(setup, config, mesh, steps_per_call) if steps_per_call > 1 else None
    logging.info("Compiled the train step in %.1f s.", time.perf_counter() - compile_start)
    _warn_single_steps(config, steps_per_call)

  # --- Loop
  total_steps = config.train.steps
  seq_len, global_batch = config.data.max_seq_len, config.train.batch_size
  flops_per_token = flops.objective_flops_per_token(setup.model, setup.objective, seq_len)
  logging.info("%s", start_summary(config, setup.param_shapes, flops_per_token, corpus))
  peak = flops.peak_flops(jax.devices()[0])
  tokens_per_step = global_batch * seq_len
  meta = {"param_shapes": setup.param_shapes, "data_fingerprint": corpus.fingerprint}
  window, window_steps, last_logged, step = [], 0, {}, start_step
  keys = batch_keys(config)
  window_start = time.perf_counter()
  if start_step >= total_steps:
    logging.info("Nothing to do: the checkpoint at step %d reached train.steps=%d.", start_step, total_steps)

  # Whatever ends the loop (done, SIGTERM, NaN, an error), saves in flight are completed.
  def fetch(step_index):
    return data.get_batch(
        corpus, step_index, global_batch, config.train.seed, jax.process_index(), jax.process_count(),
        stream_offset,
    )

  try:
    # Batches are read and gathered on a background thread, a step or two ahead.
    with _Preemption() as preemption, data.Prefetcher(fetch, start_step, stop_step=total_steps) as batches:
      call = 0
      while step < total_steps:
        if compiled_steps is not None and _steps_to_boundary(step, config) >= steps_per_call:
          # Several steps in one call; a call never crosses a log, eval or checkpoint step.
          local = [next(batches) for _ in range(steps_per_call)]
          stacked = {name: np.stack([b[name] for b in local]) for name in keys}
          batch = partitioning.global_batch_from_local(stacked, mesh, stacked=True)
          state, metrics = compiled_steps(state, batch, step_rngs(config.train.seed, step, steps_per_call))
          step += steps_per_call
          window_steps += steps_per_call
        else:
          batch = partitioning.global_batch_from_local(next(batches), mesh, keys=keys)
          state, metrics = compiled_step(state, batch, step_rng(config.train.seed, step))
          step += 1
          window_steps += 1
        window.append(metrics)
        stopping = preemption.stop_after(call)
        call += 1

        if step % config.train.log_every == 0 or step == total_steps or stopping:
          # Read the lease file (local: at each log step; a bucket: every 10 s at most): a run
          # that took the workdir over owns its logs from its checkpoint on.
          _hold_workdir(lease, 10.0 if workdir_files.is_remote(workdir) else 0.0)
          logged = _mean_metrics(window)
          elapsed = time.perf_counter() - window_start
          steps_per_sec = window_steps / elapsed
          logged.update(step=step, steps_per_sec=steps_per_sec, tokens_per_sec=steps_per_sec * tokens_per_step)
          if peak is not None:
            logged["mfu"] = logged["tokens_per_sec"] * flops_per_token / (peak * jax.device_count())
          if not math.isfinite(logged["loss"]):
            first_bad = _first_non_finite_step(window, step)
            _stop_if_not_finite("loss", logged["loss"], step, checkpointer, config, first_bad)
          if is_chief:
            metrics_log.append(logged)
            eta = (total_steps - step) / steps_per_sec
            logging.info(
                "step %d/%d | loss %.4f | mlm_acc %.3f | disc_auc %.3f | %s tokens/s | ETA %s",
                step, total_steps, logged["loss"], logged["masked_lm_accuracy"],
                logged["disc_auc"], f"{logged['tokens_per_sec']:,.0f}", config_lib.format_duration(eta),
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
                step, evaluator.num_examples, "rows" if config.data.get("pack_rows") else "examples",
                held_out["loss"], held_out["masked_lm_accuracy"],
                held_out["disc_auc"],
            )

        if step % config.checkpoint.every_steps == 0 or step == total_steps or stopping:
          last_loss = float(np.ravel(jax.device_get(metrics["loss"]))[-1])
          _stop_if_not_finite("loss", last_loss, step, checkpointer, config, step)
          # Never save a state that is not finite: the loss above predates the last update.
          if not bool(_params_finite(state.params)):
            _stop_if_not_finite("parameters", float("nan"), step, checkpointer, config)
          _hold_workdir(lease)  # never save over the checkpoints of a run that took over
          checkpointer.save(step, state, dict(meta, stream_position=stream_offset + step * global_batch))
          if is_chief:  # a bucket's logs are rewritten now and then, and at least here
            metrics_log.flush()
            eval_log.flush()
        if stopping:
          logging.warning(
              "%s received: saved a checkpoint at step %d; run the same command to resume.",
              preemption.signal_name, step
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


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str, step: int | None = None) -> dict:
  """Held-out metrics of a saved checkpoint (the latest unless `step` is given), with the same
  fixed masks as the evaluations during training; also written to <workdir>/eval_step_<N>.json."""
  mesh, corpus, setup = prepare(config)
  step, state = restore_checkpoint(workdir, setup, mesh, step, corpus)
  held_out = evaluation.HeldOutEvaluator(config, setup, mesh)(state)
  held_out["step"] = step
  if jax.process_index() == 0:
    workdir_files.write_text(
        workdir_files.path(workdir, f"eval_step_{step}.json"), json.dumps(held_out, indent=2, sort_keys=True)
    )
  return held_out
