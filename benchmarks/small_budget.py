"""Does pre-training pay off on a small budget? ELECTRA (configs/quick.py) against MLM (the same
recipe and budget, objective.name=mlm), random init and TF-IDF + logistic regression, on the two
real-text tasks of small_budget_tasks.py, each with its own pre-training corpus; the fine-tuning
defaults of configs/finetune/custom.py, several seeds, nothing tuned on dev.

  python benchmarks/small_budget.py run --budgets=12m            # resumable: done runs are kept
  python benchmarks/small_budget.py run --budgets=12m,60m --tasks=debian
  python benchmarks/small_budget.py run --budgets=12m --labels=500  # fine-tune on 500 labels
  python benchmarks/small_budget.py report                        # table + plot into docs/
  python benchmarks/small_budget.py split_check --tasks=manpages  # held-out share vs dev (TF-IDF)
  python benchmarks/small_budget.py prepare                      # task folders and tokenizers
  python benchmarks/small_budget.py probe --tasks=manpages --workdirs=pretrain_mlm_60m   # linear probes
  python benchmarks/small_budget.py run --budgets=793steps,3965steps --jobs=6   # on one GPU
  python benchmarks/small_budget.py run --budgets=3965steps --jobs=6 --arms=gen50,gdes \\
      --arm 'gen50=--config.model.generator_fraction=0.5' --arm 'gdes=--config.model.tie=gdes'

An arm is one pre-training recipe: electra (configs/quick.py), mlm (the same with
objective.name=mlm) and each --arm NAME=OVERRIDES; random (init) is fine-tuned only. --arms picks
those run (default electra,mlm,random); their rows in results.jsonl carry the arm's name as init.

A budget is CPU wall-clock time (12m, 60m: train.time_budget, measured on the machine that runs
it) or a number of optimizer steps (3965steps: train.steps), which is how the larger CPU budgets
are reached on a GPU: a 2-core CPU gets about 800 quick-recipe steps out of 12 minutes. Every
pre-training run comes first, then the fine-tuning. --jobs runs that many fine-tuning processes
at once, and as many pre-training processes when the budgets are in steps; with time budgets the
pre-training runs one at a time (processes sharing a CPU get fewer steps out of a time budget).
Random init does not depend on the budget: it is fine-tuned once.

Each task's sentencepiece model is trained once, before any arm (<task>/spm.model, from
configs/quick.py's data settings and --pretrain_override), and every arm and random init use it:
arms on one corpus share their vocabulary, and a task folder that carries its model (`prepare`
on a CPU, then copied to the GPU machine) trains none there.

Everything goes under --out (default .bench_data/small_budget): <task>/pretrain_<arm>_<budget>/
(pre-training workdirs), <task>/finetune_<init>_<budget>/ (fine-tuning workdirs), results.jsonl (one
line per finished measurement). --pretrain_override and --finetune_override make a variant: its
workdirs' names end in +<the overrides> (pre-training ones in the pre-training overrides alone, so a
fine-tuning variant reuses the encoders) and its rows carry them, so a variant is run and reported
beside the defaults instead of being taken for them. Leave the machine alone while a time budget
is measured (the first steps of each pre-training run): a busy machine gets fewer steps out of the
same wall-clock budget (train.steps in each workdir's config.json says how many).
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import numpy as np

from electra_jax import workdir_files

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import small_budget_tasks  # noqa: E402


def _cli(args: list[str], log_path: str) -> None:
  command = [sys.executable, "-m", "electra_jax.main", *args]
  start = time.time()
  with open(log_path, "a") as log:
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    # From the caller's folder, as this process: relative paths in --out and the overrides mean the same.
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
  if done.returncode:
    sys.exit(
        f"failed (exit {done.returncode}, {time.time() - start:.0f}s): {' '.join(command)}\nsee {log_path}"
    )


def _done(results_file: str) -> list[dict]:
  if not os.path.exists(results_file):
    return []
  with open(results_file) as f:
    return [json.loads(line) for line in f if line.strip()]


_RECORD_LOCK = threading.Lock()


def _record(results_file: str, row: dict) -> None:
  with _RECORD_LOCK, open(results_file, "a") as f:
    f.write(json.dumps(row, sort_keys=True) + "\n")
  print(json.dumps(row, sort_keys=True), flush=True)


def variant(overrides: list[str]) -> str:
  """'' for none, else '+' and the overrides without their --config. prefix, in characters safe in a
  folder name (long ones shortened, with a hash of the whole): what names a variant's workdirs."""
  if not overrides:
    return ""
  name = "+".join(
      re.sub(r"[^A-Za-z0-9._=,-]+", "_", o.removeprefix("--config.")) for o in overrides
  )
  if len(name) > 100:
    name = f"{name[:32]}-{hashlib.sha1(' '.join(overrides).encode()).hexdigest()[:8]}"
  return "+" + name


