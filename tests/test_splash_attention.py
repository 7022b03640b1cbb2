"""model.attention_impl='splash': the Pallas TPU flash-attention kernel, run here in Pallas's
interpret mode, must give every real token the masked-softmax reference's output and
gradients (padded rows and packed rows), inside the model, and sharded over a mesh."""

import json

import jax
import jax.export  # jax 0.6 (Python 3.10) loads it only when asked
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cli, cli_args, run_cli, tiny_config, with_devices
from electra_jax import models, objectives, splash_attention
from electra_jax.errors import ConfigError

SEQ = 128  # the kernel's tile: sequence lengths are multiples of 128


def _reference(query, key, value, segment_ids):
  """Masked softmax attention: a query sees the keys of its own (non-zero) segment."""
  same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
  return jax.nn.dot_product_attention(query, key, value, mask=same[:, None])


def _qkv(batch=2, heads=2, head_dim=32):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, (batch, SEQ, heads, head_dim), jnp.float32) for k in keys]


def _segments(kind):
  ids = np.zeros((2, SEQ), np.int32)
  if kind == "padded":  # one example per row, right-padded (the 0/1 attention mask)
    ids[0, :100], ids[1, :] = 1, 1
  else:  # packed rows: several examples side by side, then padding
    ids[0, :40], ids[0, 40:90], ids[0, 90:120] = 1, 2, 3
    ids[1, :64], ids[1, 64:] = 1, 2
  return jnp.asarray(ids)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_kernel_matches_masked_softmax_on_real_tokens(kind):
  query, key, value = _qkv()
  segments = _segments(kind)
  real = np.asarray(segments > 0)[:, :, None, None]
  weights = jax.random.normal(jax.random.key(1), query.shape)  # a loss that reads every output

  def loss(fn, q, k, v):
    return jnp.sum(jnp.where(real, fn(q, k, v, segments), 0.0) * weights)

  out = splash_attention.splash_attention(query, key, value, segments)
  want = _reference(query, key, value, segments)
  np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), atol=2e-6, rtol=1e-5)
  got_grads = jax.grad(lambda *a: loss(splash_attention.splash_attention, *a), argnums=(0, 1, 2))(
      query, key, value
  )
  want_grads = jax.grad(lambda *a: loss(_reference, *a), argnums=(0, 1, 2))(query, key, value)
  for got, want in zip(got_grads, want_grads):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  # A kernel that let queries see other segments (or padding) would differ by far more.
  leaky = jax.nn.dot_product_attention(query, key, value)
  assert np.abs(np.where(real, leaky - want, 0)).max() > 1e-2


def _splash_config(impl, **overrides):
  return tiny_config(
      **{
          "model.attention_impl": impl,
          "model.attention_dropout_rate": 0.0,
          "model.dropout_rate": 0.0,
          "data.max_seq_len": SEQ,
          "model.max_position_embeddings": SEQ,
          **overrides,
      }
  )


# Electric's cloze towers attend under causal masks, which the kernel does not take: they
# run through XLA while its discriminator runs the kernel.
@pytest.mark.parametrize(
    "packed,objective_name", [(False, "electra"), (True, "electra"), (False, "electric")]
)
def test_pretrainer_loss_and_gradients_equal_xla(packed, objective_name):
  rng = np.random.default_rng(0)
  ids = rng.integers(5, 500, size=(2, SEQ)).astype(np.int32)
  segments = np.asarray(_segments("packed" if packed else "padded"))
  ids[segments == 0] = 0
  batch = {
      "input_ids": jnp.asarray(ids),
      "token_type_ids": jnp.zeros_like(ids),
      "attention_mask": jnp.asarray((segments > 0).astype(np.int32)),
  }
  if packed:
    batch["segment_ids"] = jnp.asarray(segments)
  results = {}
  for impl in ("xla", "splash"):
    config = _splash_config(impl, **{"objective.name": objective_name})
    config.data.pack_rows = packed
    model = models.build_model(config, objectives.towers(config))
    objective = objectives.objective_from_config(config, {"pad": 0, "cls": 2, "sep": 3, "mask": 4})
    params = model.init(
        jax.random.key(0),
        batch["input_ids"],
        batch["token_type_ids"],
        batch["attention_mask"],
        jnp.zeros((2, 4), jnp.int32),
    )["params"]
    masked = objectives.mask_tokens(
        jax.random.key(1), batch["input_ids"], batch["attention_mask"], objective
    )
    normalizers = objectives.Normalizers.of(
        masked,
        batch["attention_mask"],
        objectives.candidate_mask(batch["input_ids"], batch["attention_mask"], objective),
    )

    def loss(p, model=model, objective=objective):
      return objectives.electra_forward(
          model,
          p,
          batch,
          masked,
          jax.random.split(jax.random.key(2), 2),
          jax.random.key(3),
          objective,
          normalizers,
          deterministic=False,
      )[0]

    results[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (xla_loss, xla_grads), (splash_loss, splash_grads) = results["xla"], results["splash"]
  np.testing.assert_allclose(splash_loss, xla_loss, rtol=1e-5)
  for path, got in jax.tree_util.tree_leaves_with_path(splash_grads):
    want = dict(jax.tree_util.tree_leaves_with_path(xla_grads))[path]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-3, err_msg=jax.tree_util.keystr(path))


