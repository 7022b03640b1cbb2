"""Every config group and key electra-jax reads, with ELECTRA-Small's official values (except
optimizer.bias_correction: True here, False in the paper recipes as in the official Adam).

Recipes (electra_small.py, demo.py, ...) start from this and change what they need. Run any
recipe with overrides, e.g.:

  python -m electra_jax.main --config=configs/demo.py --workdir=/tmp/demo \
      --config.train.steps=100 --config.model.generator_fraction=0.5
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()

  # The discriminator's sizes; the generator is generator_fraction as wide (same depth and
  # head size). Word, position and token-type embeddings are shared by both towers.
  config.model = model = ml_collections.ConfigDict()
  model.hidden_size = 256
  model.num_layers = 12
  model.num_heads = 4
  model.intermediate_size = 1024
  model.embedding_size = 128
  model.vocab_size = 30522  # must be >= the tokenizer's vocabulary; extra rows stay unused
  model.max_position_embeddings = 512
  model.type_vocab_size = 2
  model.dropout_rate = 0.1
  model.attention_dropout_rate = 0.1
  model.layer_norm_eps = 1e-12
  model.generator_fraction = 0.25
  # Weight sharing: "embeddings" (one embedding tree, ELECTRA's default), "none" (the generator
  # gets its own embeddings of its hidden size), "gdes" (DeBERTa-v3: the discriminator reads
  # stop_gradient(shared word table) + a zero-initialised delta), "all" (one encoder for both
  # towers; needs generator_fraction 1.0).
  model.tie = "embeddings"
  # "xla" anywhere; fused kernels, which need attention_dropout_rate = 0: "cudnn" (NVIDIA GPUs,
  # bfloat16) or "splash" (Pallas, TPUs; seq a multiple of 128).
  model.attention_impl = "xla"
  # What each encoder layer keeps for the backward pass: "none" (everything: fastest),
  # "dots" (matmul outputs only) or "full" (the layer input only). Same parameters either way.
  model.remat = "none"
  # One scanned layer instead of num_layers unrolled ones: compile time independent of depth.
  # Checkpoints keep the scanned layout; export and fine-tuning see the usual one.
  model.scan_layers = False
  # Encoder variants for small-budget pre-training (Cramming / ModernBERT style); any
  # non-default one has no Hugging Face ElectraModel form, so --mode=export_hf refuses it.
  model.norm = "post"  # "post": BERT's LN(x + f(x)); "pre": x + f(LN(x)) and a final LayerNorm
  model.ffn = "gelu"  # "gelu": dense + GELU + dense; "geglu": gelu(gate) * value, gate/value from one dense(H->2I)
  model.use_bias = (
      True  # False: no bias in the encoder's dense layers (heads and LayerNorms keep theirs)
  )
  # Primer's multi-dconv-head attention: a depthwise convolution of this odd width along the
  # sequence after each of the query, key and value projections, in both towers (0: none), so
  # every position sees its neighbours before attention has learned to find them
  # (docs/small_budget.md).
  model.attention_conv = 0

  # Replaced-token detection: loss = gen_weight * L_MLM + disc_weight * L_Disc.
  config.objective = objective = ml_collections.ConfigDict()
  objective.mask_prob = 0.15
  objective.keep_original_prob = 0.15  # chosen positions left as they are instead of [MASK]
  objective.gen_weight = 1.0
  objective.disc_weight = 50.0
  objective.temperature = 1.0  # of the generator's softmax when sampling replacements
  # Fast-ELECTRA's temperature schedule: sampling starts at initial_temperature and falls (or
  # rises) linearly to `temperature` at step round(temperature_decay_fraction * train.steps),
  # then stays there; a hot start keeps replacements easy while the generator is still weak.
  # temperature_decay_fraction = 0 (or initial_temperature = temperature) samples at
  # `temperature` throughout. Held-out evaluation always samples at `temperature`.
  objective.initial_temperature = 1.0
  objective.temperature_decay_fraction = 0.0
  # electra / electra_15: > 0 also trains the discriminator to predict the original token at
  # each masked position of its (corrupted) input, the paper's Replace-MLM as an auxiliary
  # loss of this weight; the discriminator gets an MLM head for it (not exported). 0 = off.
  objective.disc_mlm_weight = 0.0
  # "electra" (RTD on every token), "electra_15" (L_Disc only on the masked positions),
  # "uniform" (uniform random replacements, no generator), "mlm" (BERT), "replace_mlm",
  # "all_tokens_mlm", "two_stage", "adversarial", "electric". See objectives.py and the
  # docs/objectives.md.
  objective.name = "electra"
  objective.disallow_correct = False  # the generator may not sample the original token
  objective.two_stage_switch = 0  # two_stage: the discriminator's first step (0 = train.steps // 2)
  objective.adversarial_mlm_weight = 0.0  # adversarial: L_MLM's weight beside the REINFORCE loss

  config.data = data = ml_collections.ConfigDict()
  # "builtin": English text from the Python standard library; no download. "text": the files
  # in data.files, one sentence or paragraph per line, blank lines between documents. "jsonl":
  # the files in data.files, one JSON object per line whose data.text_field string is a
  # document (split into sentences on its newlines). "tfds": a prepared TFDS dataset (tfds_*
  # keys). "hf_datasets": a local Hugging Face dataset (hf_* keys). "prepared": the shards --mode=prepare_data wrote into data.prepared_dir from one of
  # the other sources (memory-mapped; nothing is tokenized at training time).
  data.source = "builtin"
  data.files = ""  # text/jsonl: comma-separated paths or globs, e.g. "corpus/*.txt,extra.txt"
  data.text_field = "text"  # jsonl, hf_datasets: the field holding each document's text
  data.tfds_name = ""  # tfds: e.g. "wikipedia/20230601.en", stored as array_record (no TensorFlow)
  data.tfds_split = "train"  # tfds: the split read; eval_fraction of its records are held out
  data.tfds_text_field = "text"  # tfds: the feature holding each document's text
  data.tfds_data_dir = ""  # tfds: "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
  # hf_datasets: a local Hugging Face dataset (save_to_disk's folder, or data files load_dataset
  # reads), its data.text_field column; nothing is downloaded (pip install electra-jax[hf_datasets]).
  data.hf_path = ""
  data.hf_split = "train"
  # --mode=prepare_data writes shards here; data.source="prepared" trains on them.
  data.prepared_dir = ""
  data.shard_documents = 10_000  # prepare_data: documents per shard (one task of one worker)
  data.max_seq_len = 128
  # True: several whole examples side by side in each row of max_seq_len (segment-aware
  # attention, positions restarting per example), so little compute goes to padding.
  data.pack_rows = False
  data.cache_dir = ""  # "" = $ELECTRA_JAX_CACHE or ~/.cache/electra_jax
  # "sentencepiece": trained on the source's train documents (spm_* keys). "wordpiece": a BERT
  # vocab.txt (data.vocab_file) with BERT's normalization (lowercase, strip_accents).
  data.tokenizer = "sentencepiece"
  data.spm_vocab_size = 8192  # sentencepiece vocabulary trained on the source's train documents
  data.spm_model_type = "unigram"  # or "bpe"
  # sentencepiece: a model from --mode=train_tokenizer, used instead of training one in the cache
  data.spm_model_file = ""
  data.vocab_file = ""  # wordpiece: path of a BERT vocab.txt holding [PAD] [UNK] [CLS] [SEP] [MASK]
  data.lowercase = True  # wordpiece: lowercase the text (False for cased vocabularies)
  # wordpiece: None = follow lowercase (as BERT does), or True/False. A bool-typed None, so
  # --config.data.strip_accents=False works on the command line.
  data.strip_accents = ml_collections.FieldReference(None, field_type=bool)
  data.max_documents = 0  # 0 = all; a small number makes tests fast
  data.eval_fraction = 0.02  # share of documents held out from training

  config.train = train = ml_collections.ConfigDict()
  train.steps = 1_000_000
  train.batch_size = 128  # global, over all devices and hosts; -1 = the largest that fits
  train.memory_fraction = 0.9  # batch_size=-1: the share of a device's memory the step may use
  train.grad_accum_steps = 1  # micro-batches per step; the loss equals the full batch's
  train.seed = 0
  train.log_every = 100
  train.dtype = "float32"  # compute dtype: "float32" or "bfloat16" (parameters stay float32)
  # Optimizer steps per compiled call (a lax.scan over that many batches): for small models
  # whose step takes milliseconds, so the host's dispatch does not dominate. Same results.
  train.steps_per_call = 1
  # A wall-clock budget, e.g. "90s", "12m", "4h" or "1h30m" ("" = none). The run times a few
  # steps on a throwaway state and replaces train.steps with as many steps as fit, so the
  # learning rate reaches 0 as the budget ends. The budget counts from the start of the run
  # (data, compiling and the timing included), less a 3% margin and an estimate of held-out
  # evaluation. config.json records the resolved train.steps; a resume with the same budget
  # reuses it (no new timing, so it trains exactly as an uninterrupted run would). Single steps
  # are timed: with train.steps_per_call > 1 the run may end a little early.
  train.time_budget = ""
  # Where metrics go besides metrics.jsonl, eval_metrics.jsonl and TensorBoard: comma-separated
  # "wandb" (Weights & Biases; WANDB_PROJECT, WANDB_MODE=offline, ... as usual) and/or "mlflow"
  # (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME). A resumed run logs into the same run. Needs
  # pip install 'electra-jax[wandb]' or '[mlflow]'.
  train.metric_writers = ""

  # AdamW with linear warmup then linear decay to 0, as the official code schedules it:
  # lr(step) = learning_rate * min(1, step / warmup_steps) * max(0, 1 - step / train.steps).
  config.optimizer = optimizer = ml_collections.ConfigDict()
  optimizer.learning_rate = 5e-4
  optimizer.warmup_steps = 10_000
  # > 0: warmup_steps = round(warmup_fraction * train.steps) instead of the key above (after
  # train.time_budget fixed train.steps); in [0, 1).
  optimizer.warmup_fraction = 0.0
  optimizer.weight_decay = 0.01  # not applied to LayerNorm parameters and biases
  optimizer.b1 = 0.9
  optimizer.b2 = 0.999
  optimizer.eps = 1e-6
  optimizer.clip_norm = 1.0  # global gradient norm
  optimizer.bias_correction = True  # False = the official ELECTRA/BERT Adam

  # Device mesh; sizes multiply to the device count and one -1 takes the rest. Batches split
  # over data x fsdp; parameters shard their embed axis over fsdp and heads/mlp/vocab over tensor.
  config.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = -1
  mesh.fsdp = 1
  mesh.tensor = 1

  # Held-out evaluation during training (and at the last step) on data.eval_fraction of the
  # documents, with fixed masks and samples so figures compare across checkpoints; written to
  # <workdir>/eval_metrics.jsonl. every_steps=0 turns it off.
  config.eval = evaluation = ml_collections.ConfigDict()
  evaluation.every_steps = 10_000
  evaluation.num_batches = 20  # at most; fewer if the held-out split is smaller
  evaluation.batch_size = 0  # 0 = the training micro-batch (train.batch_size / grad_accum_steps)
  evaluation.seed = 0

  config.checkpoint = checkpoint = ml_collections.ConfigDict()
  checkpoint.every_steps = 5000
  checkpoint.keep = 3

  return config
