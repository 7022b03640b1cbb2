"""benchmarks/hlo_audit.py, the reader behind benchmarks/compile_audit.py, on programs
compiled here: loop trip counts, matmul FLOPs and bytes against hand counts."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location(
    "hlo_audit", os.path.join(REPO, "benchmarks", "hlo_audit.py")
)
hlo_audit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hlo_audit)


def _looped_matmul(trips):
  def f(x, w):
    return jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)

  args = (jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32))
  return hlo_audit.Audit(jax.jit(f).lower(*args).compile().as_text(), peak=1e12, bandwidth=1e11)


def test_loops_count_by_trip_count_and_matmuls_by_hand():
  seven, fourteen = _looped_matmul(7), _looped_matmul(14)
  assert seven.totals()["dot_flops"] == 7 * 2 * 64 * 32 * 32
  assert fourteen.totals()["dot_flops"] == 14 * 2 * 64 * 32 * 32
  # Seven more trips launch seven more rounds of the loop's kernels (how many a round has, its
  # body's and its condition's, is up to XLA: jaxlib 0.6 fuses more of them than 0.10).
  per_trip = fourteen.totals()["launches"] - seven.totals()["launches"]
  assert per_trip % 7 == 0 and per_trip >= 7
  # The matmul reads x [64, 32] and w [32, 32] and writes [64, 32], all float32, each trip;
  # its bound is those bytes at the bandwidth (its FLOPs take 30x less at the peak).
  matmul = [v for (where, op), v in seven.by_source.items() if op.endswith("dot_general")]
  assert len(matmul) == 1
  bound, launches, dot, moved = matmul[0]
  assert (launches, dot, moved) == (7, 7 * 2 * 64 * 32 * 32, 7 * 4 * (64 * 32 * 2 + 32 * 32))
  assert bound == pytest.approx(moved / 1e11)
  assert "test_hlo_audit.py" not in "".join(
      where for where, _ in seven.by_source
  )  # electra_jax frames only


def test_shapes_and_tuples_in_bytes():
  assert hlo_audit.array_bytes("bf16[128,256]{1,0}") == 128 * 256 * 2
  assert hlo_audit.array_bytes("(f32[4]{0}, pred[3,3]{1,0}, s32[])") == 16 + 9 + 4


# A GPU program's kernels as XLA prints them (shapes and attributes as in an H100 compile of the
# train step, the rest cut away): a cuBLAS matmul with its workspace, cuDNN's attention forward
# and backward, and fusions that read one operand through a slice and one through a gather.
_GPU_MODULE = """HloModule jit_step, entry_computation_layout={()->f32[]}

%fused_slice_add (param_0.1: bf16[64,96], param_1.1: bf16[32]) -> bf16[64,32] {
  %param_0.1 = bf16[64,96]{1,0} parameter(0)
  %slice.1 = bf16[64,32]{1,0} slice(%param_0.1), slice={[0:64], [32:64]}
  %param_1.1 = bf16[32]{0} parameter(1)
  %broadcast.1 = bf16[64,32]{1,0} broadcast(%param_1.1), dimensions={1}
  ROOT %add.1 = bf16[64,32]{1,0} add(%slice.1, %broadcast.1)
}

%fused_gather (param_0.2: f32[8,1000], param_1.2: s32[8,2]) -> f32[8] {
  %param_0.2 = f32[8,1000]{1,0} parameter(0)
  %bitcast.2 = f32[8,1000,1]{2,1,0} bitcast(%param_0.2)
  %param_1.2 = s32[8,2]{1,0} parameter(1)
  %gather.2 = f32[8,1,1]{2,1,0} gather(%bitcast.2, %param_1.2), offset_dims={1,2}, collapsed_slice_dims={}, start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1,1}
  ROOT %bitcast.3 = f32[8]{0} bitcast(%gather.2)
}

