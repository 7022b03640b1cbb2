"""The mesh and shardings: size resolution, the rules table on real parameters, and the checks
of a mesh against the batch and the processes (test_distributed trains on eight devices)."""

import jax
import ml_collections
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cli_args, run_cli, tiny_config, with_devices
from electra_jax import models, objectives, partitioning, train_state


def _mesh(data, fsdp, tensor):
  return ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.fault
def test_mesh_sizes_fill_and_validate():
  assert partitioning.resolve_mesh_shape(_mesh(-1, 1, 1), 8) == (8, 1, 1)
  assert partitioning.resolve_mesh_shape(_mesh(2, -1, 2), 8) == (2, 2, 2)
  with pytest.raises(ValueError, match="multiply to 4, but there are 8 devices"):
    partitioning.resolve_mesh_shape(_mesh(2, 2, 1), 8)
  with pytest.raises(
      ValueError, match="multiply to 3, but there are 8 devices: make the product 8, or a"
  ):
    partitioning.resolve_mesh_shape(_mesh(3, -1, 1), 8)
  with pytest.raises(ValueError, match="at most one may be -1"):
    partitioning.resolve_mesh_shape(_mesh(-1, -1, 1), 8)


def test_rules_shard_parameters_and_replicate_what_does_not_divide():
  config = tiny_config()
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(config, dict(pad=0, cls=2, sep=3, mask=4))
  boxed = jax.eval_shape(train_state.make_init_fn(config, model, objective), jax.random.key(0))
  mesh = jax.sharding.AbstractMesh((2, 2, 2), partitioning.MESH_AXES)
  fitted = jax.tree.map(lambda s: s.spec, partitioning.shardings_for(boxed.params, mesh))
  assert fitted["embeddings"]["word_embeddings"]["embedding"] == P("tensor", "fsdp")
  layer = fitted["discriminator"]["encoder"]["layer_0"]
  assert layer["intermediate"]["kernel"] == P("fsdp", "tensor")
  assert layer["output"]["kernel"] == P("tensor", "fsdp")
  assert layer["attention"]["query"]["kernel"] == P("fsdp", "tensor")
  # The discriminator's scalar head output (size 1) cannot split over tensor=2: replicated.
  assert fitted["discriminator"]["head_out"]["bias"] == P(None)


def test_tables_that_a_mesh_axis_does_not_divide_are_named():
  # 510 words over tensor=4: the word table and the generator's output bias stay whole on
  # every device, which build_setup reports (official recipes: 30522 over tensor=4 or 8).
  config = tiny_config(**{"model.vocab_size": 510})
  model = models.build_model(config, objectives.towers(config))
  objective = objectives.objective_from_config(config, dict(pad=0, cls=2, sep=3, mask=4))
  boxed = jax.eval_shape(train_state.make_init_fn(config, model, objective), jax.random.key(0))
  found = partitioning.unsharded_dimensions(
      boxed.params, jax.sharding.AbstractMesh((1, 1, 4), partitioning.MESH_AXES), 0
  )
  assert found == [
      "embeddings/word_embeddings/embedding [510, 16]: dimension 0 (510) is not divisible by tensor=4",
      "generator/output_bias [510]: dimension 0 (510) is not divisible by tensor=4",
  ]
  # Over tensor=2 everything divides; small arrays are not reported by default.
  assert (
      partitioning.unsharded_dimensions(
          boxed.params, jax.sharding.AbstractMesh((2, 2, 2), partitioning.MESH_AXES), 0
      )
      == []
  )
  assert (
      partitioning.unsharded_dimensions(
          boxed.params, jax.sharding.AbstractMesh((1, 1, 4), partitioning.MESH_AXES)
      )
      == []
  )


@pytest.mark.fault
def test_processes_must_own_whole_batch_shards():
  mesh = jax.sharding.AbstractMesh((1, 2, 4), partitioning.MESH_AXES)
  train = tiny_config().train  # its batch of 8 splits over 4 shards
  partitioning.check_shards(mesh, train, 2)  # two hosts of four devices: tensor within a host
  with pytest.raises(
      ValueError,
      match=r"4 shards \(mesh.data \* mesh.fsdp = 2 \* 2\) over 8 processes.*multiple of 8",
  ):
    partitioning.check_shards(
        jax.sharding.AbstractMesh((2, 2, 2), partitioning.MESH_AXES), train, 8
    )


@pytest.mark.fault
def test_batch_not_divisible_by_data_axes_is_refused(tmp_path):
  result = run_cli(
      cli_args(tmp_path / "run", **{"train.batch_size": 6, "mesh.data": 4, "mesh.fsdp": 2}),
      env_extra=with_devices(8),
  )
  assert result.returncode != 0
  assert "train.batch_size=6" in result.stderr and "8 batch shards" in result.stderr
