"""The peer of `pretrain_throughput.py --vs-huggingface`: ELECTRA pre-training written with
Hugging Face transformers' PyTorch classes the way a typical user would, at the sizes of an
electra-jax config.

The generator is an `ElectraForMaskedLM`, the discriminator an `ElectraForPreTraining`; the
generator's `electra.embeddings` module is the discriminator's (one set of word / position /
type tables and embedding LayerNorm) and its decoder stays tied to the word embeddings. One
step: the official masking (count rule, 85% [MASK] / 15% kept), the generator's MLM loss,
Gumbel-max sampling under no_grad, the discriminator's sigmoid loss over non-padding tokens,
`gen_weight * L_MLM + disc_weight * L_Disc`, grad-norm clip 1.0 and torch.optim.AdamW.
"""

import contextlib
import os

import torch
import transformers


def _electra_config(model_config, hidden, heads, intermediate):
  return transformers.ElectraConfig(
      vocab_size=model_config.vocab_size,
      embedding_size=model_config.embedding_size,
      hidden_size=hidden,
      num_hidden_layers=model_config.num_layers,
      num_attention_heads=heads,
      intermediate_size=intermediate,
      hidden_act="gelu",  # the exact (erf) GELU, as electra-jax uses
      hidden_dropout_prob=model_config.dropout_rate,
      attention_probs_dropout_prob=model_config.attention_dropout_rate,
      max_position_embeddings=model_config.max_position_embeddings,
      type_vocab_size=model_config.type_vocab_size,
      layer_norm_eps=model_config.layer_norm_eps,
  )


