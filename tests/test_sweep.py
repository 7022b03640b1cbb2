"""Sweeps: a three-run sweep (ELECTRA, MLM, and one that fails at run time) with a tiny
downstream task, whose tables are checked against each run's own logs and FLOPs computed
independently; a re-run that leaves the finished run untouched and resumes an interrupted
one; TensorBoard events of real runs; bad keys and values refused before anything is
written; run naming and grid expansion; the sweep_report and plot CLI modes."""

import csv
import json
import math
import os
import re
import shutil
import signal
import sys

import numpy as np
import pytest

from conftest import REPO, cli, tiny_config
from electra_jax import flops, preemption, resolve, sweep, train, workdir_lease
from electra_jax.errors import ConfigError
from test_plots import assert_events_match_jsonl, png_size

WORDS = [f"w{i}" for i in range(30)]
STEPS = 3


def base_config():
  return tiny_config(
      **{
          "train.steps": STEPS,
          "checkpoint.every_steps": 2,
          "eval.every_steps": 2,
          "eval.num_batches": 1,
      }
  )


def write_task(directory, seed=0):
  """label = whether 'magic' occurs; 32 train and 16 dev sentences."""
  rng = np.random.default_rng(seed)
  paths = {}
  for split, n in (("train", 32), ("dev", 16)):
    paths[split] = os.path.join(directory, f"{split}.jsonl")
    with open(paths[split], "w") as f:
      for _ in range(n):
        words, label = list(rng.choice(WORDS, 6)), int(rng.random() < 0.5)
        if label:
          words.insert(2, "magic")
        f.write(json.dumps({"sentence": " ".join(words), "label": label}) + "\n")
  return paths


