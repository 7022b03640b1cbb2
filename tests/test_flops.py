"""The FLOP counter against PERFORMANCE.md's worked figures (Small 70.4M and Base 668.6M
training FLOPs per token, generator head on masked slots only) and the device peak table."""

import pytest

from electra_jax import config_lib, flops, models, objectives

from conftest import REPO


@pytest.mark.parametrize("recipe, want", [("electra_small", 70.4e6), ("electra_base", 668.6e6)])
def test_flops_per_token_match_the_reference(recipe, want):
  config = config_lib.sibling(f"{REPO}/configs/base.py", recipe).get_config()
  model = models.build_model(config)
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
