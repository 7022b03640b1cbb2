"""Does pre-training pay off on a small budget? ELECTRA (configs/quick.py) against MLM (the same
recipe and budget, objective.name=mlm), random init and TF-IDF + logistic regression, on the two
real-text tasks of small_budget_tasks.py, each with its own pre-training corpus; the fine-tuning
defaults of configs/finetune/custom.py, several seeds, nothing tuned on dev.

  python benchmarks/small_budget.py run --budgets=12m            # resumable: done runs are kept
  python benchmarks/small_budget.py run --budgets=12m,60m --tasks=debian
  python benchmarks/small_budget.py report                        # table + plot into docs/
  python benchmarks/small_budget.py run --budgets=793steps,3965steps --jobs=6   # on one GPU

A budget is CPU wall-clock time (12m, 60m: train.time_budget, measured on the machine that runs
it) or a number of optimizer steps (3965steps: train.steps), which is how the larger CPU budgets
are reached on a GPU: a 2-core CPU gets 793 quick-recipe steps out of 12 minutes. --jobs runs that
many pre-training and fine-tuning processes at once; use it with step budgets only (processes
sharing a CPU get fewer steps out of a time budget). Random init does not depend on the budget:
it is fine-tuned once, with the first budget's tokenizer.

Everything goes under --out (default .bench_data/small_budget): <task>/pretrain_<objective>_<budget>/
(pre-training workdirs), <task>/finetune_<init>/ (fine-tuning workdirs), results.jsonl (one line
per finished measurement). Pre-training runs alone on the machine: a busy machine gets fewer
steps out of the same wall-clock budget (train.steps in each workdir's config.json says how many).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from electra_jax import workdir_files

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import small_budget_tasks  # noqa: E402

OBJECTIVES = ("electra", "mlm")


def _cli(args: list[str], log_path: str) -> None:
  command = [sys.executable, "-m", "electra_jax.main", *args]
  start = time.time()
  with open(log_path, "a") as log:
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
  if done.returncode:
    sys.exit(f"failed (exit {done.returncode}, {time.time() - start:.0f}s): {' '.join(command)}\nsee {log_path}")


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


def pretrain(task_dir: str, objective: str, budget: str, extra: list[str]) -> str:
  workdir = os.path.join(task_dir, f"pretrain_{objective}_{budget}")
  if not os.path.exists(os.path.join(workdir, "eval_metrics.jsonl")) or not _finished(workdir):
    if budget.endswith("steps"):  # evaluated and saved 4 times, whatever the length
      steps = int(budget[: -len("steps")])
      every = max(100, steps // 4)
      length = ["--config.train.time_budget=", f"--config.train.steps={steps}",
                f"--config.eval.every_steps={every}", f"--config.checkpoint.every_steps={every}"]
    else:
      length = [f"--config.train.time_budget={budget}"]
    _cli([f"--config={ROOT}/configs/quick.py", f"--workdir={workdir}", "--config.data.source=text",
          f"--config.data.files={task_dir}/corpus.txt", *length,
          f"--config.objective.name={objective}", *extra], os.path.join(task_dir, f"pretrain_{objective}_{budget}.log"))
  return workdir


def _finished(workdir: str) -> bool:
  config = json.load(open(os.path.join(workdir, "config.json")))
  steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
  return bool(steps) and steps[-1] >= config["train"]["steps"]


def finetune(task_dir: str, init: str, init_from: str, seeds: int, extra: list[str]) -> list[float]:
  """Dev accuracy of each seed, fine-tuned with configs/finetune/custom.py's defaults."""
  workdir = os.path.join(task_dir, f"finetune_{init}")
  args = [
      "--mode=finetune", f"--config={ROOT}/configs/finetune/custom.py", f"--workdir={workdir}",
      f"--config.custom.train_file={task_dir}/train.jsonl", f"--config.custom.dev_file={task_dir}/dev.jsonl",
      "--config.custom.text_a_column=sentence", "--config.custom.label_column=label",
      f"--config.init_from={init_from}", f"--config.num_seeds={seeds}", *extra,
  ]
  if init.startswith("random"):  # "random_<budget>": the pre-training run gives only its tokenizer
    args.append("--config.random_init=True")
  _cli(args, os.path.join(task_dir, f"finetune_{init}.log"))
  results = json.load(open(os.path.join(workdir, "custom", "results.json")))
  return [results["seeds"][s]["dev"]["custom"]["accuracy"] for s in sorted(results["seeds"], key=int)]


def tfidf(task_dir: str) -> float:
  """TF-IDF (words and word pairs, sublinear tf) + logistic regression, its C chosen by 5-fold
  cross-validation on the training set."""
  from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415 (a test extra)
  from sklearn.linear_model import LogisticRegressionCV  # noqa: PLC0415

  read = lambda split: [json.loads(line) for line in open(os.path.join(task_dir, f"{split}.jsonl"))]
  train, dev = read("train"), read("dev")
  vectorizer = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2))
  features = vectorizer.fit_transform([e["sentence"] for e in train])
  classifier = LogisticRegressionCV(Cs=[0.1, 1, 10, 100], cv=5, max_iter=3000)
  classifier.fit(features, [e["label"] for e in train])
  predicted = classifier.predict(vectorizer.transform([e["sentence"] for e in dev]))
  return float(np.mean(predicted == np.array([e["label"] for e in dev])))