def _row_key(row: dict) -> tuple:
  """What tells two measurements apart: task, init, budget, labelled set and variant."""
  return (
      row["task"],
      row["init"],
      row.get("budget"),
      row.get("labels", 0),
      variant(row.get("pretrain_overrides", []) + row.get("finetune_overrides", [])),
  )


def task_tokenizer(task_dir: str, overrides: list[str]) -> list[str]:
  """The override that gives every arm of a task one sentencepiece model, <task>/spm.model,
  trained once (configs/quick.py's data settings and `overrides`) before any pre-training:
  arms on one corpus then share a vocabulary by construction, and a GPU run whose task folder
  carries the model trains none. None where `overrides` already names a model file."""
  if any(o.startswith("--config.data.spm_model_file=") for o in overrides):
    return []
  path = os.path.join(task_dir, "spm.model")
  if not os.path.exists(path):  # written atomically: a killed run leaves none behind
    _cli(
        [
            "--mode=train_tokenizer",
            f"--config={ROOT}/configs/quick.py",
            "--config.data.source=text",
            f"--config.data.files={task_dir}/corpus.txt",
            f"--out={path}",
            *overrides,
        ],
        os.path.join(task_dir, "spm.log"),
    )
  return [f"--config.data.spm_model_file={path}"]


def pretrain(task_dir: str, arm: str, budget: str, extra: list[str], tag: str = "") -> str:
  workdir = os.path.join(task_dir, f"pretrain_{arm}_{budget}{tag}")
  if not os.path.exists(os.path.join(workdir, "eval_metrics.jsonl")) or not _finished(workdir):
    if budget.endswith("steps"):  # evaluated and saved 4 times, whatever the length
      steps = int(budget[: -len("steps")])
      every = max(100, steps // 4)
      length = [
          "--config.train.time_budget=",
          f"--config.train.steps={steps}",
          f"--config.eval.every_steps={every}",
          f"--config.checkpoint.every_steps={every}",
      ]
    else:
      length = [f"--config.train.time_budget={budget}"]
    _cli(
        [
            f"--config={ROOT}/configs/quick.py",
            f"--workdir={workdir}",
            "--config.data.source=text",
            f"--config.data.files={task_dir}/corpus.txt",
            *length,
            *extra,
        ],
        os.path.join(task_dir, f"pretrain_{arm}_{budget}{tag}.log"),
    )
  return workdir


def _finished(workdir: str) -> bool:
  config = json.load(open(os.path.join(workdir, "config.json")))
  steps = [
      json.loads(line)["step"]
      for line in open(os.path.join(workdir, "metrics.jsonl"))
      if line.strip()
  ]
  return bool(steps) and steps[-1] >= config["train"]["steps"]


def task_keys(task_dir: str) -> dict[str, str]:
  """The configs/finetune/custom.py keys that read a task folder; the learning rate's held-out
  share takes whole groups (pages, packages) where its examples name them (see split_check)."""
  keys = {
      "custom.train_file": f"{task_dir}/train.jsonl",
      "custom.dev_file": f"{task_dir}/dev.jsonl",
      "custom.text_a_column": "sentence",
      "custom.label_column": "label",
  }
  if "group" in json.loads(open(os.path.join(task_dir, "train.jsonl")).readline()):
    keys["custom.group_column"] = "group"
  return keys


def finetune(
    task_dir: str, init: str, init_from: str, seeds: int, extra: list[str]
) -> tuple[list[float], dict]:
  """Dev accuracy of each seed, fine-tuned with configs/finetune/custom.py's defaults, and the
  learning rate's choice ({} when the rate was fixed): the rate and each rate's held-out score,
  the held-out share taking whole groups where the task files name them."""
  workdir = os.path.join(task_dir, f"finetune_{init}")
  args = [
      "--mode=finetune",
      f"--config={ROOT}/configs/finetune/custom.py",
      f"--workdir={workdir}",
      *(f"--config.{key}={value}" for key, value in task_keys(task_dir).items()),
      f"--config.init_from={init_from}",
      f"--config.num_seeds={seeds}",
      *extra,
  ]
  if init.startswith("random"):  # "random_<budget>": the pre-training run gives only its tokenizer
    args.append("--config.random_init=True")
  _cli(args, os.path.join(task_dir, f"finetune_{init}.log"))
  results = json.load(open(os.path.join(workdir, "custom", "results.json")))
  accuracy = [
      results["seeds"][s]["dev"]["custom"]["accuracy"] for s in sorted(results["seeds"], key=int)
  ]
  return accuracy, results["selection"] or {}


def _read(task_dir: str, split: str) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(task_dir, f"{split}.jsonl"))]


