"""`model.attention_impl='splash'`: Pallas's splash attention TPU kernel over segment ids, in
`jax.shard_map` under a mesh; compiled for another platform it runs in interpret mode (for tests).
"""

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec

from electra_jax import partitioning

MAX_BLOCK = 512  # rows are tiled into blocks of this many tokens (or the whole row when shorter)
SEQ_MULTIPLE = 128  # TPU tiles are 128 lanes wide (models.build_model refuses other lengths)


def _local_attention(query, key, value, segment_ids, *, interpret: bool):
  """One device's block: query/key/value [b, s, h, d], segment_ids [b, s] -> [b, s, h, d]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib  # noqa: PLC0415
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib  # noqa: PLC0415

  _, seq_len, num_heads, head_dim = query.shape
  block = min(MAX_BLOCK, seq_len)
  sizes = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute")  # one block size for all
  blocks = kernel_lib.BlockSizes(**{f"block_{s}": block for s in sizes}, use_fused_bwd_kernel=True)
  # No mask beyond the segment ids. Built afresh per trace: a cache would leak the tracers it holds.
  mask = mask_lib.MultiHeadMask([mask_lib.FullMask((seq_len, seq_len)) for _ in range(num_heads)])
  kernel = kernel_lib.make_splash_mha(
      mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
  )
  # The kernel applies no 1/sqrt(d) of its own; it takes [heads, seq, head_dim] per example.
  q = jnp.swapaxes(query * jnp.asarray(1.0 / math.sqrt(head_dim), query.dtype), 1, 2)
  k, v = jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)
  # jax < 0.7 (Python 3.10's newest) takes head_dim only in whole 128-lane tiles: zero columns
  # change no score, and the extra output columns are dropped.
  widths = [(0, 0)] * 3 + [(0, -head_dim % 128 if jax.__version_info__ < (0, 7) else 0)]
  ids = segment_ids.astype(jnp.int32)
  segments = kernel_lib.SegmentIds(q=ids, kv=ids)
  out = jax.vmap(kernel)(*(jnp.pad(x, widths) for x in (q, k, v)), segment_ids=segments)
  return jnp.swapaxes(out[..., :head_dim], 1, 2)


def splash_attention(query, key, value, segment_ids):
  """query/key/value [batch, seq, heads, head_dim], segment_ids [batch, seq] (0: padding; a query
  sees its own segment's keys only) -> [batch, seq, heads, head_dim]."""
  mesh = jax.sharding.get_abstract_mesh()  # jax.set_mesh's; empty when tracing parameter init
  if not mesh.empty:
    device = getattr(mesh, "abstract_device", None)  # jax >= 0.7
    platform = getattr(device, "platform", None) or jax.devices()[0].platform
    if platform != "tpu":  # a step traced for a mesh of another platform
      logging.log_first_n(
          logging.WARNING,
          "model.attention_impl='splash' is a TPU kernel; on %s it runs in Pallas interpret mode, "
          "exact but slow (for tests). Use 'xla' (or 'cudnn' on NVIDIA GPUs) to train here.",
          1,
          platform,
      )
  # The kernel for the platform the program is compiled for, which need not be this process's.
  attend = functools.partial(
      jax.lax.platform_dependent,
      tpu=functools.partial(_local_attention, interpret=False),
      default=functools.partial(_local_attention, interpret=True),
  )
  batch_axes = partitioning.BATCH_AXES  # of every mesh partitioning.make_mesh makes
  # A mesh's batch shards may not divide a shape-only trace's one dummy row (parameter init).
  if mesh.empty or mesh.size == 1 or query.shape[0] % partitioning.batch_shards(mesh):
    return attend(query, key, value, segment_ids)
  tensor = mesh.shape["tensor"]
  heads_axis = "tensor" if tensor > 1 and query.shape[2] % tensor == 0 else None
  qkv_spec = PartitionSpec(batch_axes, None, heads_axis, None)
  return jax.shard_map(
      attend,
      mesh=mesh,
      in_specs=(qkv_spec, qkv_spec, qkv_spec, PartitionSpec(batch_axes, None)),
      out_specs=qkv_spec,
      check_vma=False,
  )(query, key, value, segment_ids)