def tree_snapshot(directory):
  """{relative path: (size, mtime_ns)} of every file under `directory`."""
  snapshot = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      stat = os.stat(path)
      snapshot[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
  return snapshot


def read_jsonl(path):
  return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  root = tmp_path_factory.mktemp("sweep")
  sweep_dir = str(root / "objectives")
  runs_file = root / "runs.txt"
  runs_file.write_text(
      "# two objectives, and a vocabulary smaller than the tokenizer's (fails when the run starts)\n"
      "objective.name=electra\n"
      "objective.name=mlm   # the BERT baseline\n"
      "objective.name=electra model.vocab_size=100\n"
  )
  task = write_task(str(root))
  finetune_config = sweep.load_finetune_config(
      os.path.join(REPO, "configs", "finetune", "tiny.py"),
      [
          f"custom.train_file={task['train']}",
          f"custom.dev_file={task['dev']}",
          "epochs=1",
          "num_seeds=2",
      ],
  )
  first = sweep.run_sweep(
      base_config(), sweep_dir, sweep_file=str(runs_file), finetune_config=finetune_config
  )
  names = first["runs"]
  dirs = {name: os.path.join(sweep_dir, name) for name in names}
  before = {name: tree_snapshot(d) for name, d in dirs.items()}
  mlm_lines = open(os.path.join(dirs[names[1]], "metrics.jsonl")).read().splitlines()
  # Interrupt the MLM run after its step-2 checkpoint: its step-3 checkpoint is gone.
  shutil.rmtree(os.path.join(dirs[names[1]], "checkpoints", "3"))
  second = sweep.run_sweep(
      base_config(), sweep_dir, sweep_file=str(runs_file), finetune_config=finetune_config
  )
  return dict(
      sweep_dir=sweep_dir,
      names=names,
      dirs=dirs,
      first=first,
      second=second,
      before=before,
      mlm_lines=mlm_lines,
      runs_file=str(runs_file),
  )


def test_sweep_table_matches_each_runs_logs(swept):
  electra, mlm, failing = swept["names"]
  assert (electra, mlm) == ("name=electra", "name=mlm")
  assert failing == "name=electra,vocab_size=100"
  assert swept["first"]["failed"] == [failing] and swept["second"]["failed"] == [failing]
  record = json.load(open(os.path.join(swept["sweep_dir"], "sweep.json")))
  assert [(r["name"], r["overrides"]) for r in record["runs"]] == [
      (electra, [["objective.name", "electra"]]),
      (mlm, [["objective.name", "mlm"]]),
      (failing, [["objective.name", "electra"], ["model.vocab_size", "100"]]),
  ]

  rows = list(csv.DictReader(open(os.path.join(swept["sweep_dir"], "results.csv"))))
  assert [r["run"] for r in rows] == [electra, mlm, failing]
  assert [r["status"] for r in rows] == ["done", "done", "failed"]
  assert [r["objective.name"] for r in rows] == ["electra", "mlm", "electra"]
  assert [r["model.vocab_size"] for r in rows] == ["", "", "100"]
  tokens = STEPS * 8 * 32
  for row in rows[:2]:
    workdir = swept["dirs"][row["run"]]
    last_train = read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1]
    last_eval = read_jsonl(os.path.join(workdir, "eval_metrics.jsonl"))[-1]
    assert last_train["step"] == last_eval["step"] == STEPS
    assert int(row["steps"]) == STEPS and int(row["train_tokens"]) == tokens
    for prefix, last in (("train_", last_train), ("eval_", last_eval)):
      for name in ("loss", "masked_lm_accuracy", "disc_auc"):
        value = float(row[prefix + name])
        assert (math.isnan(value) and math.isnan(last[name])) or value == last[name], (
            row["run"],
            prefix,
            name,
        )
    assert "train_tokens_per_sec" not in row and "eval_step" not in row

    # FLOPs as train.py computes them, from the real training setup of the run's config.
    config = base_config()
    config.objective.name = row["objective.name"]
    setup = resolve.run(config).setup
    per_token = flops.train_flops_per_token(setup.model, 32, setup.objective.max_predictions)
    assert float(row["train_flops"]) == pytest.approx(per_token * tokens, rel=1e-12)
  # By hand for MLM (one tower, PERFORMANCE.md's rules): 6 x (L layers of 4H^2 + 2HI, the E->H
  # projection, the H^2 + H head, the vocabulary head on 4 of 32 positions) + 12 L s H.
  h, i, e, v, layers = 32, 64, 16, 512, base_config().model.num_layers
  params = layers * (4 * h * h + 2 * h * i) + e * h + h * h + h + (h * e + e * v) * 4 / 32
  assert float(rows[1]["train_flops"]) == 6 * params * tokens + 12 * layers * 32 * h * tokens
  assert float(rows[0]["train_flops"]) > float(rows[1]["train_flops"])  # plus the generator

  # Downstream: the mean over the two seeds of each seed's own dev score.
  for row in rows[:2]:
    seeds = [
        json.load(
            open(
                os.path.join(
                    swept["dirs"][row["run"]], "finetune", "custom", f"seed_{s}", "metrics.json"
                )
            )
        )
        for s in (0, 1)
    ]
    expected = 100 * np.mean([s["dev"]["custom"]["accuracy"] for s in seeds])
    assert row["downstream_task"] == "custom" and int(row["downstream_seeds"]) == 2
    assert float(row["downstream_score"]) == pytest.approx(expected)
  assert rows[2]["downstream_score"] == ""

  # The markdown table: the same rows, headline columns, NaN and missing shown as "–".
  lines = open(os.path.join(swept["sweep_dir"], "results.md")).read().splitlines()
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
  assert len(lines) == 2 + 3 and set(lines[1].strip("|").split("|")) == {"---"}
  assert header[:6] == [
      "run",
      "objective.name",
      "model.vocab_size",
      "status",
      "steps",
      "train_tokens",
  ]
  mlm_cells = dict(zip(header, cells[1]))
  assert mlm_cells["train_disc_auc"] == "–" and mlm_cells["model.vocab_size"] == "–"
  assert float(mlm_cells["train_loss"]) == pytest.approx(float(rows[1]["train_loss"]), rel=1e-3)
  assert float(mlm_cells["downstream_score"]) == pytest.approx(
      float(rows[1]["downstream_score"]), abs=0.005
  )
  assert dict(zip(header, cells[2]))["status"] == "failed"
  assert png_size(os.path.join(swept["sweep_dir"], "curves.png")) == (3 * 500, 350)


@pytest.mark.fault
def test_rerun_skips_finished_and_resumes_interrupted(swept):
  electra, mlm, _ = swept["names"]
  # The finished run (and its fine-tuning) was not touched at all.
  assert tree_snapshot(swept["dirs"][electra]) == swept["before"][electra]
  # The interrupted one resumed from step 2: that checkpoint untouched, step 3 trained again
  # and logged once, fine-tuning skipped (it was done).
  after = tree_snapshot(swept["dirs"][mlm])
  for path, stat in swept["before"][mlm].items():
    if path.startswith(os.path.join("checkpoints", "2")) or path.startswith("finetune"):
      assert after[path] == stat, path
  assert os.path.isdir(os.path.join(swept["dirs"][mlm], "checkpoints", "3"))
  lines = open(os.path.join(swept["dirs"][mlm], "metrics.jsonl")).read().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
  assert lines[:2] == swept["mlm_lines"][:2]
  assert [
      r["step"] for r in read_jsonl(os.path.join(swept["dirs"][mlm], "eval_metrics.jsonl"))
  ] == [2, 3]