def _tfidf(train: list[dict], evaluated: list[list[dict]]) -> list[float]:
  """TF-IDF (words and word pairs, sublinear tf) + logistic regression, its C chosen by 5-fold
  cross-validation on `train`: the accuracy on each list of `evaluated`."""
  from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415 (a test extra)
  from sklearn.linear_model import LogisticRegressionCV  # noqa: PLC0415

  vectorizer = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2))
  features = vectorizer.fit_transform([e["sentence"] for e in train])
  classifier = LogisticRegressionCV(Cs=[0.1, 1, 10, 100], cv=5, max_iter=3000)
  classifier.fit(features, [e["label"] for e in train])
  return [
      float(
          np.mean(
              classifier.predict(vectorizer.transform([e["sentence"] for e in examples]))
              == np.array([e["label"] for e in examples])
          )
      )
      for examples in evaluated
  ]


def tfidf(task_dir: str) -> float:
  return _tfidf(_read(task_dir, "train"), [_read(task_dir, "dev")])[0]


def labelled_subset(task_dir: str, labels: int) -> str:
  """The task with only `labels` of its training examples (drawn at random, seed 0; dev whole):
  <task>/labels_<N>/, where its fine-tuning workdirs go too. How pre-training pays off as the
  labelled set shrinks; 0 is the task itself."""
  subset_dir = os.path.join(task_dir, f"labels_{labels}")
  if not labels or os.path.exists(
      os.path.join(subset_dir, "dev.jsonl")
  ):  # written last: a whole folder
    return subset_dir if labels else task_dir
  train = _read(task_dir, "train")
  if not 0 < labels < len(train):
    sys.exit(
        f"--labels={labels}: give fewer than the task's {len(train)} training examples (0: all of them)"
    )
  chosen = sorted(np.random.default_rng(0).choice(len(train), labels, replace=False))
  for split, examples in (("train", [train[i] for i in chosen]), ("dev", _read(task_dir, "dev"))):
    workdir_files.write_text(
        os.path.join(subset_dir, f"{split}.jsonl"), "".join(json.dumps(e) + "\n" for e in examples)
    )
  return subset_dir