def test_sharded_training_matches_xla_on_one_device(tmp_path):
  # The kernel runs inside shard_map over data x fsdp x tensor = 2 x 2 x 2 CPU devices.
  common = {
      "train.steps": 2,
      "checkpoint.every_steps": 2,
      "optimizer.learning_rate": 1e-4,
      "eval.every_steps": 0,
      "model.attention_dropout_rate": 0.0,
      "model.dropout_rate": 0.0,
      "data.max_seq_len": SEQ,
      "model.max_position_embeddings": SEQ,
  }
  one = cli(cli_args(tmp_path / "xla", **common))
  assert one.returncode == 0, one.stderr[-3000:]
  eight = run_cli(
      cli_args(
          tmp_path / "splash",
          **common,
          **{"model.attention_impl": "splash", "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
      ),
      env_extra=with_devices(8),
  )
  assert eight.returncode == 0, eight.stderr[-3000:]
  assert "over 8 cpu devices" in eight.stderr and "interpret mode" in eight.stderr

  def losses(name):
    with open(tmp_path / name / "metrics.jsonl") as f:
      return [json.loads(line) for line in f]

  for a, b in zip(losses("xla"), losses("splash"), strict=True):
    for metric in ("loss", "masked_lm_loss", "disc_loss"):
      assert abs(a[metric] - b[metric]) < 1e-4, (a["step"], metric, a[metric], b[metric])


def test_a_program_for_tpu_carries_the_kernel_whatever_the_host():
  """Which kernel runs is decided by the platform a program is compiled for, not by this
  process's devices: a TPU program built on this CPU (ahead-of-time compiles, and
  benchmarks/compile_audit.py) holds the Mosaic kernel, forward and fused backward, while a
  CPU program runs Pallas's interpreter (no TPU call in it)."""
  q = jax.ShapeDtypeStruct((2, SEQ, 2, 64), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((2, SEQ), jnp.int32)

  def loss(q, k, v, ids):
    return splash_attention.splash_attention(q, k, v, ids).astype(jnp.float32).sum()

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  for platform, kernels in [("tpu", 2), ("cpu", 0)]:
    module = jax.export.export(step, platforms=[platform])(q, q, q, ids).mlir_module()
    assert module.count("tpu_custom_call") == kernels, platform


@pytest.mark.fault
def test_refusals_name_the_setting_and_the_fix():
  with pytest.raises(
      ConfigError, match=r"data.max_seq_len=100 is not a multiple of 128: choose e.g. 128, or"
  ):
    models.build_model(_splash_config("splash", **{"data.max_seq_len": 100}), models.Towers())
  with pytest.raises(
      ConfigError,
      match=r"data.max_seq_len=300 is not a multiple of 128: choose e.g. 256 or 384, or",
  ):
    models.build_model(
        _splash_config("splash", **{"data.max_seq_len": 300, "model.max_position_embeddings": 512}),
        models.Towers(),
    )
  for impl in ("splash", "cudnn"):
    config = _splash_config(
        impl, **{"model.attention_dropout_rate": 0.1, "train.dtype": "bfloat16"}
    )
    with pytest.raises(
        ConfigError,
        match="attention_dropout_rate=0.1: set it to 0.0",
    ):
      models.build_model(config, objectives.towers(config))