def test_tensorboard_events_of_real_runs(swept):
  for name in swept["names"][:2]:  # the MLM run's second event file purges its first's step 3
    workdir = swept["dirs"][name]
    assert_events_match_jsonl(
        os.path.join(workdir, "tensorboard", "train"), os.path.join(workdir, "metrics.jsonl")
    )
    assert_events_match_jsonl(
        os.path.join(workdir, "tensorboard", "eval"), os.path.join(workdir, "eval_metrics.jsonl")
    )


@pytest.mark.fault
@pytest.mark.parametrize(
    "grid, message",
    [
        (["objective.nam=electra,mlm"], "Sweep key 'objective.nam' is not a config key"),
        (["train.steps=3,3.5"], r"train.steps=3.5: invalid literal for int"),
        (["model.ngram_buckets=0,64"], "Sweep key 'model.ngram_buckets' is not a config key"),
        (["train.use_remat=yes"], "Sweep key 'train.use_remat'"),
        (
            ["objective.name=electra,bogus"],
            "objective.name=bogus: objective.name='bogus' is not one of",
        ),
        (["model.tie=all"], "Sweep run model.tie=all: model.tie=.all. runs one encoder"),
        (["objective.name"], "is not key=value"),
        (["objective.name=electra,"], "empty value"),
    ],
)
def test_a_bad_sweep_is_refused_before_anything_is_written(tmp_path, grid, message):
  with pytest.raises(ConfigError, match=message):
    sweep.run_sweep(base_config(), str(tmp_path / "s"), grid)
  assert not (tmp_path / "s").exists()


@pytest.mark.fault
def test_a_pre_training_recipe_for_sweep_finetune_is_refused_by_name(tmp_path):
  """It ended in a KeyError traceback from the fine-tuning checks."""
  with pytest.raises(ConfigError, match="--sweep_finetune=demo is no fine-tuning recipe"):
    sweep.load_finetune_config("demo", ["train.steps=2"])
  result = cli(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--mode=sweep",
          "--config=demo",
          f"--workdir={tmp_path / 's'}",
          "--sweep=train.steps=1",
          "--sweep_finetune=demo",
      ]
  )
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "is no fine-tuning recipe" in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "s").exists()


@pytest.mark.fault
def test_a_sweep_folder_that_is_a_file_is_refused_by_name(tmp_path):
  """It ended in a FileExistsError traceback."""
  folder = tmp_path / "s"
  folder.write_text("x")
  with pytest.raises(ConfigError, match=f"--workdir={folder} cannot be a directory: {folder} is"):
    sweep.run_sweep(base_config(), str(folder), ["train.steps=1"])
  assert folder.read_text() == "x"


@pytest.mark.fault
def test_a_bad_sweep_file_line_is_refused_naming_the_line(tmp_path):
  bad_file = tmp_path / "runs.txt"
  bad_file.write_text("objective.name=mlm\n\nmodel.tie\n")
  with pytest.raises(ConfigError, match=f"{bad_file}:3: 'model.tie' is not key=value"):
    sweep.run_sweep(base_config(), str(tmp_path / "s"), sweep_file=str(bad_file))
  assert not (tmp_path / "s").exists()


@pytest.mark.fault
@pytest.mark.parametrize(
    "kind, named",
    [
        ("missing", "does not exist"),
        ("under a file", "does not exist"),  # NotADirectoryError, a traceback
        ("directory", "is a directory"),
        ("fifo", "is a FIFO, not a regular file"),  # it hung, waiting for a writer
        ("binary", "is not UTF-8 text"),
    ],
)
def test_a_sweep_file_that_is_no_text_file_is_refused_by_name(tmp_path, kind, named):
  runs_file = tmp_path / "runs.txt"
  if kind == "under a file":
    runs_file.write_text("objective.name=mlm\n")
    runs_file = runs_file / "runs.txt"
  if kind == "directory":
    runs_file.mkdir()
  elif kind == "fifo":
    os.mkfifo(runs_file)
  elif kind == "binary":
    runs_file.write_bytes(b"objective.name=mlm\n\xff\xfe\n")
  with pytest.raises(ConfigError, match=f"--sweep_file={runs_file} {named}"):
    sweep.run_sweep(base_config(), str(tmp_path / "s"), sweep_file=str(runs_file))
  assert not (tmp_path / "s").exists()