def run(args) -> None:
  results_file = os.path.join(args.out, "results.jsonl")
  done = {(r["task"], r["init"], r.get("budget")) for r in _done(results_file)}
  budgets = args.budgets.split(",")
  for task in args.tasks.split(","):
    task_dir = small_budget_tasks.build(args.out, task)
    if (task, "tfidf", None) not in done:
      _record(results_file, dict(task=task, init="tfidf", budget=None, accuracy=[tfidf(task_dir)]))
    workdirs = {}

    def finetune_one(init, budget):
      workdir = workdirs["electra" if init == "random" else init, budget]
      start = time.time()
      accuracy = finetune(task_dir, f"{init}_{budget}", workdir, args.seeds, args.finetune_override)
      row = dict(task=task, init=init, budget=budget, accuracy=accuracy, finetune_seconds=round(time.time() - start))
      if init != "random":
        config = json.load(open(os.path.join(workdir, "config.json")))
        held_out = workdir_files.last_record(os.path.join(workdir, "eval_metrics.jsonl"))
        row.update(pretrain_steps=config["train"]["steps"],
                   held_out={k: held_out.get(k) for k in ("disc_auc", "disc_recall", "masked_lm_accuracy")})
      _record(results_file, row)

    # Each pre-training run is fine-tuned as soon as it ends; with --jobs > 1 the runs go at once
    # (on one corpus they may build its data cache together: each of its files is written atomically).
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
      futures = []

      def pretrain_and_finetune(objective, budget):
        workdirs[objective, budget] = pretrain(task_dir, objective, budget, args.pretrain_override)
        if (objective, budget) == ("electra", budgets[0]) and (task, "random", budget) not in done:
          futures.append(pool.submit(finetune_one, "random", budget))  # needs only the tokenizer
        if (task, objective, budget) not in done:
          finetune_one(objective, budget)

      futures += [pool.submit(pretrain_and_finetune, o, b) for b in budgets for o in OBJECTIVES]
      while futures:
        futures.pop(0).result()


def report(args) -> None:
  rows = _done(os.path.join(args.out, "results.jsonl"))
  lines = ["| task | budget | init | dev accuracy, mean ± sd (seeds) | pre-training steps | held-out disc_auc |",
           "|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["task"], r.get("budget") or "", r["init"])):
    acc = 100 * np.array(r["accuracy"])
    spread = f" ± {acc.std(ddof=1):.1f} ({len(acc)})" if len(acc) > 1 else ""
    auc = (r.get("held_out") or {}).get("disc_auc")
    lines.append(f"| {r['task']} | {r.get('budget') or '-'} | {r['init']} | {acc.mean():.1f}{spread} | "
                 f"{r.get('pretrain_steps', '-')} | {'-' if auc is None else f'{auc:.3f}'} |")
  print("\n".join(lines))
  if args.plot:
    import matplotlib  # noqa: PLC0415 (the plots extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tasks = sorted({r["task"] for r in rows})
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.5), squeeze=False)
    for axis, task in zip(axes[0], tasks):
      task_rows = [r for r in rows if r["task"] == task]
      for init in ("electra", "mlm"):
        points = sorted((r["pretrain_steps"], r["accuracy"]) for r in task_rows if r["init"] == init)
        if points:
          spread = [100 * np.std(a, ddof=1) if len(a) > 1 else 0.0 for _, a in points]  # as the table
          axis.errorbar([s for s, _ in points], [100 * np.mean(a) for _, a in points], yerr=spread,
                        marker="o", capsize=3, label=init)
      # Neither depends on the budget: lines across the plot.
      for init, style in (("random", ":"), ("tfidf", "--")):
        accuracy = [a for r in task_rows if r["init"] == init for a in r["accuracy"]]
        if accuracy:
          axis.axhline(100 * np.mean(accuracy), color="gray", linestyle=style,
                       label={"random": "random init", "tfidf": "TF-IDF + LR"}[init])
      axis.set(title=task, xlabel="pre-training steps (batch 64 x 128 tokens)",
               ylabel="dev accuracy (%)")
      axis.set_xscale("log")
      axis.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print("wrote", args.plot)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("command", choices=("run", "report"))
  parser.add_argument("--out", default=os.path.join(ROOT, ".bench_data", "small_budget"))
  parser.add_argument("--tasks", default="debian,manpages")
  parser.add_argument("--budgets", default="12m")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--jobs", type=int, default=1, help="processes at once (step budgets only)")
  parser.add_argument("--pretrain_override", action="append", default=[], help="e.g. --config.model.norm=post")
  parser.add_argument("--finetune_override", action="append", default=[], help="e.g. --config.head.pooling=cls")
  parser.add_argument("--plot", default="", help="report: also draw the accuracy against the budget here (PNG)")
  args = parser.parse_args()
  if args.jobs > 1 and not all(b.endswith("steps") for b in args.budgets.split(",")):
    parser.error(f"--jobs={args.jobs} with --budgets={args.budgets}: processes sharing the machine get fewer "
                 "steps out of a time budget; give budgets in steps (e.g. 793steps) or use --jobs=1.")
  run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
  main()