def split_check(args) -> None:
  """How far the score on the learning rate's held-out share (config.select) is from dev's, by
  rows, by whole groups (custom.group_column=group) and by whole groups in 3 folds
  (select.folds=3: the mean over the shares): TF-IDF fit on the rest of train, scored on the
  share and on dev, for the held-out draws of seeds 0 to --seeds - 1."""
  from electra_jax.finetune.tasks import held_out_rows  # noqa: PLC0415 (the split fine-tuning uses)

  for task in args.tasks.split(","):
    task_dir = small_budget_tasks.build(args.out, task)
    train, dev = _read(task_dir, "train"), _read(task_dir, "dev")
    if "group" not in train[0]:
      sys.exit(
          f"{task_dir}/train.jsonl has no group field (built before examples carried one): "
          "build the task again under a new --out."
      )
    groups = [e["group"] for e in train]
    for split, by, folds in (
        ("rows", [None] * len(train), 1),
        ("groups", groups, 1),
        ("groups", groups, 3),
    ):
      for seed in range(args.seeds):
        scores = [
            _tfidf([train[i] for i in fit], [[train[i] for i in held], dev])
            for held, fit in held_out_rows(by, 0.2, seed, folds)
        ]
        held_out, on_dev = np.mean(scores, axis=0)
        print(
            json.dumps(
                dict(
                    task=task,
                    held_out_by=split,
                    folds=folds,
                    seed=seed,
                    held_out=round(held_out, 4),
                    dev=round(on_dev, 4),
                )
            ),
            flush=True,
        )


