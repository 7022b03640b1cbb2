"""The one wrapper around orbax: train state plus a JSON side-car (parameter shapes, data
fingerprint, a checksum of every array) under <workdir>/checkpoints/<step>/; a restore refuses
arrays that differ (DamagedCheckpoint)."""

import asyncio
import contextlib
import dataclasses
import functools
import glob
import logging as std_logging
import os
import shutil
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from electra_jax import distributed, workdir_files
from electra_jax.errors import CheckpointRotated, ConfigError, DamagedCheckpoint


def _leaf_checksum(x: jax.Array) -> jax.Array:
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
  bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 64-bit values: two words
  # Each element weighted by an odd multiple of its flat index, without a reshape (which would
  # move sharded data).
  index, stride = jnp.zeros(bits.shape, jnp.uint32), 1
  for dim in reversed(range(bits.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * jnp.uint32(stride % 2**32)
    stride *= bits.shape[dim]
  return jnp.sum(bits * (index * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


_checksums = jax.jit(functools.partial(jax.tree.map, _leaf_checksum))  # one call for all arrays


def checksums(tree: Any) -> dict[str, int]:
  """Per array of `tree` ('params/embeddings/...'): the sum of its bits weighted by position,
  modulo 2**32, exact in any order, so independent of sharding and device count."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = jax.device_get(_checksums([leaf for _, leaf in flat]))
  # The same names for a train state and the plain dicts orbax returns.
  name = lambda path: jax.tree_util.keystr(path, simple=True, separator="/")  # noqa: E731
  return {name(path): int(value) for (path, _), value in zip(flat, values)}


def checkpoints_directory(workdir: str) -> str:
  return os.fspath(workdir_files.path(workdir, "checkpoints"))


def _move_in_bucket(source: epath.Path, target: epath.Path) -> None:
  """Copies `source`'s objects to `target`, then deletes them, its commit marker first: a move cut
  short leaves `source` whole, or unfinished to orbax. Through etils.epath, whose listings orbax
  reads."""
  top = os.fspath(source).removeprefix("gs://")
  for folder, _, files in source.walk():  # folders named without gs://
    inside = os.fspath(folder).removeprefix("gs://").removeprefix(top).strip("/")
    for name in files:
      (source / inside / name).copy(target / inside / name)
  (source / ocp.path.atomicity_types.COMMIT_SUCCESS_FILE).unlink()  # what orbax writes last
  source.rmtree()


def _without_traceback(record) -> bool:
  """orbax's threads log a failed save with its traceback; the failure is raised again by save() or
  wait(), named when it is a want of space."""
  if "orbax" in record.pathname:
    record.exc_info = record.exc_text = None
  return True


class Checkpointer:

  def __init__(self, workdir: str, keep: int):
    self.directory = checkpoints_directory(workdir)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._size, self._failed = 0, False  # bytes of the state saved last; a save ran out of space
    logging.get_absl_logger().addFilter(_without_traceback)
    self._unraisablehook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    std_logging.getLogger("asyncio").addFilter(self._asyncio_record)

  # A save that runs out of space ends in OutOfSpace alone. Its writes still in flight print
  # tracebacks as they find orbax's event loop closed (sys.unraisablehook), or as asyncio collects
  # their failed tasks (its logger): those tracebacks are dropped while the folder is short of space.
  def _unraisable(self, unraisable) -> None:
    # The innermost frame: a callback sent to a closed loop.
    last = [frame.f_code for frame, _ in traceback.walk_tb(unraisable.exc_traceback)][-1:]
    if not (last == [asyncio.BaseEventLoop._check_closed.__code__] and self._short_of_space()):
      self._unraisablehook(unraisable)

  def _asyncio_record(self, record) -> bool:
    return record.exc_info is None or not self._short_of_space()

  def _short_of_space(self) -> int | None:
    local = not workdir_files.is_remote(self.directory)
    return local and workdir_files.short_of_space(self.directory, self._size) or None

  def latest_step(self, fix: str = "") -> int | None:
    """The newest step saved; None when there is none, or, given the `fix`, a ConfigError."""
    if (step := self._manager.latest_step()) is None and fix:
      raise ConfigError(f"{self.directory} holds no checkpoint yet; {fix}.")
    return step

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Asynchronous (device arrays are copied before this returns); the meta gets the checksums."""
    meta = dict(meta, checksums=checksums(state))
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    self._size = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    self._saving(self._manager.save, step, args=args, force=True)

  def _saving(self, call, *args, **kwargs) -> None:
    """call(*args, **kwargs) (a save, or the wait for one in flight); a save that found too little space is
    OutOfSpace naming the folder, its unfinished step removed, the earlier ones kept."""
    if self._failed:
      return
    try:
      call(*args, **kwargs)
    except Exception:
      if not (code := self._short_of_space()):
        raise
      self._failed = True
      with contextlib.suppress(Exception):  # the failure again, from the threads it stops
        self._manager.close()
      for _ in range(50):  # writes in flight add and remove files there for a moment
        if not (unfinished := glob.glob(f"{self.directory}/*{ocp.path.atomicity.TMP_DIR_SUFFIX}*")):
          break
        for folder in unfinished:
          shutil.rmtree(folder, ignore_errors=True)
        time.sleep(0.1)
      with workdir_files.out_of_space_named(self.directory):
        raise OSError(code, os.strerror(code)) from None

  def _read(self, step: int, what: str, read):
    """read(), or DamagedCheckpoint saying `what` of `step` cannot be read."""
    try:
      return read()
    except Exception as error:  # noqa: BLE001 -- whatever orbax raises on a missing or broken file
      if not (epath.Path(self.directory) / str(step)).exists():  # not damaged: rotated away
        raise CheckpointRotated(
            f"The checkpoint at step {step} in {self.directory} was removed while it was read: a "
            "run writing there saved a newer one."
        ) from error
      first_line = (str(error).splitlines() or [""])[0][:200]
      why = f"its {what} cannot be read ({type(error).__name__}: {first_line})"
      raise self._damaged(step, why) from error

  def _damaged(self, step: int, why: str) -> DamagedCheckpoint:
    others = [s for s in self.all_steps() if s != step]
    return DamagedCheckpoint(
        f"The checkpoint at step {step} in {self.directory} is damaged: {why}. "
        + (f"Other steps there: {others}." if others else "It is the only step there.")
    )

  def read_meta(self, step: int) -> dict:
    meta = ocp.args.Composite(meta=ocp.args.JsonRestore())
    return self._read(step, "meta", lambda: self._manager.restore(step, args=meta)["meta"])

  def restore(self, step: int, abstract_state: Any, meta: dict | None = None) -> Any:
    """`abstract_state`: ShapeDtypeStructs with the target shardings. DamagedCheckpoint when a file
    cannot be read or an array's checksum differs from the one saved."""
    recorded = (meta if meta is not None else self.read_meta(step)).get("checksums", {})
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    state = self._read(step, "arrays", lambda: self._manager.restore(step, args=args)["state"])
    if differ := [n for n, value in checksums(state).items() if recorded.get(n) != value]:
      why = f"{len(differ)} arrays differ from what was saved (first: {differ[:3]})"
      raise self._damaged(step, why)
    return state

  def restore_newest_intact(
      self, abstract_state: Any, at_most: int, check
  ) -> tuple[int, Any, dict]:
    """(step, state, meta) of the newest step up to `at_most` that restores intact, each damaged one
    skipped with a warning; `check(step, meta)` may refuse a step before its arrays are read."""
    damaged = []
    for step in sorted((s for s in self.all_steps() if s <= at_most), reverse=True):
      try:
        check(step, meta := self.read_meta(step))
        state = self.restore(step, abstract_state, meta)
      except DamagedCheckpoint as error:
        logging.warning("%s Trying the step before it.", error)
        damaged.append(step)
        continue
      if damaged:
        logging.warning(
            "Using the checkpoint at step %d, the newest intact one (damaged: %s).", step, damaged
        )
      return step, state, meta
    raise DamagedCheckpoint(
        f"No intact checkpoint in {self.directory}: steps {damaged} are damaged (the warnings "
        "above say how). Restore them from a copy, or move them away to start over."
    )

  def set_aside_after(self, step: int) -> None:
    """Process 0 renames every step after `step` (a resume from `step` would save over it) to
    <step>.damaged while the other processes wait (a bucket's: _move_in_bucket), then forgets them.
    """
    later = [s for s in self.all_steps() if s > step]
    multihost_utils.sync_global_devices("electra_jax: before setting damaged checkpoints aside")
    for s in later if jax.process_index() == 0 else ():
      source = epath.Path(self.directory) / str(s)
      target, n = source.parent / f"{s}.damaged", 1
      while target.exists():
        target, n = source.parent / f"{s}.damaged{n}", n + 1
      if workdir_files.is_remote(source):
        _move_in_bucket(source, target)
      else:
        source.rename(target)
      logging.warning("Moved the damaged checkpoint at step %d to %s.", s, target)
    multihost_utils.sync_global_devices("electra_jax: damaged checkpoints set aside")
    if later:
      self._manager.reload()

  def wait(self) -> None:
    self._saving(self._manager.wait_until_finished)

  def close(self) -> None:
    if not self._failed:  # a failed save's writes may still reach the hook
      self._manager.close()
      if sys.unraisablehook == self._unraisable:
        sys.unraisablehook = self._unraisablehook
      std_logging.getLogger("asyncio").removeFilter(self._asyncio_record)


@dataclasses.dataclass(frozen=True)
class Start:
  """The checkpoint a run goes on from, checked against its setup and data."""

  step: int
  state: Any  # its arrays, sharded for the run's mesh
  stream_position: int  # the rows of the data stream its run had read (batch sizes may differ)
  newer_damaged: bool  # newer steps did not restore: they are set aside before the run saves


def newest_start(workdir: str, setup, corpus, changes=None) -> Start | None:
  """The newest intact checkpoint in `workdir` that holds this setup's model and this data, or None
  (`changes`: as `fits` takes them)."""
  found = workdir_files.exists(checkpoints_directory(workdir))  # else none is made here
  reading = contextlib.closing(Checkpointer(workdir, 1)) if found else contextlib.nullcontext()
  with reading as checkpointer:  # keep acts on saves alone
    mine = checkpointer.latest_step() if found else None
    # One answer for every process, even if a save ends meanwhile.
    latest = distributed.from_process_0(-1 if mine is None else mine)
    if latest >= 0 and not found:
      raise ConfigError(
          f"--workdir={workdir} is not one directory every process sees: process 0 finds step "
          f"{latest} there, process {jax.process_index()} none. Use a bucket or a shared mount."
      )
    if latest < 0:
      return None
    check = fits(checkpointer, setup, workdir, corpus, changes)
    step, state, meta = checkpointer.restore_newest_intact(setup.abstract_state, latest, check)
  position = int(meta["stream_position"]) if step else 0  # an imported pair's step 0 has none
  return Start(step, state, position, newer_damaged=step != latest)


def fits(checkpointer, setup, workdir: str, corpus=None, changes=None):
  """(step, meta) -> None, refusing a checkpoint of another model, state structure or (given
  `corpus`) data; `changes` names the model settings that differ from the workdir's config.json."""
  config_json = os.path.join(workdir, "config.json")

  def check(step: int, meta: dict) -> None:
    theirs, ours = meta["param_shapes"], setup.param_shapes
    if differ := [n for n in sorted(set(theirs) | set(ours)) if theirs.get(n) != ours.get(n)]:
      name, changed = differ[0], "; ".join(changes or [])
      changed = changed and f"; settings that differ from its config.json: {changed}"
      raise ConfigError(
          f"The workdir {workdir} holds a checkpoint of a different model: parameter {name!r} is "
          f"{theirs.get(name, 'absent')} there, {ours.get(name, 'absent')} here{changed}. Use a "
          f"new --workdir, or the config in {config_json}. Nothing was overwritten."
      )
    # From the tree metadata alone: orbax's restore would fail with a traceback.
    folder = epath.Path(checkpointer.directory) / str(step) / "state"
    read = lambda: dict(ocp.StandardCheckpointHandler().metadata(folder))  # noqa: E731
    paths = lambda tree: {"/".join(map(str, path)) for path in ocp.tree.to_flat_dict(tree)}
    saved = paths(checkpointer._read(step, "tree metadata", read))  # noqa: SLF001
    wanted = paths(ocp.tree.serialize_tree(setup.abstract_state, keep_empty_nodes=True))
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if missing or extra:
      what, fix = "a train", ""
      if all(p.startswith("opt_state") for p in missing + extra):
        what = "an optimizer"
        fix = "resume with its optimizer.bias_correction (True: Adam counts steps) or "
      raise ConfigError(
          f"The checkpoint at step {step} in {workdir} holds {what} state of another structure "
          f"(missing: {missing[:3] or 'none'}; only there: {extra[:3] or 'none'}): {fix}use a new "
          "--workdir. Nothing was overwritten."
      )
    if corpus is None:
      return
    if meta["data_fingerprint"] is None:  # imported weights: bound to a vocabulary alone
      if meta["tokenizer_fingerprint"] != corpus.tokenizer.fingerprint:
        raise ConfigError(
            f"The checkpoint in {workdir} holds weights imported from {meta['imported_from']} with "
            f"their own vocabulary ({meta['tokenizer_fingerprint']}), not this config's "
            f"({corpus.tokenizer.fingerprint}): train with {config_json}, e.g. leave out --config."
        )
    elif meta["data_fingerprint"] != corpus.fingerprint:
      raise ConfigError(
          f"The checkpoint in {workdir} was trained on data {meta['data_fingerprint']}, this config "
          f"gives {corpus.fingerprint} (another tokenizer, corpus, max_seq_len or data.pack_rows): "
          f"use a new --workdir, or the data settings of {config_json}."
      )

  return check
