"""Curves of workdirs (a sweep folder stands for its runs) as one PNG: a panel per metric, a line
per workdir (eval dashed); no pyplot, so no display is needed and a notebook's backend is kept."""

import io
import math
import os
from typing import Sequence

from electra_jax import workdir_files
from electra_jax.errors import ConfigError

DEFAULT_METRICS = ("loss", "masked_lm_accuracy", "disc_auc")


def expand_workdirs(workdirs: Sequence[str]) -> list[tuple[str, str]]:
  """[(label, workdir)]: a sweep folder (with sweep.json) becomes its runs."""
  expanded = []
  for workdir in workdirs:
    if not workdir_files.exists(workdir_files.path(workdir)):
      raise ConfigError(f"{workdir} does not exist: give training workdirs or sweep folders.")
    name = os.path.basename(os.path.normpath(workdir))
    runs = (workdir_files.read_sweep(workdir) or {"runs": ()})["runs"]
    paths = [(f"{name}/{run}", os.fspath(workdir_files.path(workdir, run))) for run, _ in runs]
    expanded += paths or [(name or workdir, workdir)]
  return expanded


def plot_curves(
    workdirs: Sequence[str], out: str | None = None, metrics: Sequence[str] | None = None
):
  """The matplotlib Figure of `workdirs`' curves, also written to `out` (PNG) if given; `metrics`:
  by default those of DEFAULT_METRICS logged."""
  try:
    from matplotlib.figure import Figure  # noqa: PLC0415 (optional extra)
  except ImportError as error:
    raise ConfigError("Plots need matplotlib (pip install matplotlib, the plots extra).") from error

  if out and workdir_files.path(out).is_dir():
    raise ConfigError(f"--out={out} is a directory: give the PNG's path, e.g. {out}/curves.png.")
  if out:
    workdir_files.check_usable(os.path.dirname(out) or ".", "--out")
  runs = expand_workdirs(workdirs)
  logs = []  # (label, {"train": records, "eval": records}) of the workdirs that logged
  for label, workdir in runs:
    split_logs = {
        split: [r for r in workdir_files.read_jsonl(os.path.join(workdir, file)) if "step" in r]
        for split, file in (("train", "metrics.jsonl"), ("eval", "eval_metrics.jsonl"))
    }
    if any(split_logs.values()):
      logs.append((label, split_logs))
  if not logs:
    raise ConfigError(
        f"No metrics.jsonl or eval_metrics.jsonl in {', '.join(w for _, w in runs)}: pass training "
        "workdirs (or sweep folders) whose runs have logged."
    )
  logged = {k for _, split_logs in logs for log in split_logs.values() for r in log for k in r}
  logged.discard("step")
  metrics = metrics or [m for m in DEFAULT_METRICS if m in logged] or sorted(logged)
  if unknown := [m for m in metrics if m not in logged]:
    raise ConfigError(
        f"--plot_metrics {', '.join(unknown)}: not logged; these runs logged {sorted(logged)}."
    )

  columns = min(3, len(metrics))
  rows = math.ceil(len(metrics) / columns)
  # 500 x 350 pixels a panel.
  figure = Figure(figsize=(5.0 * columns, 3.5 * rows), dpi=100, layout="constrained")
  axes = figure.subplots(rows, columns, squeeze=False).ravel()
  for ax, metric in zip(axes, metrics):
    for i, (label, split_logs) in enumerate(logs):  # a workdir's two lines share a colour
      for split, style in (("train", "-"), ("eval", ".--")):  # eval: dots on a dashed line
        points = [(int(r["step"]), float(r[metric])) for r in split_logs[split] if metric in r]
        if points:  # NaN values leave gaps in the line
          ax.plot(*zip(*points), f"C{i % 10}{style}", label=f"{label} ({split})")
    ax.set(title=metric, xlabel="step")
    ax.grid(alpha=0.3)
  for ax in axes[len(metrics) :]:
    ax.set_visible(False)
  axes[0].legend(fontsize="small")
  if out:
    png = io.BytesIO()
    figure.savefig(png, format="png")
    workdir_files.write_bytes(out, png.getvalue())
  return figure