def probe(args) -> None:
  """Linear probes: each pre-trained encoder (--workdirs, pre-training workdirs in the task folder)
  frozen, its states mean-pooled over the tokens at the embeddings, after every layer and at the
  encoder's output, and logistic regression fit on each (C chosen by 5-fold cross-validation on
  train, folds by whole groups where the task has them); dev accuracy per layer. It tells what an
  encoder holds before fine-tuning moves it. Random init (the first workdir's sizes and
  tokenizer, --seeds draws) is the floor. Lines go to stdout and <out>/probes.jsonl."""
  import jax  # noqa: PLC0415
  from flax import linen as nn  # noqa: PLC0415
  from sklearn.linear_model import LogisticRegressionCV  # noqa: PLC0415 (a test extra)
  from sklearn.model_selection import GroupKFold  # noqa: PLC0415
  from sklearn.pipeline import make_pipeline  # noqa: PLC0415
  from sklearn.preprocessing import StandardScaler  # noqa: PLC0415

  from electra_jax import api  # noqa: PLC0415
  from electra_jax import encoder as encoder_lib  # noqa: PLC0415
  from electra_jax.finetune import model as model_lib, tasks  # noqa: PLC0415

  if not args.workdirs:
    sys.exit(
        "probe: name the pre-training workdirs, e.g. --workdirs=pretrain_electra_60m,pretrain_mlm_60m"
    )
  warnings.filterwarnings("ignore", category=FutureWarning, module="sklearn")  # its coming defaults
  probed = (encoder_lib.Embeddings, encoder_lib.EncoderLayer, encoder_lib.Encoder)
  for task in args.tasks.split(","):
    task_dir = small_budget_tasks.build(args.out, task)
    workdirs = args.workdirs.split(",")
    inits = [(name, name, 0) for name in workdirs] + [
        (f"random_{s}", None, s) for s in range(args.seeds)
    ]
    for init, workdir, seed in inits:
      config = api.load_config(
          "finetune/custom",
          {
              **task_keys(task_dir),
              "init_from": os.path.join(task_dir, workdir or workdirs[0]),
              "random_init": workdir is None,
          },
      )
      backbone, data = model_lib.load_backbone(config), tasks.load_task(config)
      encoder = backbone.model
      params = backbone.params
      if params is None:
        ids = np.zeros((1, 8), np.int32)
        params = encoder.init(jax.random.key(seed), ids)["params"]
      params = nn.meta.unbox(params)

      @jax.jit
      def pooled(params, input_ids, attention_mask, token_type_ids):
        _, state = encoder.apply(
            {"params": params},
            input_ids,
            attention_mask,
            token_type_ids,
            capture_intermediates=lambda module, method: isinstance(module, probed)
            and method == "__call__",
            mutable=["intermediates"],
        )
        found = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
        return {
            "/".join(
                k.key for k in path if getattr(k, "key", "__call__") != "__call__"
            ): model_lib.pool(value, attention_mask, "mean")
            for path, value in found
        }

      def features(examples):
        arrays = tasks.encode_examples(examples, backbone.tokenizer, config.max_seq_len, data)
        parts = [
            pooled(
                params,
                *(
                    arrays[k][i : i + 256]
                    for k in ("input_ids", "attention_mask", "token_type_ids")
                ),
            )
            for i in range(0, len(examples), 256)
        ]
        return {
            name: np.concatenate([np.asarray(p[name]) for p in parts]) for name in parts[0]
        }, arrays["labels"]

      (train_x, train_y), (dev_x, dev_y) = features(data.train), features(data.dev["custom"])
      groups = [e.group if e.group is not None else e.index for e in data.train]
      folds = list(GroupKFold(5).split(train_y, train_y, groups))
      accuracy = {}
      for name in train_x:
        classifier = make_pipeline(
            StandardScaler(), LogisticRegressionCV(Cs=[0.01, 0.1, 1, 10], cv=folds, max_iter=3000)
        )
        classifier.fit(train_x[name], train_y)
        accuracy[name] = round(float(np.mean(classifier.predict(dev_x[name]) == dev_y)), 4)
      row = dict(task=task, init=init, source=backbone.source, dev_accuracy=accuracy)
      with open(os.path.join(args.out, "probes.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
      print(json.dumps(row), flush=True)


def parse_arms(definitions: list[str], chosen: str) -> dict[str, list[str]]:
  """{arm: its pre-training overrides} for the chosen arms: electra, mlm and those --arm defines
  (NAME=OVERRIDES, space-separated); random (init) has none and is fine-tuned only."""
  arms = {"electra": [], "mlm": ["--config.objective.name=mlm"], "random": []}
  for definition in definitions:
    name, sep, overrides = definition.partition("=")
    if not sep or not name.isidentifier() or name in arms:
      sys.exit(
          f"--arm {definition!r}: give NAME=OVERRIDES with a new NAME (letters, digits, _), "
          "e.g. --arm 'gdes=--config.model.tie=gdes'"
      )
    arms[name] = overrides.split()
  unknown = [name for name in chosen.split(",") if name not in arms]
  if unknown:
    sys.exit(f"--arms={chosen}: {', '.join(unknown)} undefined; the arms are {', '.join(arms)}")
  return {name: arms[name] for name in chosen.split(",")}


def prepare(args) -> tuple[dict[str, str], dict[str, list[str]]]:
  """Builds each task's folder and trains its tokenizer (tasks at once): {task: its folder} and
  {task: the override that names its model}. What a GPU run needs from a CPU: `run` then trains
  none."""
  task_dirs = {task: small_budget_tasks.build(args.out, task) for task in args.tasks.split(",")}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
    overrides = pool.map(lambda d: task_tokenizer(d, args.pretrain_override), task_dirs.values())
    return task_dirs, dict(zip(task_dirs, overrides))


def run(args) -> None:
  results_file = os.path.join(args.out, "results.jsonl")
  done = {_row_key(r) for r in _done(results_file)}
  overrides = {
      key: value
      for key, value in (
          ("pretrain_overrides", args.pretrain_override),
          ("finetune_overrides", args.finetune_override),
      )
      if value
  }
  tag = variant(args.pretrain_override + args.finetune_override)
  budgets, arms = args.budgets.split(","), parse_arms(args.arm, args.arms)
  task_dirs, tokenizers = prepare(args)
  labelled = {task: labelled_subset(task_dir, args.labels) for task, task_dir in task_dirs.items()}
  for task in task_dirs:
    if (task, "tfidf", None, args.labels, "") not in done:
      _record(
          results_file,
          dict(
              task=task,
              init="tfidf",
              budget=None,
              labels=args.labels,
              accuracy=[tfidf(labelled[task])],
          ),
      )

  # Each task's tokenizer first (prepare), then every pre-training run of every task, then the
  # fine-tuning. A time budget needs the machine to itself, so those pre-train one at a time
  # (step budgets: --jobs at once; on one corpus they may build its shards together, each file
  # written atomically); the fine-tuning runs, whose length is fixed in steps, go --jobs at once in
  # either case. Random init needs a tokenizer only: the first pre-trained arm's workdir gives it.
  pretrained = [name for name in arms if name != "random"]
  if not pretrained:
    sys.exit(
        f"--arms={args.arms}: name at least one pre-trained arm (random init takes its tokenizer)"
    )
  runs = [(task, arm, budget) for task in task_dirs for budget in budgets for arm in pretrained]
  pretrain_jobs = args.jobs if all(b.endswith("steps") for b in budgets) else 1
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, pretrain_jobs)) as pool:
    workdirs = dict(
        zip(
            runs,
            pool.map(
                lambda r: pretrain(
                    task_dirs[r[0]],
                    r[1],
                    r[2],
                    tokenizers[r[0]] + args.pretrain_override + arms[r[1]],
                    variant(args.pretrain_override),
                ),
                runs,
            ),
        )
    )

  def finetune_one(task, init, budget):
    workdir = workdirs[task, pretrained[0] if init == "random" else init, budget]
    start = time.time()
    accuracy, selection = finetune(
        labelled[task], f"{init}_{budget}{tag}", workdir, args.seeds, args.finetune_override
    )
    row = dict(
        task=task,
        init=init,
        budget=budget,
        labels=args.labels,
        accuracy=accuracy,
        selection=selection,
        finetune_seconds=round(time.time() - start),
        **overrides,
    )
    if init != "random":
      config = json.load(open(os.path.join(workdir, "config.json")))
      held_out = workdir_files.last_record(os.path.join(workdir, "eval_metrics.jsonl"))
      row.update(
          pretrain_steps=config["train"]["steps"],
          overrides=arms[init],
          held_out={k: held_out.get(k) for k in ("disc_auc", "disc_recall", "masked_lm_accuracy")},
      )
    _record(results_file, row)

  finetunes = [(task, "random", budgets[0]) for task in task_dirs if "random" in arms] + runs
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
    list(
        pool.map(
            lambda r: finetune_one(*r), [r for r in finetunes if (*r, args.labels, tag) not in done]
        )
    )