@pytest.mark.fault
def test_a_sweep_folder_of_another_base_config_is_refused(swept):
  other = base_config()
  other.train.steps = 5
  with pytest.raises(ConfigError, match=r"another base config \(.*train.steps: 3 -> 5\)"):
    sweep.run_sweep(other, swept["sweep_dir"], ["objective.name=electra"])


@pytest.mark.fault
@pytest.mark.parametrize(
    "edit, named",
    [
        ({"ngram_buckets": 0}, "model.ngram_buckets is no key"),  # an older electra-jax's key
        ({"num_layers": True}, "model.num_layers=True is of type bool"),
        ({"hidden_size": "32"}, "model.hidden_size='32' is of type str"),
    ],
)
def test_an_edited_or_older_sweep_json_is_refused_naming_the_file_and_key(
    swept, tmp_path, edit, named
):
  """sweep.json's base config is read as config.json is; the folder is left as it was."""
  folder = tmp_path / "sweep"
  shutil.copytree(swept["sweep_dir"], folder)
  record = json.load(open(folder / "sweep.json"))
  record["base_config"]["model"].update(edit)
  (folder / "sweep.json").write_text(json.dumps(record))
  before = tree_snapshot(folder)
  with pytest.raises(ConfigError, match=f"{folder}/sweep.json is not as electra-jax writes it"):
    sweep.run_sweep(base_config(), str(folder), ["objective.name=electra"], plot=False)
  with pytest.raises(ConfigError, match=re.escape(named)):
    sweep.write_report(str(folder))
  assert tree_snapshot(folder) == before


def test_grid_expansion_and_run_names(tmp_path):
  runs_file = tmp_path / "runs.txt"
  runs_file.write_text(
      "# comment\nmodel.tie=none 'data.text_dir=/a b'\n\nobjective.temperature=2\n"
  )
  runs = sweep.expand(
      ["objective.name=electra,mlm", "model.generator_fraction=0.25,0.5"], str(runs_file)
  )
  assert len(runs) == 2 * 2 * 2
  assert runs[0] == [
      ("model.tie", "none"),
      ("data.text_dir", "/a b"),
      ("objective.name", "electra"),
      ("model.generator_fraction", "0.25"),
  ]
  assert runs[-1] == [
      ("objective.temperature", "2"),
      ("objective.name", "mlm"),
      ("model.generator_fraction", "0.5"),
  ]
  named = sweep.name_runs(
      [
          [("objective.name", "x/y z")],
          [("eval.seed", "1"), ("train.seed", "2")],
          [("objective.name", "x y/z")],
      ],
      [],
      base_config(),
  )
  assert [r.name for r in named] == ["name=x-y-z", "eval.seed=1,train.seed=2", "name=x-y-z-2"]
  # A recorded run keeps its name; a new one avoids the recorded names.
  again = [[("objective.name", "x y/z")], [("objective.name", "x?y?z")]]
  again = sweep.name_runs(again, named, base_config())
  assert [r.name for r in again] == ["name=x-y-z-2", "name=x-y-z-3"]
  config = sweep.apply_overrides(
      base_config(),
      [
          ("optimizer.learning_rate", "1"),
          ("data.lowercase", "false"),
          ("objective.name", "mlm"),
          ("data.strip_accents", "true"),  # a bool-typed None
      ],
  )
  assert config.optimizer.learning_rate == 1.0 and isinstance(config.optimizer.learning_rate, float)
  assert config.data.lowercase is False and config.objective.name == "mlm"
  assert config.data.strip_accents is True and base_config().data.strip_accents is None


def test_every_run_given_trains_and_a_run_listed_twice_trains_once(tmp_path):
  """MLM has no generator, yet its runs at two generator fractions are two runs (two configs, two
  workdirs); the same run written 1e-3 and 0.001 is one."""
  runs_file = tmp_path / "runs.txt"
  runs_file.write_text("optimizer.learning_rate=1e-3\noptimizer.learning_rate=0.001\n")
  sweep_dir = tmp_path / "sweep"
  grid = ["objective.name=mlm", "model.generator_fraction=0.25,0.5"]
  result = sweep.run_sweep(base_config(), str(sweep_dir), grid, str(runs_file), plot=False)
  assert result["failed"] == [] and len(result["runs"]) == 2
  record = json.load(open(sweep_dir / "sweep.json"))
  assert [r["name"] for r in record["runs"]] == result["runs"]
  fractions = []
  for name in result["runs"]:
    saved = json.load(open(sweep_dir / name / "config.json"))
    fractions.append(saved["model"]["generator_fraction"])
    assert (sweep_dir / name / "checkpoints" / str(STEPS)).is_dir()
  assert fractions == [0.25, 0.5]


