"""Curves and TensorBoard events: plots of hand-written logs (panels, sizes, the plotted
values, sweep folders expanding to their runs, bad metric names) and event files read back
with our own TFRecord parser, equal to the JSONL records, including NaN and the purge of a
resumed run."""

import glob
import json
import math
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from electra_jax import plots, tensorboard_log, workdir_files
from electra_jax.errors import ConfigError


def write_log(workdir, name, records):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, name), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def png_size(path):
  with open(path, "rb") as f:
    header = f.read(24)
  assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
  return struct.unpack(">II", header[16:24])


# ---------------------------------------------------------------------------------------
# TensorBoard events, read back without TensorFlow or tensorboard
# ---------------------------------------------------------------------------------------
def read_records(path):
  """TFRecord framing: uint64 length, uint32 masked CRC of it, data, uint32 masked CRC."""
  with open(path, "rb") as f:
    data = f.read()
  offset, records = 0, []
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset : offset + 8])
    records.append(data[offset + 12 : offset + 12 + length])
    offset += 12 + length + 4
  assert offset == len(data)
  return records


def read_scalars(logdir):
  """{tag: {step: value}} as TensorBoard shows it: files in order, a SessionLog START at step
  N dropping what earlier files logged at steps >= N."""
  from tensorboardX.proto import event_pb2

  scalars = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    for record in read_records(path):
      event = event_pb2.Event.FromString(record)
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        for by_step in scalars.values():
          for step in [s for s in by_step if s >= event.step]:
            del by_step[step]
      for value in event.summary.value:
        scalars.setdefault(value.tag, {})[event.step] = value.simple_value
  return scalars


def assert_events_match_jsonl(logdir, jsonl_file):
  records = [json.loads(line) for line in open(jsonl_file)]
  scalars = read_scalars(logdir)
  expected_tags = {k for r in records for k in r if k != "step"}
  assert set(scalars) == expected_tags
  for record in records:
    for name, value in record.items():
      if name == "step":
        continue
      got = scalars[name][record["step"]]
      if math.isnan(value):
        assert math.isnan(got), (name, record["step"])
      else:
        assert got == np.float32(value), (name, record["step"], got, value)
  for tag, by_step in scalars.items():
    assert sorted(by_step) == [
        r["step"] for r in records if tag in r
    ]  # nothing extra, no stale points


def test_tensorboard_events_equal_jsonl_with_nan_and_resume(tmp_path):
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  train_log, eval_log = tensorboard_log.open_logs(workdir)
  for step in (1, 2, 3, 4):
    train_log.append(
        {
            "step": step,
            "loss": 10.0 / step,
            "disc_auc": float("nan") if step == 2 else 0.5 + step / 100,
        }
    )
  eval_log.append({"step": 2, "loss": 4.5, "masked_lm_accuracy": 0.25})
  # Flushed at each record: readable before close.
  assert read_scalars(os.path.join(workdir, "tensorboard", "train"))["loss"][4] == np.float32(2.5)
  train_log.close()
  eval_log.close()
  assert_events_match_jsonl(
      os.path.join(workdir, "tensorboard", "train"), os.path.join(workdir, "metrics.jsonl")
  )
  assert_events_match_jsonl(
      os.path.join(workdir, "tensorboard", "eval"), os.path.join(workdir, "eval_metrics.jsonl")
  )

  # Resumed from a checkpoint at step 2: step 3 is re-run with other values, and this time
  # the run stops there, so the first file's step 4 must go.
  import time

  time.sleep(1.1)  # event file names carry the second they were opened
  train_log, eval_log = tensorboard_log.open_logs(workdir)
  train_log.truncate_after(2)
  eval_log.truncate_after(2)
  train_log.append({"step": 3, "loss": 103.0, "disc_auc": 0.75})
  train_log.close()
  eval_log.close()
  assert len(glob.glob(os.path.join(workdir, "tensorboard", "train", "events.*"))) == 2
  assert [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))] == [
      1,
      2,
      3,
  ]
  assert_events_match_jsonl(
      os.path.join(workdir, "tensorboard", "train"), os.path.join(workdir, "metrics.jsonl")
  )
  assert read_scalars(os.path.join(workdir, "tensorboard", "train"))["loss"] == {
      1: 10.0,
      2: 5.0,
      3: 103.0,
  }


def test_event_files_leave_torch_unloaded_and_importable(tmp_path):
  # tensorboardX would import torch (seconds and hundreds of MB in every run) when it is installed.
  code = (
      "import sys; from electra_jax import tensorboard_log as t\n"
      f"log, _ = t.open_logs({str(tmp_path)!r}); log.append({{'step': 1, 'loss': 2.0}}); log.close()\n"
      "assert 'torch' not in sys.modules, 'torch loaded'\n"
      "import torch; print(torch.__name__)"
  )
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and result.stdout.strip() == "torch", result.stderr[-2000:]
  assert read_scalars(str(tmp_path / "tensorboard" / "train"))["loss"] == {1: 2.0}


