"""Pre-training, top to bottom: `train_and_evaluate` resolves the run (resolve.py), takes the
workdir, compiles the step, then loops: logs, evaluations, saves, preemption and NaN checks."""

import collections
import contextlib
import functools
import math
import time
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from electra_jax import (
    checkpointing,
    config_lib,
    data,
    evaluation,
    flops,
    memory,
    objectives,
    partitioning,
    preemption,
    resolve,
    tensorboard_log,
    train_state,
    workdir_files,
    workdir_lease,
)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, take_over_workdir: bool = False
) -> dict[str, float]:
  """Pre-trains per `config`, going on from the newest intact checkpoint in `workdir`; returns the
  last logged metrics. A workdir another live run holds is refused, unless `take_over_workdir`."""
  with contextlib.ExitStack() as stack:  # closes what the run opened, whatever ends it
    signals = stack.enter_context(preemption.Preemption())
    # --- Resolve: every check, the mesh, the data, the setup and the checkpoint; nothing written
    run = resolve.run(config, workdir)
    config, mesh, setup, corpus, start = run.config, run.mesh, run.setup, run.corpus, run.start
    t, step = config.train, start.step if start is not None else 0
    if step >= t.steps:
      logging.info(f"Nothing to do: the checkpoint at step {step} reached train.steps={t.steps}.")
      return {}
    evaluator = None  # built (its batch checked, its data read) before anything is written
    if config.eval.every_steps:
      evaluator = evaluation.HeldOutEvaluator(config, setup, mesh, run.schedule)

    # --- The workdir: its lease, its checkpoints (saves in flight complete at the end, whatever
    # ends the run), its files; out of memory named in one line
    lease = stack.enter_context(workdir_lease.held(workdir, take_over_workdir))
    micro = f" (micro-batches of {t.batch_size // t.grad_accum_steps})"
    out_of_memory = memory.out_of_memory_named(
        f"with train.batch_size={t.batch_size}{micro if t.grad_accum_steps > 1 else ''}",
        "lower it, raise train.grad_accum_steps, set model.remat=full, or set train.batch_size=-1 "
        "for the largest batch that fits; the checkpoints saved are kept",
    )
    stack.enter_context(out_of_memory)
    checkpointer = checkpointing.Checkpointer(workdir, keep=config.checkpoint.keep)
    stack.callback(checkpointer.close)
    stack.callback(checkpointer.wait)
    if start is not None:
      logging.info("Resuming from the checkpoint at step %d in %s.", step, checkpointer.directory)
      if start.newer_damaged:
        checkpointer.set_aside_after(step)

    # --- State and compiled step
    with partitioning.activate(mesh):
      state = start.state if start is not None else train_state.fresh_state(setup, t.seed)
      compile_start, steps_per_call = time.perf_counter(), t.steps_per_call
      compiled = {
          n: train_state.compile_train_step(setup, config, mesh, n if n > 1 else None)
          for n in {1, steps_per_call}
      }
      logging.info("Compiled the train step in %.1f s.", time.perf_counter() - compile_start)

    # --- Process 0 writes the tokenizer (fine-tuning and export need no corpus then) and opens
    # the logs, cut back to the checkpoint (a bucket's are not rewritten once the lease is lost);
    # config.json follows the first step. The workdir may be a bucket.
    is_chief, metrics_log, eval_log = jax.process_index() == 0, None, None
    if is_chief:
      data.keep_tokenizer(corpus.tokenizer, workdir)
      logs = tensorboard_log.open_logs(workdir, t.metric_writers, config_lib.as_saved(config))
      metrics_log, eval_log = logs
      for log in logs:  # a run killed after its checkpoint logged steps this one logs again
        stack.callback(log.close)
        log.holds = lease.holds
        log.truncate_after(step)

    # --- The loop: several steps a call where they fit before the next log, evaluation or save
    seq_len, global_batch = config.data.max_seq_len, t.batch_size
    # The data stream goes on where the checkpoint's run stopped reading (its batch size may vary).
    stream_offset = start.stream_position - step * global_batch if step else 0
    if stream_offset:
      logging.info(
          f"The checkpoint at step {step} read {start.stream_position} rows of the data stream "
          f"(the batch size changed along the way); batches of {global_batch} go on from there."
      )
    what_is_held_out = "rows" if config.data.pack_rows else "examples"
    flops_per_token = flops.objective_flops_per_token(setup.model, setup.objective, seq_len)
    parts = collections.Counter()  # the line a run starts with: what it trains, how big, on what
    for path, shape in setup.param_shapes.items():
      parts[path.split("/", 1)[0]] += math.prod(shape)
    counts = ", ".join(f"{name} {count / 1e6:.2f}M" for name, count in sorted(parts.items()))
    logging.info(
        f"Training {config.objective.name}: parameters {counts} ({sum(parts.values()) / 1e6:.2f}M "
        f"in all); {flops_per_token / 1e6:.1f} model MFLOPs per token; {global_batch * seq_len:,} "
        f"tokens per step (batch {global_batch} x {seq_len}) for {t.steps:,} steps; {t.dtype}, "
        f"attention {config.model.attention_impl}; data {config.data.source}: "
        f"{corpus.num_examples:,} train examples, vocabulary {corpus.tokenizer.vocab_size:,}."
    )
    peak = flops.peak_flops(jax.devices()[0])
    meta = {"param_shapes": setup.param_shapes, "data_fingerprint": corpus.fingerprint}
    window, window_steps, last_logged, call = [], 0, {}, 0
    keys, periods = data.batch_keys(config.data.pack_rows), _periods(config, steps_per_call)
    window_start = time.perf_counter()
    save_config = functools.partial(
        config_lib.save_config, workdir, config, run.saved_config, start and start.step
    )

    def fetch(step_index):
      processes = jax.process_index(), jax.process_count()
      return data.get_batch(corpus, step_index, global_batch, t.seed, *processes, stream_offset)

    signals.start_loop()
    # Batches are read and gathered on a background thread, a step or two ahead.
    batches = stack.enter_context(data.prefetch(fetch, step, stop_step=t.steps))
    while step < t.steps:
      to_boundary = min([*(p - step % p for p in periods), t.steps - step])
      num_steps = steps_per_call if to_boundary >= steps_per_call else 1
      if num_steps > 1:
        local = [next(batches) for _ in range(num_steps)]
        stacked = {name: np.stack([b[name] for b in local]) for name in keys}
        batch = partitioning.global_batch_from_local(stacked, mesh, stacked=True)
        rngs = train_state.step_rngs(t.seed, step, num_steps)
      else:
        batch = partitioning.global_batch_from_local(next(batches), mesh, keys=keys)
        rngs = train_state.step_rng(t.seed, step)
      state, metrics = compiled[num_steps](state, batch, rngs, run.schedule)
      if call == 0 and is_chief:  # config.json records a batch that ran, not one over memory
        jax.block_until_ready(metrics)
        save_config()
      step += num_steps
      window_steps += num_steps
      window.append(metrics)
      stopping = signals.stop_after(call)
      call += 1
      at_log = step % t.log_every == 0 or step == t.steps or stopping
      at_save = step % config.checkpoint.every_steps == 0 or step == t.steps or stopping
      at_eval = evaluator and (step % config.eval.every_steps == 0 or step == t.steps)
      if not (at_log or at_save or at_eval):
        continue

      if at_log or at_save:  # never log or save after a step that was not finite
        _stop_if_not_finite(window, state.params if at_save else None, step, checkpointer, t.dtype)
      if at_log:
        logged = _mean_metrics(window)
        rate = window_steps / (time.perf_counter() - window_start)  # steps a second
        logged.update(step=step, steps_per_sec=rate, tokens_per_sec=rate * global_batch * seq_len)
        if peak is not None:
          logged["mfu"] = logged["tokens_per_sec"] * flops_per_token / (peak * jax.device_count())
        eta = config_lib.format_duration((t.steps - step) / rate)
        last_logged, window, window_steps, window_start = logged, [], 0, time.perf_counter()
      if at_eval:
        eval_start = time.perf_counter()
        held_out = evaluator(state)
        window_start += time.perf_counter() - eval_start  # keep eval out of tokens/s
      if at_log or at_save:
        # The lease file (a bucket's read at most every 10 s between saves): a run that took the
        # workdir over owns its logs and checkpoints from its checkpoint on.
        workdir_lease.hold(lease, 10.0 if workdir_files.is_remote(workdir) and not at_save else 0.0)
      if is_chief and at_log:
        metrics_log.append(logged)
        logging.info(
            "step %(step)d/%(steps)d | loss %(loss).4f | mlm_acc %(masked_lm_accuracy).3f | "
            "disc_auc %(disc_auc).3f | %(tokens)s tokens/s | ETA %(eta)s",
            dict(logged, steps=t.steps, tokens=f"{logged['tokens_per_sec']:,.0f}", eta=eta),
        )
      if is_chief and at_eval:
        eval_log.append(dict(held_out, step=step))
        logging.info(
            "eval step %(step)d (%(n)d held-out %(what)s) | loss %(loss).4f | mlm_acc "
            "%(masked_lm_accuracy).3f | disc_auc %(disc_auc).3f",
            dict(held_out, step=step, n=evaluator.num_examples, what=what_is_held_out),
        )
      if at_save:
        checkpointer.save(
            step, state, dict(meta, stream_position=stream_offset + step * global_batch)
        )
        if is_chief:  # a bucket's logs are rewritten now and then, and at least here
          metrics_log.flush()
          eval_log.flush()
      if stopping:
        logging.warning(
            f"{signals.signal_name} received: saved a checkpoint at step {step}; run the same "
            "command to resume."
        )
        break
    if step >= t.steps and is_chief:
      logging.info("Done: step %d, checkpoints in %s.", step, checkpointer.directory)
    return last_logged