def report(args) -> None:
  rows = _done(os.path.join(args.out, "results.jsonl"))
  lines = [
      "| task | labels | budget | init | rate chosen (held-out score by rate) | "
      "dev accuracy, mean ± sd (seeds) | pre-training steps | held-out disc_auc |",
      "|---" * 8 + "|",
  ]
  named = lambda r: r["init"] + _row_key(r)[4]  # noqa: E731 (the init with its variant)
  for r in sorted(
      rows, key=lambda r: (r["task"], r.get("labels", 0), r.get("budget") or "", named(r))
  ):
    acc = 100 * np.array(r["accuracy"])
    spread = f" ± {acc.std(ddof=1):.1f} ({len(acc)})" if len(acc) > 1 else ""
    auc = (r.get("held_out") or {}).get("disc_auc")
    chosen = r.get("selection") or {}
    scores = " / ".join(f"{k} {100 * v:.1f}" for k, v in chosen.get("held_out_scores", {}).items())
    rate = f"{chosen['learning_rate']:g} ({scores})" if chosen else "-"
    lines.append(
        f"| {r['task']} | {r.get('labels') or 'all'} | {r.get('budget') or '-'} | {named(r)} | {rate} | "
        f"{acc.mean():.1f}{spread} | {r.get('pretrain_steps', '-')} | "
        f"{'-' if auc is None else f'{auc:.3f}'} |"
    )
  print("\n".join(lines))
  if args.plot:
    import matplotlib  # noqa: PLC0415 (the plots extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [
        r for r in rows if _row_key(r)[3:] == (args.labels, "")
    ]  # one labelled set, no variants
    tasks = sorted({r["task"] for r in rows})
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.5), squeeze=False)
    for axis, task in zip(axes[0], tasks):
      task_rows = [r for r in rows if r["task"] == task]
      for init in sorted({r["init"] for r in task_rows} - {"random", "tfidf"}):
        points = sorted(
            (r["pretrain_steps"], r["accuracy"]) for r in task_rows if r["init"] == init
        )
        if points:
          spread = [
              100 * np.std(a, ddof=1) if len(a) > 1 else 0.0 for _, a in points
          ]  # as the table
          axis.errorbar(
              [s for s, _ in points],
              [100 * np.mean(a) for _, a in points],
              yerr=spread,
              marker="o",
              capsize=3,
              label=init,
          )
      # Neither depends on the budget: lines across the plot.
      for init, style in (("random", ":"), ("tfidf", "--")):
        accuracy = [a for r in task_rows if r["init"] == init for a in r["accuracy"]]
        if accuracy:
          axis.axhline(
              100 * np.mean(accuracy),
              color="gray",
              linestyle=style,
              label={"random": "random init", "tfidf": "TF-IDF + LR"}[init],
          )
      axis.set(
          title=task, xlabel="pre-training steps (batch 64 x 128 tokens)", ylabel="dev accuracy (%)"
      )
      axis.set_xscale("log")
      axis.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print("wrote", args.plot)


