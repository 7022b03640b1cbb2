"""benchmarks/hf_peer.py, the PyTorch step electra-jax is timed against, computes the same
objective: here, that its generator keeps to the tokenizer's vocabulary as ours does when the
recipe has more embedding rows than the tokenizer has tokens."""

import math
import os
import sys

import numpy as np
import pytest

from conftest import REPO, tiny_config
from electra_jax import objectives

sys.path.insert(0, os.path.join(REPO, "benchmarks"))


@pytest.mark.parametrize("gather_masked", [False, True])
def test_the_peer_samples_and_scores_only_the_tokenizers_vocabulary(gather_masked):
  import hf_peer  # noqa: PLC0415 (it and torch are kept out of collection: see conftest._NativePeerWatch)
  import torch  # noqa: PLC0415

  config = tiny_config(
      **{
          "model.vocab_size": 64,
          "model.hidden_size": 32,
          "model.num_layers": 1,
          "model.num_heads": 2,
          "model.intermediate_size": 64,
          "model.embedding_size": 32,
          "model.generator_fraction": 0.5,
          "data.max_seq_len": 16,
      }
  )
  objective = objectives.ElectraObjective(
      mask_prob=0.5,
      max_predictions=8,
      gen_weight=1.0,
      disc_weight=50.0,
      temperature=1.0,
      keep_original_prob=0.15,
      mask_id=4,
      pad_id=0,
      cls_id=2,
      sep_id=3,
      vocab_size=12,
  )
  peer = hf_peer.HfElectraPretraining(config, objective, gather_masked=gather_masked)
  with torch.no_grad():  # a generator that favours the rows past the vocabulary
    peer.generator.generator_lm_head.bias[12:] = 5.0
  ids = np.random.default_rng(0).integers(5, 12, size=(4, 16))
  ids[:, 0], ids[:, -1] = 2, 3
  batch = dict(input_ids=ids, token_type_ids=np.zeros_like(ids), attention_mask=np.ones_like(ids))
  seen = []  # what the discriminator reads: the originals (all below 12) with the samples put in
  forward = peer.discriminator.forward
  peer.discriminator.forward = lambda input_ids, **kwargs: seen.append(
      input_ids.clone()
  ) or forward(input_ids, **kwargs)
  peer.step(batch)
  assert (
      len(seen) == 1 and int(seen[0].max()) < 12 and bool((seen[0] != torch.as_tensor(ids)).any())
  )
  if (
      gather_masked
  ):  # our loss's softmax leaves the extra rows out; the typical script's is HF's own
    masked_ids, positions, is_used, target_ids = peer._mask(
        torch.as_tensor(ids), torch.ones(4, 16, dtype=torch.long)
    )
    with torch.no_grad():
      loss, _ = peer._generator_loss_and_logits(
          masked_ids,
          torch.zeros_like(masked_ids),
          torch.ones_like(masked_ids),
          positions,
          is_used,
          target_ids,
      )
    assert float(loss) < math.log(12) + 0.5  # with the 52 rows at +5 it would be above log(52 e^5)
