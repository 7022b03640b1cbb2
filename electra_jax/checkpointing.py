"""The one thin wrapper around orbax: train state plus a JSON side-car (step, parameter
shapes, data fingerprint) under <workdir>/checkpoints/<step>/."""

import os
from typing import Any, Optional

import orbax.checkpoint as ocp
from etils import epath

from electra_jax import workdir_files


def checkpoints_directory(workdir: str) -> str:
  """<workdir>/checkpoints; a bucket path (gs://...) stays as it is (os.path.abspath would
  make it a local one). Orbax writes to buckets through gcsfs and google-cloud-storage: the
  `gcs` extra."""
  return os.fspath(workdir_files.path(workdir, "checkpoints"))


class Checkpointer:

  def __init__(self, workdir: str, keep: int):
    self.directory = checkpoints_directory(workdir)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Asynchronous: device arrays are copied before this returns, files written after."""
    self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
    )

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def state_difference(self, step: int, abstract_state: Any) -> tuple[list[str], list[str]]:
    """(paths the checkpoint lacks, paths only it has) between the train state saved at `step`
    and `abstract_state`, read from the checkpoint's tree metadata (no array is read). Both
    empty when the structures match; orbax's restore fails with a traceback otherwise."""
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
    saved_paths = set(ocp.tree.to_flat_dict(dict(saved)))
    wanted = set(ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True)))
    name = lambda path: "/".join(map(str, path))
    return sorted(map(name, wanted - saved_paths)), sorted(map(name, saved_paths - wanted))

  def restore(self, step: int, abstract_state: Any) -> Any:
    """`abstract_state` leaves are ShapeDtypeStructs carrying the target NamedShardings."""
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    )
    return restored["state"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
