"""Where metrics go: the JSONL logs (the source of truth), TensorBoard events in
<workdir>/tensorboard/{train,eval} (a resume purges later points), W&B or MLflow runs."""

import importlib
import logging as std_logging
import numbers
import os
import secrets
import sys
import time

from absl import logging

from electra_jax import workdir_files
from electra_jax.errors import ConfigError

SUBDIR = "tensorboard"


def _tensorboardx():
  """The tensorboardX modules we write with. It would import torch, if installed (seconds and
  hundreds of MB): hidden meanwhile."""
  hide_torch = "torch" not in sys.modules and "tensorboardX" not in sys.modules  # not yet seen
  if hide_torch:
    sys.modules["torch"] = None
  try:
    from tensorboardX import event_file_writer, summary  # noqa: PLC0415 (torch hidden first)
    from tensorboardX.proto import event_pb2  # noqa: PLC0415
  finally:
    if hide_torch:
      del sys.modules["torch"]
  # It warns at every NaN scalar; NaN is expected here (disc_auc on a one-class window).
  std_logging.getLogger("tensorboardX.x2num").setLevel(std_logging.ERROR)
  return event_file_writer, summary, event_pb2


def _numbers(record: dict, prefix: str = "") -> dict[str, float]:
  """The record's numbers (not "step", not booleans) as floats, their names under `prefix`."""
  return {
      prefix + name: float(value)
      for name, value in record.items()
      if name != "step" and not isinstance(value, bool) and isinstance(value, numbers.Real)
  }


class ScalarWriter:
  """Scalars into one new event file, opened on first use (after purge_after), flushed after each
  record: SummaryWriter's flush does not wait for its queue."""

  def __init__(self, logdir: str):
    self.logdir, self._writer, self._purge_step = logdir, None, None
    self._modules = _tensorboardx()

  def purge_after(self, last_step: int) -> None:
    """TensorBoard then drops the points earlier files logged past `last_step`."""
    self._purge_step = last_step + 1

  def write(self, record: dict) -> None:
    event_file_writer, summary, event_pb2 = self._modules
    if self._writer is None:
      os.makedirs(self.logdir, exist_ok=True)
      suffix = f".{os.getpid()}.{time.monotonic_ns()}"  # writers opened in the same second differ
      self._writer = event_file_writer.EventsWriter(os.path.join(self.logdir, "events"), suffix)
      if self._purge_step is not None:  # what SummaryWriter(purge_step=N) writes
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        event = event_pb2.Event(wall_time=time.time(), step=self._purge_step, session_log=start)
        self._writer.write_event(event)
    step, now = int(record["step"]), time.time()
    for name, value in sorted(_numbers(record).items()):
      scalar = summary.scalar(name, value)
      self._writer.write_event(event_pb2.Event(wall_time=now, step=step, summary=scalar))
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


class WandbRun:
  """The workdir's W&B run (`run_id`: an earlier start's, or None), logged against "step" so a
  resumed run may log steps again."""

  def __init__(self, workdir: str, config: dict, run_id: str | None):
    import wandb  # noqa: PLC0415 (the wandb extra)

    self.run_id = run_id or secrets.token_hex(6)  # W&B ids: letters and digits
    local_dir = None if workdir_files.is_remote(workdir) else workdir
    name = os.path.basename(os.path.normpath(workdir))
    self.run = wandb.init(id=self.run_id, resume="allow", name=name, config=config, dir=local_dir)
    self.run.define_metric("*", step_metric="step")

  def log(self, record: dict, prefix: str) -> None:
    self.run.log({**_numbers(record, f"{prefix}/"), "step": int(record["step"])})

  def close(self) -> None:
    self.run.finish()


class MlflowRun:
  """The workdir's MLflow run (experiment MLFLOW_EXPERIMENT_NAME or "electra-jax"), the config as
  its config.json artifact; reopened by `run_id` on a restart."""

  def __init__(self, workdir: str, config: dict, run_id: str | None):
    import mlflow  # noqa: PLC0415 (the mlflow extra)

    self.client, self.entities, self.run_id = mlflow.MlflowClient(), mlflow.entities, run_id
    if run_id is not None:
      self.client.update_run(run_id, status="RUNNING")
      return
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "electra-jax")
    experiment = self.client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
    run_name = os.path.basename(os.path.normpath(workdir))
    self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
    self.client.log_dict(self.run_id, config, "config.json")

  def log(self, record: dict, prefix: str) -> None:
    now, step = int(time.time() * 1000), int(record["step"])
    values = _numbers(record, f"{prefix}/").items()
    metrics = [self.entities.Metric(key, value, now, step) for key, value in values]
    self.client.log_batch(self.run_id, metrics=metrics)

  def close(self) -> None:
    self.client.set_terminated(self.run_id)


_RUNS = {"wandb": WandbRun, "mlflow": MlflowRun}


def writer_names(text: str) -> list[str]:
  """train.metric_writers as names, each refused by name unless known and installed."""
  names = [name.strip() for name in str(text).split(",") if name.strip()]
  for name in names:
    if name not in _RUNS:
      raise ConfigError(
          f"train.metric_writers: {name!r} is not one of {sorted(_RUNS)} (comma-separated, or '')."
      )
    try:  # each service's module, and the extra that installs it, has its name
      importlib.import_module(name)
    except ImportError:
      raise ConfigError(
          f"train.metric_writers={text!r} needs {name}: pip install 'electra-jax[{name}]'."
      ) from None
  return names


class MetricLog(workdir_files.JsonlLog):
  """A JsonlLog that also writes each record to a ScalarWriter (or None) and to `runs` under
  `prefix`; close() closes the runs too if `closes_runs`."""

  def __init__(self, file, writer: ScalarWriter | None, runs, prefix: str, closes_runs: bool):
    super().__init__(file)
    self.writer, self.runs, self.prefix, self.closes_runs = writer, runs, prefix, closes_runs

  def truncate_after(self, last_step: int) -> None:
    super().truncate_after(last_step)
    if self.writer is not None:
      self.writer.purge_after(last_step)

  def append(self, record: dict) -> None:
    super().append(record)
    if self.writer is not None:
      self.writer.write(record)
    for run in self.runs:
      run.log(record, self.prefix)

  def close(self) -> None:
    self.flush()
    if self.writer is not None:
      self.writer.close()
    for run in self.runs if self.closes_runs else ():
      run.close()


def open_logs(workdir: str, metric_writers: str = "", config: dict | None = None):
  """(metrics.jsonl, eval_metrics.jsonl) of `workdir` as MetricLogs, with TensorBoard events
  (local workdirs only) and the runs `metric_writers` names (the train log closes them)."""
  if remote := workdir_files.is_remote(workdir):
    message = "%s is a bucket: its metrics go to the JSONL logs only (TensorBoard events: local)."
    logging.log_first_n(logging.WARNING, message, 1, workdir)
  runs = []
  for name in writer_names(metric_writers):  # its run id, kept in the workdir, reopens it
    id_file = workdir_files.path(workdir, f"{name}_run_id")
    run_id = workdir_files.read_text(id_file).strip() if workdir_files.exists(id_file) else None
    runs.append(_RUNS[name](workdir, config or {}, run_id))
    workdir_files.write_text(id_file, runs[-1].run_id)
  logs = []
  for split, file in (("train", "metrics.jsonl"), ("eval", "eval_metrics.jsonl")):
    writer = None if remote else ScalarWriter(str(workdir_files.path(workdir, SUBDIR, split)))
    path = workdir_files.path(workdir, file)
    logs.append(MetricLog(path, writer, runs, split, closes_runs=split == "train"))
  return tuple(logs)