class HfElectraPretraining:
  """Both towers, the optimizer and one eager (uncompiled) training step.

  `gather_masked=False` (the default, what a typical HF user writes) calls ElectraForMaskedLM
  with labels=-100 at unmasked positions, so vocabulary logits are computed at every position.
  `gather_masked=True` runs the generator's encoder, gathers the masked positions and applies
  the MLM head only there, as electra-jax does. Both sample only the tokenizer's vocabulary
  (`objective.vocab_size`), as electra-jax does; the default's loss is transformers' own, over
  every row.
  """

  def __init__(
      self,
      config,
      objective,
      gather_masked: bool = False,
      seed: int = 0,
      device: str = "cpu",
      autocast_dtype=None,
  ):
    """`device` "cuda" runs on the GPU; `autocast_dtype` (e.g. torch.bfloat16) runs the forward
    passes under torch.autocast with float32 master weights, as mixed-precision users do."""
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(seed)
    self.device = torch.device(device)
    self.autocast_dtype = autocast_dtype
    m = config.model
    frac = m.generator_fraction
    disc_config = _electra_config(m, m.hidden_size, m.num_heads, m.intermediate_size)
    gen_config = _electra_config(
        m,
        int(m.hidden_size * frac),
        max(1, int(m.num_heads * frac)),
        int(m.intermediate_size * frac),
    )
    self.generator = transformers.ElectraForMaskedLM(gen_config)
    self.discriminator = transformers.ElectraForPreTraining(disc_config)
    # ELECTRA's sharing: the generator uses the discriminator's embedding module itself.
    shared = self.discriminator.electra.embeddings
    self.generator.electra.embeddings = shared
    self.generator.generator_lm_head.weight = shared.word_embeddings.weight
    self.generator.to(self.device).train()
    self.discriminator.to(self.device).train()

    self.objective = objective
    self.gather_masked = gather_masked
    self.never_masked = torch.tensor(
        objective.never_masked_ids, dtype=torch.long, device=self.device
    )
    self.params = self._unique_parameters()
    decay = [p for n, p in self.params if p.ndim > 1]
    no_decay = [p for n, p in self.params if p.ndim <= 1]  # LayerNorm parameters and biases
    self.optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.optimizer.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.optimizer.learning_rate,
        betas=(config.optimizer.b1, config.optimizer.b2),
        eps=config.optimizer.eps,
        fused=self.device.type == "cuda",  # PyTorch's fastest AdamW on GPUs
    )

  def _unique_parameters(self):
    seen, params = set(), []
    for model in (self.discriminator, self.generator):
      for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) not in seen:
          seen.add(id(p))
          params.append((name, p))
    return params

  def num_parameters(self) -> int:
    return sum(p.numel() for _, p in self.params)

  def shares_embeddings(self) -> bool:
    g, d = self.generator, self.discriminator
    return (
        g.electra.embeddings is d.electra.embeddings
        and g.generator_lm_head.weight is d.electra.embeddings.word_embeddings.weight
    )

  def _mask(self, input_ids, attention_mask):
    """Official count rule: clip(round(n * mask_prob), 1, N) distinct positions among
    non-special, non-padding tokens (uniform scores + top-k); 85% of them become [MASK]."""
    obj = self.objective
    batch_size, seq_len = input_ids.shape
    is_candidate = attention_mask.bool() & ~torch.isin(input_ids, self.never_masked)
    num_tokens = attention_mask.float().sum(-1)
    num_to_predict = torch.round(num_tokens * obj.mask_prob).clamp(
        1, obj.max_predictions
    )  # half to even
    num_to_predict = torch.minimum(num_to_predict, is_candidate.sum(-1).float()).long()
    scores = torch.where(
        is_candidate,
        torch.rand(batch_size, seq_len, device=self.device),
        torch.full((), -1.0, device=self.device),
    )
    positions = scores.topk(obj.max_predictions, dim=1).indices  # [batch, N]
    is_used = (
        torch.arange(obj.max_predictions, device=self.device)[None, :] < num_to_predict[:, None]
    )
    target_ids = input_ids.gather(1, positions)
    put_mask = is_used & (
        torch.rand(batch_size, obj.max_predictions, device=self.device) >= obj.keep_original_prob
    )
    masked_ids = input_ids.scatter(1, positions, torch.where(put_mask, obj.mask_id, target_ids))
    return masked_ids, positions, is_used, target_ids

  def _generator_loss_and_logits(
      self, masked_ids, token_type_ids, attention_mask, positions, is_used, target_ids
  ):
    """(mean MLM loss over masked positions, logits at `positions` [batch, N, vocab])."""
    if not self.gather_masked:
      labels = torch.full_like(masked_ids, -100)
      labels.scatter_(1, positions, torch.where(is_used, target_ids, -100))
      out = self.generator(
          input_ids=masked_ids,
          attention_mask=attention_mask,
          token_type_ids=token_type_ids,
          labels=labels,
      )
      index = positions[..., None].expand(-1, -1, out.logits.shape[-1])
      return out.loss, out.logits.gather(1, index)
    hidden = self.generator.electra(
        input_ids=masked_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
    ).last_hidden_state
    index = positions[..., None].expand(-1, -1, hidden.shape[-1])
    picked = hidden.gather(1, index)  # [batch, N, hidden]
    logits = self._vocabulary_only(
        self.generator.generator_lm_head(self.generator.generator_predictions(picked))
    )
    labels = torch.where(is_used, target_ids, -100)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )
    return loss, logits

  def _vocabulary_only(self, logits):
    """As electra-jax's objective: rows past the tokenizer's vocabulary (a recipe's 30522 rows
    over a smaller tokenizer) get logit -1e9, so they are neither sampled nor in the softmax."""
    vocab_size = self.objective.vocab_size
    if not 0 < vocab_size < logits.shape[-1]:
      return logits
    return logits.masked_fill(
        torch.arange(logits.shape[-1], device=logits.device) >= vocab_size, -1e9
    )

  def _autocast(self):
    if self.autocast_dtype is None:
      return contextlib.nullcontext()
    return torch.autocast(self.device.type, dtype=self.autocast_dtype)

  def synchronize(self) -> None:
    if self.device.type == "cuda":
      torch.cuda.synchronize()

  def step(self, batch, sync: bool = True):
    """One optimizer update on `batch` (numpy int arrays [batch, seq]); returns the loss, a
    float when `sync` (waits for the device), else the loss tensor (timing loops)."""
    obj = self.objective
    to_device = lambda a: torch.as_tensor(a, dtype=torch.long).to(self.device, non_blocking=True)  # noqa: E731
    input_ids = to_device(batch["input_ids"])
    token_type_ids = to_device(batch["token_type_ids"])
    attention_mask = to_device(batch["attention_mask"])

    masked_ids, positions, is_used, target_ids = self._mask(input_ids, attention_mask)
    with self._autocast():
      mlm_loss, picked_logits = self._generator_loss_and_logits(
          masked_ids, token_type_ids, attention_mask, positions, is_used, target_ids
      )
    with torch.no_grad():  # Gumbel-max sample of softmax(logits / T), float32
      uniform = torch.rand(picked_logits.shape, device=self.device).clamp_(1e-20, 1.0)
      gumbel = -torch.log(-torch.log(uniform))
      sampled = (self._vocabulary_only(picked_logits.float()) / obj.temperature + gumbel).argmax(-1)
      corrupted = input_ids.scatter(1, positions, torch.where(is_used, sampled, target_ids))
      is_replaced = (corrupted != input_ids).float()  # a sample equal to the original is original
    with self._autocast():
      disc_loss = self.discriminator(
          input_ids=corrupted,
          attention_mask=attention_mask,
          token_type_ids=token_type_ids,
          labels=is_replaced,
      ).loss  # sigmoid BCE averaged over attention_mask == 1
    loss = obj.gen_weight * mlm_loss + obj.disc_weight * disc_loss

    self.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for _, p in self.params], 1.0)
    self.optimizer.step()
    return loss.item() if sync else loss