@pytest.mark.fault
def test_a_run_whose_last_step_was_logged_but_not_saved_is_incomplete(swept, tmp_path):
  """Killed between logging its last step and saving it (in the final evaluation, say): the
  sweep resumes such a run, so its table must not call it done."""
  copy = tmp_path / "sweep"
  shutil.copytree(swept["sweep_dir"], copy)
  electra = swept["names"][0]
  shutil.rmtree(copy / electra / "checkpoints" / str(STEPS))
  _, rows = sweep.collect_rows(str(copy))
  assert [r["status"] for r in rows] == ["incomplete", "done", "failed"]


@pytest.mark.fault
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_between_runs_stops_the_sweep_after_the_run(tmp_path, monkeypatch, signum):
  """A preemption notice that lands while a run finishes (its last evaluation or save) used to
  be forgotten with the run's handler, and the sweep started the next run on a dying VM. A SIGHUP
  (a closed terminal) there killed the sweep, its lease left held."""
  from electra_jax import train  # noqa: PLC0415

  real = train.train_and_evaluate

  def finish_then_signal(config, workdir, **kwargs):
    result = real(config, workdir, **kwargs)
    signal.raise_signal(signum)  # after the run's own handler is gone
    return result

  preemption.clear_sigterm()
  monkeypatch.setattr(train, "train_and_evaluate", finish_then_signal)
  sweep_dir = tmp_path / "sweep"
  unheard = []  # this process's own handler (a SIGHUP would end pytest), where the sweep has none
  previous = signal.signal(signum, lambda *_: unheard.append(signum))
  try:
    result = sweep.run_sweep(base_config(), str(sweep_dir), ["optimizer.learning_rate=1e-3,2e-3"])
  finally:
    signal.signal(signum, previous)
  assert unheard == [] and workdir_lease.read_lease(str(sweep_dir))["released"]
  first, second = result["runs"]
  assert result["preempted"] and result["failed"] == []
  assert (sweep_dir / first / "checkpoints" / str(STEPS)).exists()
  assert not (sweep_dir / second / "config.json").exists()  # not started
  preemption.clear_sigterm()
  monkeypatch.setattr(train, "train_and_evaluate", real)
  again = sweep.run_sweep(base_config(), str(sweep_dir), ["optimizer.learning_rate=1e-3,2e-3"])
  assert not again["preempted"] and (sweep_dir / second / "checkpoints" / str(STEPS)).exists()


def test_a_recorded_run_is_found_whatever_the_flag_order_or_spelling():
  """The same sweep with its --sweep flags in another order, or 0.5 written .5, trained its
  runs a second time under new names."""
  first = sweep.name_runs(
      sweep.expand(["model.generator_fraction=0.5", "optimizer.learning_rate=0.001"]),
      [],
      base_config(),
  )
  again = sweep.expand(["optimizer.learning_rate=1e-3,2e-3", "model.generator_fraction=.5"])
  runs = sweep.name_runs(again, first, base_config())
  assert runs[0] is first[0] and runs[1].name not in {r.name for r in first}
  # Values that differ stay different runs.
  assert sweep.identity(base_config(), [("optimizer.learning_rate", "1e-3")]) != sweep.identity(
      base_config(), [("optimizer.learning_rate", "1e-4")]
  )