def test_event_files_leave_torch_blocked_where_the_caller_blocked_it(tmp_path, monkeypatch):
  # The hiding took the caller's own `sys.modules["torch"] = None` away with its own.
  monkeypatch.setitem(sys.modules, "torch", None)
  tensorboard_log.ScalarWriter(str(tmp_path))
  assert "torch" in sys.modules and sys.modules["torch"] is None


def test_bucket_workdir_writes_no_events(monkeypatch):
  # No bucket is touched: only the decision is checked.
  opened = []
  monkeypatch.setattr(tensorboard_log, "ScalarWriter", lambda logdir: opened.append(logdir))
  train_log, eval_log = tensorboard_log.open_logs("gs://some-bucket/run")
  assert train_log.writer is None and eval_log.writer is None and not opened
  assert str(train_log.file) == "gs://some-bucket/run/metrics.jsonl"


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------
def make_runs(root):
  a, b = str(root / "a"), str(root / "b")
  write_log(
      a,
      "metrics.jsonl",
      [
          {
              "step": s,
              "loss": 5.0 - s,
              "disc_auc": 0.5 + 0.1 * s,
              "masked_lm_accuracy": 0.1 * s,
              "tokens_per_sec": 100.0,
          }
          for s in (1, 2, 3)
      ],
  )
  write_log(
      a,
      "eval_metrics.jsonl",
      [{"step": 2, "loss": 4.2, "disc_auc": 0.66, "masked_lm_accuracy": 0.15}],
  )
  write_log(
      b,
      "metrics.jsonl",
      [{"step": s, "loss": 7.0 - 2 * s, "masked_lm_accuracy": 0.05 * s} for s in (2, 4)],
  )
  return a, b


def test_plot_panels_lines_and_png_size(tmp_path):
  a, b = make_runs(tmp_path)
  out = str(tmp_path / "out" / "curves.png")
  figure = plots.plot_curves(
      [a, b], out, ["loss", "disc_auc", "masked_lm_accuracy", "tokens_per_sec"]
  )
  # 4 panels -> a 2 x 3 grid of 500 x 350 pixels, the last two hidden.
  assert png_size(out) == (3 * 500, 2 * 350)
  visible = [ax for ax in figure.axes if ax.get_visible()]
  assert [ax.get_title() for ax in visible] == [
      "loss",
      "disc_auc",
      "masked_lm_accuracy",
      "tokens_per_sec",
  ]
  lines = {(ax.get_title(), line.get_label()): line for ax in visible for line in ax.get_lines()}
  loss_a = lines[("loss", "a (train)")]
  assert list(loss_a.get_xdata()) == [1, 2, 3] and list(loss_a.get_ydata()) == [4.0, 3.0, 2.0]
  assert loss_a.get_linestyle() == "-"
  eval_a = lines[("loss", "a (eval)")]
  assert (
      list(eval_a.get_xdata()) == [2]
      and list(eval_a.get_ydata()) == [4.2]
      and eval_a.get_linestyle() == "--"
  )
  assert eval_a.get_color() == loss_a.get_color() != lines[("loss", "b (train)")].get_color()
  assert list(lines[("loss", "b (train)")].get_ydata()) == [3.0, -1.0]  # 7 - 2 * step
  assert ("disc_auc", "b (train)") not in lines  # b never logged it
  # Defaults: the headline metrics that were logged, one panel each.
  figure = plots.plot_curves([a], None)
  assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == [
      "loss",
      "masked_lm_accuracy",
      "disc_auc",
  ]


@pytest.mark.fault
def test_plot_sweep_folder_expands_and_bad_input_is_refused(tmp_path):
  sweep_dir = tmp_path / "sweep"
  make_runs(sweep_dir)
  (sweep_dir / "sweep.json").write_text(
      json.dumps(
          {
              "base_config": {},
              "runs": [
                  {"name": "a", "overrides": [["k", "1"]]},
                  {"name": "b", "overrides": [["k", "2"]]},
              ],
          }
      )
  )
  assert plots.expand_workdirs([str(sweep_dir)]) == [
      ("sweep/a", str(sweep_dir / "a")),
      ("sweep/b", str(sweep_dir / "b")),
  ]
  out = str(tmp_path / "one.png")
  figure = plots.plot_curves([str(sweep_dir)], out, ["loss"])
  assert png_size(out) == (500, 350)
  assert sorted(line.get_label() for line in figure.axes[0].get_lines()) == [
      "sweep/a (eval)",
      "sweep/a (train)",
      "sweep/b (train)",
  ]
  with pytest.raises(ConfigError, match="--plot_metrics disc_aucc: not logged"):
    plots.plot_curves([str(sweep_dir)], out, ["loss", "disc_aucc"])
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match="No metrics.jsonl"):
    plots.plot_curves([str(tmp_path / "empty")], out)
  assert workdir_files.exists(out)  # the earlier PNG is left as it was