%fused_rows (param_0.3: f32[10,8], param_1.3: s32[64,1]) -> f32[64,8] {
  %param_0.3 = f32[10,8]{1,0} parameter(0)
  %param_1.3 = s32[64,1]{1,0} parameter(1)
  ROOT %gather.3 = f32[64,8]{1,0} gather(%param_0.3, %param_1.3), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
}

ENTRY %main.1 () -> f32[] {
  %x = bf16[64,48]{1,0} parameter(0)
  %w = bf16[48,96]{1,0} parameter(1)
  %b = bf16[32]{0} parameter(2)
  %q = bf16[2,128,4,16]{3,2,1,0} parameter(3)
  %k = bf16[2,64,4,16]{3,2,1,0} parameter(4)
  %v = bf16[2,64,4,16]{3,2,1,0} parameter(5)
  %lengths = s32[2]{0} parameter(6)
  %logits = f32[8,1000]{1,0} parameter(7)
  %ids = s32[8,2]{1,0} parameter(8)
  %cublas-lt-matmul.1 = (bf16[64,96]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %gte.1 = bf16[64,96]{1,0} get-tuple-element(%cublas-lt-matmul.1), index=0
  %loop_add_fusion.1 = bf16[64,32]{1,0} fusion(%gte.1, %b), kind=kLoop, calls=%fused_slice_add
  %fwd.1 = (bf16[2,4,128,16]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %lengths, %lengths), custom_call_target="__cudnn$fmhaSoftmax"
  %out.1 = bf16[2,4,128,16]{3,1,2,0} get-tuple-element(%fwd.1), index=0
  %bwd.1 = (bf16[2,128,4,16]{3,2,1,0}, bf16[2,64,4,16]{3,2,1,0}, bf16[2,64,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %out.1, %lengths, %lengths), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %input_gather_fusion.1 = f32[8]{0} fusion(%logits, %ids), kind=kInput, calls=%fused_gather
  %table = f32[10,8]{1,0} parameter(9)
  %rows = s32[64,1]{1,0} parameter(10)
  %loop_gather_fusion.1 = f32[64,8]{1,0} fusion(%table, %rows), kind=kLoop, calls=%fused_rows
  ROOT %r = f32[] constant(0)
}
"""


def test_gpu_kernels_by_hand():
  """Counts for what only a GPU compile contains, against hand counts: a cuBLAS call's FLOPs
  from its dot dimensions and its bytes without the scratch workspace; cuDNN's attention as 4
  B N Tq Tk D FLOPs forward and 2.5 times that backward; a fusion that slices or gathers an
  operand charged for what it takes, never more than the whole operand."""
  audit = hlo_audit.Audit(_GPU_MODULE, peak=1e12, bandwidth=1e11)
  by_name = {operation: value for (_, operation), value in audit.by_source.items()}
  assert set(by_name) == {"?"}  # no op_name metadata here: everything lands on one row
  totals = audit.totals()
  attention = 4 * 2 * 4 * 128 * 64 * 16
  assert totals["dot_flops"] == 2 * 64 * 96 * 48 + attention + int(2.5 * attention)
  assert totals["launches"] == 6
  matmul = 2 * (64 * 48 + 48 * 96 + 64 * 96)  # no s8 workspace
  sliced_add = 2 * (64 * 32 + 32 + 64 * 32)  # the [64, 32] slice of the [64, 96] operand
  q, kv, out = 2 * 2 * 128 * 4 * 16, 2 * 2 * 64 * 4 * 16, 2 * 2 * 4 * 128 * 16
  forward = q + 2 * kv + 2 * 4 * 2 + out + 4 * 2 * 4 * 128
  backward = q + 2 * kv + out + 2 * 4 * 2 + q + 2 * kv
  gather = 4 * 8 + 4 * 8 * 2 + 4 * 8  # 8 logits taken, the ids, the result
  rows = 4 * 10 * 8 + 4 * 64 + 4 * 64 * 8  # 64 rows taken from 10: the table read once at most
  assert totals["bytes"] == matmul + sliced_add + forward + backward + gather + rows