def test_cli_sweep_report_and_plot(swept, tmp_path):
  sweep_dir = swept["sweep_dir"]
  table = open(os.path.join(sweep_dir, "results.md")).read()
  os.remove(os.path.join(sweep_dir, "results.md"))
  result = cli(
      [sys.executable, "-m", "electra_jax.main", "--mode=sweep_report", f"--workdir={sweep_dir}"]
  )
  assert result.returncode == 0, result.stderr
  assert open(os.path.join(sweep_dir, "results.md")).read() == table
  out = str(tmp_path / "curves.png")
  result = cli(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--mode=plot",
          f"--workdir={sweep_dir}",
          f"--out={out}",
          "--plot_metrics=loss,disc_auc,masked_lm_accuracy,disc_accuracy",
      ]
  )
  assert result.returncode == 0, result.stderr
  assert png_size(out) == (3 * 500, 2 * 350)
  # A bad sweep key is one line on stderr, before any training.
  bad_dir = str(tmp_path / "bad")
  result = cli(
      [
          sys.executable,
          "-m",
          "electra_jax.main",
          "--mode=sweep",
          f"--config={REPO}/configs/demo.py",
          f"--workdir={bad_dir}",
          "--sweep=objective.name=electra,mlm",
          "--sweep=model.generator_frac=0.5",
      ]
  )
  assert result.returncode == 1
  assert (
      result.stderr.strip()
      .splitlines()[-1]
      .startswith("electra-jax: error: Sweep key 'model.generator_frac' is not a config key")
  )
  assert not os.path.exists(bad_dir)


@pytest.mark.fault
def test_one_sweep_at_a_time_holds_a_sweep_folder(tmp_path, monkeypatch):
  """Two sweeps on one folder each rewrote sweep.json, and each counted the run the other was
  training as failed (its workdir held) and left an error file in it. A second sweep is now
  refused before it writes anything, and a sweep whose folder was taken over stops before its
  next run."""

  sweep_dir = tmp_path / "sweep"
  grid = ["optimizer.learning_rate=1e-3,2e-3"]
  other = workdir_lease.WorkdirLease(str(sweep_dir))
  other.acquire()  # a live sweep (this process's own lease counts as live)
  try:
    with pytest.raises(
        workdir_lease.WorkdirInUse, match="The sweep folder .* is in use by run " + other.run_id
    ):
      sweep.run_sweep(base_config(), str(sweep_dir), grid)
  finally:
    other.release()
  # No sweep.json, no run: only the lease (and its hidden lock file).
  assert [n for n in os.listdir(sweep_dir) if n[0] != "."] == ["lease.json"]

  real = train.train_and_evaluate
  taker = {}

  def train_then_taken_over(config, workdir, **kwargs):
    result = real(config, workdir, **kwargs)
    taker["lease"] = workdir_lease.WorkdirLease(str(sweep_dir))
    taker["lease"].acquire(take_over=True)  # another sweep, started with --take_over_workdir
    return result

  monkeypatch.setattr(train, "train_and_evaluate", train_then_taken_over)
  try:
    with pytest.raises(workdir_lease.WorkdirInUse, match="Another run took over"):
      sweep.run_sweep(base_config(), str(sweep_dir), grid)
  finally:
    taker["lease"].release()
  runs = sweep.read_record(str(sweep_dir))["runs"]
  assert (sweep_dir / runs[0].name / "checkpoints" / str(STEPS)).exists()
  assert not (sweep_dir / runs[1].name).exists()  # the second run was left to the new holder
  monkeypatch.setattr(train, "train_and_evaluate", real)
  assert sweep.run_sweep(base_config(), str(sweep_dir), grid, plot=False)["failed"] == []


@pytest.mark.fault
def test_a_sweep_taken_over_during_a_run_writes_nothing_more_into_the_folder(tmp_path, monkeypatch):
  """The run of a sweep whose folder another sweep took over stops with WorkdirInUse (the new
  sweep took its workdir too). The old sweep counted that as a failed run, wrote sweep_error.txt
  into the run the new sweep now trains, and, being at its last run, rewrote the tables."""

  sweep_dir = tmp_path / "sweep"
  taker = {}

  def taken_over_while_training(config, workdir, **kwargs):
    taker["lease"] = workdir_lease.WorkdirLease(str(sweep_dir))
    taker["lease"].acquire(take_over=True)  # another sweep, started with --take_over_workdir
    raise workdir_lease.WorkdirInUse(f"Another run took over the workdir {workdir}.")

  monkeypatch.setattr(train, "train_and_evaluate", taken_over_while_training)
  try:
    with pytest.raises(
        workdir_lease.WorkdirInUse, match="Another run took over the workdir .*sweep:"
    ):
      sweep.run_sweep(base_config(), str(sweep_dir), ["optimizer.learning_rate=1e-3"])
  finally:
    taker["lease"].release()
  (run,) = sweep.read_record(str(sweep_dir))["runs"]
  assert not (sweep_dir / run.name / sweep.ERROR_FILE).exists()
  assert not (sweep_dir / "results.md").exists() and not (sweep_dir / "results.csv").exists()
