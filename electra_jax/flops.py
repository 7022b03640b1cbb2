"""Model FLOPs per token (6N plus attention for each tower) and the accelerator peaks that turn
throughput into MFU (the rules: docs/training.md, "Metrics")."""

import jax

from electra_jax.encoder import EncoderConfig
from electra_jax.models import ElectraPretrainer

# bfloat16 dense peak FLOP/s per chip (datasheets, half the sparse figure), matched in order against
# jax.Device.device_kind: PCIe and NVL parts first, as the SXM ones' names carry no form factor.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
)


def _encoder_matmul_params(cfg: EncoderConfig, embedding_size: int) -> int:
  # Q, K, V and the attention output (4 H x H), then the FFN: H x I in and I x H out, and for
  # GEGLU one more H x I for the gate (its in-projection is H x 2I). Biases are not matmuls.
  # The attention convolutions' taps (3 x width x H) are used once per token, as a matmul's are.
  ffn_matrices = 3 if cfg.ffn == "geglu" else 2
  per_layer = 4 * cfg.hidden_size**2 + ffn_matrices * cfg.hidden_size * cfg.intermediate_size
  per_layer += 3 * cfg.attention_conv * cfg.hidden_size
  projection = embedding_size * cfg.hidden_size if embedding_size != cfg.hidden_size else 0
  return cfg.num_layers * per_layer + projection


def _attention_flops(cfg: EncoderConfig, seq_len: int) -> int:
  # QK^T and AV: 2 matmuls of 2*s*H each per token and layer, times 3 for forward + backward.
  return 12 * cfg.num_layers * seq_len * cfg.hidden_size


def train_flops_per_token(model, seq_len, max_predictions, all_positions_mlm=False) -> float:
  """Training FLOPs per input token of an ElectraPretrainer's towers, the MLM heads on the
  max_predictions slots (the discriminator's at every position with `all_positions_mlm`)."""
  gen, disc = model.generator_config, model.discriminator_config
  gen_emb, emb = model.generator_embedding_size, model.embedding_size
  # Electric's cloze generator runs two encoders, and its head (from 2 H_g) at every position.
  towers, gen_positions = (2, seq_len) if model.towers.cloze else (1, max_predictions)
  gen_head = towers * gen.hidden_size * gen_emb + gen_emb * model.vocab_size
  gen_params = towers * _encoder_matmul_params(gen, gen_emb) + gen_head * gen_positions / seq_len
  disc_params = _encoder_matmul_params(disc, emb) + disc.hidden_size**2 + disc.hidden_size
  if model.towers.mlm_head:  # MLM-family ablations: the tower's own vocabulary head
    positions = seq_len if all_positions_mlm else max_predictions
    disc_params += (disc.hidden_size * emb + emb * model.vocab_size) * positions / seq_len
  generator = 6 * gen_params + towers * _attention_flops(gen, seq_len)
  generator = generator if model.towers.has_generator else 0
  return generator + 6 * disc_params + _attention_flops(disc, seq_len)


def objective_flops_per_token(model: ElectraPretrainer, objective, seq_len: int) -> float:
  """train_flops_per_token for an objective: where its MLM heads predict."""
  all_positions = objective.name == "all_tokens_mlm"
  return train_flops_per_token(model, seq_len, objective.max_predictions, all_positions)


def peak_flops(device: jax.Device) -> float | None:
  """Peak bf16 FLOP/s of one device, or None when unknown (CPUs, unlisted chips)."""
  kind = getattr(device, "device_kind", "").lower()
  return next((peak for name, peak in PEAK_FLOPS if name.lower() in kind), None)