def main() -> None:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("command", choices=("run", "prepare", "report", "split_check", "probe"))
  parser.add_argument("--out", default=os.path.join(ROOT, ".bench_data", "small_budget"))
  parser.add_argument("--tasks", default="debian,manpages")
  parser.add_argument("--budgets", default="12m")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument(
      "--jobs",
      type=int,
      default=1,
      help="fine-tuning processes at once; pre-training too when the budgets are in steps",
  )
  parser.add_argument(
      "--pretrain_override",
      action="append",
      default=[],
      help="every arm's pre-training, e.g. --config.model.norm=post",
  )
  parser.add_argument(
      "--arm",
      action="append",
      default=[],
      help="another pre-training arm, NAME=OVERRIDES: e.g. 'gdes=--config.model.tie=gdes'",
  )
  parser.add_argument(
      "--arms", default="electra,mlm,random", help="the arms run (random: fine-tuned only)"
  )
  parser.add_argument(
      "--labels",
      type=int,
      default=0,
      help="run: fine-tune (and fit TF-IDF) on this many training examples, drawn at random; "
      "report: plot that set (0: all)",
  )
  parser.add_argument(
      "--finetune_override", action="append", default=[], help="e.g. --config.head.pooling=cls"
  )
  parser.add_argument(
      "--workdirs",
      default="",
      help="probe: pre-training workdirs in each task folder, e.g. "
      "pretrain_electra_60m,pretrain_mlm_60m",
  )
  parser.add_argument(
      "--plot", default="", help="report: also draw the accuracy against the budget here (PNG)"
  )
  args = parser.parse_args()
  dict(run=run, prepare=prepare, report=report, split_check=split_check, probe=probe)[args.command](
      args
  )


if __name__ == "__main__":
  main()
