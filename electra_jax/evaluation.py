"""Held-out pre-training evaluation: the official metric set over a fixed set of held-out
examples with fixed masks and fixed samples, so numbers compare across checkpoints and runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from electra_jax import data, memory, objectives, partitioning
from electra_jax.errors import ConfigError


def eval_step(state, batch, seed_key, schedule):
  """Forward pass without dropout: (additive stats, per-token arrays). Masks and samples (at the
  final temperature) come from a key per example: the figures do not depend on the batch size."""
  objective = state.objective
  example_keys = jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(batch["example_index"])
  mask_keys, sample_keys = jnp.moveaxis(jax.vmap(jax.random.split)(example_keys), 1, 0)
  masked = jax.vmap(
      lambda key, ids, mask: objectives.mask_tokens(key, ids[None], mask[None], objective)
  )(mask_keys, batch["input_ids"], batch["attention_mask"])
  masked = jax.tree.map(lambda x: x[:, 0], masked)  # [batch, 1, ...] -> [batch, ...]
  candidates = objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective)
  normalizers = objectives.Normalizers.of(masked, batch["attention_mask"], candidates)
  # The parameters as they are (two_stage's copy is the next train step's); the stats, not the loss.
  args = (state.model, state.params, batch, masked, sample_keys, seed_key, objective, normalizers)
  options = dict(deterministic=True, step=state.step, schedule=schedule)
  return objectives.electra_forward(*args, **options)[1]  # (loss, (stats, per-token arrays))


class HeldOutEvaluator:
  """A train state's metrics on the first `eval.num_batches` held-out batches, in order; a short
  last batch is filled with all-padding rows (no weight): each example counts once."""

  def __init__(self, config, setup, mesh, schedule):
    held_out = data.load_pretraining_data(config.data, split="eval")
    batch_size = config.eval.batch_size or config.train.batch_size // config.train.grad_accum_steps
    shards, processes = partitioning.batch_shards(mesh), jax.process_count()
    if batch_size % shards or batch_size % processes:
      raise ConfigError(
          f"eval.batch_size={batch_size} is not divisible by the {shards} batch shards "
          f"(mesh.data * mesh.fsdp) and {processes} processes; choose a multiple."
      )
    num_rows = min(held_out.num_rows, config.eval.num_batches * batch_size)
    num_batches, rows = -(-num_rows // batch_size), batch_size // processes
    local = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    padded = {"example_index": np.arange(num_batches * batch_size, dtype=np.int32)}
    # The first rows in storage order (packed rows with data.pack_rows): the same every time.
    for name, array in data.get_rows(held_out, np.arange(num_rows)).items():
      fill = held_out.tokenizer.pad_id if name == "input_ids" else 0
      padded[name] = np.full((num_batches * batch_size, array.shape[1]), fill, np.int32)
      padded[name][:num_rows] = array
    self._batches = [
        {name: rows[i * batch_size : (i + 1) * batch_size][local] for name, rows in padded.items()}
        for i in range(num_batches)
    ]
    self.num_examples = num_rows
    self._keys = data.batch_keys(bool(config.data.pack_rows)) + ("example_index",)
    self._mesh, self._schedule, self._seed = mesh, schedule, config.eval.seed
    self._what = f"with a held-out batch of {batch_size} (eval.batch_size)"  # what ran out
    replicated = partitioning.replicated(mesh)
    shardings = (setup.state_shardings, partitioning.batch_sharding(mesh), replicated, replicated)
    self._step = jax.jit(eval_step, in_shardings=shardings, out_shardings=replicated)

  def __call__(self, state) -> dict[str, float]:
    outputs, fix = [], "set a smaller eval.batch_size"
    with partitioning.activate(self._mesh), memory.out_of_memory_named(self._what, fix):
      for local_batch in self._batches:
        batch = partitioning.global_batch_from_local(local_batch, self._mesh, keys=self._keys)
        outputs.append(self._step(state, batch, jax.random.key(self._seed), self._schedule))
      metrics = _summarize(outputs, state.objective)
    return {name: float(value) for name, value in jax.device_get(metrics).items()}


@functools.partial(jax.jit, static_argnums=1)  # one program, not one per operation
def _summarize(outputs, objective):
  """The metrics of eval_step's outputs: stats summed in batch order, arrays concatenated."""
  totals = jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs), *(stats for stats, _ in outputs))
  per_token = jax.tree.map(lambda *xs: jnp.concatenate(xs), *(arrays for _, arrays in outputs))
  return objectives.summarize(totals, per_token, objective)