def evaluate_checkpoint(
    config: ml_collections.ConfigDict, workdir: str, step: int | None = None
) -> dict:
  """Held-out metrics of a saved checkpoint (the latest unless `step` is given), also written to
  <workdir>/eval_step_<N>.json."""
  run = resolve.run(config)  # the checkpoint is read below, at `step`
  step, state = resolve.restore_checkpoint(workdir, run.setup, run.mesh, step, run.corpus)
  held_out = evaluation.HeldOutEvaluator(run.config, run.setup, run.mesh, run.schedule)(state)
  held_out["step"] = step
  if jax.process_index() == 0:
    workdir_files.write_json(workdir_files.path(workdir, f"eval_step_{step}.json"), held_out)
  return held_out


def _stop_if_not_finite(window: list, params, step: int, checkpointer, dtype: str) -> None:
  """Stops the run when a loss of the window ending at `step` or, given `params` (a loss predates
  its step's update), a parameter is not finite; says if the last checkpoint did it."""
  first_bad = _first_non_finite_step(window, step)
  if first_bad is None and (params is None or bool(_params_finite(params))):
    return
  checkpointer.wait()  # the last good checkpoint may still be being written
  latest = checkpointer.latest_step()
  what = f"loss became {_mean_metrics(window)['loss']}" if first_bad else "parameters became nan"
  saved = "No checkpoint was saved yet: the next start begins from scratch."
  if latest is not None:
    saved = f"The last checkpoint is step {latest}."
  if latest is not None and first_bad is not None and latest >= first_bad - 1:
    saved += (
        f" Its parameters are finite but already gave step {latest + 1} a non-finite loss: "
        "resume from an earlier checkpoint (checkpoint.keep keeps more) or start over."
    )
  raise FloatingPointError(
      f"The {what} by step {step}; stopping without saving. {saved} Lower "
      "optimizer.learning_rate or raise optimizer.warmup_steps"
      + (", or use train.dtype=float32." if dtype != "float32" else ".")
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


def _periods(config, steps_per_call: int) -> tuple[int, ...]:
  """Steps between logs, saves and evaluations; warns if train.steps_per_call leaves lone steps."""
  periods = {
      "train.log_every": config.train.log_every,
      "checkpoint.every_steps": config.checkpoint.every_steps,
      "eval.every_steps": config.eval.every_steps,  # 0: no evaluation, no boundary
  }
  if uneven := [f"{name}={p}" for name, p in periods.items() if p % steps_per_call]:
    logging.warning(
        f"train.steps_per_call={steps_per_call} does not divide {', '.join(uneven)}: steps short "
        f"of a call before them run one call each (slower); use multiples of {steps_per_call}."
    )
  return tuple(p for p in periods.values() if p)
