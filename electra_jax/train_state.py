"""The train state and its update: `train_step(state, batch, rng, schedule)`, a pure function; the
state's sharded setup (`build_setup`, whatever the batch size and length) and the compiled step."""

import dataclasses
import functools
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import logging

from electra_jax import data, evaluation, objectives, optimizer, partitioning
from electra_jax.models import ElectraPretrainer, build_model
from electra_jax.optimizer import Schedule


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


def train_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array, schedule: Schedule):
  """One optimizer update on `batch` ([batch, seq] arrays). Masks are drawn for the whole batch first, so
  micro-batch losses share whole-batch denominators and their gradients sum to the full one."""
  objective = state.objective
  registered = objectives.REGISTRY[objective.name]
  params = registered.before_step(state.params, state.step, schedule)
  mask_rng, sample_rng, dropout_rng = jax.random.split(rng, 3)
  ids, attention = batch["input_ids"], batch["attention_mask"]
  masked = objectives.mask_tokens(mask_rng, ids, attention, objective)
  sample_keys = jax.random.split(sample_rng, ids.shape[0])
  candidates = objectives.candidate_mask(ids, attention, objective)
  normalizers = objectives.Normalizers.of(masked, attention, candidates)
  temperature = objectives.sampling_temperature(objective, state.step, schedule.temperature_decay)

  forward = functools.partial(  # (params, batch, masked, sample keys, dropout key) of a micro-batch
      objectives.electra_forward,
      state.model,
      objective=objective,
      normalizers=normalizers,
      step=state.step,
      temperature=temperature,
      schedule=schedule,
  )
  grad_fn = jax.value_and_grad(forward, has_aux=True)
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
      micro, micro_dropout_rng = inputs  # (batch, masked, sample keys) of one micro-batch
      (_, (stats, per_token)), grads = grad_fn(params, *micro, micro_dropout_rng)
      return jax.tree.map(jnp.add, carry, (grads, stats)), per_token

    first = jax.tree.map(lambda x: x[0], micro_inputs)
    (_, (stats_shape, _)), grads_shape = jax.eval_shape(
        grad_fn, params, *first, micro_dropout_rngs[0]
    )
    zeros = jax.tree.map(jnp.zeros_like, (grads_shape, stats_shape))
    (grads, stats), per_token = jax.lax.scan(accumulate, zeros, (micro_inputs, micro_dropout_rngs))

  updates, opt_state = state.tx.update(grads, state.opt_state, params, schedule=schedule)
  params = optax.apply_updates(params, registered.updates(updates, state.step, schedule))
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
    step, opt_state = jnp.zeros((), jnp.int32), self.tx.init(params)
    return TrainState(
        step, params, opt_state, self.model, self.tx, self.objective, self.grad_accum_steps
    )


def make_init_fn(config, model: ElectraPretrainer, objective) -> StateInit:
  tx = optimizer.make_optimizer(config.optimizer)
  return StateInit(model, objective, tx, config.data.max_seq_len, config.train.grad_accum_steps)


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


def build_setup(config, mesh, special_ids: dict[str, int]) -> TrainingSetup:
  """Model, objective, optimizer and shardings: independent of the batch size and the run's length."""
  init_fn = make_init_fn(
      config,
      build_model(config, objectives.towers(config)),
      objectives.objective_from_config(config, special_ids),
  )
  boxed_shapes = jax.eval_shape(init_fn, jax.random.key(0))
  state_shardings = partitioning.shardings_for(boxed_shapes, mesh)
  if unsharded := partitioning.unsharded_dimensions(boxed_shapes.params, mesh):
    logging.warning(
        f"Replicated on every device, as no mesh axis divides them: {'; '.join(unsharded)}. Make "
        "those sizes (e.g. model.vocab_size) multiples of the mesh axes, or use smaller axes."
    )
  abstract_state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      nn.meta.unbox(boxed_shapes),
      state_shardings,
  )
  shapes = param_shapes(boxed_shapes.params)
  return TrainingSetup(
      init_fn.model, init_fn.objective, init_fn, state_shardings, abstract_state, shapes
  )


def compile_train_step(
    setup: TrainingSetup, config, mesh, num_steps: int | None = None, batch_size: int | None = None
):
  """train_step compiled for a global batch (default train.batch_size) with the state donated, or
  with `num_steps`, train_steps over that many stacked batches and keys."""
  # Abstract keys: compile-only devices (benchmarks/compile_audit.py) cannot run anything.
  leading = () if num_steps is None else (num_steps,)
  rng = jax.eval_shape(lambda: step_rngs(0, 0, num_steps) if leading else jax.random.key(0))
  batch_sharding = partitioning.batch_sharding(mesh, stacked=bool(leading))
  replicated = partitioning.replicated(mesh)
  shape = (*leading, batch_size or config.train.batch_size, config.data.max_seq_len)
  abstract_batch = {
      name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
      for name in data.batch_keys(config.data.pack_rows)
  }
  abstract_rng = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated)
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)  # each Schedule field
  abstract_schedule = Schedule(*[scalar] * len(dataclasses.fields(Schedule)))
  jitted = jax.jit(
      train_steps if leading else train_step,
      in_shardings=(setup.state_shardings, batch_sharding, replicated, replicated),
      out_shardings=(setup.state_shardings, replicated),
      donate_argnums=(0,),
  )
  with partitioning.activate(mesh):
    lowered = jitted.lower(setup.abstract_state, abstract_batch, abstract_rng, abstract_schedule)
    return lowered.compile()


_TIMED_STEPS = 3  # after one warm-up step


def measure_step_time(config, setup: TrainingSetup, mesh, corpus) -> tuple[float, float, float]:
  """Seconds of (one train step, compiling it and the evaluation, one held-out evaluation or 0), on
  a throwaway state and batch 0 after a warm-up step and a first evaluation; in activate(mesh)."""
  seed, keys = config.train.seed, data.batch_keys(config.data.pack_rows)
  state, clock = fresh_state(setup, seed), time.perf_counter()
  step_fn = compile_train_step(setup, config, mesh)
  compile_seconds = time.perf_counter() - clock
  local = data.get_batch(
      corpus, 0, config.train.batch_size, seed, jax.process_index(), jax.process_count()
  )
  batch = partitioning.global_batch_from_local(local, mesh, keys=keys)
  schedule, rng, seconds = optimizer.make_schedule(config), step_rng(seed, 0), []
  for count in (1, _TIMED_STEPS):  # the warm-up step, then the timed ones
    clock = time.perf_counter()
    for _ in range(count):
      state, _ = step_fn(state, batch, rng, schedule)
    jax.block_until_ready(state)
    seconds.append(time.perf_counter() - clock)
  evaluated = []
  if config.eval.every_steps:  # the first evaluation compiles
    evaluator = evaluation.HeldOutEvaluator(config, setup, mesh, schedule)
    for _ in range(2):
      clock = time.perf_counter()
      jax.block_until_ready(evaluator(state))
      evaluated.append(time.perf_counter() - clock)
    compile_seconds += max(evaluated[0] - evaluated[1], 0.0)
  return seconds[1] / _TIMED_STEPS, compile_seconds, evaluated[-1] if evaluated else 0.0


def special_ids(tokenizer) -> dict[str, int]:
  """The token ids build_setup needs from the corpus's tokenizer."""
  ids = {name: getattr(tokenizer, f"{name}_id") for name in ("pad", "cls", "sep", "mask")}
  return dict(ids, vocab_size=tokenizer.vocab_size)
