"""Checkpoints in a bucket, against the local GCS API (tests/gcs_server.py): orbax writes its arrays
through tensorstore's own GCS driver, which the in-memory fsspec stand-in never reached."""

import jax
import jax.numpy as jnp
import numpy as np

from electra_jax import checkpointing


def test_a_checkpoint_saved_into_a_bucket_restores_exactly_and_lives_there(bucket, gcs_server):
  state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.int32(7)}
  checkpointer = checkpointing.Checkpointer(f"{bucket}/run", keep=2)
  checkpointer.save(3, state, {"note": "x"})
  checkpointer.wait()
  names = gcs_server.objects(bucket, "run/checkpoints/3/")
  assert any(
      name.startswith("run/checkpoints/3/state/") for name in names
  ), names  # the arrays, via tensorstore
  assert checkpointer.all_steps() == [3]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored = checkpointer.restore(3, abstract)
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert int(restored["step"]) == 7
  assert checkpointer.read_meta(3)["note"] == "x"
  checkpointer.close()
