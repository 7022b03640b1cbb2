"""Every key fine-tuning reads (electra_jax/finetune/trainer.py), with ELECTRA's official
fine-tuning values: batch 32, lr 1e-4 (the official code's value for Small and Base), 10%
warmup then linear decay, weight decay 0.01, layer-wise lr decay 0.8, max_seq_len 128,
3 epochs (10 for RTE and STS-B). Recipes (glue.py, custom.py, tiny.py) start from this."""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()

  # --- Task. A GLUE task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli) or "custom".
  config.task = "cola"
  config.source = "dir"  # GLUE from "dir" (its TSV layout, under data_dir) or "tfds" (glue/<task>)
  config.data_dir = ""  # GLUE's root (holding CoLA/, SST-2/, ...) or one task's folder
  config.tfds_data_dir = ""  # "" = TFDS's default; the data must be prepared as array_record
  config.double_unordered = True  # MRPC/STS-B: train on both sentence orders, as the official code

  # Custom tasks (task="custom"): TSV/CSV with a header row, or JSONL objects.
  config.custom = custom = ml_collections.ConfigDict()
  custom.train_file = ""
  custom.dev_file = ""
  custom.test_file = ""  # optional, unlabelled: predictions are written for it
  custom.format = ""  # "" = from the extension: .tsv, .csv, .jsonl
  custom.text_a_column = "sentence"
  custom.text_b_column = ""  # "" = single-sentence task
  custom.label_column = "label"
  custom.kind = "classification"  # or "regression" (one output, MSE loss)
  custom.labels = ""  # label order, comma-separated; "" = the sorted labels seen in train. F1's
  # positive class is the second label.
  custom.metrics = ""  # comma-separated from accuracy,f1,mcc,pearson,spearman; "" = accuracy
  # (classification) or pearson,spearman (regression)
  # The train file's column naming each example's group (its document, page or source): the
  # learning rate's held-out share (config.select) then takes whole groups, so it scores on
  # unseen groups as dev does, not on siblings of the examples it trained on. "" = rows.
  custom.group_column = ""

  # --- Initialization. init_from: a pre-training workdir (its latest checkpoint: the
  # discriminator and the shared embeddings) or a Hugging Face ELECTRA directory.
  config.init_from = ""
  config.random_init = False  # same sizes and tokenizer as init_from, fresh weights (a baseline)
  # The top N layers of the pre-trained encoder (and a pre-LN encoder's final LayerNorm) start
  # from fresh weights, as the head does: for a pre-training objective whose top layers serve
  # that objective more than the task (Zhang et al. 2021, few-sample fine-tuning). 0 = keep all.
  config.reinit_layers = 0
  config.tokenizer = ""  # "" = the pre-training one; else a sentencepiece .model or vocab.txt
  # vocab.txt tokenizers: lowercase the text? None = as a Hugging Face init_from's
  # tokenizer_config.json records it (its strip_accents too), else True (BERT uncased).
  config.lowercase = ml_collections.FieldReference(None, field_type=bool)
  # Sizes for init_from="" (training from scratch with config.tokenizer).
  config.model = model = ml_collections.ConfigDict()
  model.hidden_size = 256
  model.num_layers = 12
  model.num_heads = 4
  model.intermediate_size = 1024
  model.embedding_size = 128
  model.vocab_size = 0  # 0 = the tokenizer's
  model.max_position_embeddings = 512

  # --- Training
  config.max_seq_len = 128
  config.batch_size = 32
  config.eval_batch_size = 0  # 0 = batch_size
  config.epochs = 0  # 0 = the official number: 3, or 10 for RTE and STS-B
  # At least this many optimizer steps: when the epochs give fewer for the training set, more
  # epochs are trained (ceil(min_steps / steps per epoch)); warmup and decay span the total.
  # 0 = off, the official recipe.
  config.min_steps = 0
  config.num_seeds = 1  # seeds seed .. seed + num_seeds - 1; results give mean, median, best
  config.seed = 0
  # The epoch whose model a seed keeps (checkpoint, test predictions) and reports: "last", as
  # the official code (train every epoch, then evaluate); "best" picks the epoch with the best
  # dev score, which is chosen on dev itself and so reads higher than the paper's numbers.
  config.keep_epoch = "last"
  # The learning rate chosen on the training set itself, never on dev: each of these rates
  # (comma-separated, e.g. "3e-4,1e-3,3e-3") fine-tunes seed `seed` on a (1 - fraction) share of
  # train and is scored on the rest; the best then trains every seed on all of train, in place of
  # optimizer.learning_rate. "" = off. folds=K (> 1) scores each rate on K disjoint shares of
  # train in turn (K trials per rate; fraction unused) and takes the mean: every row is held out
  # once, which separates rates closer than one share can.
  config.select = ml_collections.ConfigDict(dict(learning_rates="", fraction=0.2, folds=1))
  config.dropout_rate = 0.1  # encoder hidden dropout while fine-tuning
  config.attention_dropout_rate = 0.1
  config.head_dropout_rate = 0.1  # on the pooled vector before the dense layer
  config.dtype = "float32"  # or "bfloat16" (parameters stay float32)
  config.log_every = 100

  # The classification/regression head (SQuAD has its own span head and needs "cls").
  config.head = head = ml_collections.ConfigDict()
  # "cls": the first token's final hidden state, as the official code. "mean": the mean of the
  # final hidden states over each example's real tokens ([CLS] and [SEP] included): replaced
  # token detection never replaces [CLS], so its vector is the one pre-training trained least.
  head.pooling = "cls"

  config.optimizer = optimizer = ml_collections.ConfigDict()
  optimizer.learning_rate = 1e-4
  optimizer.warmup_fraction = 0.1
  optimizer.weight_decay = 0.01  # not on LayerNorm parameters or biases
  # lr of layer l = learning_rate * decay^(num_layers + 1 - l): embeddings l=0, the head
  # full lr. "official" reproduces the official code, which gives every layer one more factor
  # of decay (the top layer decay^2). 1.0 turns it off.
  optimizer.layerwise_lr_decay = 0.8
  optimizer.layerwise_lr_decay_rule = "correct"
  optimizer.b1 = 0.9
  optimizer.b2 = 0.999
  optimizer.eps = 1e-6
  optimizer.clip_norm = 1.0
  optimizer.bias_correction = False  # the official Adam has none; True = optax's scale_by_adam

  # --- SQuAD (task="squad1.1" | "squad2.0"; source "dir": data_dir holds the official
  # train-v<version>.json and dev-v<version>.json; "tfds": squad/v<version> as array_record).
  config.squad = squad = ml_collections.ConfigDict()
  squad.doc_stride = 128
  squad.max_query_len = 64
  squad.n_best = 20
  squad.max_answer_len = 30
  # Predict "" when the null odds exceed it: the official qa_na_threshold, which scores dev (the
  # v2 script's --na-prob-thresh) and writes test predictions alike.
  squad.null_threshold = -2.75
  squad.answerable_classifier = True  # 2.0: ELECTRA's answerability head
  squad.answerable_weight = 0.5
  return config
