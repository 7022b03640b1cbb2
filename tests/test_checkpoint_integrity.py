"""Checkpoint integrity: every saved array's checksum is recorded and checked on restore, so a
damaged step is named and skipped on resume (the newest intact one is used), refused when asked
for by step, and export refuses non-finite weights before it writes anything."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import tiny_config
from electra_jax import checkpointing, train
from electra_jax.checkpointing import DamagedCheckpoint
from electra_jax.errors import ConfigError
from electra_jax.interop import export

STEPS = {"train.steps": 6, "checkpoint.every_steps": 3, "checkpoint.keep": 2}


def _metrics(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run of 6 steps with checkpoints at steps 3 and 6, never modified: tests copy it."""
  workdir = str(tmp_path_factory.mktemp("integrity") / "run")
  train.train_and_evaluate(tiny_config(**STEPS), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]
  return workdir


@pytest.fixture
def workdir(trained, tmp_path):
  copy = str(tmp_path / "run")
  shutil.copytree(trained, copy)
  return copy


def _rewrite_step(workdir, step, change, keep_meta=True, drop_checksums=False):
  """Writes checkpoint `step` again with `change(state)`; its meta (and so its checksums) stays
  the old one unless keep_meta is False. Stands for a storage fault that leaves valid files
  (drop_checksums: for a checkpoint as 0.1.0 wrote it, before checksums)."""
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  state = change(state)
  if not keep_meta:
    meta = dict(meta, checksums=checkpointing.checksums(state))
  if drop_checksums:
    meta.pop("checksums")
  manager.close()
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
  )
  manager.wait_until_finished()
  manager.close()


def _bump_a_weight(state):
  word = state["params"]["embeddings"]["word_embeddings"]["embedding"]
  state["params"]["embeddings"]["word_embeddings"]["embedding"] = np.asarray(word).copy()
  state["params"]["embeddings"]["word_embeddings"]["embedding"][5, 3] += 1e-3
  return state


def _truncate(workdir, step, what="arrays"):
  """Cuts in half the largest file of the step's array data, or its tree metadata."""
  state = os.path.join(workdir, "checkpoints", str(step), "state")
  if what == "arrays":
    directory = os.path.join(state, "ocdbt.process_0", "d")
    path = max(
        (os.path.join(directory, name) for name in os.listdir(directory)), key=os.path.getsize
    )
  else:
    path = os.path.join(state, "_METADATA")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


@pytest.mark.fault
def test_checksums_see_one_changed_or_moved_value_and_nothing_else():
  tree = {
      "a": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
      "b": jnp.array(7, jnp.int32),
      "c": jnp.ones((2, 3), jnp.bfloat16),
      "k": jax.random.key(0),
  }
  base = checkpointing.checksums(tree)
  assert set(base) == {"a", "b", "c", "k"}
  assert checkpointing.checksums(jax.tree.map(lambda x: x, tree)) == base
  changed = dict(tree, a=tree["a"].at[2, 1].add(1e-6))
  assert checkpointing.checksums(changed)["a"] != base["a"]
  swapped = dict(tree, a=tree["a"].at[0, 0].set(1.0).at[0, 1].set(0.0))  # two values trade places
  assert checkpointing.checksums(swapped)["a"] != base["a"]
  assert checkpointing.checksums(dict(tree, c=tree["c"].at[1, 2].set(2)))["c"] != base["c"]
  assert checkpointing.checksums(dict(tree, k=jax.random.key(1)))["k"] != base["k"]
  # The figure is of the values, whatever array type or placement holds them.
  assert checkpointing.checksums(jax.device_get(tree["a"])) == checkpointing.checksums(tree["a"])


@pytest.mark.fault
@pytest.mark.parametrize("damage", ["changed values", "arrays", "metadata"])
def test_resume_skips_a_damaged_latest_step_and_is_bit_exact_from_the_one_before(
    trained, workdir, damage, caplog
):
  if damage == "changed values":
    _rewrite_step(workdir, 6, _bump_a_weight)
  else:
    _truncate(workdir, 6, damage)
  with caplog.at_level("WARNING"):
    train.train_and_evaluate(tiny_config(**STEPS), workdir)
  assert "The checkpoint at step 6 in" in caplog.text and "is damaged" in caplog.text
  assert (
      "arrays differ from what was saved" in caplog.text
      if damage == "changed values"
      else "cannot be read" in caplog.text
  )
  assert "Using the checkpoint at step 3, the newest intact one (damaged: [6])" in caplog.text
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "3",
      "6",
      "6.damaged",
  ]  # kept aside
  want, got = _metrics(trained), _metrics(workdir)
  assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]
  for a, b in zip(want, got):
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], a["step"]  # to the last bit


@pytest.mark.fault
def test_a_damaged_step_asked_for_by_number_is_refused_and_the_latest_falls_back(workdir):
  _rewrite_step(workdir, 6, _bump_a_weight)
  config = tiny_config(**STEPS)
  with pytest.raises(
      DamagedCheckpoint,
      match=r"step 6 .* is damaged: 1 arrays differ .*word_embeddings.*Other steps there: \[3\]",
  ):
    train.evaluate_checkpoint(config, workdir, step=6)
  assert train.evaluate_checkpoint(config, workdir)["step"] == 3


@pytest.mark.fault
def test_a_checkpoint_without_checksums_is_refused_as_damaged(workdir):
  """An older electra-jax's checkpoint (0.1.0 saved none) reads as any other edited one."""
  _rewrite_step(workdir, 6, lambda state: state, drop_checksums=True)
  with pytest.raises(DamagedCheckpoint, match=r"step 6 .* is damaged: \d+ arrays differ"):
    train.evaluate_checkpoint(tiny_config(**STEPS), workdir, step=6)


@pytest.mark.fault
def test_no_intact_step_is_one_clear_error(workdir):
  for step in (3, 6):
    _truncate(workdir, step)
  with pytest.raises(
      DamagedCheckpoint, match=r"No intact checkpoint in .*steps \[6, 3\] are damaged"
  ):
    train.train_and_evaluate(tiny_config(**STEPS), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
      "3",
      "6",
  ], "nothing may be deleted"


@pytest.mark.fault
def test_export_refuses_non_finite_weights_and_writes_nothing(workdir, tmp_path):
  def nan_weight(state):
    state = _bump_a_weight(state)
    state["params"]["embeddings"]["word_embeddings"]["embedding"][5, 3] = np.nan
    return state

  _rewrite_step(workdir, 6, nan_weight, keep_meta=False)  # saved as it is: the checksums agree
  out = tmp_path / "export"
  with pytest.raises(
      ConfigError, match=r"the checkpoint at step 6 .*word_embeddings.* holds 1 NaN or infinite"
  ):
    export.export_workdir(workdir, str(out))
  assert not out.exists() or not any(out.iterdir())


@pytest.mark.fault
def test_eval_of_a_damaged_step_ends_in_one_line_and_nothing_after_it(workdir):
  """The message quoted orbax's error whole (a dozen lines of TensorStore spec), and the reads it
  cut short printed "Exception ignored" tracebacks after it."""
  _truncate(workdir, 6)
  args = [sys.executable, "-m", "electra_jax.main", "--mode=eval", f"--workdir={workdir}"]
  done = subprocess.run([*args, "--step=6"], capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr[-2000:]
  last = done.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("electra-jax: error: The checkpoint at step 6") and "[3]" in last, last
  assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
