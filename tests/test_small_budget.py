"""benchmarks/small_budget.py: each task's tokenizer is trained once, before the arms, and every
arm of the task pre-trains with it (arms sharing a corpus then share a vocabulary, and a task
folder that carries its model trains none). The electra-jax processes are replaced by recorders."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import small_budget  # noqa: E402


def _recording_cli(monkeypatch):
  calls = []

  def cli(args, log_path):
    calls.append(args)
    out = [a for a in args if a.startswith("--out=")]
    if out:
      open(out[0][len("--out=") :], "wb").close()

  monkeypatch.setattr(small_budget, "_cli", cli)
  return calls


def test_the_task_tokenizer_is_trained_once_with_the_overrides(tmp_path, monkeypatch):
  calls = _recording_cli(monkeypatch)
  model = str(tmp_path / "spm.model")
  first = small_budget.task_tokenizer(str(tmp_path), ["--config.data.spm_vocab_size=512"])
  assert first == [f"--config.data.spm_model_file={model}"]
  assert len(calls) == 1
  assert "--mode=train_tokenizer" in calls[0] and f"--out={model}" in calls[0]
  assert f"--config.data.files={tmp_path}/corpus.txt" in calls[0]
  assert calls[0][-1] == "--config.data.spm_vocab_size=512"  # data overrides shape the vocabulary
  assert small_budget.task_tokenizer(str(tmp_path), []) == first
  assert len(calls) == 1  # the model is there: nothing trained again


def test_an_override_naming_a_model_file_trains_none(tmp_path, monkeypatch):
  calls = _recording_cli(monkeypatch)
  assert (
      small_budget.task_tokenizer(str(tmp_path), ["--config.data.spm_model_file=/m/spm.model"])
      == []
  )
  assert calls == [] and not os.path.exists(tmp_path / "spm.model")


def test_every_arm_of_a_task_pretrains_with_its_tokenizer(tmp_path, monkeypatch):
  calls = _recording_cli(monkeypatch)
  task_dirs = {}
  for task in ("debian", "manpages"):
    task_dirs[task] = str(tmp_path / task)
    os.makedirs(task_dirs[task])
  monkeypatch.setattr(small_budget.small_budget_tasks, "build", lambda out, task: task_dirs[task])
  monkeypatch.setattr(small_budget, "tfidf", lambda task_dir: 0.5)
  pretrained = []

  def pretrain(task_dir, arm, budget, extra, tag):
    assert tag == "+train.seed=1"
    pretrained.append((task_dir, arm, extra))
    workdir = os.path.join(task_dir, f"pretrain_{arm}_{budget}{tag}")
    os.makedirs(workdir, exist_ok=True)
    json.dump({"train": {"steps": 10}}, open(os.path.join(workdir, "config.json"), "w"))
    open(os.path.join(workdir, "eval_metrics.jsonl"), "w").write(
        json.dumps({"step": 10, "disc_auc": 0.7}) + "\n"
    )
    return workdir

  monkeypatch.setattr(small_budget, "pretrain", pretrain)
  choice = {"learning_rate": 1e-3, "held_out_scores": {"0.0003": 0.662, "0.001": 0.697}}
  monkeypatch.setattr(
      small_budget,
      "finetune",
      lambda task_dir, init, *args: ([0.5], {} if init.startswith("random") else choice),
  )
  monkeypatch.setattr(
      sys,
      "argv",
      [
          "small_budget.py",
          "run",
          f"--out={tmp_path}",
          "--tasks=debian,manpages",
          "--budgets=10steps",
          "--jobs=3",
          "--arms=electra,gdes,random",
          "--arm",
          "gdes=--config.model.tie=gdes",
          "--pretrain_override=--config.train.seed=1",
      ],
  )
  small_budget.main()

  assert sorted(a for c in calls for a in c if a.startswith("--out=")) == sorted(
      f"--out={d}/spm.model" for d in task_dirs.values()
  )  # one tokenizer per task, none per arm
  assert len(pretrained) == 4
  for task_dir, arm, extra in pretrained:
    assert extra[:2] == [
        f"--config.data.spm_model_file={task_dir}/spm.model",
        "--config.train.seed=1",
    ]
    assert extra[2:] == ({"gdes": ["--config.model.tie=gdes"]}.get(arm, []))
  rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  assert sorted((r["task"], r["init"]) for r in rows if r["init"] != "tfidf") == sorted(
      (task, init) for task in task_dirs for init in ("electra", "gdes", "random")
  )
  assert all(
      r["selection"] == ({} if r["init"] == "random" else choice)
      for r in rows
      if r["init"] != "tfidf"
  )
  assert all(
      r["pretrain_overrides"] == ["--config.train.seed=1"] for r in rows if r["init"] != "tfidf"
  )


def test_a_fine_tuning_variant_runs_beside_the_defaults_on_the_same_encoders(
    tmp_path, monkeypatch, capsys
):
  task_dir = str(tmp_path / "debian")
  os.makedirs(task_dir)
  monkeypatch.setattr(small_budget.small_budget_tasks, "build", lambda out, task: task_dir)
  monkeypatch.setattr(small_budget, "tfidf", lambda task_dir: 0.5)
  monkeypatch.setattr(small_budget, "task_tokenizer", lambda task_dir, overrides: [])
  pretrained, finetuned = [], []

  def pretrain(task_dir, arm, budget, extra, tag=""):
    pretrained.append(f"pretrain_{arm}_{budget}{tag}")
    workdir = os.path.join(task_dir, pretrained[-1])
    os.makedirs(workdir, exist_ok=True)
    json.dump({"train": {"steps": 10}}, open(os.path.join(workdir, "config.json"), "w"))
    open(os.path.join(workdir, "eval_metrics.jsonl"), "w").write(json.dumps({"step": 10}) + "\n")
    return workdir

  def finetune(task_dir, init, init_from, seeds, extra):
    finetuned.append((init, os.path.basename(init_from), extra))
    return [0.6 if extra else 0.5], {}

  monkeypatch.setattr(small_budget, "pretrain", pretrain)
  monkeypatch.setattr(small_budget, "finetune", finetune)
  run = [
      "small_budget.py",
      "run",
      f"--out={tmp_path}",
      "--tasks=debian",
      "--budgets=10steps",
      "--arms=electra,random",
  ]
  for argv in (run, run + ["--finetune_override=--config.select.folds=3"], run):
    monkeypatch.setattr(sys, "argv", argv)
    small_budget.main()
  # The variant's workdirs are its own, its encoders the defaults'; a second default run does nothing.
  folds = ["--config.select.folds=3"]
  assert finetuned == [
      (init, "pretrain_electra_10steps", extra)
      for extra, tag in (([], ""), (folds, "+select.folds=3"))
      for init in (f"random_10steps{tag}", f"electra_10steps{tag}")
  ]
  assert set(pretrained) == {"pretrain_electra_10steps"}
  rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  assert [(r["init"], r.get("finetune_overrides")) for r in rows if r["init"] != "tfidf"] == [
      ("random", None),
      ("electra", None),
      ("random", folds),
      ("electra", folds),
  ]
  monkeypatch.setattr(sys, "argv", ["small_budget.py", "report", f"--out={tmp_path}"])
  capsys.readouterr()
  small_budget.main()
  table = [
      line.split(" | ")[3:6:2]
      for line in capsys.readouterr().out.splitlines()[2:]
      if "tfidf" not in line
  ]
  assert table == [
      ["electra", "50.0"],
      ["electra+select.folds=3", "60.0"],
      ["random", "50.0"],
      ["random+select.folds=3", "60.0"],
  ]
  assert small_budget.variant(["--config.a=", "--config.b=x y"]) == "+a=+b=x_y"
  long = small_budget.variant(["--config.custom.train_file=/a/b c/" + "x" * 100])
  assert long.startswith("+custom.train_file=_a_b_c_") and len(long) == 42 and "/" not in long


def test_the_report_shows_each_rate_chosen_and_its_held_out_scores(tmp_path, monkeypatch, capsys):
  rows = [
      dict(
          task="debian",
          init="electra",
          budget="60m",
          accuracy=[0.5, 0.52],
          pretrain_steps=3255,
          held_out={"disc_auc": 0.85},
          selection={"learning_rate": 1e-3, "held_out_scores": {"0.0003": 0.662, "0.001": 0.697}},
      ),
      dict(task="debian", init="random", budget="60m", accuracy=[0.5], selection={}),
  ]
  (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  monkeypatch.setattr(sys, "argv", ["small_budget.py", "report", f"--out={tmp_path}"])
  small_budget.main()
  table = capsys.readouterr().out.splitlines()
  assert (
      table[2]
      == "| debian | all | 60m | electra | 0.001 (0.0003 66.2 / 0.001 69.7) | 51.0 ± 1.4 (2) | 3255 | 0.850 |"
  )
  assert table[3] == "| debian | all | 60m | random | - | 50.0 | - | - |"


def test_a_labelled_subset_draws_from_train_keeps_dev_and_is_drawn_once(tmp_path):
  examples = [{"sentence": f"s{i}", "label": str(i % 3)} for i in range(50)]
  for split, rows in (("train", examples), ("dev", examples[:7])):
    (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rows))
  assert small_budget.labelled_subset(str(tmp_path), 0) == str(tmp_path)
  subset = small_budget.labelled_subset(str(tmp_path), 20)
  assert subset == str(tmp_path / "labels_20")
  train = small_budget._read(subset, "train")
  assert (
      len(train) == 20
      and len({e["sentence"] for e in train}) == 20
      and all(e in examples for e in train)
  )
  assert small_budget._read(subset, "dev") == examples[:7]
  (tmp_path / "train.jsonl").write_text("")  # a folder already drawn is kept as it is
  assert small_budget._read(small_budget.labelled_subset(str(tmp_path), 20), "train") == train
  with pytest.raises(
      SystemExit, match=r"--labels=20: give fewer than the task's 20 training examples"
  ):
    small_budget.labelled_subset(str(tmp_path / "labels_20"), 20)


def test_a_task_folder_records_the_digests_that_tell_two_days_tasks_apart(tmp_path, monkeypatch):
  import hashlib

  import small_budget_tasks

  def task(words):
    return lambda rng: (
        [[words, "second paragraph"]],
        [{"sentence": "a b", "label": "x"}],
        [{"sentence": "c d", "label": "y"}],
    )

  monkeypatch.setitem(small_budget_tasks.TASKS, "one", task("some words"))
  monkeypatch.setitem(small_budget_tasks.TASKS, "two", task("other words"))
  stats = {
      name: json.loads(
          open(os.path.join(small_budget_tasks.build(str(tmp_path), name), "stats.json")).read()
      )
      for name in ("one", "two")
  }
  for file, digest in stats["one"]["sha256"].items():
    assert digest == hashlib.sha256((tmp_path / "one" / file).read_bytes()).hexdigest()[:16]
  assert stats["one"]["sha256"]["corpus.txt"] != stats["two"]["sha256"]["corpus.txt"]
  assert stats["one"]["sha256"]["dev.jsonl"] == stats["two"]["sha256"]["dev.jsonl"]