@pytest.mark.fault
@pytest.mark.parametrize(
    "workdir, out, named",
    [
        ("gone", "c.png", "{tmp}/gone does not exist: give training workdirs"),  # left out silently
        ("a", ".", "--out={tmp} is a directory: give the PNG's path"),  # IsADirectoryError
        ("a", "a/metrics.jsonl/c.png", "--out={tmp}/a/metrics.jsonl cannot be a directory"),
    ],
)
def test_plot_of_a_missing_workdir_or_into_a_directory_is_refused(tmp_path, workdir, out, named):
  make_runs(tmp_path)
  workdirs = [str(tmp_path / "a"), str(tmp_path / workdir)]
  with pytest.raises(ConfigError, match=re.escape(named.format(tmp=tmp_path))):
    plots.plot_curves(workdirs, os.path.normpath(tmp_path / out))
  assert not (tmp_path / "c.png").exists()


@pytest.mark.fault
def test_plot_without_matplotlib_names_the_install(tmp_path, monkeypatch):
  make_runs(tmp_path / "sweep")
  for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(
      sys.modules, "matplotlib", None
  )  # `import matplotlib...` now raises ImportError
  with pytest.raises(ConfigError, match="pip install matplotlib"):
    plots.plot_curves([str(tmp_path / "sweep" / "a")], str(tmp_path / "c.png"))
  assert not (tmp_path / "c.png").exists()


def test_wandb_and_mlflow_runs_receive_the_metrics_and_a_resume_logs_into_the_same_run(
    tmp_path, monkeypatch
):
  import mlflow  # noqa: PLC0415

  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv(
      "MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri()
  )  # a local store: offline
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  config = {"train": {"steps": 3}}
  train_log, eval_log = tensorboard_log.open_logs(workdir, "wandb, mlflow", config)
  for step in (1, 2):
    train_log.append(
        {"step": step, "loss": 10.0 / step, "disc_auc": float("nan") if step == 1 else 0.6}
    )
  eval_log.append({"step": 2, "loss": 4.5})
  wandb_run = train_log.runs[0].run
  assert {k: dict(wandb_run.summary)[k] for k in ("train/loss", "eval/loss", "step")} == {
      "train/loss": 5.0,
      "eval/loss": 4.5,
      "step": 2,
  }
  train_log.close()
  eval_log.close()
  ids = {
      service: open(os.path.join(workdir, f"{service}_run_id")).read()
      for service in ("wandb", "mlflow")
  }

  # W&B names an offline run's folder by its start, to the second: the resume starts in the next.
  first_second = int(time.time())
  while int(time.time()) == first_second:
    time.sleep(0.02)
  train_log, eval_log = tensorboard_log.open_logs(
      workdir, "wandb,mlflow", config
  )  # resumed at step 2
  train_log.truncate_after(2)
  train_log.append({"step": 3, "loss": 3.0, "disc_auc": 0.7})
  wandb_run = train_log.runs[0].run
  assert wandb_run.id == ids["wandb"] and dict(wandb_run.summary)["train/loss"] == 3.0
  train_log.close()
  eval_log.close()
  assert {
      service: open(os.path.join(workdir, f"{service}_run_id")).read() for service in ids
  } == ids

  client = mlflow.MlflowClient()
  history = lambda key: [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], key)]
  assert history("train/loss") == [(1, 10.0), (2, 5.0), (3, 3.0)]
  assert history("eval/loss") == [(2, 4.5)] and math.isnan(history("train/disc_auc")[0][1])
  assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
  assert json.loads(open(client.download_artifacts(ids["mlflow"], "config.json")).read()) == config
  # W&B offline: both starts wrote into run <id>'s local files.
  assert (
      len(
          glob.glob(
              os.path.join(
                  workdir, "wandb", f"offline-run-*-{ids['wandb']}", f"run-{ids['wandb']}.wandb"
              )
          )
      )
      == 2
  )


@pytest.mark.fault
def test_unknown_metric_writers_are_refused_by_name():
  with pytest.raises(
      ConfigError, match=r"train.metric_writers: 'neptune' is not one of \['mlflow', 'wandb'\]"
  ):
    tensorboard_log.writer_names("mlflow,neptune")
  assert tensorboard_log.writer_names(" wandb , ") == ["wandb"]
