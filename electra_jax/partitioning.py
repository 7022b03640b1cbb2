"""The device mesh (axes data, fsdp, tensor), the one table that maps logical axis names to
mesh axes, and the NamedShardings built from it for parameters, train state and batches."""

import contextlib
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from electra_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axis, activations (act_*) first. A mesh axis is used at most once per array: a
# later logical axis that wants one already used stays replicated.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("act_batch", BATCH_AXES),
    ("act_len", None),
    ("act_embed", None),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("kv", None),
    ("position", None),
    ("token_type", None),
    ("unmodeled", None),
    ("layers", None),  # the stacked axis of scanned layers (model.scan_layers)
)


def resolve_mesh_shape(mesh_config, device_count: int) -> tuple[int, int, int]:
  """Sizes for (data, fsdp, tensor); one -1 takes whatever the others leave."""
  sizes = [int(mesh_config[name]) for name in MESH_AXES]
  shown = ", ".join(f"mesh.{n}={s}" for n, s in zip(MESH_AXES, sizes))
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(
        f"Mesh sizes {shown}: each must be a positive integer, and at most one may be -1 (the rest)."
    )
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes and device_count % known == 0:
    sizes[sizes.index(-1)] = device_count // known
  if math.prod(sizes) != device_count:  # (negative while a -1 is left)
    raise ConfigError(
        f"Mesh sizes {shown} multiply to {known}, but there are {device_count} devices: make the "
        f"product {device_count}, or a divisor of it with one size -1."
    )
  return tuple(sizes)


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config, len(devices))
  # Auto axis types: Linen's logical constraints are hints, which explicit-axis meshes reject.
  auto = (jax.sharding.AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=auto)


@contextlib.contextmanager
def activate(mesh: Mesh):
  """The context in which model code is traced, so logical constraints reach the compiler."""
  # jax 0.6 (Python 3.10) has only use_mesh.
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  with set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    yield


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def _undivided(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh):
  """(dimension, mesh axis names, their size) for each dimension of `shape` that `spec`'s axes do not divide."""
  for dim, axes in enumerate(spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = math.prod(mesh.shape[n] for n in names)
    if names and shape[dim] % size:
      yield dim, names, size


def shardings_for(boxed_tree, mesh: Mesh):
  """NamedShardings for a tree from `jax.eval_shape(init)` by the rules table; a dimension its mesh
  axes do not divide (one generator head over tensor=2), and anything unannotated, replicated."""
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), LOGICAL_AXIS_RULES)

  def fit(spec, leaf):
    spec = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
    undivided = {dim for dim, _, _ in _undivided(spec, leaf.shape, mesh)}
    kept = (None if dim in undivided else axes or None for dim, axes in enumerate(spec))
    return NamedSharding(mesh, PartitionSpec(*kept))

  return jax.tree.map(fit, mesh_specs, nn.meta.unbox(boxed_tree), is_leaf=_is_spec)


def unsharded_dimensions(boxed_tree, mesh, min_elements: int = 2**20) -> list[str]:
  """One line per array of at least `min_elements` replicated as its rules' mesh axes do not divide a
  dimension (a 30522-word table over tensor=4: every device holds it and its optimizer moments)."""
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_tree), LOGICAL_AXIS_RULES)
  specs = jax.tree_util.tree_leaves_with_path(mesh_specs, is_leaf=_is_spec)
  return [
      f"{jax.tree_util.keystr(path, simple=True, separator='/')} {list(leaf.shape)}: dimension {dim} "
      f"({leaf.shape[dim]}) is not divisible by {'*'.join(names)}={size}"
      for (path, spec), leaf in zip(specs, jax.tree.leaves(nn.meta.unbox(boxed_tree)))
      if math.prod(leaf.shape) >= min_elements
      for dim, names, size in _undivided(spec, leaf.shape, mesh)
  ]


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
  """Batches split over BATCH_AXES; `stacked` ones (a leading step axis): each alike."""
  return NamedSharding(mesh, PartitionSpec(*(None,) * stacked, BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def check_shards(mesh: Mesh, train, process_count: int) -> None:
  """Each process feeds whole batch shards (data * fsdp a multiple of the processes), and the global
  batch and each micro-batch of the `train` group split evenly over them (unless searched: -1)."""
  shards = batch_shards(mesh)
  if shards % process_count:
    raise ConfigError(
        f"The mesh splits each batch into {shards} shards (mesh.data * mesh.fsdp = "
        f"{mesh.shape['data']} * {mesh.shape['fsdp']}) over {process_count} processes: make it a "
        f"multiple of {process_count} (mesh.tensor={mesh.shape['tensor']} within one host)."
    )
  if train.batch_size != -1 and (micro := train.batch_size // train.grad_accum_steps) % shards:
    raise ConfigError(
        f"train.batch_size={train.batch_size} (micro-batch {micro} with train.grad_accum_steps="
        f"{train.grad_accum_steps}) is not divisible by the {shards} batch shards (mesh.data * "
        f"mesh.fsdp). Use a multiple of {shards * train.grad_accum_steps}, or change the mesh."
    )


def global_batch_from_local(local_batch: dict, mesh: Mesh, stacked=False, keys=None) -> dict:
  """Global arrays (only `keys`, if given) from this process's rows; `stacked`: [steps, rows, ...]."""
  make, sharding = jax.make_array_from_process_local_data, batch_sharding(mesh, stacked)
  return {name: make(sharding, local_batch[name]) for name in keys or local_batch}
