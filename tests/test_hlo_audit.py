"""benchmarks/hlo_audit.py, the reader behind benchmarks/gpu_compile_audit.py, on programs
compiled here: loop trip counts, matmul FLOPs and bytes against hand counts."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("hlo_audit", os.path.join(REPO, "benchmarks", "hlo_audit.py"))
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
  # Seven more trips launch seven more of the loop's kernels (its body and its condition).
  per_trip = fourteen.totals()["launches"] - seven.totals()["launches"]
  assert per_trip % 7 == 0 and per_trip >= 7 * 2
  # The matmul reads x [64, 32] and w [32, 32] and writes [64, 32], all float32, each trip;
  # its bound is those bytes at the bandwidth (its FLOPs take 30x less at the peak).
  matmul = [v for (where, op), v in seven.by_source.items() if op.endswith("dot_general")]
  assert len(matmul) == 1
  bound, launches, dot, moved = matmul[0]
  assert (launches, dot, moved) == (7, 7 * 2 * 64 * 32 * 32, 7 * 4 * (64 * 32 * 2 + 32 * 32))
  assert bound == pytest.approx(moved / 1e11)
  assert "test_hlo_audit.py" not in "".join(where for where, _ in seven.by_source)  # electra_jax frames only


def test_shapes_and_tuples_in_bytes():
  assert hlo_audit.array_bytes("bf16[128,256]{1,0}") == 128 * 256 * 2
  assert hlo_audit.array_bytes("(f32[4]{0}, pred[3,3]{1,0}, s32[])") == 16 + 9 + 4
