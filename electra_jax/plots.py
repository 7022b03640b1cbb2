"""Curves of workdirs (a sweep folder stands for its runs) as one PNG: a panel per metric, a line per workdir
(metrics.jsonl solid, eval_metrics.jsonl dashed). No pyplot: no display needed, a notebook's backend kept.
"""

import io
import math
import os
from typing import Sequence

from electra_jax import workdir_files
from electra_jax.errors import ConfigError

DEFAULT_METRICS = ("loss", "masked_lm_accuracy", "disc_auc")
PANEL_SIZE = (5.0, 3.5)  # inches; at DPI, one panel is 500 x 350 pixels
DPI = 100
MAX_COLUMNS = 3


def expand_workdirs(workdirs: Sequence[str]) -> list[tuple[str, str]]:
  """[(label, workdir)]: a sweep folder (with sweep.json) becomes its runs."""
  expanded = []
  for workdir in workdirs:
    name = os.path.basename(os.path.normpath(workdir))
    record = workdir_files.read_sweep(workdir) or {"runs": ()}
    runs = [
        (f"{name}/{run}", os.fspath(workdir_files.path(workdir, run))) for run, _ in record["runs"]
    ]
    expanded += runs or [(name or workdir, workdir)]
  return expanded


def plot_curves(
    workdirs: Sequence[str], out: str | None = None, metrics: Sequence[str] | None = None
):
  """The matplotlib Figure of `workdirs`' curves, also written to `out` (PNG) if given; `metrics`: by default
  those of DEFAULT_METRICS logged."""
  try:
    from matplotlib.figure import Figure  # noqa: PLC0415 (optional extra)
  except ImportError as error:
    raise ConfigError(
        "Plots need matplotlib: pip install matplotlib (the `plots` extra)."
    ) from error

  runs = expand_workdirs(workdirs)
  logs = [
      (
          label,
          *(
              workdir_files.read_jsonl(workdir_files.path(workdir, file))
              for file in ("metrics.jsonl", "eval_metrics.jsonl")
          ),
      )
      for label, workdir in runs
  ]
  logs = [
      (label, train_log, eval_log) for label, train_log, eval_log in logs if train_log or eval_log
  ]
  if not logs:
    raise ConfigError(
        f"No metrics.jsonl or eval_metrics.jsonl in {', '.join(w for _, w in runs)}: pass training "
        "workdirs (or sweep folders) whose runs have logged."
    )
  logged = {k for _, t, e in logs for r in t + e for k in r if k != "step"}
  metrics = metrics or [m for m in DEFAULT_METRICS if m in logged] or sorted(logged)
  if unknown := [m for m in metrics if m not in logged]:
    raise ConfigError(
        f"--plot_metrics {', '.join(unknown)}: not logged by these runs; they logged {sorted(logged)}."
    )

  columns = min(MAX_COLUMNS, len(metrics))
  rows = math.ceil(len(metrics) / columns)
  figure = Figure(
      figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained"
  )
  axes = figure.subplots(rows, columns, squeeze=False).ravel()
  for ax, metric in zip(axes, metrics):
    for i, (label, train_log, eval_log) in enumerate(
        logs
    ):  # a workdir's train and eval lines share a colour
      for split, log, linestyle, marker in (
          ("train", train_log, "-", None),
          ("eval", eval_log, "--", "."),
      ):
        points = [(int(r["step"]), float(r[metric])) for r in log if metric in r and "step" in r]
        if points:  # NaN values leave gaps in the line
          ax.plot(
              *zip(*points),
              color=f"C{i % 10}",
              linestyle=linestyle,
              marker=marker,
              label=f"{label} ({split})",
          )
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  for ax in axes[len(metrics) :]:
    ax.set_visible(False)
  axes[0].legend(fontsize="small")
  if out:
    png = io.BytesIO()
    figure.savefig(png, format="png")
    workdir_files.write_bytes(out, png.getvalue())
  return figure
