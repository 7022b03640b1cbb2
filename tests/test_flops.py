"""The FLOP counter against PERFORMANCE.md's worked figures (Small 70.4M and Base 668.6M
training FLOPs per token, generator head on masked slots only) and the device peak table."""

import pytest

from electra_jax import config_lib, flops, models, objectives

from conftest import REPO, TINY_OVERRIDES, tiny_config


@pytest.mark.parametrize("recipe, want", [("electra_small", 70.4e6), ("electra_base", 668.6e6)])
def test_flops_per_token_match_the_reference(recipe, want):
  config = config_lib.sibling(f"{REPO}/configs/base.py", recipe).get_config()
  model = models.build_model(config, objectives.towers(config))
  slots = objectives.official_max_predictions(config.objective.mask_prob, config.data.max_seq_len)
  got = flops.train_flops_per_token(model, config.data.max_seq_len, slots)
  assert got == pytest.approx(want, rel=5e-3)


class _Device:

  def __init__(self, kind):
    self.device_kind = kind


def test_peaks_by_device_kind():
  assert flops.peak_flops(_Device("NVIDIA H100 80GB HBM3")) == 989e12
  assert flops.peak_flops(_Device("NVIDIA H100 PCIe")) == 756e12  # not the SXM part's peak
  assert flops.peak_flops(_Device("NVIDIA H200 NVL")) == 835e12
  assert flops.peak_flops(_Device("TPU v5 lite")) == 197e12
  assert flops.peak_flops(_Device("TPU v5p")) == 459e12
  assert flops.peak_flops(_Device("cpu")) is None


@pytest.mark.parametrize("objective", ["mlm", "all_tokens_mlm"])
def test_the_throughput_benchmark_counts_the_objectives_flops(tmp_path, objective):
  """benchmarks/pretrain_throughput.py counted every objective as ELECTRA's two towers (MLM:
  +32%, All-Tokens MLM: -52%); it now counts what train.py logs and the sweep table sums."""
  import json
  import subprocess
  import sys

  from electra_jax import sweep

  settings = {**TINY_OVERRIDES, "objective.name": objective, "model.generator_fraction": 1.0}
  result = subprocess.run(
      [
          sys.executable,
          "benchmarks/pretrain_throughput.py",
          "--config=configs/base.py",
          "--steps=1",
          "--windows=1",
          "--warmup=0",
          *(f"--config.{key}={value}" for key, value in settings.items()),
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  printed = json.loads(result.stdout[result.stdout.index("{") :])
  config = tiny_config(**settings)
  want = sweep.train_flops_per_token(config)
  slots = objectives.official_max_predictions(config.objective.mask_prob, config.data.max_seq_len)
  with_generator = objectives.towers(config)._replace(has_generator=True)
  electra = flops.train_flops_per_token(
      models.build_model(config, with_generator), config.data.max_seq_len, slots
  )
  assert printed["model_flops_per_token"] == pytest.approx(
      want, rel=1e-9
  ) and want != pytest.approx(electra, rel=0.05)


@pytest.mark.fault
@pytest.mark.parametrize("script", ["pretrain_throughput", "step_profile", "compile_audit"])
def test_the_benchmarks_name_a_misspelt_config_key_in_one_line(script):
  """A --config.* override of a key the recipe lacks gave ml_collections' traceback from these
  scripts; they now share the CLI's one-line error, before anything is built."""
  import subprocess
  import sys

  result = subprocess.run(
      [
          sys.executable,
          f"benchmarks/{script}.py",
          "--config=configs/demo.py",
          "--config.train.batchsize=4",
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      f"{script}: error: --config.train.batchsize: the config has no key 'batchsize'. Did you mean "
      "'batch_size'? configs/base.py lists every key with its default."
  )
  assert "Traceback" not in result.stderr


def test_geglu_counts_its_gate_and_bias_free_layers_count_the_same():
  """GEGLU's in-projection is H x 2I: one more H x I matrix per layer and tower, 6 FLOPs per
  parameter per token. Biases are not counted, so model.use_bias and model.norm change nothing."""
  config = config_lib.sibling(f"{REPO}/configs/base.py", "electra_small").get_config()
  slots = objectives.official_max_predictions(config.objective.mask_prob, config.data.max_seq_len)

  def count(**model_options):
    config.model.update(model_options)
    return flops.train_flops_per_token(
        models.build_model(config, objectives.towers(config)), config.data.max_seq_len, slots
    )

  default = count(norm="post", ffn="gelu", use_bias=True)
  disc = models.build_model(config, objectives.towers(config)).discriminator_config
  gen = models.generator_encoder_config(disc, config.model.generator_fraction)
  gates = 6 * sum(t.num_layers * t.hidden_size * t.intermediate_size for t in (disc, gen))
  assert count(ffn="geglu") == pytest.approx(default + gates, rel=1e-12)
  assert count(ffn="gelu", norm="pre", use_bias=False) == default
  taps = 6 * sum(t.num_layers * 3 * 3 * t.hidden_size for t in (disc, gen))  # q, k, v x width 3
  assert count(attention_conv=3) == pytest.approx(default + taps, rel=1e-12)
